#!/usr/bin/env bash
# kvseal device check: everything that needs a GPU, in one run, on a machine with NO
# network: `bash scripts/device_check.sh` (what `make device-check` runs; the device
# image may have no make). Designed for an H200 host where torch, cuda-python, grpcio,
# protobuf and pytest are preinstalled in the system python3 and the repo's .venv does
# not exist. Other packages come as wheels in ./wheels (`make device-wheels` on a
# machine with network; carry `wheels` along) and are installed into build/device-deps,
# never into the system site-packages.
#
# Stages, each with its own time limit, all clamped to a global deadline (START + 450 s,
# DEVICE_CHECK_BUDGET to change it), so the whole script ends inside 8 minutes:
#   0. environment: python, platform, driver, CC mode                       (setup.log)
#   1. dependencies: wheels -> build/device-deps, per package on failure;
#      what is still missing is recorded and the run goes on; then the
#      effective versions (and where each module comes from)                (setup.log)
#   2. GPU probe                                                            (setup.log)
#   3. NVRTC build of the kernels (cached on disk for the daemon)           (setup.log)
#   4. CPU emulator tests (kernels + backend request logic)                 (emulator-tests.log)
#      -- without a GPU the run stops here (exit 3) --
#   5. CUDA IPC preflight: torch parent, cuda-python child; no kvseal code  (ipc-preflight.log)
#   6. GPU tests, in-process half (-k "not daemon")                         (gpu-tests.log)
#   7. GPU tests, daemon half over CUDA IPC (-k daemon), in a pytest run of
#      its own so that a kernel trap in one cannot poison the other         (gpu-daemon-tests.log)
#      then every daemon log those tests left                               (daemon-logs.log)
#   8. benchmark (bench/bench_gpu.py), with the time left as its budget    (bench.log)
# The summary table always prints last (also on an early exit or a signal), followed by
# the benchmark's table, and is kept as summary.md: 8 files in all under $OUT, the most
# the device runner brings back. Write nothing else there.
#
# Environment: PYTHON (default python3), OUT (logs go there if set, else
# build/device-check), DEVICE (GPU ordinal, default 0), QUICK=1 (shorter benchmark).
# Exit status: 0 all passed, 1 a stage failed, 2 dependencies missing (the stages that
# need them ran and failed), 3 no GPU.
set -u -o pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-0}
LOGS=${OUT:-$ROOT/build/device-check}
DEPS=$ROOT/build/device-deps
START=$(date +%s)
DEADLINE=$((START + ${DEVICE_CHECK_BUDGET:-450}))
mkdir -p "$LOGS"
SETUP_LOG=$LOGS/setup.log
: >"$SETUP_LOG"
export PYTHONPATH="$DEPS:$ROOT/client:$ROOT/server:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export KVSEAL_CACHE_DIR=${KVSEAL_CACHE_DIR:-$ROOT/build/kvseal-cache}
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# No telemetry exporter may try the (absent) network from a daemon under test.
export OTEL_TRACES_EXPORTER=none OTEL_METRICS_EXPORTER=none
# The engine side (tests, preflight, `kvseal selftest`) exports torch CUDA tensors
# over legacy CUDA IPC, which refuses expandable-segment memory; the image may set it.
# torch >= 2.9 reads PYTORCH_ALLOC_CONF first, older torch only the CUDA name.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False
export PYTORCH_ALLOC_CONF=expandable_segments:False
export PY DEVICE
# NVRTC from pip wheels (nvidia-cuda-nvrtc[-cu12], also pulled in by torch): cuda-python
# before 12.8 dlopens libnvrtc by soname only, so put those lib dirs on the search path.
NV_LIBS=$(timeout 30 "$PY" - <<'EOF' 2>/dev/null
import glob, os, site, sys
roots = list(sys.path)
try:
    roots += [*site.getsitepackages(), site.getusersitepackages()]
except Exception:
    pass
dirs = []
for root in roots:
    for d in sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib"))):
        if glob.glob(os.path.join(d, "libnvrtc.so*")) and d not in dirs:
            dirs.append(d)
print(":".join(dirs))
EOF
)
[ -n "$NV_LIBS" ] && export LD_LIBRARY_PATH="$NV_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
declare -a SUMMARY=()
FAILED=0 MISSING_DEPS=0 NO_GPU=0 PREFLIGHT="not run"

note() { printf '\n=== %s\n' "$*"; }
record() { SUMMARY+=("| $1 | $2 | $3 |"); }
left() { echo $((DEADLINE - $(date +%s))); }

# clamp SECONDS: the limit a stage may have, given the global deadline.
clamp() {
    local l
    l=$(left)
    [ "$1" -lt "$l" ] && l=$1
    echo "$l"
}
# tmo SECONDS: a `timeout` argument for a short check: clamped, at least 1
# (`timeout 0` would mean no limit at all).
tmo() {
    local l
    l=$(clamp "$1")
    [ "$l" -lt 1 ] && l=1
    echo "$l"
}

# stage NAME LOG SECONDS CMD...: run CMD with a time limit clamped to the deadline,
# appending its output to $LOGS/LOG.log. Sets RC (124: timed out, 99: not started,
# too little time left), TOOK and LIMIT; records nothing (see verdict).
stage() {
    local name=$1 log=$LOGS/$2.log
    LIMIT=$(clamp "$3")
    shift 3
    TOOK=0
    if [ "$LIMIT" -lt 5 ]; then
        note "$name: skipped, the global deadline is reached" | tee -a "$log"
        RC=99
        return 0
    fi
    local t0=$SECONDS
    note "$name (limit ${LIMIT}s)" | tee -a "$log"
    timeout --kill-after=10 "$LIMIT" "$@" 2>&1 | tee -a "$log"
    RC=${PIPESTATUS[0]}
    TOOK=$((SECONDS - t0))
    return 0
}

# verdict NAME LOG [NOTES]: record the last stage's RC in the summary (LOG: its
# file under $LOGS without .log).
verdict() {
    local name=$1 log=$2.log notes=${3:-}
    case $RC in
        0) record "$name" "ok" "${TOOK}s${notes:+; $notes}" ;;
        99) record "$name" "SKIPPED" "global deadline reached" ;;
        124 | 137) record "$name" "TIMEOUT" "${TOOK}s (limit ${LIMIT}s), see $log${notes:+; $notes}" ;;
        *) record "$name" "FAILED (exit $RC)" "${TOOK}s, see $log${notes:+; $notes}" ;;
    esac
    [ "$RC" -ne 0 ] && FAILED=1
    return 0
}

# pytest_verdict NAME LOG [NOTES]: like verdict, with pytest's own counts and its exit 5.
pytest_verdict() {
    local name=$1 log=$2 extra=${3:-} counts
    counts=$(grep -E '(passed|failed|error|skipped|deselected|no tests ran).* in [0-9.]+s' \
        "$LOGS/$log.log" | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')
    if [ "$RC" -eq 5 ]; then
        local why
        why=$(grep -m1 -E '^SKIPPED' "$LOGS/$log.log" | cut -c1-160)
        record "$name" "NO GPU TESTS RAN" "module skipped, see $log.log${why:+: $why}"
        FAILED=1
    else
        verdict "$name" "$log" "$counts${extra:+; $extra}"
    fi
}

summary() {
    note "summary ($(($(date +%s) - START))s in all; logs in $LOGS)"
    echo "| stage | result | notes |"
    echo "|---|---|---|"
    printf '%s\n' "${SUMMARY[@]}"
    if [ -s "$LOGS/bench.log" ]; then
        echo
        sed -n '/^## kvseal GPU benchmark/,$p' "$LOGS/bench.log"
    fi
}

finish() {
    trap - EXIT INT TERM
    summary | tee "$LOGS/summary.md"
}
# The summary prints last whatever happens: normal end, early exit, a signal.
trap finish EXIT
trap 'record "device check" "INTERRUPTED" "signal after $(($(date +%s) - START))s"; exit 1' INT TERM

# ---- 0. what is this machine --------------------------------------------------------
env_probe() {
    "$PY" --version
    "$PY" - <<'EOF'
import platform, sys
print("platform:", platform.platform())
print("executable:", sys.executable)
EOF
    if command -v nvidia-smi >/dev/null; then
        timeout 20 nvidia-smi -L
        echo "driver: $(timeout 20 nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"
        timeout 20 nvidia-smi conf-compute -f 2>/dev/null
    else
        echo "nvidia-smi: missing"
    fi
    "$PY" -c 'from kvseal.server.backends.cuda.probe import cc_mode; print("CC mode (NVML):", cc_mode())' 2>&1
    command -v g++ >/dev/null && g++ --version | head -1 || echo "g++: missing (emulator tests skip)"
    echo "PYTORCH_(CUDA_)ALLOC_CONF=$PYTORCH_ALLOC_CONF LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
}
export -f env_probe
stage environment setup 60 bash -c env_probe
verdict environment setup

# ---- 1. dependencies ----------------------------------------------------------------
# Modules kvseal's daemon and tests import beyond torch and cuda-python.
NEEDED="cryptography grpc_health grpc_reflection opentelemetry.sdk prometheus_client pytest pytest_timeout hypothesis"
MISSING_PY='
import importlib.util, sys
def have(m):
    try:
        return importlib.util.find_spec(m) is not None
    except ImportError:  # a parent package is missing
        return False
print(" ".join(m for m in sys.argv[1:] if not have(m)))'
pkg_of() {
    case $1 in
        grpc_health) echo grpcio-health-checking ;;
        grpc_reflection) echo grpcio-reflection ;;
        opentelemetry.sdk) echo opentelemetry-sdk ;;
        prometheus_client) echo prometheus-client ;;
        pytest_timeout) echo pytest-timeout ;;
        grpc) echo grpcio ;;
        google.protobuf) echo protobuf ;;
        *) echo "$1" ;;
    esac
}
# kvseal's generated stubs need protobuf >= 7.35.1 and grpcio >= 1.85.1 (their gencode
# versions); an older system protobuf/grpcio fails every daemon and client import.
STUBS_PY='import kvseal.v1.kvseal_pb2, kvseal.v1.kvseal_pb2_grpc'
# cryptography-vectors (56 MB) stays behind: the run tool carries 64 MiB, and the
# NIST-vector tests already run in CI; here they skip.
WHEEL_FAILED=""
# until END: seconds from now to END, at least 1 (`timeout 0` would mean no limit).
until_() {
    local s=$(($1 - $(date +%s)))
    [ "$s" -lt 1 ] && s=1
    echo "$s"
}
install_deps() {
    local missing pkgs="" m p end
    end=$(($(date +%s) + $(clamp 60)))  # all pip calls together
    missing=$(timeout "$(tmo 30)" "$PY" -c "$MISSING_PY" $NEEDED 2>/dev/null)
    for m in $missing; do pkgs="$pkgs $(pkg_of "$m")"; done
    if ! timeout "$(tmo 30)" "$PY" -c "$STUBS_PY" >/dev/null 2>&1; then
        echo "system protobuf/grpcio too old for kvseal's stubs: taking them from ./wheels"
        pkgs="$pkgs protobuf grpcio"
    fi
    [ -z "${pkgs// /}" ] && { echo "nothing to install"; return 0; }
    if ! ls wheels/*.whl >/dev/null 2>&1; then
        echo "no ./wheels here (carry=['wheels'] missing?); needed:$pkgs"
        return 0
    fi
    mkdir -p "$DEPS"
    # pip --target ignores what is installed elsewhere: every dependency of these
    # packages (grpcio, protobuf, typing_extensions, ...) lands in $DEPS too and, first
    # on PYTHONPATH, shadows the system copies. That is what makes the generated
    # stubs' version guards pass against an older system grpcio/protobuf.
    if ! "$PY" -m pip --version >/dev/null 2>&1; then
        echo "no pip for $PY: unpacking every wheel in ./wheels into $DEPS instead"
        for p in wheels/*.whl; do
            timeout "$(tmo 30)" "$PY" -m zipfile -e "$p" "$DEPS" || WHEEL_FAILED="$WHEEL_FAILED $p"
        done
        return 0
    fi
    echo "installing$pkgs from ./wheels into $DEPS (no network)"
    # shellcheck disable=SC2086
    if timeout "$(until_ "$end")" "$PY" -m pip install --quiet --disable-pip-version-check \
        --no-index --find-links wheels --target "$DEPS" --upgrade $pkgs; then
        return 0
    fi
    # One missing or broken wheel must not cost the others: one package at a time,
    # what fails is recorded and the run goes on.
    echo "all at once failed: one package at a time"
    for p in $pkgs; do
        if [ "$(until_ "$end")" -lt 3 ]; then
            WHEEL_FAILED="$WHEEL_FAILED $p(no-time-left)"
            continue
        fi
        timeout "$(until_ "$end")" "$PY" -m pip install --quiet --disable-pip-version-check \
            --no-index --find-links wheels --target "$DEPS" --upgrade "$p" ||
            WHEEL_FAILED="$WHEEL_FAILED $p"
    done
    return 0
}
note "dependencies" | tee -a "$SETUP_LOG"
# Not in a pipeline: install_deps sets WHEEL_FAILED in this shell.
DEPS_OUT=$(mktemp /tmp/kvseal-deps.XXXXXX)
install_deps >"$DEPS_OUT" 2>&1
tee -a "$SETUP_LOG" <"$DEPS_OUT"
rm -f "$DEPS_OUT"
missing=$(timeout "$(tmo 30)" "$PY" -c "$MISSING_PY" $NEEDED torch 2>/dev/null)
timeout "$(tmo 30)" "$PY" -c 'from kvseal.server.backends.cuda.probe import driver_module; driver_module()' \
    2>/dev/null || missing="$missing cuda-python"
if ! timeout "$(tmo 30)" "$PY" -c "$STUBS_PY" >>"$SETUP_LOG" 2>&1; then
    missing="$missing protobuf>=7.35.1/grpcio>=1.85.1(stubs-fail,see-setup.log)"
fi
if [ -n "${missing// /}" ]; then
    hint="run 'make device-wheels' where there is network"
    ls wheels/*.whl >/dev/null 2>&1 || hint="no ./wheels: carry=['wheels'] missing?"
    echo "device-check: MISSING Python modules:$missing ($hint)" | tee -a "$SETUP_LOG"
    record "dependencies" "MISSING" "${missing# }; $hint${WHEEL_FAILED:+; wheels that failed:$WHEEL_FAILED}"
    MISSING_DEPS=1
else
    record "dependencies" "ok" "${WHEEL_FAILED:+wheels that failed (not needed):$WHEEL_FAILED}"
fi
versions() {
    "$PY" - <<'EOF'
import importlib, importlib.metadata as md
for mod, dist in (("grpc", "grpcio"), ("google.protobuf", "protobuf"),
                  ("cryptography", "cryptography"), ("torch", "torch"),
                  ("cuda.bindings", "cuda-bindings"), ("pytest", "pytest")):
    try:
        m = importlib.import_module(mod)
        v = getattr(m, "__version__", None) or md.version(dist)
        print(f"{mod}: {v} from {m.__file__}")
    except Exception as e:
        print(f"{mod}: MISSING ({type(e).__name__}: {e})")
try:
    print("dist nvidia-cuda-nvrtc:", md.version("nvidia-cuda-nvrtc"))
except md.PackageNotFoundError:
    pass
try:
    from kvseal.server.backends.cuda.compile import nvrtc_version
    print("NVRTC:", nvrtc_version())
except Exception as e:
    print("NVRTC: unavailable:", e)
try:
    import torch
    print("torch.version.cuda:", torch.version.cuda, "| cuda available:", torch.cuda.is_available())
except Exception as e:
    print("torch CUDA query failed:", e)
EOF
}
export -f versions
stage versions setup 60 bash -c versions
verdict "effective versions" setup

# ---- 2. is there a GPU --------------------------------------------------------------
stage "gpu probe" setup 60 "$PY" - "$DEVICE" <<'EOF'
import sys
from kvseal.server.backends.cuda.probe import cuda_available
ok, why = cuda_available(int(sys.argv[1]))
print(("GPU: " if ok else "no usable GPU: ") + why)
sys.exit(0 if ok else 3)
EOF
probe_line=$(grep -E '^(GPU: |no usable GPU: )' "$SETUP_LOG" | tail -1)
if [ "$RC" -eq 0 ]; then
    record "gpu probe" "ok" "$probe_line"
else
    NO_GPU=1
    record "gpu probe" "NO GPU" "${probe_line:-probe exit $RC, see setup.log}"
fi

# ---- 3. NVRTC build, 4. emulator tests: they need no GPU -------------------------
stage nvrtc-build setup 90 "$PY" - "$DEVICE" <<'EOF'
import sys, time
from kvseal.server.backends.cuda import compile as kc
from kvseal.server.backends.cuda.probe import cuda_available, driver_module
arch = kc.DEFAULT_ARCH
if cuda_available(int(sys.argv[1]))[0]:
    cu = driver_module()
    cu.cuInit(0)
    _, dev = cu.cuDeviceGet(int(sys.argv[1]))
    attr = cu.CUdevice_attribute
    _, major = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    _, minor = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    arch = f"sm_{major}{minor}"
t0 = time.monotonic()
try:
    k = kc.compile_kernels(arch)
except kc.NvrtcError as e:
    print("CUBIN for this arch failed, using PTX:", str(e).splitlines()[0])
    k = kc.compile_kernels(kc.DEFAULT_ARCH, output="ptx")
print(f"NVRTC {k.nvrtc_version}: {k.output} {k.arch}, {len(k.image)} bytes, "
      f"cached={k.cached}, {time.monotonic() - t0:.1f}s")
EOF
verdict nvrtc-build setup
stage emulator-tests emulator-tests 75 "$PY" -m pytest -q -rs --tb=short -p no:cacheprovider \
    -o timeout=60 tests/test_gpu_kernels_emulated.py tests/test_gpu_kernels_compile.py \
    tests/test_cuda_backend_cpu.py tests/test_torch_pool.py
pytest_verdict emulator-tests emulator-tests

if [ "$NO_GPU" -eq 1 ]; then
    echo "device-check: no usable GPU: nothing more to run" >&2
    exit 3
fi

# ---- 5. can this sandbox do CUDA IPC between processes at all? ---------------------
stage ipc-preflight ipc-preflight 30 "$PY" scripts/ipc_preflight.py --device "$DEVICE" --budget 25
PREFLIGHT=$(grep -E '^preflight: summary: ' "$LOGS/ipc-preflight.log" | tail -1 | cut -d' ' -f3-)
case $RC in
    0) record ipc-preflight "ok" "${TOOK}s; $PREFLIGHT" ;;
    2) record ipc-preflight "SKIPPED" "${TOOK}s; $PREFLIGHT" ;;
    99) verdict ipc-preflight ipc-preflight ;;
    *)
        verdict ipc-preflight ipc-preflight "${PREFLIGHT:-no summary line}"
        PREFLIGHT="FAILED"
        ;;
esac

# ---- 6./7. GPU tests: in-process half, then the daemon half in a process of its own -
# -v: the name of a test that hangs is on screen; faulthandler: Python stacks of a
# test stuck in a driver call (where pytest-timeout's signal cannot interrupt it).
GPU_PYTEST=("$PY" -m pytest -v -rs --tb=short -p no:cacheprovider -o timeout=60
    -o faulthandler_timeout=50 -m gpu)
stage gpu-tests gpu-tests 100 "${GPU_PYTEST[@]}" -k "not daemon" tests/gpu
pytest_verdict gpu-tests gpu-tests
# Short and private: the daemons' Unix sockets live below it (108-byte path limit).
GPU_TMP=$(mktemp -d /tmp/kvseal-dc.XXXXXX)
stage gpu-daemon-tests gpu-daemon-tests 150 "${GPU_PYTEST[@]}" -k daemon \
    --basetemp "$GPU_TMP/pt" tests/gpu
blame=""
[ "$RC" -ne 0 ] && [ "$PREFLIGHT" = "FAILED" ] &&
    blame="CUDA IPC failed without kvseal too (ipc-preflight): the sandbox, not necessarily kvseal"
pytest_verdict gpu-daemon-tests gpu-daemon-tests "$blame"
{
    found=0
    while IFS= read -r f; do
        found=1
        echo "==== $f ($(wc -c <"$f") bytes; last 30000)"
        tail -c 30000 "$f"
        echo
    done < <(find "$GPU_TMP" -name 'daemon.log' 2>/dev/null | sort)
    [ "$found" -eq 0 ] && echo "no daemon logs under $GPU_TMP"
} >"$LOGS/daemon-logs.log" 2>&1

# ---- 8. benchmark -------------------------------------------------------------------
limit=$(clamp 130)
BENCH_ARGS=(--device "$DEVICE" --budget $((limit > 25 ? limit - 15 : 10)))
[ "${QUICK:-0}" = 1 ] && BENCH_ARGS+=(--quick)
stage bench bench 130 "$PY" bench/bench_gpu.py "${BENCH_ARGS[@]}"
verdict bench bench

rm -rf "$GPU_TMP"
if [ "$MISSING_DEPS" -eq 1 ]; then
    exit 2
fi
exit "$FAILED"
