# kvseal inside a real SGLang server (kvseal.sglang), on the CPU, in its own venv:
# `make test-sglang` (run by .ci/run after `make test-vllm-033`) builds .venv-sglang from
# requirements-sglang.txt (every package pinned, --no-deps), generates a tiny
# random-weight Llama and runs tests_sglang/ against real `sglang.launch_server`
# processes and a real daemon. SGLANG_USE_CPU_ENGINE=1 selects SGLang's CPU engine;
# tests_sglang/stub (first on PYTHONPATH) is a placeholder sgl_kernel, because the
# registry has no CPU build of it (docs/sglang.md, "Testing").
#
#   make test-sglang   the suite (about 12 minutes on 2 cores, plus the venv once; the
#                      sliding-window server test adds ~3 minutes at load 10, the pool-level
#                      family tests ~20 s)

SGLANG_PYTHON ?= python3.11
SGLANG_VENV   := .venv-sglang
SGLANG_PY     := $(SGLANG_VENV)/bin/python
SGLANG_STAMP  := $(SGLANG_VENV)/.installed
SGLANG_ENV    := SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=$(abspath tests_sglang/stub)

.PHONY: venv-sglang test-sglang

venv-sglang: $(SGLANG_STAMP)

$(SGLANG_STAMP): requirements-sglang.txt client/pyproject.toml server/pyproject.toml
	$(SGLANG_PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install --quiet --upgrade pip
	$(SGLANG_PY) -m pip install --quiet --no-deps -r requirements-sglang.txt
	$(SGLANG_PY) -m pip install --quiet --no-deps --no-build-isolation -e client -e server
	touch $@

test-sglang: venv-sglang
	$(SGLANG_ENV) $(SGLANG_PY) -m pytest tests_sglang -o timeout=900 -p no:cacheprovider $(PYTEST_ARGS)
