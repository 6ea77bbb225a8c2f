# GPU kernels (server/kvseal/server/backends/cuda): checks that need no GPU.
# Included by the top-level Makefile (-include mk/*.mk); uses its PY and venv.

KERNELS_DIR   := server/kvseal/server/backends/cuda
KERNELS_ARCH  ?= sm_90
NVCC          ?= nvcc
# NVRTC compile-only wheels, verified to work on a machine without a GPU or driver.
KERNELS_NVRTC_PKGS := cuda-bindings==13.0.3 nvidia-cuda-nvrtc==13.0.88

.PHONY: kernels-check kernels-nvcc kernels-nvrtc-deps

## Emulated kernels vs AESGCM + NIST vectors, NVRTC/nvcc compile checks (skip what is absent).
kernels-check: venv
	$(PY) -m pytest tests/test_gpu_kernels_emulated.py tests/test_gpu_kernels_compile.py \
	    tests/test_gpu_kernels_threaded.py -q

## nvcc object + register/spill report for KERNELS_ARCH (needs nvcc, not a GPU).
kernels-nvcc:
	mkdir -p build
	$(NVCC) -arch=$(KERNELS_ARCH) -c -Xptxas -v $(KERNELS_DIR)/kernels.cu \
	    -o build/kvseal-kernels-$(KERNELS_ARCH).o

## Install the optional NVRTC compile-only dependencies into .venv.
kernels-nvrtc-deps: venv
	$(PY) -m pip install --quiet $(KERNELS_NVRTC_PKGS)

# The newest cuda-bindings release, alone, beside the pinned one: the fake-driver
# conformance test (tests/test_cuda_backend_cpu.py::test_cuda_device_over_fake_driver)
# runs under both, because a new release can change the API under the pinned CI
# (13.4 made the IPC handle types opaque). --no-deps: it imports over the venv's
# cuda-pathfinder and NVRTC wheel. The test reads CUDA_BINDINGS_NEWEST from this file
# and asserts the version its subprocess loaded; under CI=true a missing install fails.
# `make test` installs it (the prerequisite below), so a fresh clone gets it.
CUDA_BINDINGS_NEWEST := 13.5.0
CUDA_BINDINGS_NEWEST_DIR := $(VENV)/cuda-bindings-newest
CUDA_BINDINGS_NEWEST_STAMP := $(CUDA_BINDINGS_NEWEST_DIR)/.installed-$(CUDA_BINDINGS_NEWEST)

.PHONY: cuda-bindings-newest

## Install cuda-bindings==CUDA_BINDINGS_NEWEST alone into .venv/cuda-bindings-newest.
cuda-bindings-newest: $(CUDA_BINDINGS_NEWEST_STAMP)

$(CUDA_BINDINGS_NEWEST_STAMP): $(STAMP)
	rm -rf $(CUDA_BINDINGS_NEWEST_DIR)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps \
	    --target $(CUDA_BINDINGS_NEWEST_DIR) cuda-bindings==$(CUDA_BINDINGS_NEWEST)
	touch $@

test: cuda-bindings-newest

# ---------------------------------------------------------------------------------
# GPU runs (need an NVIDIA GPU): benchmark and the one-shot device check.
#
# The device check (scripts/device_check.sh; its header is the reference) is the GPU
# work only, at most 360 s: stages env, probe, deps, nvrtc, inprocess, preflight,
# daemon, bench (quick); `make device-check STAGES="preflight daemon"` runs a
# selection (env always; probe and deps when a selected stage needs them). No GPU:
# exit 3 after the env facts. The CPU-only checks (emulator, fake driver under both
# cuda-bindings) run in `make test`, not there. docs/gpu-path.md gives the exact call
# of the device tool and what each stage shows.

# What the device image lacks (the workplace's device notes, 2026-11: its python3 is
# 3.12.3 with torch 2.11 cu130, cuda-bindings, NVRTC, numpy, grpcio, protobuf,
# prometheus-client, pytest, pytest-timeout, hypothesis and typing-extensions), with
# every dependency of it that the image does not have, one pinned wheel each, at
# requirements-dev.txt's versions: --no-deps downloads exactly this list (about
# 13 MB). grpcio and protobuf come too but are installed there only when the image's
# are too old for kvseal's generated stubs (scripts/device_deps.py decides).
DEVICE_WHEELS := cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 \
    grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \
    opentelemetry-semantic-conventions==0.66b2 \
    grpcio==1.85.3 protobuf==7.36.2
DEVICE_PYS ?= 3.12
# Binary wheels for the device's interpreter and platform, whatever this machine is:
# the same files on every download, and never an sdist that would need a compiler
# (or network) there.
DEVICE_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_34_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64
# Any pip will do: the venv's if it is built, else python3's. No venv is built for it.
DEVICE_PIP ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m pip

.PHONY: device-wheels device-check bench-gpu

## GPU benchmark: kernels, sealed vs plaintext DMA, classic CC path, latency, launches.
bench-gpu: venv
	$(PY) bench/bench_gpu.py $(ARGS)

## GPU work in <= 360 s on a machine without network (system python3). STAGES="..."
## selects from: env probe deps nvrtc inprocess preflight daemon bench (default all).
## On the device run `bash scripts/device_check.sh` directly: its image may have no make.
device-check:
	STAGES="$(STAGES)" bash scripts/device_check.sh

## Download only the wheels the device lacks into ./wheels (where there is network;
## carry `wheels` to the device). Replaces what was there: one version of each.
device-wheels:
	mkdir -p wheels
	rm -f wheels/*.whl
	for v in $(DEVICE_PYS); do \
	    $(DEVICE_PIP) download --quiet --disable-pip-version-check --no-deps \
	        --only-binary=:all: --python-version $$v --implementation cp \
	        $(addprefix --platform ,$(DEVICE_PLATFORMS)) -d wheels $(DEVICE_WHEELS) || exit 1; \
	done
	@du -sh wheels
