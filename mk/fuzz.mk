# Fuzz suite (issue 12): a structure-aware fuzzer against a real daemon over its
# Unix socket (tests/suites/fuzz.py). Included by the top-level Makefile.

.PHONY: fuzz

FUZZ_N    ?= 100000
FUZZ_SEED ?= 1

## Fuzz the daemon: FUZZ_N requests (default 100,000), seed FUZZ_SEED; prints an
## RPC x status table, the checks and "N passed, M failed"; non-zero exit on failure.
fuzz: venv
	$(PY) -m tests.suites.fuzz --requests $(FUZZ_N) --seed $(FUZZ_SEED) $(ARGS)
