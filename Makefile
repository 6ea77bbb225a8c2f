# kvseal — the two commands a fresh machine needs are `make run` and `make test`;
# each creates .venv (pinned versions from requirements-dev.txt) on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv run test lint proto bench bench-gpu device-check clean

venv: $(STAMP)

$(STAMP): requirements-dev.txt client/pyproject.toml server/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e client -e server
	touch $(STAMP)

## Start the daemon (CPU backend without a GPU) on its default Unix socket.
run: venv
	$(VENV)/bin/kvseal-server --backend auto $(ARGS)

## The whole test suite (CI runs this through .ci/run).
test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

lint: venv
	$(VENV)/bin/ruff check client server tests tests_sglang tests_vllm tests_stores bench scripts
	$(VENV)/bin/ruff format --check client server tests tests_sglang tests_vllm tests_stores bench scripts
	$(VENV)/bin/mypy

## Regenerate the Python API from proto/ (tests fail when the two drift).
proto: venv
	$(PY) -m grpc_tools.protoc -I proto --python_out=client --grpc_python_out=client \
	    --pyi_out=client proto/kvseal/v1/kvseal.proto

# The store backends' rows (bench/store_backends.py) start weed and
# mooncake_master from .venv-stores, inside tests_stores/netns.sh's private
# network namespace (Mooncake's transfer engine refuses the loopback); a
# backend that cannot start here (no root for the namespace, no libibverbs)
# is skipped with the reason printed. The other rows are unaffected by it.
bench: venv venv-stores stores-system-deps
	PYTHONPATH=$(abspath .venv-stores) tests_stores/netns.sh $(PY) bench/bench_cpu.py $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build */build */*.egg-info

# Feature fragments (GPU path, deployment checks) live in mk/*.mk.
-include mk/*.mk
