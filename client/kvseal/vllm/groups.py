"""The KV-cache groups kvseal offloads for one vLLM engine, as kvseal sees them.

vLLM's offloading config selects every prefix-cacheable KV-cache group
(``OffloadingConfig.groups``: full attention, sliding window, MLA, Mamba /
linear-attention state in ``align`` mode, ...). Each selected group becomes
its own kvseal pool (worker side) and observer pool (scheduler side), with its
own model fingerprint, so that:

- a group's blocks are sealed under its own namespace (the fingerprint binds
  the group index, its layer names, its kind and its real block bytes): a
  block swapped across groups, or across layer kinds, fails verification like
  any other swap;
- a block takes exactly the group's real bytes in the host tier (the sum of
  its layers' un-padded pages), never a row sized for every group, so a
  hybrid model's tier holds as many tokens as its bytes allow.

:func:`describe_groups` reads the groups from vLLM's ``KVCacheConfig`` (the
connector hands it over, scheduler and worker alike) and refuses, with the
reason, a group whose layout kvseal cannot carry. Nothing here is on a hot
path; it imports vLLM's spec classes lazily so the module stays importable in
tests without an engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Kinds, as they enter the fingerprint and the support matrix.
FULL = "full"
SLIDING_WINDOW = "sliding_window"
MLA = "mla"
SLIDING_WINDOW_MLA = "sliding_window_mla"
MAMBA = "mamba"


@dataclass(frozen=True)
class GroupLayout:
    """One offloaded KV-cache group on one rank.

    ``block_bytes``: the un-padded bytes of one block of all the group's layers
    (what the worker's pool copies, and what the host tier holds per block);
    0 when unknown (no ``KVCacheConfig`` was handed over). ``window``: the
    sliding window in tokens (0: none). ``heads`` / ``head_dim``: the KV heads
    and head size of an attention group (MLA: one latent "head" of
    ``kv_lora_rank + rope`` values), 0 for Mamba state. ``quant``: vLLM's KV
    quantization mode name (``NONE``, ``FP8_PER_TENSOR``, ...): per-tensor
    scales are the layers' own parameters (part of the model, bound by the
    fingerprint's model name and revision); per-token-head scales live inside
    the page and are copied with it."""

    group_id: int
    kind: str
    layer_names: tuple[str, ...]
    block_bytes: int
    window: int = 0
    heads: int = 0
    head_dim: int = 0
    quant: str = "NONE"
    mamba_mode: str = ""

    @property
    def fingerprint_tag(self) -> str:
        """What the group adds to the model fingerprint beyond its index and
        layers: empty for a plain full-attention group (so a single-group model
        keeps the fingerprint, and the stored blocks, of earlier releases)."""
        if self.kind == FULL and self.quant == "NONE":
            return ""
        return f"kind={self.kind};window={self.window};quant={self.quant}"


def _layer_specs(group_spec: Any, layer_names: Sequence[str]) -> list[Any]:
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs  # noqa: PLC0415

    if isinstance(group_spec, UniformTypeKVCacheSpecs):
        return [group_spec.kv_cache_specs[n] for n in layer_names]
    return [group_spec] * len(layer_names)


def _unpadded_bytes(spec: Any) -> int:
    """The bytes vLLM's own offloading worker copies per page of one layer."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec  # noqa: PLC0415

    if isinstance(spec, AttentionSpec):
        return int(spec.unpadded_page_size_bytes)
    if isinstance(spec, MambaSpec):
        return int(spec.real_page_size_bytes)
    raise ValueError(f"{type(spec).__name__} is neither attention nor Mamba state")


def _kind(spec: Any) -> tuple[str, int]:
    """(kind, window tokens) of one layer spec; ValueError for a kind vLLM's
    offloading does not carry or kvseal does not know."""
    from vllm.v1.kv_cache_interface import (  # noqa: PLC0415
        ChunkedLocalAttentionSpec,
        CrossAttentionSpec,
        EncoderOnlyAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    name = type(spec).__name__
    if isinstance(spec, (CrossAttentionSpec, EncoderOnlyAttentionSpec)):
        raise ValueError(f"{name} is not prefix-cacheable, so it is never offloaded")
    if isinstance(spec, ChunkedLocalAttentionSpec):
        raise ValueError(f"{name}: chunked local attention is not offloaded by kvseal yet")
    if isinstance(spec, SlidingWindowMLASpec):
        return SLIDING_WINDOW_MLA, int(spec.sliding_window)
    if isinstance(spec, SlidingWindowSpec):
        return SLIDING_WINDOW, int(spec.sliding_window)
    if isinstance(spec, MLAAttentionSpec):
        return MLA, 0
    if isinstance(spec, FullAttentionSpec):
        # A full-attention spec standing in for sliding-window layers (vLLM's
        # hybrid allocator off) keeps its window: the pages still hold them all.
        return FULL, int(getattr(spec, "sliding_window", None) or 0)
    if isinstance(spec, MambaSpec):
        if spec.mamba_cache_mode != "align":
            # vLLM's offloading scheduler restores one Mamba state per hit only in
            # "align" mode (resolve_mamba_align_size); other modes keep no state
            # at block boundaries that a restore could start from.
            raise ValueError(
                f"Mamba state in cache mode {spec.mamba_cache_mode!r}: vLLM offloads "
                "Mamba / linear-attention state only with --mamba-cache-mode align"
            )
        return MAMBA, 0
    raise ValueError(f"{name}: kvseal does not know this KV-cache layout")


def describe_groups(offloading_config: Any, kv_cache_config: Any | None) -> list[GroupLayout]:
    """The :class:`GroupLayout` of every group in ``offloading_config.groups``,
    in that order. ``kv_cache_config`` (vLLM's ``KVCacheConfig``) may be None
    (the spec was named on vLLM's own OffloadingConnector): then only a single
    group can be described, as full attention with the config's
    ``worker_kv_bytes_per_block``; several groups are refused, since their
    real bytes are unknown. ValueError, saying which group and why, for a
    layout kvseal cannot carry: the engine's start fails rather than offload
    anything wrong."""
    groups = list(offloading_config.groups)
    if kv_cache_config is None:
        if len(groups) != 1:
            raise ValueError(
                f"this model has {len(groups)} KV-cache groups: kvseal offloads hybrid "
                "models only through its connector (kv_connector=KVSealOffloadingConnector)"
            )
        g = groups[0]
        return [
            GroupLayout(
                g.group_id,
                FULL,
                tuple(g.layer_names),
                int(offloading_config.worker_kv_bytes_per_block),
            )
        ]
    out: list[GroupLayout] = []
    for g in groups:
        group_spec = kv_cache_config.kv_cache_groups[g.group_id].kv_cache_spec
        specs = _layer_specs(group_spec, g.layer_names)
        if not specs:
            raise ValueError(f"KV-cache group {g.group_id} has no layer")
        try:
            kinds = {_kind(s) for s in specs}
            if len(kinds) != 1:
                raise ValueError(f"its layers mix kinds {sorted(kinds)}")
            kind, window = kinds.pop()
            nbytes = sum(_unpadded_bytes(s) for s in specs)
        except ValueError as e:
            raise ValueError(f"kvseal cannot offload KV-cache group {g.group_id}: {e}") from e
        s0 = specs[0]
        quant = getattr(getattr(s0, "kv_quant_mode", None), "name", "NONE")
        out.append(
            GroupLayout(
                group_id=g.group_id,
                kind=kind,
                layer_names=tuple(g.layer_names),
                block_bytes=nbytes,
                window=window,
                heads=int(getattr(s0, "num_kv_heads", 0) or 0) if kind != MAMBA else 0,
                head_dim=int(getattr(s0, "head_size", 0) or 0) if kind != MAMBA else 0,
                quant=str(quant),
                mamba_mode=str(getattr(s0, "mamba_cache_mode", "")) if kind == MAMBA else "",
            )
        )
    return out
