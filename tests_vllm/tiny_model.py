"""A tiny random-weight Llama saved locally: no hub download, seconds to create.

The weights are random but fixed by the seed, so greedy decoding is
deterministic and two engines given the same prompts must produce the same
tokens; that is all the end-to-end tests need.
"""

from __future__ import annotations

from pathlib import Path

VOCAB = 1024


def make_tiny_llama(path: Path, seed: int = 1234) -> Path:
    """Write the model to ``path`` (idempotent) and return it."""
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path
