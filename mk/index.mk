# Trusted index (server/kvseal/server/index/): eviction cost under the lock.
# Included by the top-level Makefile (-include mk/*.mk); uses its PY and venv.

.PHONY: bench-index

## Index benchmark: ms under the index lock per eviction, 1,000,000 blocks by default
## (ARGS="--blocks 2000000" or ARGS=--quick).
bench-index: venv
	$(PY) bench/bench_index.py $(ARGS)
