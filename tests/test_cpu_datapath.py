"""The CPU backend's streamed data path, in process, on real shared memory.

A real ``CpuBackend`` (1 and 2 sealing threads), a real ``HostRegion`` (the
memfd one, reached by ``memmove``, and a ``--host-region`` file, reached by
``pread``/``pwrite``) and a real pool in every layout. Chunk sizes are chosen
to cut segments in the middle and to leave a short last chunk, so every
byte a chunk boundary can touch is covered. Checked:

- the bytes in the region are exactly format v1 (``AESGCM`` over the whole
  block with the record's nonce and the block's AAD): chunking never shows;
- restore into shuffled pages, consecutive runs and gaps mixed, gives back
  every block byte for byte;
- one tampered block: nothing is written to any page of the request;
- restore staging is reused, and buffers beyond the idle limit are dropped.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from kvseal.client.shm import LAYOUTS, KVShape, SharedKVPool
from kvseal.server import convert, sealing
from kvseal.server.backends.base import BlockIO
from kvseal.server.backends.cpu.backend import CpuBackend
from kvseal.server.backends.cpu.staging import PrivateBuffer, StagingPool
from kvseal.server.hostregion import Extent, HostRegion, RegionError, align_up
from kvseal.server.sealing import BlockAD, BlockSealer
from kvseal.v1 import kvseal_pb2 as pb

from .conftest import POISON, SMALL, fill_random, poison

KEY = bytes(range(32))
NS, TENANT = b"N" * 32, b"T" * 32


@pytest.fixture
def known_key(monkeypatch: pytest.MonkeyPatch) -> bytes:
    """New epochs get KEY (the cipher is real; only the CSPRNG is replaced)."""
    import ctypes

    monkeypatch.setattr(sealing, "_fill_random", lambda buf: ctypes.memmove(buf, KEY, 32))
    return KEY


@pytest.fixture(params=LAYOUTS)
def pool(request: pytest.FixtureRequest) -> Iterator[SharedKVPool]:
    p = SharedKVPool(KVShape(12, **SMALL), request.param, name_prefix="kvseal-dp")
    yield p
    p.close()


def _blocks(pool: SharedKVPool, pages: list[int]) -> list[BlockIO]:
    size = pool.shape.block_bytes
    slot = align_up(size)
    return [
        BlockIO(page, Extent(k * slot, slot), BlockAD(NS, TENANT, os.urandom(32), k), size)
        for k, page in enumerate(pages)
    ]


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("chunk", [96, 4096])  # mid-segment cuts / one chunk per block
@pytest.mark.parametrize("file_region", [False, True], ids=["memfd", "file"])
def test_streamed_round_trip_is_format_v1_and_byte_exact(
    pool: SharedKVPool,
    known_key: bytes,
    workers: int,
    chunk: int,
    file_region: bool,
    tmp_path: Path,
) -> None:
    data = fill_random(pool)
    backend = CpuBackend(BlockSealer(), workers, chunk_bytes=chunk)
    region = backend.make_region(1 << 20, str(tmp_path / "r.bin") if file_region else None)
    mapped = backend.map_pool(convert.pool_spec(_register(pool), "cpu"))
    try:
        src = [3, 4, 5, 0, 9, 10, 7]  # runs of consecutive pages and gaps
        blocks = _blocks(pool, src)
        records = backend.seal_blocks(mapped, blocks, region)
        size = pool.shape.block_bytes
        for blk, rec in zip(blocks, records, strict=True):
            sealed = bytearray(size)
            assert region.read_into(blk.extent.offset, memoryview(sealed)) == size
            expected = AESGCM(known_key).encrypt(rec.nonce, data[blk.page], blk.ad.encode())
            assert bytes(sealed) + rec.tag == expected

        dst = [8, 2, 1, 11, 6, 3, 4]  # the same blocks into other pages, shuffled
        poison(pool, dst)
        moved = [BlockIO(p, b.extent, b.ad, b.size) for p, b in zip(dst, blocks, strict=True)]
        assert backend.open_blocks(mapped, moved, records, region) == []
        for p, b in zip(dst, blocks, strict=True):
            assert pool.read_block(p) == data[b.page]
    finally:
        mapped.close()
        backend.close()
        region.close()


@pytest.mark.parametrize("workers", [1, 2])
def test_one_tampered_block_writes_no_page(pool: SharedKVPool, workers: int) -> None:
    fill_random(pool)
    backend = CpuBackend(BlockSealer(), workers, chunk_bytes=96)
    region = backend.make_region(1 << 20, None)
    mapped = backend.map_pool(convert.pool_spec(_register(pool), "cpu"))
    try:
        pages = list(range(8))
        blocks = _blocks(pool, pages)
        records = backend.seal_blocks(mapped, blocks, region)
        bad = random.randrange(len(blocks))
        flip = bytearray(1)
        at = blocks[bad].extent.offset + random.randrange(blocks[bad].size)
        region.read_into(at, memoryview(flip))
        flip[0] ^= 0x40
        region.write(at, memoryview(flip))
        poison(pool, pages)
        assert backend.open_blocks(mapped, blocks, records, region) == [bad]
        for p in pages:
            assert pool.read_block(p) == bytes([POISON]) * pool.shape.block_bytes
    finally:
        mapped.close()
        backend.close()
        region.close()


def test_staging_is_reused_up_to_the_idle_limit() -> None:
    staging = StagingPool(limit=8 << 20)
    a = staging.take(5 << 20)
    assert a.size >= 5 << 20
    staging.give(a)
    assert staging.take(5 << 20) is a  # the same pages: no faults, no zero-fill
    assert staging.take(1) is not a  # a is taken: a new buffer
    staging.give(a)
    big = staging.take(9 << 20)
    staging.give(big)  # over the limit: unmapped, not kept
    assert staging.idle_bytes == a.size
    assert staging.take(9 << 20) is not big
    # A buffer that fits the limit alone displaces smaller idle ones (the
    # 64 MiB / 256 MiB / 1 GiB sequence: the largest must stay).
    whole = staging.take(8 << 20)
    staging.give(whole)
    assert staging.idle_bytes == whole.size and staging.take(1) is whole
    staging.give(whole)
    staging.close()
    assert staging.idle_bytes == 0


def test_a_restore_of_exactly_the_idle_limit_keeps_its_staging(
    pool: SharedKVPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The "1 GiB cliff": staging of exactly the idle limit must be kept (it
    was one tag per block too big for the limit, so every such restore paid
    a fresh zero-filled buffer)."""
    fill_random(pool)
    n = pool.shape.num_pages
    limit = n * pool.shape.block_bytes
    backend = CpuBackend(BlockSealer(), 2, chunk_bytes=4096, staging_idle_bytes=limit)
    region = backend.make_region(1 << 20, None)
    mapped = backend.map_pool(convert.pool_spec(_register(pool), "cpu"))
    made: list[PrivateBuffer] = []
    real = PrivateBuffer.__init__

    def counting(self: PrivateBuffer, size: int) -> None:
        real(self, size)
        made.append(self)

    try:
        blocks = _blocks(pool, list(range(n)))
        records = backend.seal_blocks(mapped, blocks, region)
        monkeypatch.setattr(PrivateBuffer, "__init__", counting)
        for _ in range(3):
            assert backend.open_blocks(mapped, blocks, records, region) == []
        staging = [b for b in made if b.size >= limit]
        assert len(staging) <= 1, "each restore allocated fresh staging"
    finally:
        mapped.close()
        backend.close()
        region.close()


def test_private_buffer_is_zeroed_private_memory() -> None:
    buf = PrivateBuffer(3 << 20)
    assert bytes(buf.view[:4096]) == bytes(4096) and buf.address != 0
    buf.view[:5] = b"hello"
    buf.close()
    assert buf.address == 0


def test_region_address_copies_are_bounds_checked() -> None:
    region = HostRegion(1 << 16)
    buf = PrivateBuffer(4096)
    try:
        region.write_at(0, buf.address, 4096)
        assert region.read_at((1 << 16) - 100, buf.address, 4096) == 100  # short at the end
        with pytest.raises(RegionError):
            region.write_at((1 << 16) - 100, buf.address, 4096)
    finally:
        buf.close()
        region.close()


def _register(pool: SharedKVPool) -> pb.RegisterPoolRequest:
    return pb.RegisterPoolRequest(name="dp", model_fingerprint=b"m", geometry=pool.geometry())
