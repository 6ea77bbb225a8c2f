"""The worker's KV pool layout (kvseal.core.kv_pool) from vLLM's canonical KV
tensors, on CPU tensors with the shapes and strides vLLM gives the worker on a
GPU (its ``register_kv_caches`` builds them with the same ``set_`` call used
here). Only shapes, strides and bytes matter for the layout, so what holds for
these tensors holds for CUDA ones; tests/gpu/test_vllm_worker_gpu.py runs the
same code on CUDA tensors against a CUDA daemon."""

from __future__ import annotations

import pytest
import torch
from kvseal.client.torch_pool import page_segments
from kvseal.core import kv_pool, shm_kv
from kvseal.v1 import kvseal_pb2 as pb
from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCacheTensor

BLOCKS, TOKENS, HEADS, DIM = 6, 4, 2, 8
PAGE = 2 * TOKENS * HEADS * DIM * 2  # K and V, bf16


def vllm_view(storage: torch.Tensor, byte_offset: int, page: int, stride: int) -> torch.Tensor:
    """vLLM's canonical per-layer tensor: int8 ``(num_blocks, page)`` over the
    layer's storage, ``stride`` bytes between blocks (as register_kv_caches)."""
    return torch.tensor([], dtype=torch.int8, device=storage.device).set_(
        storage.untyped_storage(), byte_offset, (BLOCKS, page), (stride, 1)
    )


def template() -> pb.PoolGeometry:
    return pb.PoolGeometry(
        num_pages=1, tokens_per_page=TOKENS, num_layers=2, num_kv_heads=HEADS, head_dim=DIM,
        dtype="bfloat16", layout="vllm-page:default",
    )  # fmt: skip


def _rows(buf: torch.Tensor, start: int, stride: int, n: int) -> list[bytes]:
    raw = buf.numpy().tobytes()
    return [raw[start + p * stride : start + p * stride + n] for p in range(BLOCKS)]


@pytest.mark.parametrize(
    ("name", "page", "unpadded", "stride", "layer_offsets"),
    [
        # one tensor per layer, back to back: stride == page
        ("per-layer", PAGE, PAGE, PAGE, [0, BLOCKS * PAGE]),
        # padded pages: the layer uses fewer bytes than its page
        ("padded", PAGE + 64, PAGE, PAGE + 64, [0, BLOCKS * (PAGE + 64)]),
        # packed (layers interleaved per block): block stride spans all layers
        ("packed", PAGE, PAGE, 2 * PAGE, [0, PAGE]),
    ],
)
def test_layer_views_follow_vllms_shapes_and_strides(
    name: str, page: int, unpadded: int, stride: int, layer_offsets: list[int]
) -> None:
    buf = torch.randint(-128, 127, (2 * BLOCKS * max(page, stride) + 256,), dtype=torch.int8)
    tensors = [CanonicalKVCacheTensor(vllm_view(buf, o, page, stride), page) for o in layer_offsets]
    refs = [CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=unpadded) for i in (0, 1)]
    views = kv_pool.layer_page_views(tensors, refs)
    assert [tuple(v.shape) for v in views] == [(BLOCKS, unpadded)] * 2
    for v, off in zip(views, layer_offsets, strict=True):
        assert v.data_ptr() == buf.data_ptr() + off  # a view: nothing copied
        got = [bytes(v[p].numpy().tobytes()) for p in range(BLOCKS)]
        assert got == _rows(buf, off, stride, unpadded)
        # The segment the daemon gets for it (torch_pool's rule, as on CUDA).
        pages, segs = page_segments(tuple(v.shape), tuple(v.stride()), 1, 0, off)
        assert (pages, segs) == (BLOCKS, [(off, stride, unpadded)])


def test_views_of_typed_tensors_are_their_bytes() -> None:
    """A canonical tensor that is not int8 (e.g. bf16 ``(blocks, 2, tokens, heads,
    dim)``): its page is its bytes, in memory order."""
    t = torch.randn(BLOCKS, 2, TOKENS, HEADS, DIM, dtype=torch.float32).to(torch.bfloat16)
    (v,) = kv_pool.layer_page_views(
        [CanonicalKVCacheTensor(t, PAGE)], [CanonicalKVCacheRef(0, PAGE)]
    )
    assert tuple(v.shape) == (BLOCKS, PAGE) and v.stride() == (PAGE, 1)
    assert bytes(v[3].numpy().tobytes()) == bytes(t[3].contiguous().view(torch.int8).numpy())


def test_bad_layouts_are_refused_with_the_reason() -> None:
    buf = torch.zeros(4 * BLOCKS * PAGE, dtype=torch.int8)
    ok = CanonicalKVCacheTensor(vllm_view(buf, 0, PAGE, PAGE), PAGE)
    # a page that is not one run of bytes (K and V of a block far apart)
    split = CanonicalKVCacheTensor(
        buf[: BLOCKS * PAGE].view(2, BLOCKS, PAGE // 2).transpose(0, 1), PAGE
    )
    fewer = CanonicalKVCacheTensor(buf[: (BLOCKS - 1) * PAGE].view(BLOCKS - 1, PAGE), PAGE)
    cases = [
        ([ok], [], "no layer"),
        ([split], [CanonicalKVCacheRef(0, PAGE)], "contiguous"),
        ([ok], [CanonicalKVCacheRef(0, PAGE + 1)], "bytes per page"),
        ([ok, fewer], [CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)], "blocks"),
    ]
    for tensors, refs, needle in cases:
        with pytest.raises(ValueError, match=needle):
            kv_pool.layer_page_views(tensors, refs)  # type: ignore[arg-type]


def test_cpu_geometry_is_the_shared_memory_pool() -> None:
    with shm_kv.shm_kv_allocation():  # at least shm_kv.MIN_KV_BYTES
        buf = torch.zeros(max(2 * BLOCKS * PAGE, shm_kv.MIN_KV_BYTES), dtype=torch.int8)
    (alloc,) = [a for a in shm_kv.allocations() if a.base == buf.data_ptr()]
    try:
        tensors = [
            CanonicalKVCacheTensor(vllm_view(buf, o, PAGE, PAGE), PAGE) for o in (0, BLOCKS * PAGE)
        ]
        refs = [CanonicalKVCacheRef(i, PAGE) for i in (0, 1)]
        g, backend = kv_pool.pool_geometry(kv_pool.layer_page_views(tensors, refs), template())
        assert backend == pb.BACKEND_CPU
        assert [b.shm_name for b in g.buffers] == [alloc.shm_name]
        assert [(s.buffer, s.offset, s.page_stride, s.bytes) for s in g.segments] == [
            (0, 0, PAGE, PAGE),
            (0, BLOCKS * PAGE, PAGE, PAGE),
        ]
        assert g.num_pages == BLOCKS
        assert (g.tokens_per_page, g.dtype, g.layout) == (TOKENS, "bfloat16", "vllm-page:default")
        # Memory outside the connector's shared memory cannot be handed to the daemon.
        private = torch.zeros(BLOCKS * PAGE, dtype=torch.int8)
        views = kv_pool.layer_page_views(
            [CanonicalKVCacheTensor(private.view(BLOCKS, PAGE), PAGE)],
            [CanonicalKVCacheRef(0, PAGE)],
        )
        with pytest.raises(ValueError, match="shared memory"):
            kv_pool.pool_geometry(views, template())
    finally:
        alloc.unlink()
