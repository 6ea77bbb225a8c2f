#!/usr/bin/env bash
# kvseal device check: everything that needs a GPU, in one run, on a machine with NO
# network (``make device-check``). Designed for an H200 host where torch, cuda-python,
# grpcio and protobuf are preinstalled in the system python3 and the repo's .venv does
# not exist. Other packages come as wheels in ./wheels (``make device-wheels`` on a
# machine with network) and are installed into build/device-deps, never into the
# system site-packages.
#
# Steps (each with its own time limit, 8 minutes in all at worst):
#   0. report python/torch/CUDA versions and the CC mode
#   1. dependencies (wheels -> build/device-deps), fail fast listing what is missing
#   2. GPU probe, fail fast without a usable GPU
#   3. NVRTC build of the kernels (cached on disk for the daemon)
#   4. CPU emulator tests (kernels + backend request logic)
#   5. GPU tests (tests/gpu, marker gpu)
#   6. benchmark (bench/bench_gpu.py)
# then a summary table, and the benchmark's table last.
#
# Environment: PYTHON (default python3), OUT (logs go there if set, else
# build/device-check), DEVICE (GPU ordinal, default 0), QUICK=1 (shorter benchmark).
# Exit status: 0 all passed, 1 a step failed, 2 missing dependencies, 3 no GPU.
set -u -o pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-0}
LOGS=${OUT:-$ROOT/build/device-check}
DEPS=$ROOT/build/device-deps
mkdir -p "$LOGS"
export PYTHONPATH="$DEPS:$ROOT/client:$ROOT/server:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export KVSEAL_CACHE_DIR=${KVSEAL_CACHE_DIR:-$ROOT/build/kvseal-cache}
export PYTHONDONTWRITEBYTECODE=1
START=$(date +%s)
# NVRTC from pip wheels (nvidia-cuda-nvrtc[-cu12], also pulled in by torch): cuda-python
# before 12.8 dlopens libnvrtc by soname only, so put those lib dirs on the search path.
NV_LIBS=$("$PY" - <<'EOF' 2>/dev/null
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

note() { printf '\n=== %s\n' "$*"; }
record() { SUMMARY+=("| $1 | $2 | $3 |"); }

# run NAME SECONDS CMD... : run with a time limit, log to $LOGS/NAME.log, record status.
run() {
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS rc
    note "$name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
    rc=${PIPESTATUS[0]}
    local took=$((SECONDS - t0))
    if [ "$rc" -eq 0 ]; then
        record "$name" "ok" "${took}s"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        record "$name" "TIMEOUT" "${took}s (limit ${limit}s)"
    else
        record "$name" "FAILED (exit $rc)" "${took}s, see $name.log"
    fi
    return "$rc"
}

summary() {
    note "summary ($(($(date +%s) - START))s in all; logs in $LOGS)"
    echo "| step | result | notes |"
    echo "|---|---|---|"
    printf '%s\n' "${SUMMARY[@]}"
    if [ -s "$LOGS/bench.log" ]; then
        echo
        sed -n '/^## kvseal GPU benchmark/,$p' "$LOGS/bench.log"
    fi
}

# ---- 0. what is this machine --------------------------------------------------------
note "environment"
{
    "$PY" --version
    "$PY" - <<'EOF'
import importlib, importlib.metadata as md, platform
print("platform:", platform.platform())
for mod, attr in (("torch", "__version__"), ("cuda.bindings", "__version__"),
                  ("cuda.cuda", "__name__"), ("grpc", "__version__"),
                  ("google.protobuf", "__version__")):
    try:
        m = importlib.import_module(mod)
        print(f"{mod}: {getattr(m, attr, '?')}")
    except Exception as e:
        print(f"{mod}: MISSING ({e})")
for dist in ("cuda-python", "cuda-bindings", "nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12"):
    try:
        print(f"dist {dist}: {md.version(dist)}")
    except md.PackageNotFoundError:
        pass
try:
    from kvseal.server.cuda.compile import nvrtc_version
    print("NVRTC:", nvrtc_version())
except Exception as e:
    print("NVRTC: unavailable:", e)
try:
    import torch
    print("torch.version.cuda:", torch.version.cuda, "| cuda available:", torch.cuda.is_available())
    if torch.cuda.is_available():
        print("device 0:", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
except Exception as e:
    print("torch CUDA query failed:", e)
EOF
    command -v nvidia-smi >/dev/null && nvidia-smi -L
    command -v nvidia-smi >/dev/null &&
        echo "driver: $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1)"
    command -v nvidia-smi >/dev/null && nvidia-smi conf-compute -f 2>/dev/null
    "$PY" -c 'from kvseal.server.cuda.probe import cc_mode; print("CC mode (NVML):", cc_mode())' \
        2>&1
    command -v g++ >/dev/null && g++ --version | head -1 || echo "g++: missing (emulator tests skip)"
} 2>&1 | tee "$LOGS/environment.log"

# ---- 1. dependencies ----------------------------------------------------------------
MISSING_PY='
import importlib.util, sys
def have(m):
    try:
        return importlib.util.find_spec(m) is not None
    except ImportError:  # a parent package is missing
        return False
print(" ".join(m for m in sys.argv[1:] if not have(m)))'
# cryptography-vectors (56 MB) stays behind: the run tool carries 64 MiB, and
# the NIST-vector tests already run in CI; here they skip.
NEEDED="cryptography grpc_health grpc_reflection opentelemetry.sdk pytest pytest_timeout hypothesis"
if [ -d wheels ] && ls wheels/*.whl >/dev/null 2>&1; then
    note "installing wheels from ./wheels into $DEPS (no network)"
    mkdir -p "$DEPS"
    missing=$("$PY" -c "$MISSING_PY" $NEEDED 2>/dev/null)
    # Only what the system python lacks: never shadow its torch/grpcio/protobuf.
    pkgs=""
    for m in $missing; do
        case $m in
            grpc_health) pkgs="$pkgs grpcio-health-checking" ;;
            grpc_reflection) pkgs="$pkgs grpcio-reflection" ;;
            opentelemetry.sdk) pkgs="$pkgs opentelemetry-sdk" ;;
            pytest_timeout) pkgs="$pkgs pytest-timeout" ;;
            cryptography_vectors) pkgs="$pkgs cryptography-vectors" ;;
            *) pkgs="$pkgs $m" ;;
        esac
    done
    if [ -n "$pkgs" ]; then
        "$PY" -m pip install --quiet --no-index --find-links wheels --target "$DEPS" \
            --upgrade $pkgs 2>&1 | tee "$LOGS/wheels.log"
    fi
fi
# kvseal's generated stubs need protobuf >= 7.35.1 and grpcio >= 1.85.1 (their gencode
# versions); an older system protobuf/grpcio fails every daemon and client import.
STUBS_PY='import kvseal.v1.kvseal_pb2, kvseal.v1.kvseal_pb2_grpc'
if ! "$PY" -c "$STUBS_PY" >/dev/null 2>&1 && ls wheels/protobuf-*.whl >/dev/null 2>&1; then
    note "system protobuf/grpcio too old for kvseal's stubs: installing them from ./wheels into $DEPS"
    mkdir -p "$DEPS"
    "$PY" -m pip install --quiet --no-index --find-links wheels --target "$DEPS" \
        --upgrade protobuf grpcio 2>&1 | tee -a "$LOGS/wheels.log"
fi
missing=$("$PY" -c "$MISSING_PY" $NEEDED)
for m in torch grpc google.protobuf; do
    "$PY" -c "import $m" 2>/dev/null || missing="$missing $m"
done
# cuda-python: cuda.bindings.driver (>= 12.6) or cuda.cuda (older), as probe.driver_module.
"$PY" -c 'from kvseal.server.cuda.probe import driver_module; driver_module()' 2>/dev/null ||
    missing="$missing cuda-python"
if [ -z "${missing// /}" ] && ! "$PY" -c "$STUBS_PY" 2>"$LOGS/stubs.log"; then
    missing="$missing protobuf>=7.35.1/grpcio>=1.85.1(see-stubs.log)"
fi
if [ -n "${missing// /}" ]; then
    echo "device-check: missing Python modules:$missing" >&2
    echo "  run 'make device-wheels' on a machine with network and copy wheels/ here" >&2
    record "dependencies" "MISSING" "$missing"
    summary
    exit 2
fi
record "dependencies" "ok" ""

# ---- 2. is there a GPU --------------------------------------------------------------
if ! "$PY" - "$DEVICE" <<'EOF' 2>&1 | tee "$LOGS/probe.log"; then
import sys
from kvseal.server.cuda.probe import cuda_available
ok, why = cuda_available(int(sys.argv[1]))
print(("GPU: " if ok else "no usable GPU: ") + why)
sys.exit(0 if ok else 3)
EOF
    record "gpu probe" "NO GPU" "$(tail -1 "$LOGS/probe.log")"
    summary
    exit 3
fi
record "gpu probe" "ok" "$(tail -1 "$LOGS/probe.log")"

# ---- 3..6 ---------------------------------------------------------------------------
failed=0
run nvrtc-build 90 "$PY" - "$DEVICE" <<'EOF' || failed=1
import sys, time
from kvseal.server.cuda import compile as kc
from kvseal.server.cuda.probe import driver_module
cu = driver_module()
cu.cuInit(0)
_, dev = cu.cuDeviceGet(int(sys.argv[1]))
attr = cu.CUdevice_attribute
_, major = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
_, minor = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
t0 = time.monotonic()
try:
    k = kc.compile_kernels(f"sm_{major}{minor}")
except kc.NvrtcError as e:
    print("CUBIN for this arch failed, using PTX:", str(e).splitlines()[0])
    k = kc.compile_kernels(kc.DEFAULT_ARCH, output="ptx")
print(f"NVRTC {k.nvrtc_version}: {k.output} {k.arch}, {len(k.image)} bytes, "
      f"cached={k.cached}, {time.monotonic() - t0:.1f}s")
EOF
run emulator-tests 75 "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_gpu_kernels_emulated.py tests/test_gpu_kernels_compile.py \
    tests/test_cuda_backend_cpu.py tests/test_torch_pool.py || failed=1
run gpu-tests 170 "$PY" -m pytest -q -rs -p no:cacheprovider -m gpu tests/gpu || failed=1
BENCH_ARGS="--device $DEVICE"
[ "${QUICK:-0}" = 1 ] && BENCH_ARGS="$BENCH_ARGS --quick"
# shellcheck disable=SC2086
run bench 130 "$PY" bench/bench_gpu.py $BENCH_ARGS || failed=1

summary
exit "$failed"
