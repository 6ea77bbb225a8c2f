"""The serving benchmark's model: a random-weight Llama and a word-level
tokenizer, both generated locally (no hub download), saved as one HF folder
that ``vllm serve`` loads.

Sized so that computing a token's KV costs far more than restoring it: a wide
MLP (6,144) and 24 query heads but only 2 KV heads (GQA) of dim 64 over 8
layers (~265 M parameters), so a token's KV is 4 KiB (a 32-token block
128 KiB) while its prefill is ~265 M multiply-adds (a GPU serving a 32B model
spends ~32 G multiply-adds on a token whose KV is 256 KiB: the same order of
compute per KV byte). The tokenizer maps the
words ``w3`` .. ``w1023`` one to one onto
token ids, so a prompt of n words is n tokens and a model's answer, sent back
as text, tokenizes to the same ids (multi-turn prefixes stay cacheable).
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 1024
LAYERS, KV_HEADS, HEAD_DIM = 8, 2, 64
HIDDEN, MLP, Q_HEADS = 1536, 6144, 24
# The smoke's model (``make_model(small=True)``, run.py ``--small-model``): the
# same KV shape (so the same bytes per token, engine blocks and tier blocks)
# with a sliver of the compute (~5 M parameters): a smoke checks that every arm
# serves, restores and isolates, which needs the KV layout, not the compute ratio.
SMALL_HIDDEN, SMALL_MLP, SMALL_Q_HEADS = 256, 512, 4
KV_BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # K and V, bf16
# The hybrid model (``make_hybrid_model``): the same shape as a Gemma-3-like
# sliding-window model, 3 local layers to 1 global (Gemma 3 has 5 : 1; 8 layers
# give 3 : 1), a 128-token window (4 blocks of 32).
HYBRID_LAYER_TYPES = (["sliding_attention"] * 3 + ["full_attention"]) * 2
HYBRID_WINDOW = 128
# The serving bench's context length (its stamp, and so its folder, predates
# the ``max_position`` keyword: only another length is stamped).
MAX_POSITION = 4096


def word(i: int) -> str:
    return f"w{i}"


def make_model(
    path: Path, seed: int = 4321, small: bool = False, max_position: int = MAX_POSITION
) -> Path:
    """Write model and tokenizer to ``path`` (idempotent: a model of another
    shape there is rebuilt) and return it. ``small``: the smoke's model
    (``SMALL_*`` widths, the same KV shape), which no measurement may use.
    ``max_position``: the context length (``make bench-pd``'s 8k prompts use a
    longer one, written to its own folder); the weights are the same random
    draw, only the config's ``max_position_embeddings`` differs."""
    return _build(path, "llama-small" if small else "llama", seed, max_position)


def make_hybrid_model(path: Path, seed: int = 4321) -> Path:
    """The hybrid model of ``make bench-serving --arms h-none,h-plain,h-wt``:
    Gemma-3-like, the Llama's widths and KV shape (4 KiB of KV per token over 8
    layers), layers ``HYBRID_LAYER_TYPES`` with a ``HYBRID_WINDOW``-token
    sliding window; vLLM makes it four KV-cache groups of two layers each (one
    full-attention, three sliding-window). Written to ``path`` (idempotent)."""
    return _build(path, "hybrid", seed)


def _widths(family: str) -> tuple[int, int, int]:
    """``(hidden, mlp, q_heads)`` of ``family``: the small Llama's or the bench's."""
    if family == "llama-small":
        return SMALL_HIDDEN, SMALL_MLP, SMALL_Q_HEADS
    return HIDDEN, MLP, Q_HEADS


def _config(family: str, max_position: int = MAX_POSITION) -> object:
    """The transformers config of ``family`` ("llama", "llama-small" or "hybrid"),
    with a context of ``max_position`` tokens."""
    from transformers import Gemma3TextConfig, LlamaConfig

    if family == "hybrid":
        return Gemma3TextConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=MLP,
            num_hidden_layers=LAYERS,
            num_attention_heads=Q_HEADS,
            num_key_value_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            sliding_window=HYBRID_WINDOW,
            layer_types=HYBRID_LAYER_TYPES,
            max_position_embeddings=max_position,
            bos_token_id=1,
            eos_token_id=2,
            torch_dtype="bfloat16",
        )
    hidden, mlp, q_heads = _widths(family)
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=LAYERS,
        num_attention_heads=q_heads,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=max_position,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )


def _build(path: Path, family: str, seed: int, max_position: int = MAX_POSITION) -> Path:
    stamp = path / "kvseal-model.json"
    hidden, mlp, q_heads = _widths(family)
    shape: dict[str, object] = {"layers": LAYERS, "hidden": hidden, "mlp": mlp,
                                "q_heads": q_heads, "kv_heads": KV_HEADS,
                                "head_dim": HEAD_DIM, "seed": seed}  # fmt: skip
    if family == "hybrid":  # the Llamas' stamps stay what they were (no rebuild)
        shape.update(family=family, layer_types=HYBRID_LAYER_TYPES, window=HYBRID_WINDOW)
    if max_position != MAX_POSITION:  # the default's stamp stays what it was
        shape["max_position"] = max_position
    built = (path / "tokenizer.json").exists() and stamp.exists()
    if built and json.loads(stamp.read_text()) == shape:
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Gemma3ForCausalLM, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(seed)
    cfg = _config(family, max_position)
    cls = Gemma3ForCausalLM if family == "hybrid" else LlamaForCausalLM
    model = cls(cfg).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, VOCAB):
        vocab[word(i)] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)
    # No BOS added: a prompt's token ids are exactly its words.
    tc = json.loads((path / "tokenizer_config.json").read_text())
    tc["add_bos_token"] = False
    (path / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))
    stamp.write_text(json.dumps(shape))  # a model of another shape is rebuilt
    return path
