# kvseal inside a real vLLM engine (kvseal.vllm), on the CPU, in its own venv:
# `make test` stays fast and vLLM-free; `make test-vllm` (run by .ci/run after it)
# builds .venv-vllm from requirements-vllm.txt (every package pinned, --no-deps),
# generates a tiny random-weight model and runs tests_vllm/ against a real daemon.
#
#   make test-vllm    the suite: real engines and daemons (21 minutes of pytest, quiet, in a
#                     fresh clone's .ci/run on this project's 2-core CPU machine, 2026-12-07;
#                     36 minutes at load 3-85; engines that share nothing start together).
#                     Its five engine modules (e2e, evict, families, store_engine, mla_tp2)
#                     alone, at load 5-24 (others' runs beside): 21.5 min of pytest before the
#                     drivers ran their engines in-process (tests_vllm/engine_process.py),
#                     10.3 min after. The whole suite after (110 tests, test_pd.py's
#                     included): 19.6 min of pytest at load 3-15, 2026-12-07; test_evict's
#                     workload (5.3 min of it) is what is left to shorten
#   make test-vllm-033  vLLM 0.33's own scheduler and connector code against a real
#                     daemon (no CPU engine of 0.33 exists): the 0.33 wheel installed
#                     --no-deps into .venv-vllm/vllm033, first on PYTHONPATH
#   make test-vllm-034  the same suite (tests_vllm/v033) against vLLM 0.34's code,
#                     from .venv-vllm/vllm034
#   make bench-vllm   scheduler-side lookup cost: kvseal's manager vs vLLM's own

VLLM_PYTHON ?= python3.11
VLLM_VENV   := .venv-vllm
VLLM_PY     := $(VLLM_VENV)/bin/python
VLLM_STAMP  := $(VLLM_VENV)/.installed

VLLM033_DIR   := $(VLLM_VENV)/vllm033
VLLM033_STAMP := $(VLLM033_DIR)/.installed

VLLM034_DIR   := $(VLLM_VENV)/vllm034
VLLM034_STAMP := $(VLLM034_DIR)/.installed

.PHONY: venv-vllm test-vllm test-vllm-033 test-vllm-034 bench-vllm

venv-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): requirements-vllm.txt client/pyproject.toml server/pyproject.toml
	$(VLLM_PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet --no-deps -r requirements-vllm.txt
	$(VLLM_PY) -m pip install --quiet --no-deps --no-build-isolation -e client -e server
	touch $@

# timeout=1200: a backstop above every test's own bounds (an engine fixture's 900 s;
# a test whose bounds add up past it marks its own), so on a loaded machine a slow
# run fails on the bound that names what was slow, with its log.
test-vllm: venv-vllm
	$(VLLM_PY) -m pytest tests_vllm --ignore=tests_vllm/v033 --ignore=tests_vllm/test_pd.py -o timeout=1200 -p no:cacheprovider $(PYTEST_ARGS)

# A failed download or install fails the target (CI runs it): never a skip.
$(VLLM033_STAMP): $(VLLM_STAMP) requirements-vllm033.txt
	rm -rf $(VLLM033_DIR)
	$(VLLM_PY) -m pip install --quiet --no-deps --target $(VLLM033_DIR) -r requirements-vllm033.txt
	touch $@

test-vllm-033: $(VLLM033_STAMP)
	KVSEAL_VLLM_EXPECT=0.33 PYTHONPATH=$(abspath $(VLLM033_DIR)) $(VLLM_PY) -m pytest tests_vllm/v033 -o timeout=600 -p no:cacheprovider $(PYTEST_ARGS)

# The same connector-level suite against vLLM 0.34 (its tests read vllm.__version__).
$(VLLM034_STAMP): $(VLLM_STAMP) requirements-vllm034.txt
	rm -rf $(VLLM034_DIR)
	$(VLLM_PY) -m pip install --quiet --no-deps --target $(VLLM034_DIR) -r requirements-vllm034.txt
	touch $@

test-vllm-034: $(VLLM034_STAMP)
	KVSEAL_VLLM_EXPECT=0.34 PYTHONPATH=$(abspath $(VLLM034_DIR)) $(VLLM_PY) -m pytest tests_vllm/v033 -o timeout=600 -p no:cacheprovider $(PYTEST_ARGS)

bench-vllm: venv-vllm
	$(VLLM_PY) tests_vllm/bench_lookup.py $(ARGS)
