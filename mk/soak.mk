# Soak suite (tests/suites/soak.py; issue 12): a real daemon, several engine
# processes, mixed traffic under eviction pressure for SOAK_S seconds; prints a
# table row per period (min(300, SOAK_S/6) s) and the leak / correctness checks,
# ending with "N passed, M failed" (non-zero exit on a failure).
# Included by the top-level Makefile (-include mk/*.mk); uses its PY and venv.

SOAK_S ?= 1800

.PHONY: soak

## Soak: 30 minutes by default (make soak SOAK_S=300 for five); ARGS for more flags.
soak: venv
	SOAK_S=$(SOAK_S) $(PY) -m tests.suites.soak --duration $(SOAK_S) $(ARGS)
