#!/usr/bin/env bash
# kvseal device check: the GPU work, in one run of at most 360 s, on a machine with NO
# network: `bash scripts/device_check.sh` (what `make device-check` runs; the device
# image may have no make). Sized for a 15-minute device allowance in which every call
# starts a fresh machine (1-2 minutes, counted), and no machine starts with under
# 4 minutes left: one full run (about 8 minutes with the start) leaves room for one
# rerun of the stages that failed (STAGES=..., on another fresh machine: the wheels
# are installed again, the kernels compiled again). docs/gpu-path.md gives the exact
# `run` call.
# Designed for an H200 host where torch, cuda-python (cuda-bindings), grpcio, protobuf,
# numpy, pytest, pytest-timeout and hypothesis are preinstalled in the system python3
# and the repo's .venv does not exist. The rest comes as wheels in ./wheels (`make
# device-wheels` on a machine with network; carry `wheels` along), installed by
# scripts/device_deps.py into build/device-deps, never into the system site-packages.
# The CPU-only checks (kernel emulator, the fake-driver conformance test under both
# cuda-bindings versions) run in CI, not here.
#
# Stages, in this order (name: what; its time limit; its log under $OUT). Every limit
# is clamped to the global deadline (START + DEVICE_CHECK_BUDGET, default 360 s):
#   env        0. facts: python, platform, cuda-bindings (a WARNING outside the
#                 tested 13.0.3 - 13.5.x), cuda-python, driver (cuDriverGetVersion,
#                 nvidia-smi), IPC handle types opaque or not, compute mode, CC
#                 mode, /dev/shm size, torch (a cold first `import torch` and CUDA
#                 initialisation); "unknown (why)" for a fact it cannot get.
#                 Always runs.                                          90 s  setup.log
#   probe      is there a usable GPU (exit 3 without one, before any
#              install). Runs whenever a GPU stage is selected.        45 s  setup.log
#   deps       wheels -> build/device-deps (only what the image lacks,
#              offline, isolated from the image's pip configuration),
#              then the effective versions. Runs whenever nvrtc,
#              inprocess, daemon or bench is selected.                 60 s  setup.log
#   nvrtc      NVRTC build of the kernels for this GPU into the on-disk
#              cache (build/kvseal-cache) the daemons and tests use.
#              Unselected, they compile on first use (a few seconds).  60 s  setup.log
#   inprocess  GPU tests, in-process half (-k "not daemon"): the GPU's
#              bytes against `cryptography`'s AESGCM, first, since a
#              symmetric AES bug would pass the daemon's round trip.   90 s  gpu-tests.log
#   preflight  CUDA IPC between processes with kvseal out of the
#              picture (scripts/ipc_preflight.py): torch parent,
#              cuda-python child making every driver call the daemon
#              makes on a mapping.                                     35 s  ipc-preflight.log
#   daemon     GPU tests, daemon half over CUDA IPC (-k daemon), in a
#              pytest run of its own so that a kernel trap in one half
#              cannot poison the other's context; then every daemon log
#              they left (daemon-logs.log). SKIPPED when the preflight
#              ran and failed: it would only wait out its timeouts.    120 s  gpu-daemon-tests.log
#   bench      bench/bench_gpu.py --quick (QUICK=0: the full one), with
#              the time left (at most 90 s) as its budget.             90 s  bench.log
# Both pytest runs: -q (no test names: a hang is named by pytest-timeout's stack
# dump), --tb=short, 60 s per test, and byte comparisons that report the first
# differing offset (tests/gpu/bytes_check.py), so a kernel bug fails in seconds
# and the rest of the half still runs.
# STAGES="preflight daemon" (names above, space or comma separated; empty: all) runs
# only those, plus env and the probe/deps they need, as listed. An unknown name is an
# error (exit 64) that lists the valid ones.
#
# The summary table always prints last (also on an early exit or a signal), followed
# by the benchmark's table, and is kept as summary.md: 7 files in all under $OUT, the
# device runner brings back at most 8. Write nothing else there.
#
# Environment: PYTHON (default python3), OUT (logs go there if set, else
# build/device-check), DEVICE (GPU ordinal, default 0), STAGES, QUICK (default 1),
# DEVICE_CHECK_BUDGET (seconds, default 360), KVSEAL_KERNELS_SAFE (passed to NVRTC:
# `vector` turns off the 16-byte load/store fast path, `atomics` the device atomics,
# `1` both; the summary names it; for bisecting wrong bytes in a rerun).
# Exit status: 0 all selected stages passed; 1 a stage failed (the summary says which;
# a preflight DEFECT is a kvseal/cuda-bindings bug, a preflight FAILED a platform
# finding); 2 dependencies missing (the stages that need them ran and failed); 3 no
# GPU; 64 unknown STAGES name.
set -u -o pipefail

ALL_STAGES="env probe deps nvrtc inprocess preflight daemon bench"
case "${1:-}" in
    -h | --help)
        sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'
        exit 0
        ;;
esac
SELECTED=$(echo "${STAGES:-$ALL_STAGES}" | tr ',' ' ' | xargs)
[ -z "$SELECTED" ] && SELECTED=$ALL_STAGES
for s in $SELECTED; do
    case " $ALL_STAGES " in
        *" $s "*) ;;
        *)
            echo "device-check: unknown stage '$s' in STAGES; valid: $ALL_STAGES" >&2
            exit 64
            ;;
    esac
done
selected() { case " $SELECTED " in *" $1 "*) return 0 ;; esac; return 1; }
any_selected() {
    local s
    for s in "$@"; do selected "$s" && return 0; done
    return 1
}
# What runs: the selection plus what its stages need (see the header).
RUN_PROBE=0 RUN_DEPS=0
any_selected probe nvrtc inprocess preflight daemon bench && RUN_PROBE=1
any_selected deps nvrtc inprocess daemon bench && RUN_DEPS=1

cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-0}
LOGS=${OUT:-$ROOT/build/device-check}
DEPS=$ROOT/build/device-deps
START=$(date +%s)
DEADLINE=$((START + ${DEVICE_CHECK_BUDGET:-360}))
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
declare -a SUMMARY=()
FAILED=0 MISSING_DEPS=0

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
# The first failure's one-line reason goes into the notes too (-rfE prints it: for a
# byte comparison, its first differing offset), with "|" made harmless for the table.
pytest_verdict() {
    local name=$1 log=$2 extra=${3:-} counts first
    counts=$(grep -E '(passed|failed|error|skipped|deselected|no tests ran).* in [0-9.]+s' \
        "$LOGS/$log.log" | tail -1 | tr -d '=' | sed 's/^ *//; s/ *$//')
    first=$(grep -m1 -E '^(FAILED|ERROR) ' "$LOGS/$log.log" | cut -c1-300 | tr '|' '/')
    [ -n "$first" ] && extra="first: $first${extra:+; $extra}"
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
    note "summary ($(($(date +%s) - START))s in all; stages: $SELECTED${SAFE:+; KVSEAL_KERNELS_SAFE=$SAFE}; logs in $LOGS)"
    echo "| stage | result | notes |"
    echo "|---|---|---|"
    printf '%s\n' "${SUMMARY[@]}"
    if [ -s "$LOGS/bench.log" ]; then
        echo
        sed -n '/^## kvseal GPU benchmark/,$p' "$LOGS/bench.log"
    fi
}

GPU_TMP=""
finish() {
    trap - EXIT INT TERM
    [ -n "$GPU_TMP" ] && rm -rf "$GPU_TMP"
    summary | tee "$LOGS/summary.md"
}
# The summary prints last whatever happens: normal end, early exit, a signal.
trap finish EXIT
trap 'record "device check" "INTERRUPTED" "signal after $(($(date +%s) - START))s"; exit 1' INT TERM

echo "device-check: stages: $ALL_STAGES" | tee -a "$SETUP_LOG"
ALSO="env"
[ "$RUN_PROBE" -eq 1 ] && ! selected probe && ALSO="$ALSO probe"
[ "$RUN_DEPS" -eq 1 ] && ! selected deps && ALSO="$ALSO deps"
echo "device-check: selected: $SELECTED (also run, as needed: $ALSO)" | tee -a "$SETUP_LOG"
echo "device-check: budget $((DEADLINE - START))s, logs in $LOGS" | tee -a "$SETUP_LOG"
SAFE="${KVSEAL_KERNELS_SAFE:-}"
[ -n "$SAFE" ] && echo "device-check: KVSEAL_KERNELS_SAFE=$SAFE (diagnostic kernels)" |
    tee -a "$SETUP_LOG"

# NVRTC from pip wheels (nvidia-cuda-nvrtc[-cu12], also pulled in by torch): cuda-python
# before 12.8 dlopens libnvrtc by soname only, so put those lib dirs on the search path.
NV_LIBS=$(timeout "$(tmo 30)" "$PY" - <<'EOF' 2>/dev/null
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

# ---- env (stage 0): what is this machine ---------------------------------------------
# Every fact prints "name: value" or "name: unknown (why)"; nothing here aborts.
env_facts() {
    local v
    echo "python: $("$PY" --version 2>&1 || echo "unknown ($PY does not run)")"
    if command -v nvidia-smi >/dev/null; then
        timeout 10 nvidia-smi -L 2>&1 || echo "gpus: unknown (nvidia-smi -L failed)"
        v=$(timeout 10 nvidia-smi -i "$DEVICE" --query-gpu=driver_version,compute_mode \
            --format=csv,noheader 2>&1 | head -1)
        echo "nvidia-smi driver, compute mode: ${v:-unknown (no answer)}"
        v=$(timeout 10 nvidia-smi conf-compute -f 2>&1 | head -3 | tr '\n' ' ')
        echo "nvidia-smi conf-compute -f: ${v:-unknown (no answer)}"
    else
        echo "nvidia-smi: unknown (not on PATH): driver, compute mode and CC from the bindings below"
    fi
    if [ -d /dev/shm ]; then
        v=$(df -h --output=size,avail /dev/shm 2>/dev/null | tail -1 | xargs)
        echo "/dev/shm size, available: ${v:-unknown (df failed)}"
    else
        echo "/dev/shm: unknown (absent: --host-region files and the preflight use the temp dir)"
    fi
    # 60 s: a fresh machine's first `import torch` and CUDA initialisation are cold
    # (the nvidia-smi calls above take at most 30 s: 90 s for the stage).
    timeout 60 "$PY" - "$DEVICE" <<'EOF' 2>&1 || echo "python facts: unknown (exit $?)"
import importlib, importlib.metadata as md, platform, sys

def fact(name, fn):
    try:
        print(f"{name}: {fn()}")
    except Exception as e:  # each fact on its own: one missing never hides the rest
        print(f"{name}: unknown ({type(e).__name__}: {e})")

dev = int(sys.argv[1])
fact("platform", platform.platform)
fact("executable", lambda: sys.executable)

# The versions CI tests (mk/cuda.mk: the pinned KERNELS_NVRTC_PKGS one and
# CUDA_BINDINGS_NEWEST, under the fake driver); tests/test_device_check.py keeps
# these in step with it.
TESTED = ((13, 0, 3), (13, 5))

def bindings():
    import cuda.bindings
    v = cuda.bindings.__version__
    nums = tuple(int(x) for x in v.split("+")[0].split(".")[:3] if x.isdigit())
    lo, hi = TESTED
    inside = lo <= nums and nums[:2] <= hi
    warn = "" if inside else (
        " WARNING: outside the tested range 13.0.3 - 13.5.x (an API change there is"
        " what a preflight DEFECT would show)")
    return f"{v} from {cuda.bindings.__file__}{warn}"
fact("cuda-bindings", bindings)

def cuda_python():
    try:
        return md.version("cuda-python")
    except md.PackageNotFoundError:
        return "not installed (the metapackage is optional)"
fact("cuda-python", cuda_python)

def drv():
    for name in ("cuda.bindings.driver", "cuda.cuda"):
        try:
            return importlib.import_module(name)
        except ImportError as e:
            err = e
    raise err

def opaque():
    cu = drv()
    out = []
    for t in ("CUipcMemHandle", "CUipcEventHandle"):
        h = getattr(cu, t)()
        kind = "opaque (no reserved)" if not hasattr(h, "reserved") else "reserved attribute"
        out.append(f"{t}: {kind}, getPtr {'yes' if hasattr(h, 'getPtr') else 'NO'}")
    return "; ".join(out)
fact("IPC handle types", opaque)

def driver_version():
    cu = drv()
    err, v = cu.cuDriverGetVersion()
    if int(err) != 0:
        raise RuntimeError(f"CUresult {int(err)}")
    return f"CUDA {int(v) // 1000}.{int(v) % 1000 // 10} ({int(v)})"
fact("driver (cuDriverGetVersion)", driver_version)

def compute_mode():
    cu = drv()
    (err,) = cu.cuInit(0)
    if int(err) != 0:
        raise RuntimeError(f"cuInit: CUresult {int(err)}")
    err, d = cu.cuDeviceGet(dev)
    if int(err) != 0:
        raise RuntimeError(f"cuDeviceGet({dev}): CUresult {int(err)}")
    attr = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_MODE
    err, mode = cu.cuDeviceGetAttribute(attr, d)
    if int(err) != 0:
        raise RuntimeError(f"cuDeviceGetAttribute: CUresult {int(err)}")
    name = cu.CUcomputemode(int(mode)).name
    warn = "" if int(mode) == 0 else " (not DEFAULT: the engine and the daemon cannot share the GPU)"
    return f"{name}{warn}"
fact(f"compute mode (device {dev})", compute_mode)

def cc():
    from kvseal.server.backends.cuda.probe import cc_mode
    mode = cc_mode()  # "on", "off" or "unknown: why"
    return f"unknown ({mode[9:]})" if mode.startswith("unknown: ") else mode
fact("CC mode (NVML)", cc)

def torch_version():
    import torch
    return f"{torch.__version__}, torch.version.cuda {torch.version.cuda}"
fact("torch", torch_version)
EOF
    echo "PYTORCH_(CUDA_)ALLOC_CONF=$PYTORCH_ALLOC_CONF LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
}
export -f env_facts
stage env setup 90 bash -c env_facts
verdict env setup

# ---- probe: is there a GPU (before anything is installed) ---------------------------
if [ "$RUN_PROBE" -eq 1 ]; then
    stage probe setup 45 "$PY" - "$DEVICE" <<'EOF'
import sys
from kvseal.server.backends.cuda.probe import cuda_available
ok, why = cuda_available(int(sys.argv[1]))
print(("GPU: " if ok else "no usable GPU: ") + why)
sys.exit(0 if ok else 3)
EOF
    probe_line=$(grep -E '^(GPU: |no usable GPU: )' "$SETUP_LOG" | tail -1)
    if [ "$RC" -eq 0 ]; then
        record probe "ok" "${TOOK}s; $probe_line"
    else
        record probe "NO GPU" "${probe_line:-probe exit $RC, see setup.log}"
        echo "device-check: no usable GPU: nothing more to run" >&2
        exit 3
    fi
fi

# ---- deps: what the image lacks, from ./wheels ---------------------------------------
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
# kvseal's generated stubs need protobuf >= 7.35.1 and grpcio >= 1.85.1 (their gencode
# versions); an older system protobuf/grpcio fails every daemon and client import.
STUBS_PY='import kvseal.v1.kvseal_pb2, kvseal.v1.kvseal_pb2_grpc'
# cryptography-vectors (56 MB) stays behind: the run tool carries 64 MiB, and the
# NIST-vector tests run in CI.
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
EOF
}
export -f versions
if [ "$RUN_DEPS" -eq 1 ]; then
    t0=$SECONDS
    note "deps (limit $(clamp 60)s)" | tee -a "$SETUP_LOG"
    # scripts/device_deps.py: each carried wheel whose distribution the image lacks
    # (grpcio/protobuf also when the image's fail kvseal's stubs), pip --no-index
    # --no-deps --isolated with PIP_CONFIG_FILE=/dev/null, into $DEPS (first on
    # PYTHONPATH), never into the system site-packages.
    timeout --kill-after=5 "$(tmo 60)" "$PY" scripts/device_deps.py wheels "$DEPS" 2>&1 |
        tee -a "$SETUP_LOG"
    DEPS_RC=${PIPESTATUS[0]}
    missing=$(timeout "$(tmo 20)" "$PY" -c "$MISSING_PY" $NEEDED torch 2>/dev/null)
    timeout "$(tmo 20)" "$PY" -c 'from kvseal.server.backends.cuda.probe import driver_module; driver_module()' \
        2>/dev/null || missing="$missing cuda-python"
    if ! timeout "$(tmo 20)" "$PY" -c "$STUBS_PY" >>"$SETUP_LOG" 2>&1; then
        missing="$missing protobuf>=7.35.1/grpcio>=1.85.1(stubs-fail,see-setup.log)"
    fi
    timeout "$(tmo 20)" bash -c versions 2>&1 | tee -a "$SETUP_LOG"
    if [ -n "${missing// /}" ]; then
        hint="run 'make device-wheels' where there is network"
        ls wheels/*.whl >/dev/null 2>&1 || hint="no ./wheels: carry=['wheels'] missing?"
        echo "device-check: MISSING Python modules:$missing ($hint)" | tee -a "$SETUP_LOG"
        record deps "MISSING" "${missing# }; $hint; device_deps.py exit $DEPS_RC"
        MISSING_DEPS=1
    else
        record deps "ok" "$((SECONDS - t0))s$([ "$DEPS_RC" -ne 0 ] && echo "; device_deps.py exit $DEPS_RC (not needed)")"
    fi
fi

# ---- nvrtc: the kernels for this GPU, into the cache the daemons use ------------------
if selected nvrtc; then
    stage nvrtc setup 60 "$PY" - "$DEVICE" <<'EOF'
import sys, time
from kvseal.server.backends.cuda import compile as kc
from kvseal.server.backends.cuda.probe import driver_module
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
    verdict nvrtc setup "$(grep -E '^NVRTC [(0-9]' "$SETUP_LOG" | tail -1 | cut -c1-120)"
fi

# ---- inprocess, daemon: GPU tests, each half in a pytest run of its own ---------------
# -q, not -v: a failing comparison of 4 MiB byte strings is one line (bytes_check),
# and pytest -v would diff them for minutes; pytest-timeout (60 s a test) names a
# test that hangs with its stack; faulthandler: Python stacks of a test stuck in a
# driver call (where pytest-timeout's signal cannot interrupt it). COLUMNS: the short
# summary's FAILED lines keep their whole one-line reason (the offset), not 80 columns.
GPU_PYTEST=(env COLUMNS=400 "$PY" -m pytest -q -rfEs --tb=short -p no:cacheprovider
    -o timeout=60 -o faulthandler_timeout=50 -m gpu)
# The in-process half first: GPU bytes against cryptography's AESGCM (a symmetric AES
# bug would pass the daemon's round trip, which only opens what the GPU sealed).
if selected inprocess; then
    stage inprocess gpu-tests 90 "${GPU_PYTEST[@]}" -k "not daemon" tests/gpu
    pytest_verdict inprocess gpu-tests
fi

# ---- preflight: can this sandbox do CUDA IPC between processes at all? ----------------
PREFLIGHT_RC="" PREFLIGHT=""
if selected preflight; then
    stage preflight ipc-preflight 35 "$PY" scripts/ipc_preflight.py --device "$DEVICE" --budget 30
    PREFLIGHT_RC=$RC
    PREFLIGHT=$(grep -E '^preflight: summary: ' "$LOGS/ipc-preflight.log" | tail -1 | cut -d' ' -f3-)
    case $RC in
        0) record preflight "ok" "${TOOK}s; $PREFLIGHT" ;;
        2) record preflight "SKIPPED" "${TOOK}s; $PREFLIGHT" ;;
        3)
            record preflight "DEFECT (kvseal/cuda-bindings)" "${TOOK}s; $PREFLIGHT"
            FAILED=1
            ;;
        1) verdict preflight ipc-preflight "platform finding: ${PREFLIGHT:-no summary line}" ;;
        *) verdict preflight ipc-preflight "${PREFLIGHT:-no summary line}" ;;
    esac
fi

if selected daemon; then
    if [ -n "$PREFLIGHT_RC" ] && [ "$PREFLIGHT_RC" -ne 0 ]; then
        # The daemon half needs CUDA IPC between processes: it would wait out its
        # timeouts and say less than the preflight already did.
        record daemon "SKIPPED" "the IPC preflight did not pass (exit $PREFLIGHT_RC): ${PREFLIGHT:-see ipc-preflight.log}"
        echo "device-check: daemon half skipped: the IPC preflight did not pass" >"$LOGS/gpu-daemon-tests.log"
        [ "$PREFLIGHT_RC" -ne 2 ] && FAILED=1
    else
        # Short and private: the daemons' Unix sockets live below it (108-byte limit).
        GPU_TMP=$(mktemp -d -t kvseal-dc.XXXXXX)
        stage daemon gpu-daemon-tests 120 "${GPU_PYTEST[@]}" -k daemon \
            --basetemp "$GPU_TMP/pt" tests/gpu
        pytest_verdict daemon gpu-daemon-tests
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
    fi
fi

# ---- bench ----------------------------------------------------------------------------
if selected bench; then
    limit=$(clamp 90)
    BENCH_ARGS=(--device "$DEVICE" --budget $((limit > 25 ? limit - 15 : 10)))
    [ "${QUICK:-1}" = 1 ] && BENCH_ARGS+=(--quick)
    stage bench bench 90 "$PY" bench/bench_gpu.py "${BENCH_ARGS[@]}"
    verdict bench bench
fi

if [ "$MISSING_DEPS" -eq 1 ]; then
    exit 2
fi
exit "$FAILED"
