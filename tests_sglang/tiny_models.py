"""Tiny random-weight models of the families kvseal's SGLang linker carries,
saved locally (no hub download, seconds to create), as
:func:`tests_vllm.tiny_model.make_tiny_llama` does for Llama.

Weights are random but fixed by the seed, so greedy decoding is deterministic:
two servers given the same prompts produce the same tokens. Each builder
writes ``config.json`` and safetensors into ``path`` (idempotent) and returns
it. Which of these SGLang 0.5.23's CPU engine runs is in docs/sglang.md
("Model families").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB = 1024


def _save(path: Path, model: Any) -> Path:
    import torch

    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


def make_tiny_deepseek_v2(path: Path, seed: int = 1234) -> Path:
    """A DeepSeek-V2-like MLA model: 2 dense layers, one latent KV per layer
    (kv_lora_rank 64 + rope 16 = 80 values per token)."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV2Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        first_k_dense_replace=2,  # dense MLPs only: MLA is what is tested
        n_routed_experts=4,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        max_position_embeddings=4096,
        # SGLang's CPU rope for MLA is DeepSeek's YaRN only (factor 1: no scaling).
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 1.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        torch_dtype="bfloat16",
    )
    cfg.moe_layer_freq = 1  # read by SGLang's DeepSeek code, not kept by transformers
    return _save(path, DeepseekV2ForCausalLM(cfg))


def make_tiny_gemma3(path: Path, seed: int = 1234) -> Path:
    """A Gemma-3-like sliding-window hybrid: 4 layers, 3 local (window 32
    tokens) : 1 global."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=32,
        sliding_window_pattern=4,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    )
    return _save(path, Gemma3ForCausalLM(cfg))


def make_tiny_granite_swa(path: Path, seed: int = 1234) -> Path:
    """A Granite-SWA-like sliding-window hybrid (gpt-oss's attention shape,
    dense): 4 layers, 3 sliding-window (32 tokens) : 1 full, attention sinks.
    SGLang gives it a hybrid SWA pool (a full and a sliding-window KV pool)."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import GraniteSWAConfig, GraniteSWAForCausalLM

    torch.manual_seed(seed)
    cfg = GraniteSWAConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=32,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    return _save(path, GraniteSWAForCausalLM(cfg))


def make_tiny_mellum(path: Path, seed: int = 1234) -> Path:
    """A Mellum-like sliding-window hybrid without attention sinks (SGLang's
    CPU attention has none): 4 layers, 3 sliding-window (32 tokens) : 1 full,
    dense MLPs. SGLang gives it a hybrid SWA pool (a full and a
    sliding-window KV pool) and the tree its SWA component."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import MellumConfig, MellumForCausalLM

    torch.manual_seed(seed)
    cfg = MellumConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=32,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        mlp_layer_types=["dense"] * 4,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    return _save(path, MellumForCausalLM(cfg))


def make_tiny_qwen3_next(path: Path, seed: int = 1234) -> Path:
    """A Qwen3-Next-like linear-attention hybrid: 3 gated-delta-net layers,
    1 full-attention layer."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        full_attention_interval=4,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    )
    return _save(path, Qwen3NextForCausalLM(cfg))


def make_tiny_falcon_h1(path: Path, seed: int = 1234) -> Path:
    """A Falcon-H1-like Mamba2 + attention hybrid (2 layers)."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import FalconH1Config, FalconH1ForCausalLM

    torch.manual_seed(seed)
    cfg = FalconH1Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        mamba_d_ssm=128,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_chunk_size=64,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    )
    return _save(path, FalconH1ForCausalLM(cfg))


BUILDERS = {
    "deepseek_v2": make_tiny_deepseek_v2,
    "gemma3": make_tiny_gemma3,
    "granite_swa": make_tiny_granite_swa,
    "mellum": make_tiny_mellum,
    "qwen3_next": make_tiny_qwen3_next,
    "falcon_h1": make_tiny_falcon_h1,
}
