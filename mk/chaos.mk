# Chaos suite (tests/suites/chaos.py): kill -9 the daemon and engine processes at
# random points of their transfers, restart them, check what must survive.
# Included by the top-level Makefile (-include mk/*.mk); uses its PY and venv.

CHAOS_KILLS ?= 200
CHAOS_SEED ?=
CHAOS_TIME_S ?= 1800

.PHONY: chaos

## Chaos suite: >= CHAOS_KILLS kill -9s (default 200) within CHAOS_TIME_S seconds;
## CHAOS_SEED=N replays a schedule (random by default, printed); prints a table and
## "N passed, M failed", fails on any failure. ARGS="--workdir DIR" keeps the logs.
chaos: venv
	CHAOS_KILLS=$(CHAOS_KILLS) CHAOS_SEED=$(CHAOS_SEED) CHAOS_TIME_S=$(CHAOS_TIME_S) \
	    $(PY) -m tests.suites.chaos $(ARGS)
