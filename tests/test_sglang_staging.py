"""The SGLang linker's data path without SGLang: SGLang-layout K/V tensors,
the linker's staging blocks (:mod:`kvseal.sglang.staging`), the page copies
(:mod:`kvseal.sglang.layout`) and the vLLM adapter's ``KVPool`` against a real
daemon. Pages are gathered into staging, sealed, wiped in the "engine", restored
into other staging blocks and scattered into other pages: the bytes must come
back exactly. :func:`staging_round_trip` is shared with the GPU variant
(``tests/gpu/test_sglang_staging_gpu.py``: device memory, CUDA IPC, a CUDA
daemon), so the CPU run here is its twin.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from kvseal.client import ClientConfig, KVSealClient, tenant_digest  # noqa: E402
from kvseal.core.kv_pool import KVPool  # noqa: E402
from kvseal.sglang.layout import PageCopier, geometry_of  # noqa: E402
from kvseal.sglang.staging import Slots, new_staging, pool_inputs  # noqa: E402
from kvseal.v1 import kvseal_pb2 as pb  # noqa: E402

from .conftest import start_daemon  # noqa: E402

LAYERS, PAGES, PS, HEADS, DIM = 3, 12, 16, 2, 32


class SGLangKV:
    """``MHATokenToKVPool``'s NHD buffers: one K and one V tensor per layer,
    ``(pages * page_size + page_size, heads, head_dim)`` (SGLang pads one page)."""

    def __init__(self, device: Any) -> None:
        rows = PAGES * PS + PS
        g = torch.Generator().manual_seed(3)
        self.k_buffer = [
            torch.randn((rows, HEADS, DIM), generator=g).to(torch.bfloat16).to(device)
            for _ in range(LAYERS)
        ]
        self.v_buffer = [
            torch.randn((rows, HEADS, DIM), generator=g).to(torch.bfloat16).to(device)
            for _ in range(LAYERS)
        ]
        self.use_hnd = False

    def pages(self, pages: list[int]) -> list[Any]:
        return [
            t[p * PS : (p + 1) * PS].clone() for p in pages for t in self.k_buffer + self.v_buffer
        ]


def _tokens(pages: list[int], device: Any) -> Any:
    return torch.tensor(
        [p * PS + j for p in pages for j in range(PS)], dtype=torch.int64, device=device
    )


def staging_round_trip(target: str, device: Any, backend: int) -> None:
    """The linker's offload then restore of three pages (module doc)."""
    kv = SGLangKV(device)
    g = geometry_of(kv, PS)
    staging = new_staging(8, g.block_bytes, device)
    copier = PageCopier(kv.k_buffer, kv.v_buffer, g)
    tensors, refs = pool_inputs(staging)
    template = pb.PoolGeometry(
        num_pages=1, tokens_per_page=PS, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM,
        dtype=g.dtype, layout="sglang-page:v1",
        segments=[pb.Segment(buffer=0, offset=0, page_stride=g.block_bytes, bytes=g.block_bytes)],
    )  # fmt: skip
    client = KVSealClient(ClientConfig(target=target, transfer_timeout_s=30))
    pool = KVPool(
        client,
        f"sglang.test.{time.monotonic_ns()}",
        b"sglang-staging-test",
        template,
        tensors,
        refs,
    )
    try:
        assert pool.backend == backend and pool.block_bytes == g.block_bytes
        assert pool.pool.wait_ready(30), pool.pool.registration_error
        tenant = tenant_digest("sglang-tenant")
        src = [2, 5, 9]
        want = kv.pages(src)
        hashes = [bytes([i]) * 32 for i in (1, 2, 3)]
        slots = Slots(8)
        s = slots.take(3)
        copier.gather(_tokens(src, device), staging, torch.tensor(s, device=device))
        assert pool.offload(tenant, hashes, s, event=pool.engine_event())
        staging.zero_()
        for t in kv.k_buffer + kv.v_buffer:
            t.zero_()
        slots.give(s)
        r = slots.take(3)[::-1]  # other blocks, other order
        assert pool.restore(tenant, hashes, r, event=pool.engine_event())
        dst = [0, 7, 11]
        copier.scatter(staging, torch.tensor(r, device=device), _tokens(dst, device))
        if device.type == "cuda":
            torch.cuda.synchronize()
        got = kv.pages(dst)
        assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(want, got, strict=True))
        # Another tenant's restore of the same hashes fails and writes nothing.
        staging.zero_()
        assert not pool.restore(tenant_digest("other"), hashes, r, event=pool.engine_event())
        assert not staging.any()
    finally:
        pool.close()
        client.close()


def test_sglang_staging_round_trip_cpu_daemon(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "d", host_bytes="16MiB")
    try:
        staging_round_trip(d.target, torch.device("cpu"), pb.BACKEND_CPU)
    finally:
        d.stop()
