"""make bench-serving: kvseal behind a real `vllm serve` (benchmark only)."""
