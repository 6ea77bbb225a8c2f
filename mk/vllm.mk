# kvseal inside a real vLLM engine (kvseal.vllm), on the CPU, in its own venv:
# `make test` stays fast and vLLM-free; `make test-vllm` (run by .ci/run after it)
# builds .venv-vllm from requirements-vllm.txt (every package pinned, --no-deps),
# generates a tiny random-weight model and runs tests_vllm/ against a real daemon.
#
#   make test-vllm    the suite (two short engine runs, about 4 minutes on 2 cores)
#   make bench-vllm   scheduler-side lookup cost: kvseal's manager vs vLLM's own

VLLM_PYTHON ?= python3.11
VLLM_VENV   := .venv-vllm
VLLM_PY     := $(VLLM_VENV)/bin/python
VLLM_STAMP  := $(VLLM_VENV)/.installed

.PHONY: venv-vllm test-vllm bench-vllm

venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): requirements-vllm.txt client/pyproject.toml server/pyproject.toml
	$(VLLM_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet --no-deps -r requirements-vllm.txt
	$(VLLM_PY) -m pip install --quiet --no-deps --no-build-isolation -e client -e server
	touch $@

test-vllm: venv-vllm
	$(VLLM_PY) -m pytest tests_vllm -o timeout=1200 -p no:cacheprovider $(PYTEST_ARGS)

bench-vllm: venv-vllm
	$(VLLM_PY) tests_vllm/bench_lookup.py $(ARGS)
