# GPU kernels (server/kvseal/server/cuda): checks that need no GPU.
# Included by the top-level Makefile (-include mk/*.mk); uses its PY and venv.

KERNELS_DIR   := server/kvseal/server/cuda
KERNELS_ARCH  ?= sm_90
NVCC          ?= nvcc
# NVRTC compile-only wheels, verified to work on a machine without a GPU or driver.
KERNELS_NVRTC_PKGS := cuda-bindings==13.0.3 nvidia-cuda-nvrtc==13.0.88

.PHONY: kernels-check kernels-nvcc kernels-nvrtc-deps

## Emulated kernels vs AESGCM + NIST vectors, NVRTC/nvcc compile checks (skip what is absent).
kernels-check: venv
	$(PY) -m pytest tests/test_gpu_kernels_emulated.py tests/test_gpu_kernels_compile.py -q

## nvcc object + register/spill report for KERNELS_ARCH (needs nvcc, not a GPU).
kernels-nvcc:
	mkdir -p build
	$(NVCC) -arch=$(KERNELS_ARCH) -c -Xptxas -v $(KERNELS_DIR)/kernels.cu \
	    -o build/kvseal-kernels-$(KERNELS_ARCH).o

## Install the optional NVRTC compile-only dependencies into .venv.
kernels-nvrtc-deps: venv
	$(PY) -m pip install --quiet $(KERNELS_NVRTC_PKGS)
