# Leak surface (docs/threat-model.md, "Leak surface"): what the host and an admitted
# peer can learn from sizes, timing, prefix hits and metrics, measured against real
# daemons on the CPU backend. Included by the top-level Makefile (-include mk/*.mk).

.PHONY: leak-surface

## Measure the leak surface: region sizes, offload/restore latency vs blocks, prefix-hit
## probes across tenants, Stats and /metrics (ARGS=--quick for a smoke run).
leak-surface: venv
	$(PY) bench/leak_surface.py $(ARGS)
