# kvseal behind a real `vllm serve` (OpenAI HTTP server, CPU platform, a local
# random-weight model and word-level tokenizer; no hub download), driven over
# HTTP by bench/serving/run.py. Four arms in one invocation: no offload, the
# plaintext anchor (bench/serving/anchor.py: vLLM's CPUOffloadingManager with a
# plain shared-memory copy worker; benchmark only), kvseal write-through and
# kvseal write-back, each kvseal arm with a real daemon.
#
# Workloads: llmd, conv, conv-salted (a cache_salt per tenant, 1 to one per
# conversation) and fits; ARGS="--workloads conv-salted" runs a subset.
#
#   make bench-serving ARGS=--quick   one short point per workload (about 8 minutes on 2 cores)
#   make bench-serving                the sweep of docs/serving.md (about 50 minutes on 2 cores)
#   make serving-report               docs/serving.md tables and docs/serving-*.png from
#                                     docs/serving-results.json (SERVING_RESULTS=... for another)

SERVING_WORK    ?= build/bench-serving
SERVING_RESULTS ?= docs/serving-results.json

.PHONY: bench-serving serving-report

bench-serving: venv-vllm
	$(VLLM_PY) -m bench.serving.run --work $(SERVING_WORK) $(ARGS)

serving-report: venv-vllm
	$(VLLM_PY) -m bench.serving.report $(SERVING_RESULTS) --md docs/serving.md \
	  --png-prefix docs/serving

# The SGLang arms (bench/serving/sglang_arm.py: sg-none, sg-wt) of the same workloads,
# from the SGLang venv, into their own results file (docs/serving.md, "SGLang").
SERVING_SGLANG_RESULTS ?= docs/serving-sglang-results.json

.PHONY: bench-serving-sglang serving-report-sglang

bench-serving-sglang: venv-sglang
	SGLANG_USE_CPU_ENGINE=1 $(SGLANG_PY) -m bench.serving.run --work $(SERVING_WORK)-sglang \
	  --arms sg-none,sg-wt --workloads llmd,conv,conv-salted $(ARGS)

serving-report-sglang: venv-vllm
	$(VLLM_PY) -m bench.serving.report $(SERVING_SGLANG_RESULTS) --md docs/serving.md \
	  --section sglang-tables --png-prefix docs/serving-sglang
