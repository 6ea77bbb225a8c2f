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
# work only, at most 300 s, so that a 15-minute device lease (1-2 minutes of machine
# start included) leaves room to rerun a failed stage: stages env, probe, deps, nvrtc,
# preflight, daemon, inprocess, bench (quick); `make device-check STAGES="preflight
# daemon"` runs a selection (env always; probe and deps when a selected stage needs
# them). No GPU: exit 3 after the env facts. The CPU-only checks (emulator, fake driver
# under both cuda-bindings) run in `make test`, not there.

# Everything the device check needs beyond the device image's torch and cuda-python
# (pip download also fetches dependencies), at the versions requirements-dev.txt pins.
# device_check.sh installs only what the image lacks, plus protobuf/grpcio when the
# image's are older than kvseal's generated stubs need.
DEVICE_WHEELS := cryptography==50.0.2 protobuf==7.36.2 grpcio==1.85.3 \
    grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 \
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 prometheus-client==0.26.0 \
    pytest==9.2.0 pytest-timeout==2.4.0 hypothesis==6.170.17
# The lent H200's image (the workplace's device notes, 2026-11): python3 3.12.3,
# torch 2.11 cu130, cuda-bindings and nvidia-cuda-nvrtc, driver 580 (CUDA 13), x86_64
# glibc Linux. device_check.sh prints the versions it finds first; fetch for others
# with `make device-wheels DEVICE_PYS="3.11 3.12"`. The run tool carries at most
# 64 MiB: name `wheels` in its carry list.
DEVICE_PYS ?= 3.12
# Binary wheels for the device's interpreter and platform, whatever this machine is:
# the same files on every download, and never an sdist that would need a compiler
# (or network) there.
DEVICE_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_34_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64

.PHONY: device-wheels

## GPU benchmark: kernels, sealed vs plaintext DMA, classic CC path, latency, launches.
bench-gpu: venv
	$(PY) bench/bench_gpu.py $(ARGS)

## GPU work in <= 300 s on a machine without network (system python3). STAGES="..."
## selects from: env probe deps nvrtc preflight daemon inprocess bench (default all).
## On the device run `bash scripts/device_check.sh` directly: its image may have no make.
device-check:
	STAGES="$(STAGES)" bash scripts/device_check.sh

## Download the wheels device-check installs offline (run where there is network).
device-wheels: venv
	mkdir -p wheels
	for v in $(DEVICE_PYS); do \
	    $(PY) -m pip download --quiet --only-binary=:all: --python-version $$v \
	        --implementation cp $(addprefix --platform ,$(DEVICE_PLATFORMS)) \
	        -d wheels $(DEVICE_WHEELS) || exit 1; \
	done
