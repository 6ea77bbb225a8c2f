"""The pools SGLang 0.5.23's linker hands kvseal, read into components.

``UnifiedCacheLinkerWrapper`` drives a linker with one ``PoolTransfer`` per
tree component it carries (``unified_cache_linker.py``:
``_EXTERNAL_LINKER_SUPPORTED_COMPONENTS`` is Full, SWA and Mamba; the tree
refuses any other at start-up), over the KV pool the worker built:

=====================  ==========================  ===============================
SGLang KV pool          components                  kvseal components (PoolName)
=====================  ==========================  ===============================
``MHATokenToKVPool``    Full                        ``kv``: per layer K, V
  (+FP4/MXFP8 scales)                               (+ K scales, V scales)
``MLATokenToKVPool``    Full                        ``kv``: per layer the latent
  (+FP4 scales, DSA)                                (+ scales, DSA indexer keys)
``SWAKVPool``           Full + SWA                  ``kv`` (full layers), ``swa``
                                                    (sliding-window layers)
``HybridLinearKVPool``  Full + Mamba (+ SWA)        ``kv`` (MHA or MLA), ``mamba``:
                                                    per layer temporal, conv states
=====================  ==========================  ===============================

Each component is its own kvseal pool: its real bytes per page (no row sized
for all of them), its own layout name and fingerprint, hence its own
namespace, so a block offered as another component's (or another layer
kind's) fails verification like any other swap.

Refused at start-up, with the reason (:func:`components` raises ValueError):
components SGLang's linker wrapper refuses itself (C128, auxiliary SWA);
DeepSeek-V4's pools (compressed C4/C128 KV, indexer and compress-state pools
riding the KV and SWA indices: SGLang's own direct linkers carry them, kvseal
does not yet); pools whose bytes are not one run per page (ROCm's
``vectorized_5d``), Mamba
side states SGLang's own direct-linker assembler refuses too (int8
checkpoints, short-conv and n-gram states, ReplaySSM rings), and draft KV
pools of speculative decoding.

Nothing here imports SGLang; torch is imported only through
:mod:`kvseal.sglang.layout`'s helpers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvseal.sglang.layout import (
    LAYOUT_MAMBA,
    LAYOUT_MHA,
    LAYOUT_MHA_HND,
    LAYOUT_MLA,
    PageGeometry,
    Part,
    byte_rows,
    token_part,
)

KV, SWA, MAMBA = "kv", "swa", "mamba"  # SGLang's PoolName values


@dataclass(frozen=True)
class Component:
    """One pool the linker carries: SGLang's ``PoolName`` value, its page
    geometry and the parts its pages are made of (block order)."""

    name: str
    geometry: PageGeometry
    parts: tuple[Part, ...]
    device: Any
    # The same bytes on every TP rank (MLA's latent): stored once per block.
    rank_replicated: bool = False
    start_layer: int = 0


def _dtype_name(pool: Any, t: Any) -> str:
    # fp8 pools keep fp8 in uint8 storage: the pool's dtype names the bytes.
    return str(getattr(pool, "dtype", None) or t.dtype).removeprefix("torch.")


def _token_rows(pool: Any) -> int:
    # SGLang's token pools have size + page_size slots (slot 0 is padding).
    return int(pool.size) + int(pool.page_size)


def mha_component(name: str, pool: Any, page_size: int) -> Component:
    """An ``MHATokenToKVPool`` (or a subclass with scale buffers) as
    component ``name``: per layer K, V, then K scales, V scales if any."""
    k, v = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
    if not isinstance(k, list) or not isinstance(v, list) or not k or len(k) != len(v):
        raise ValueError(f"{type(pool).__name__}: no per-layer k_buffer/v_buffer")
    if getattr(pool, "kv_cache_layout", None) == "vectorized_5d":
        raise ValueError(
            "kvseal does not store the vectorized_5d KV layout (ROCm AITER only: "
            "a page's bytes are not one run per tensor)"
        )
    if int(pool.page_size) != page_size:
        raise ValueError(f"{name} pool page size {pool.page_size}, the tree's {page_size}")
    ks = getattr(pool, "k_scale_buffer", None)
    vs = getattr(pool, "v_scale_buffer", None)
    scaled = ks is not None
    if ks is not None and (vs is None or len(ks) != len(k) or len(vs) != len(v)):
        raise ValueError(f"{type(pool).__name__}: K and V scale buffers do not pair up")
    rows = _token_rows(pool)
    parts: list[Part] = []
    for i in range(len(k)):
        tensors = [("K", k[i]), ("V", v[i])]
        if ks is not None and vs is not None:
            tensors += [("K scale", ks[i]), ("V scale", vs[i])]
        for what, t in tensors:
            if t.dtype != tensors[0][1].dtype and what in ("K", "V"):
                raise ValueError(f"layer {i}: K/V buffers differ in dtype")
            parts.append(token_part(t, rows, page_size, f"layer {i} {what}"))
    hnd = bool(getattr(pool, "use_hnd", False))
    k0, v0 = k[0], v[0]
    heads = int(k0.shape[1])
    head_dim = int(k0.shape[-1])
    v_head_dim = int(v0.shape[-1])
    g = PageGeometry(
        page_size=page_size,
        num_layers=len(k),
        heads=heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        dtype=_dtype_name(pool, k0),
        itemsize=int(k0.element_size()),
        hnd=hnd,
        part_bytes=tuple(p.page_bytes for p in parts),
        component=name,
        kind="mha",
        scaled=scaled,
        layout=(LAYOUT_MHA_HND if hnd else LAYOUT_MHA) + ("+scales" if scaled else ""),
    )
    return Component(name, g, tuple(parts), k0.device, False, int(pool.start_layer or 0))


def mla_component(name: str, pool: Any, page_size: int) -> Component:
    """An ``MLATokenToKVPool`` (or FP4 / DSA subclass): per layer the latent
    row (``kv_lora_rank + qk_rope_head_dim``), then its scales, then DSA's
    indexer keys with their scales (sparse attention reads them: restoring
    the latent without them would be wrong output)."""
    kvb = getattr(pool, "kv_buffer", None)
    if not isinstance(kvb, list) or not kvb:
        raise ValueError(f"{type(pool).__name__}: no per-layer kv_buffer")
    if int(pool.page_size) != page_size:
        raise ValueError(f"{name} pool page size {pool.page_size}, the tree's {page_size}")
    scales = getattr(pool, "kv_scale_buffer", None)
    indexer = getattr(pool, "index_k_with_scale_buffer", None) if pool.use_dsa else None
    if pool.use_dsa and not indexer:
        raise ValueError("a DSA pool without its indexer buffers")
    rows = _token_rows(pool)
    parts: list[Part] = []
    for i, t in enumerate(kvb):
        parts.append(token_part(t, rows, page_size, f"layer {i} latent"))
        if scales is not None:
            parts.append(token_part(scales[i], rows, page_size, f"layer {i} latent scale"))
        if indexer:
            parts.append(token_part(indexer[i], rows, page_size, f"layer {i} indexer keys"))
    t0 = kvb[0]
    layout = LAYOUT_MLA + ("+scales" if scales is not None else "") + ("+dsa" if indexer else "")
    g = PageGeometry(
        page_size=page_size,
        num_layers=len(kvb),
        heads=1,
        head_dim=int(pool.kv_cache_dim),
        v_head_dim=int(pool.kv_lora_rank),
        dtype=_dtype_name(pool, t0),
        itemsize=int(t0.element_size()),
        hnd=False,
        part_bytes=tuple(p.page_bytes for p in parts),
        component=name,
        kind="mla",
        scaled=scales is not None or bool(indexer),
        layout=layout,
    )
    return Component(name, g, tuple(parts), t0.device, True, int(pool.start_layer or 0))


def mamba_component(req_to_token_pool: Any) -> Component:
    """The Mamba state pool (``req_to_token_pool.mamba_pool``): one state per
    "page" (per device index), per layer the temporal then conv states.
    Refuses the side states SGLang's own direct-linker assembler refuses."""
    pool = getattr(req_to_token_pool, "mamba_pool", None)
    if pool is None:
        raise ValueError("a Mamba component without a mamba_pool")
    why = []
    if getattr(req_to_token_pool, "mamba_ckpt_pool", None) is not None:
        why.append("int8 Mamba checkpoints")
    for side in ("short_conv_pool", "ngram_pool"):
        if getattr(getattr(req_to_token_pool, side, None), "enabled", False):
            why.append(side.removesuffix("_pool").replace("_", "-") + " states")
    cache = pool.mamba_cache
    if any(getattr(cache, f, None) is not None for f in ("replayssm_d", "replayssm_k")):
        why.append("ReplaySSM rings")
    if why:
        raise ValueError(
            f"kvseal does not store Mamba side states ({', '.join(why)}): "
            "SGLang 0.5.23's direct linker does not carry them either"
        )
    states = [s for s in (cache.temporal, *cache.conv) if s.numel() > 0]
    layers = int(pool.num_mamba_layers)
    parts = [Part(byte_rows(s[layer]), 1) for layer in range(layers) for s in states]
    g = PageGeometry(
        page_size=1,
        num_layers=layers,
        heads=0,
        head_dim=0,
        v_head_dim=0,
        dtype="+".join(str(s.dtype).removeprefix("torch.") for s in states),
        itemsize=1,
        hnd=False,
        part_bytes=tuple(p.page_bytes for p in parts),
        component=MAMBA,
        kind="mamba",
        indices_per_page=1,
        layout=LAYOUT_MAMBA,
    )
    return Component(MAMBA, g, tuple(parts), states[0].device)


def _full(name: str, pool: Any, page_size: int) -> Component:
    if isinstance(getattr(pool, "kv_buffer", None), list) and hasattr(pool, "kv_lora_rank"):
        return mla_component(name, pool, page_size)
    return mha_component(name, pool, page_size)


def components(kvcache: Any, params: Any, kinds: set[str], page_size: int) -> list[Component]:
    """kvseal's components for SGLang's pool ``kvcache`` and tree component
    names ``kinds`` (``{"FULL", "SWA", "MAMBA"}`` subsets), the Full one
    first; ValueError with the reason for what kvseal cannot carry."""
    if page_size < 1:
        raise ValueError(f"page size {page_size}")
    others = sorted(kinds - {"FULL", "SWA", "MAMBA"})
    if others:
        raise ValueError(
            f"SGLang 0.5.23's linker carries Full, SWA and Mamba components; "
            f"this model also has {others}"
        )
    kind = type(kvcache).__name__
    if kind.startswith("DeepSeekV4") or hasattr(kvcache, "c4_kv_pool"):
        raise ValueError(
            "DeepSeek-V4's pools (compressed C4/C128 KV, indexer and compress-state "
            "pools riding the KV and SWA indices) are not carried by kvseal yet"
        )
    drafts = [
        p
        for attr in ("mtp_draft_device_pools", "sidecar_draft_device_pools")
        for p in (getattr(params, attr, ()) or ())
    ]
    if drafts:
        raise ValueError("kvseal does not store the draft KV pools of speculative decoding")
    full_pool = getattr(kvcache, "full_kv_pool", None)
    out: list[Component] = []
    if "SWA" in kinds:
        swa_pool = getattr(kvcache, "swa_kv_pool", None)
        if full_pool is None or swa_pool is None:
            raise ValueError(f"an SWA model whose KV pool {kind} has no full and SWA pools")
        out.append(mha_component(KV, full_pool, page_size))
        out.append(mha_component(SWA, swa_pool, page_size))
    elif full_pool is not None:
        out.append(_full(KV, full_pool, page_size))
    else:
        out.append(_full(KV, kvcache, page_size))
    if "MAMBA" in kinds:
        out.append(mamba_component(getattr(params, "req_to_token_pool", None)))
    if len(out) > 1:  # only a pool group made of replicated pools is replicated
        out = [Component(c.name, c.geometry, c.parts, c.device, False, c.start_layer) for c in out]
    return out
