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
#   make bench-serving ARGS=--quick   one short point per workload, 30 requests per arm (5-7
#                                     minutes on this machine's 2 cores at load 7-18); the smoke,
#                                     tests_vllm/test_serving_smoke.py, adds --small-model (the
#                                     same KV shape, a sliver of the compute) and --parallel-start
#   make bench-serving                the sweep of docs/serving.md (about 50 minutes on 2 cores)
#   make serving-report               the full tables into $(SERVING_MD) and docs/serving-*.png
#                                     from $(SERVING_HIST)/serving-results.json
#                                     (SERVING_RESULTS=... for another)
#
# Results files, the full tables and the log of every run live under
# bench/serving/history/ (SERVING_HIST); docs/serving.md holds only the figures
# that stand now, and the plots it shows (docs/serving-*.png).

SERVING_WORK    ?= build/bench-serving
SERVING_HIST    ?= bench/serving/history
SERVING_MD      ?= $(SERVING_HIST)/README.md
SERVING_RESULTS ?= $(SERVING_HIST)/serving-results.json

.PHONY: bench-serving serving-report

bench-serving: venv-vllm
	$(VLLM_PY) -m bench.serving.run --work $(SERVING_WORK) $(ARGS)

serving-report: venv-vllm
	$(VLLM_PY) -m bench.serving.report $(SERVING_RESULTS) --md $(SERVING_MD) \
	  --png-prefix docs/serving

# The SGLang arms (bench/serving/sglang_arm.py: sg-none, sg-wt) of the same workloads,
# from the SGLang venv, into their own results file (bench/serving/history/README.md, "SGLang").
SERVING_SGLANG_RESULTS ?= $(SERVING_HIST)/serving-sglang-results.json

.PHONY: bench-serving-sglang serving-report-sglang

bench-serving-sglang: venv-sglang
	SGLANG_USE_CPU_ENGINE=1 $(SGLANG_PY) -m bench.serving.run --work $(SERVING_WORK)-sglang \
	  --arms sg-none,sg-wt --workloads llmd,conv,conv-salted $(ARGS)

serving-report-sglang: venv-vllm
	$(VLLM_PY) -m bench.serving.report $(SERVING_SGLANG_RESULTS) --md $(SERVING_MD) \
	  --section sglang-tables --png-prefix docs/serving-sglang

# The hybrid model (bench/serving/model.py's Gemma-3-like, 3 sliding-window
# layers : 1 full, four KV-cache groups) on the llm-d shape: no offload, the
# plaintext anchor and kvseal write-through (h-none, h-plain, h-wt), into its
# own results file (bench/serving/history/README.md, "Hybrid models").
#
#   make bench-serving-hybrid ARGS=--quick   one short point (about 8 minutes on 2 cores)
#   make bench-serving-hybrid                the llm-d rate sweep (about 25 minutes on 2 cores)
#   make serving-report-hybrid               $(SERVING_MD)'s hybrid tables
SERVING_HYBRID_RESULTS ?= $(SERVING_HIST)/serving-hybrid-results.json

.PHONY: bench-serving-hybrid serving-report-hybrid

bench-serving-hybrid: venv-vllm
	$(VLLM_PY) -m bench.serving.run --work $(SERVING_WORK)-hybrid \
	  --arms h-none,h-plain,h-wt --workloads llmd $(ARGS)

serving-report-hybrid: venv-vllm
	$(VLLM_PY) -m bench.serving.report $(SERVING_HYBRID_RESULTS) --md $(SERVING_MD) \
	  --section hybrid-tables

# Offload at eviction (issue 29; bench/serving/history/README.md "Offload at eviction"): the
# fits and conversation workloads with no offload, the plaintext anchor,
# kvseal write-through, offload at eviction and write-back over it (none,
# plain, wt, ev, ewb) on vLLM; SGLang's no offload, write-through and offload
# at eviction and write-back over it (sg-none, sg-wt, sg-ev, sg-ewb) from the SGLang venv. Each into its own
# results file.
#
#   make bench-serving-evict            the vLLM arms (about 40 minutes on 2 cores)
#   make bench-serving-evict-sglang     the SGLang arms (about 25 minutes on 2 cores)
#   make serving-report-evict           $(SERVING_MD)'s eviction tables (both files)
SERVING_EVICT_RESULTS ?= $(SERVING_HIST)/serving-evict-results.json
SERVING_EVICT_SGLANG_RESULTS ?= $(SERVING_HIST)/serving-evict-sglang-results.json

.PHONY: bench-serving-evict bench-serving-evict-sglang serving-report-evict

bench-serving-evict: venv-vllm
	$(VLLM_PY) -m bench.serving.run --work $(SERVING_WORK)-evict \
	  --arms none,plain,wt,ev,ewb --workloads fits,conv --out $(SERVING_EVICT_RESULTS) $(ARGS)

bench-serving-evict-sglang: venv-sglang
	SGLANG_USE_CPU_ENGINE=1 $(SGLANG_PY) -m bench.serving.run --work $(SERVING_WORK)-evict-sglang \
	  --arms sg-none,sg-wt,sg-ev,sg-ewb --workloads fits,conv --out $(SERVING_EVICT_SGLANG_RESULTS) $(ARGS)

# A fits run on fresh engines (make bench-serving-evict ARGS="--workloads fits
# --cost-rounds 0 --out $(SERVING_EVICT_FITS_RESULTS)") replaces run 1's fits points.
SERVING_EVICT_FITS_RESULTS ?= $(SERVING_HIST)/serving-evict-fits-results.json

serving-report-evict: venv-vllm
	$(VLLM_PY) -m bench.serving.report $(SERVING_EVICT_RESULTS) \
	  $(wildcard $(SERVING_EVICT_FITS_RESULTS)) --md $(SERVING_MD) --section evict-tables
	for f in fits:fits-q40-256 fits-default:fits-q40 smalltier:smalltier llmd:llmd \
	    sglang-fits:sglang-fits; do \
	  r=$(SERVING_HIST)/serving-evict-$${f#*:}-results.json; [ -f $$r ] || continue; \
	  $(VLLM_PY) -m bench.serving.report $$r --md $(SERVING_MD) \
	    --section evict-$${f%%:*}-tables; done
	if [ -f $(SERVING_EVICT_SGLANG_RESULTS) ]; then \
	  $(VLLM_PY) -m bench.serving.report $(SERVING_EVICT_SGLANG_RESULTS) --md $(SERVING_MD) \
	    --section evict-sglang-tables; fi

# The sealed store tier (docs/store.md) at its two serving points, restart-warm
# and second replica (bench/serving/store_points.py: kvseal write-through with
# --store-dir and a file: key against a restarted no-offload engine, one engine
# at a time), into its own results file (bench/serving/history/README.md, "The sealed store tier").
#
#   make bench-serving-store ARGS=--quick   one repetition of a short round (about 6 minutes on 2 cores)
#   make bench-serving-store                three repetitions (about 26 minutes on 2 cores)
#   make serving-report-store               $(SERVING_MD)'s store tables and docs/serving-store.png
SERVING_STORE_RESULTS ?= $(SERVING_HIST)/serving-store-results.json

.PHONY: bench-serving-store serving-report-store

bench-serving-store: venv-vllm
	$(VLLM_PY) -m bench.serving.store_points --work $(SERVING_WORK)-store $(ARGS)

serving-report-store: venv-vllm
	$(VLLM_PY) -m bench.serving.store_points --report $(SERVING_STORE_RESULTS) \
	  --md $(SERVING_MD) --png docs/serving-store.png

# The second-replica point per store backend (issue 38): the directory, S3
# (SeaweedFS's weed mini) and Mooncake Store (mooncake_master plus this
# process as the store node), against the no-offload baseline, each server
# started by the bench (bench/store_backends.py) from .venv-stores, inside
# tests_stores/netns.sh's namespace (Mooncake's transfer engine refuses the
# loopback; without root the Mooncake point is skipped with its reason).
# 8 engine starts with ARGS=--quick (7.5 minutes on 2 cores at load 5-7).
#
#   make bench-serving-store-backends ARGS=--quick
SERVING_STORE_BACKENDS_RESULTS ?= $(SERVING_HIST)/serving-store-backends-results.json

.PHONY: bench-serving-store-backends

bench-serving-store-backends: venv-vllm venv-stores stores-system-deps
	PYTHONPATH=$(abspath .venv-stores) tests_stores/netns.sh $(VLLM_PY) -m bench.serving.store_points \
	  --work $(SERVING_WORK)-store-backends --backends dir,s3,mooncake --points none,replica \
	  --out $(SERVING_STORE_BACKENDS_RESULTS) $(ARGS)
