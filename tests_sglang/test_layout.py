"""The page copies between SGLang's KV tensors and kvseal's staging blocks,
and the identity mapping, without a server (torch only)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from kvseal.sglang import keys
from kvseal.sglang.layout import PageCopier, geometry_of


def _pool(
    hnd: bool, layers: int = 3, pages: int = 6, ps: int = 4, heads: int = 2, dim: int = 8
) -> SimpleNamespace:
    g = torch.Generator().manual_seed(5)
    shape = (pages, heads, ps, dim) if hnd else (pages * ps, heads, dim)
    k = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(layers)]
    v = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(layers)]
    return SimpleNamespace(k_buffer=k, v_buffer=v, use_hnd=hnd)


@pytest.mark.parametrize("hnd", [False, True])
def test_gather_then_scatter_moves_exactly_the_pages(hnd: bool) -> None:
    src = _pool(hnd)
    ps = 4
    g = geometry_of(src, ps)
    assert g.block_bytes == 3 * 2 * ps * 2 * 8 * 2
    # HND page bytes are head-major, NHD's token-major: never one namespace.
    assert g.layout == ("sglang-page:v1/hnd" if hnd else "sglang-page:v1")
    staging = torch.zeros((5, g.block_bytes), dtype=torch.uint8)
    tok = torch.tensor([p * ps + j for p in (4, 1) for j in range(ps)])  # pages 4 then 1
    slots = torch.tensor([3, 0])
    PageCopier(src.k_buffer, src.v_buffer, g).gather(tok, staging, slots)
    assert not staging[1].any() and not staging[2].any() and not staging[4].any()
    # Block layout: layer by layer, K then V, each the page's bytes.
    kb = g.k_bytes
    page4_l0_k = (src.k_buffer[0][4] if hnd else src.k_buffer[0][16:20]).contiguous()
    assert bytes(staging[3, :kb].numpy()) == page4_l0_k.view(torch.uint8).numpy().tobytes()

    dst = _pool(hnd)
    for t in dst.k_buffer + dst.v_buffer:
        t.zero_()
    out = torch.tensor([p * ps + j for p in (0, 5) for j in range(ps)])  # into pages 0 and 5
    PageCopier(dst.k_buffer, dst.v_buffer, g).scatter(staging, slots, out)
    for layer in range(3):
        for a, b in (
            (src.k_buffer[layer], dst.k_buffer[layer]),
            (src.v_buffer[layer], dst.v_buffer[layer]),
        ):
            if hnd:
                assert torch.equal(a[4], b[0]) and torch.equal(a[1], b[5])
                assert not b[1:5].any()
            else:
                assert torch.equal(a[16:20], b[0:4]) and torch.equal(a[4:8], b[20:24])
                assert not b[4:20].any()


def test_partial_pages_and_unsupported_pools_are_refused() -> None:
    src = _pool(False)
    g = geometry_of(src, 4)
    with pytest.raises(ValueError, match="whole number"):
        PageCopier(src.k_buffer, src.v_buffer, g).gather(
            torch.arange(6),
            torch.zeros((2, g.block_bytes), dtype=torch.uint8),
            torch.tensor([0, 1]),
        )
    with pytest.raises(ValueError, match="MHA"):
        geometry_of(SimpleNamespace(kv_buffer=[torch.zeros(4, 1, 8)]), 4)  # MLA-like
    with pytest.raises(ValueError, match="scale"):
        geometry_of(
            SimpleNamespace(k_buffer=src.k_buffer, v_buffer=src.v_buffer, k_scale_buffer=[1]), 4
        )


def test_hashes_tenants_and_fingerprints() -> None:
    h = "ab" * 32
    assert keys.kvseal_hash(h) == bytes.fromhex(h)
    other = keys.kvseal_hash("not-hex")
    assert len(other) == 32 and other != keys.kvseal_hash("not-hex2")
    t = keys.Tenants(from_env=False)
    assert t.of(None) == t.of("") == t.shared
    assert t.of("alice") != t.of("bob") != t.shared
    keyed = keys.Tenants(b"k" * 32)
    assert keyed.of("alice") != t.of("alice")  # a tenant key changes every digest
    base = dict(
        model="m", revision=None, dtype="bfloat16", page_size=16, num_layers=2, start_layer=0,
        heads=2, head_dim=32, v_head_dim=32, block_bytes=8192, tp_rank=0, tp_size=1, pp_rank=0,
    )  # fmt: skip
    fp = keys.model_fingerprint(**base)  # type: ignore[arg-type]
    for field, value in (("model", "m2"), ("page_size", 32), ("tp_rank", 1), ("dtype", "float16")):
        assert keys.model_fingerprint(**{**base, field: value}) != fp  # type: ignore[arg-type]


def test_batches_without_a_queued_load_leave_no_counter_state() -> None:
    """SGLang starts layer-wise loading for every batch but finishes only
    batches that loaded: a batch with nothing queued must not leave an entry
    in the layer counter (one per batch would grow without bound)."""
    from kvseal.sglang.linker import KVSealLinker
    from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter

    linker = object.__new__(KVSealLinker)
    linker._queued = {}
    linker.layer_done_counter = LayerWiseLoadCounter(4)
    for _ in range(1000):
        assert linker.start_layer_wise_loading() == -1
    assert linker.layer_done_counter.futures == {}
    assert linker.finish_layer_wise_loading(-1) is True
