"""Pool geometry from torch tensors (client/kvseal/client/torch_pool.py), on the CPU.

The CUDA variant differs from the shm one only in how a tensor's buffer is located
(``_share_cuda_``); the stride -> segment logic is shared and checked here against
``SharedKVPool.geometry()`` for the three supported engine layouts.
"""

from __future__ import annotations

import pytest
from kvseal.client import torch_pool as tp
from kvseal.client.shm import BLOCK_ORDER, KVShape, SharedKVPool

torch = pytest.importorskip("torch")

SHAPE = KVShape(num_pages=5, tokens_per_page=4, num_layers=3, num_kv_heads=2, head_dim=8)
META = {
    "layout_name": BLOCK_ORDER,
    "tokens_per_page": SHAPE.tokens_per_page,
    "num_layers": SHAPE.num_layers,
    "num_kv_heads": SHAPE.num_kv_heads,
    "head_dim": SHAPE.head_dim,
}


@pytest.fixture
def pools() -> list[SharedKVPool]:
    made: list[SharedKVPool] = []
    yield made
    for p in made:
        p.close()


def _pool(pools: list[SharedKVPool], layout: str) -> SharedKVPool:
    p = SharedKVPool(SHAPE, layout, name_prefix="kvseal-test-torch")
    pools.append(p)
    return p


def test_vllm_per_layer_tensors_give_the_pool_geometry(pools: list[SharedKVPool]) -> None:
    pool = _pool(pools, "vllm_per_layer")
    tensors = pool.tensors()  # one [2, pages, tokens, heads, dim] tensor per layer
    g = tp.geometry_from_shm_tensors(pool, tensors, 1, **META)
    assert g == pool.geometry()


def test_vllm_cross_layer_tensor_gives_the_pool_geometry(pools: list[SharedKVPool]) -> None:
    pool = _pool(pools, "vllm_cross_layer")
    g = tp.geometry_from_shm_tensors(pool, pool.tensors(), 0, **META)
    assert g == pool.geometry()


def test_sglang_kv_buffers_give_the_pool_geometry(pools: list[SharedKVPool]) -> None:
    pool = _pool(pools, "sglang_per_layer")
    paged = [t.unflatten(0, (-1, SHAPE.tokens_per_page)) for t in pool.tensors()]
    g = tp.geometry_from_shm_tensors(pool, paged, 0, **META)
    assert g == pool.geometry()


def test_geometry_bytes_match_the_pool_blocks(pools: list[SharedKVPool]) -> None:
    """Reading a block through the derived segments gives pool.read_block's bytes."""
    pool = _pool(pools, "vllm_per_layer")
    for t in pool.tensors():
        t.copy_(torch.randn(t.shape).to(t.dtype))
    g = tp.geometry_from_shm_tensors(pool, pool.tensors(), 1, **META)
    views = {b.name: b.view for b in pool.buffers}
    for page in range(SHAPE.num_pages):
        got = b"".join(
            bytes(views[g.buffers[s.buffer].shm_name][s.offset + page * s.page_stride :][: s.bytes])
            for s in g.segments
        )
        assert got == pool.read_block(page)


def test_non_contiguous_tensor_is_refused(pools: list[SharedKVPool]) -> None:
    pool = _pool(pools, "vllm_per_layer")
    t = pool.tensors()[0].transpose(-1, -2)  # heads/dim swapped: a page is not one run
    with pytest.raises(ValueError, match="must be contiguous"):
        tp.geometry_from_shm_tensors(pool, [t], 1, **META)


def test_foreign_tensor_is_refused(pools: list[SharedKVPool]) -> None:
    pool = _pool(pools, "vllm_cross_layer")
    with pytest.raises(ValueError, match="does not live"):
        tp.geometry_from_shm_tensors(pool, [torch.zeros(5, 3, 2, 4, 2, 8)], 0, **META)


def test_disagreeing_page_counts_are_refused(pools: list[SharedKVPool]) -> None:
    pool = _pool(pools, "vllm_per_layer")
    a, b = pool.tensors()[:2]
    with pytest.raises(ValueError, match="disagree"):
        tp.geometry_from_shm_tensors(pool, [a, b[:, :3]], 1, **META)


def test_page_segments_arithmetic() -> None:
    # [2, pages=5, 4, 2, 8] bf16: K and V segments, 128 B per page.
    pages, segs = tp.page_segments((2, 5, 4, 2, 8), (320, 64, 16, 8, 1), 2, 1, 1000)
    assert pages == 5 and segs == [(1000, 128, 128), (1640, 128, 128)]
    # A sliced view (every other page) keeps its real stride.
    pages, segs = tp.page_segments((3, 4, 8), (64, 8, 1), 2, 0, 0)
    assert segs == [(0, 128, 64)]
    # Size-1 inner dims may have any stride.
    pages, segs = tp.page_segments((5, 1, 8), (8, 999, 1), 4, 0, 0)
    assert segs == [(0, 32, 32)]
    with pytest.raises(ValueError, match="overlap"):
        tp.page_segments((5, 8), (4, 1), 1, 0, 0)
    with pytest.raises(ValueError, match="out of range"):
        tp.page_segments((5, 8), (8, 1), 1, 2, 0)
    with pytest.raises(ValueError, match="empty"):
        tp.page_segments((0, 8), (8, 1), 1, 0, 0)


def test_torch_ipc_handle_formats() -> None:
    raw = bytes(range(64))
    assert tp._legacy_handle(raw) == raw
    assert tp._legacy_handle(b"\x03c" + raw) == raw
    with pytest.raises(ValueError, match="expandable_segments:False"):
        tp._legacy_handle(b"\x03e" + b"\x00" * 80)


def test_cuda_variant_refuses_cpu_tensors() -> None:
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        tp.geometry_from_tensors([torch.zeros(2, 5, 4, 2, 8)], 1, **META)
