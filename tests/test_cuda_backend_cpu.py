"""The CUDA backend's request logic on the CPU.

``CudaBackend`` talks to the driver only through its ``Device`` interface; here it runs
on ``EmulatedDevice`` (host memory + the g++-built kernel emulator), so descriptor
building, chunking, staging/extent copy plans, epoch grouping, the all-or-nothing
restore rule, nonce burning, IPC handle bookkeeping and host-region fallbacks are all
exercised exactly as the GPU path issues them. What only a GPU can check (cuda-python
call signatures, real streams/events, IPC across processes, pinned memory) is in
tests/gpu/.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from kvseal.server.backends.base import BlockIO
from kvseal.server.backends.cuda import emulated as E
from kvseal.server.backends.cuda import probe
from kvseal.server.backends.cuda.backend import CudaBackend
from kvseal.server.backends.cuda.device import CudaError
from kvseal.server.backends.cuda.emulated_device import EmulatedDevice
from kvseal.server.backends.cuda.ipc import decode_torch_ipc_handle
from kvseal.server.backends.cuda.launch import (
    PoolDescriptors,
    batch_check_code,
    check_batch,
    chunk_batch,
    fill_descriptors,
    plan_runs,
    request_layout,
    split_chunks,
    staging_layout,
)
from kvseal.server.backends.cuda.region import CudaHostRegion
from kvseal.server.deadline import Deadline
from kvseal.server.errors import (
    BadRequest,
    DeadlinePassed,
    EngineNotReady,
    HandleUnusable,
    RequestCancelled,
    ShuttingDown,
)
from kvseal.server.hostregion import Extent, align_up
from kvseal.server.pools import BufferSpec, Geometry, PoolSpec, SegmentSpec
from kvseal.server.sealing import BlockAD, BlockSealer, KeyDestroyed


@pytest.fixture(scope="module")
def emu() -> E.Emulator:
    try:
        return E.load_emulator()
    except E.EmulatorUnavailable as exc:
        pytest.skip(f"CPU emulator unavailable: {exc}")


# --------------------------------------------------------------------------------------
# A BlockSealer with the device key API, as the CUDA backend expects it. Test-only: its
# keys are derived from the epoch index so tests can compare with AESGCM directly.
# --------------------------------------------------------------------------------------


def known_key(epoch: int) -> bytes:
    return hashlib.sha256(b"kvseal test key %d" % epoch).digest()


class DeviceSealer(BlockSealer):
    """The production sealer (scopes, epochs, arena, device key API), with each
    epoch's key derived from its (globally unique) id instead of drawn from
    getrandom, so that tests can compare with AESGCM directly."""

    def _generate_key(self, epoch_index: int, dst: ctypes.Array[ctypes.c_char]) -> None:
        ctypes.memmove(dst, known_key(epoch_index), 32)

    def live_blocks(self, epoch: int) -> int:
        with self._lock:
            e = self._epochs.get(epoch)
            return e.live if e is not None else 0


# --------------------------------------------------------------------------------------
# Pure helpers
# --------------------------------------------------------------------------------------


def test_staging_layout_aligns_slots() -> None:
    offs, total = staging_layout(3, 1000)
    assert offs == [0, 1024, 2048] and total == 3072
    offs, total = staging_layout(2, 4 << 20)
    assert offs == [0, 4 << 20] and total == 8 << 20


def test_plan_runs_merges_only_back_to_back_extents() -> None:
    bb = 4096
    staging, _ = staging_layout(5, bb)
    host = [0, 4096, 8192, 20480, 24576]
    assert plan_runs(host, staging, bb, 0, 5) == [(0, 0, 12288), (20480, 12288, 8192)]
    assert plan_runs(host, staging, bb, 1, 3) == [(4096, 4096, 8192)]
    # Padded slots (block size not a multiple of 256) never merge: no padding is copied.
    bb = 1000
    staging, _ = staging_layout(3, bb)
    host = [0, 1024, 2048]
    assert plan_runs(host, staging, bb, 0, 3) == [
        (0, 0, 1000),
        (1024, 1024, 1000),
        (2048, 2048, 1000),
    ]


def test_split_chunks_is_balanced_bounded_and_covers_everything() -> None:
    assert split_chunks(0, 100) == []
    assert split_chunks(1, 4 << 20) == [(0, 1)]
    assert split_chunks(3, 1024) == [(0, 3)]  # too small to split
    assert split_chunks(1024, 4 << 20) == [(0, 256), (256, 512), (512, 768), (768, 1024)]
    for n in range(1, 50):
        for k in (1, 2, 3, 4, 7):
            ch = split_chunks(n, 1 << 20, k, 1 << 20)
            assert 1 <= len(ch) <= k
            assert ch[0][0] == 0 and ch[-1][1] == n
            assert all(a < b for a, b in ch)
            assert all(ch[i][1] == ch[i + 1][0] for i in range(len(ch) - 1))


def test_request_layout_sections_are_aligned_and_disjoint() -> None:
    for n in (1, 7, 64, 4096):
        lay = request_layout(n)
        starts = [lay.pages, lay.staging_offsets, lay.nonces, lay.aads, lay.tags, lay.ok, lay.ws]
        sizes = [8 * n, 8 * n, 12 * n, 112 * n, 16 * n, n, 24 * n]
        assert all(s % 256 == 0 for s in starts)
        for (a, sa), b in zip(
            zip(starts, sizes, strict=True), [*starts[1:], lay.total], strict=True
        ):
            assert a + sa <= b
        assert lay.upload_seal == lay.tags and lay.upload_open == lay.ok


def test_fill_descriptors_rejects_bad_input_before_writing() -> None:
    lay = request_layout(2)
    buf = ctypes.create_string_buffer(lay.total)
    addr = ctypes.addressof(buf)
    good = {
        "pages": [1, 2],
        "staging_offsets": [0, 256],
        "nonces": [b"n" * 12] * 2,
        "aads": [b"a" * 112] * 2,
    }
    with pytest.raises(ValueError, match="exceeds"):
        fill_descriptors(addr, lay.total - 1, lay, **good)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one entry per block"):
        fill_descriptors(addr, lay.total, lay, **{**good, "pages": [1]})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="12 bytes"):
        fill_descriptors(addr, lay.total, lay, **{**good, "nonces": [b"n" * 11] * 2})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=">= 0"):
        fill_descriptors(addr, lay.total, lay, **{**good, "pages": [-1, 2]})  # type: ignore[arg-type]
    assert buf.raw == bytes(lay.total)
    fill_descriptors(addr, lay.total, lay, tags=[b"t" * 16, b"u" * 16], **good)  # type: ignore[arg-type]
    raw = buf.raw
    assert struct.unpack_from("<qq", raw, lay.pages) == (1, 2)
    assert struct.unpack_from("<QQ", raw, lay.staging_offsets) == (0, 256)
    assert raw[lay.tags : lay.tags + 32] == b"t" * 16 + b"u" * 16


def test_host_batch_check_matches_the_kernels_check(emu: E.Emulator) -> None:
    rng = random.Random(7)
    lib = emu._lib
    for _ in range(400):
        b = E.KvsBatch()
        for f in ("key", "buffers", "segments", "pages", "nonces", "aads", "staging"):
            setattr(b, f, rng.choice([0, 64, 128]) if rng.random() < 0.1 else 64)
        for f in ("staging_offsets", "tags", "ok", "ws"):
            setattr(b, f, 0 if rng.random() < 0.05 else 64)
        b.block_bytes = rng.choice([1, 16, 1000, 4 << 20, (1 << 27) - 1, 1 << 27, 1 << 28])
        b.threads_per_cta = rng.choice([16, 32, 48, 64, 256, 1024, 2048])
        b.slice_blocks = rng.choice([0, 32, 100, 256, 16384])
        b.num_segments = rng.choice([0, 1, 5])
        m = (b.block_bytes + 15) // 16
        right = max(1, -(-m // b.slice_blocks)) if b.slice_blocks else 1
        b.ctas_per_block = right if rng.random() < 0.8 else right + 1
        b.num_blocks = 1
        assert batch_check_code(b) == lib.kvseal_emu_check(ctypes.byref(b)), b
    b.threads_per_cta = 16
    with pytest.raises(ValueError, match="bad kernel descriptor"):
        check_batch(b)


def test_chunk_batch_offsets_every_per_block_array() -> None:
    lay = request_layout(10)
    pool = PoolDescriptors(buffers=0x1000, segments=0x2000, num_segments=3, block_bytes=4096)
    b = chunk_batch(
        key=0x10,
        pool=pool,
        desc=0x100000,
        lay=lay,
        staging=0x900000,
        start=4,
        stop=7,
        config=E.LaunchConfig(),
    )
    assert b.pages == 0x100000 + lay.pages + 32
    assert b.nonces == 0x100000 + lay.nonces + 48
    assert b.aads == 0x100000 + lay.aads + 448
    assert b.staging_offsets == 0x100000 + lay.staging_offsets + 32
    assert b.tags == 0x100000 + lay.tags + 64
    assert b.ok == 0x100000 + lay.ok + 4
    assert b.ws == 0x100000 + lay.ws + 96
    assert b.staging == 0x900000 and b.num_blocks == 3 and b.all_or_nothing == 0
    with pytest.raises(ValueError):
        chunk_batch(
            key=1, pool=pool, desc=1, lay=lay, staging=1, start=5, stop=11, config=E.LaunchConfig()
        )


def test_decode_torch_ipc_handle() -> None:
    raw = bytes(range(64))
    assert decode_torch_ipc_handle(raw) == raw
    assert decode_torch_ipc_handle(b"\x03c" + raw) == raw
    assert decode_torch_ipc_handle(b"\x02c" + raw) == raw
    with pytest.raises(ValueError, match="expandable_segments:False"):
        decode_torch_ipc_handle(b"\x03e" + raw + b"more")
    with pytest.raises(ValueError, match="unrecognised"):
        decode_torch_ipc_handle(b"xx")


def test_cc_mode_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSEAL_CC_MODE", "on")
    assert probe.cc_mode() == "on"
    monkeypatch.setenv("KVSEAL_CC_MODE", "off")
    assert probe.cc_mode() == "off"
    monkeypatch.delenv("KVSEAL_CC_MODE")
    mode = probe.cc_mode()
    assert mode in ("on", "off") or mode.startswith("unknown: ")


def test_cuda_available_answers_without_raising() -> None:
    ok, why = probe.cuda_available(0)
    assert isinstance(ok, bool) and why
    ok2, why2 = probe.cuda_available(10_000)
    assert not ok2 and why2


# --------------------------------------------------------------------------------------
# The backend on the emulated device
# --------------------------------------------------------------------------------------

NS, TENANT = b"N" * 32, b"T" * 32


class Rig:
    """An engine pool in host memory, exported through the emulated device's fake IPC."""

    def __init__(self, backend: CudaBackend, dev: EmulatedDevice, *, pages: int = 12) -> None:
        self.backend, self.dev = backend, dev
        # Two buffers, odd segment sizes and offsets, like the kernel tests (the block
        # straddles segments at non-16-byte boundaries); one buffer shared by 2 handles'
        # worth of segments.
        self.pages = pages
        self.segs = [
            SegmentSpec(0, 40, 300, 200),
            SegmentSpec(1, 8, 1024, 1000),
            SegmentSpec(0, 40 + 300 * pages, 120, 57),
        ]
        self.bufs = [
            bytearray(os.urandom(40 + 300 * pages + 120 * pages + 64)),
            bytearray(os.urandom(8 + 1024 * pages)),
        ]
        self.handles = [dev.export(b) for b in self.bufs]
        self.block_bytes = sum(s.bytes for s in self.segs)

    def spec(self, name: str = "p", handles: list[bytes] | None = None) -> PoolSpec:
        hs = handles or self.handles
        buffers = tuple(
            BufferSpec(None, h, 0, len(b), 0) for h, b in zip(hs, self.bufs, strict=True)
        )
        g = Geometry(self.pages, 4, 2, 2, 16, "bfloat16", "test", buffers, tuple(self.segs))
        spec = PoolSpec(name, b"model", g, "cuda")
        spec.validate()
        return spec

    def read(self, page: int) -> bytes:
        return b"".join(
            bytes(self.bufs[s.buffer][s.offset + page * s.page_stride :][: s.bytes])
            for s in self.segs
        )

    def poison(self, page: int) -> None:
        for s in self.segs:
            start = s.offset + page * s.page_stride
            self.bufs[s.buffer][start : start + s.bytes] = b"\xa5" * s.bytes

    def blocks(self, pages: list[int], first_slot: int = 0, gaps: bool = False) -> list[BlockIO]:
        size = align_up(self.block_bytes)
        out = []
        slot = first_slot
        for i, p in enumerate(pages):
            out.append(
                BlockIO(
                    p,
                    Extent(slot * size, size),
                    BlockAD(NS, TENANT, bytes([i]) * 32, 1),
                    self.block_bytes,
                )
            )
            slot += 2 if gaps else 1
        return out


@pytest.fixture
def rig(emu: E.Emulator) -> Iterator[tuple[CudaBackend, EmulatedDevice, DeviceSealer, Rig]]:
    dev = EmulatedDevice()
    sealer = DeviceSealer()
    backend = CudaBackend(sealer, 0, dev=dev, cc="off", min_chunk_bytes=1)
    yield backend, dev, sealer, Rig(backend, dev)
    backend.close()


def _expected(rec_key: bytes, nonce: bytes, ad: BlockAD, pt: bytes) -> bytes:
    return AESGCM(rec_key).encrypt(nonce, pt, ad.encode())


@pytest.mark.parametrize("seal_mode", ["dma", "mapped"])
@pytest.mark.parametrize("gaps", [False, True])
def test_seal_then_open_round_trip_matches_aesgcm(
    emu: E.Emulator, seal_mode: str, gaps: bool
) -> None:
    dev = EmulatedDevice()
    sealer = DeviceSealer()
    backend = CudaBackend(sealer, 0, dev=dev, cc="off", min_chunk_bytes=1, seal_mode=seal_mode)
    try:
        r = Rig(backend, dev)
        region = backend.make_region(1 << 20, None)
        assert region.description == "pinned cuMemHostAlloc (CC off)" and region.device_ptr
        pool = backend.map_pool(r.spec())
        pages = [3, 0, 11, 5, 7]
        blocks = r.blocks(pages, gaps=gaps)
        plain = {p: r.read(p) for p in pages}
        dev.launches.clear()
        records = backend.seal_blocks(pool, blocks, region)
        kernels = [k for k, _ in dev.launches]
        assert kernels.count("kvseal_key_setup") == 1
        assert 1 < kernels.count("kvseal_seal") <= 4  # chunked, bounded
        for b, rec in zip(blocks, records, strict=True):
            sealed = _expected(known_key(rec.epoch), rec.nonce, b.ad, plain[b.page])
            ct = bytearray(b.size)
            assert region.read_into(b.extent.offset, memoryview(ct)) == b.size
            assert bytes(ct) == sealed[:-16] and rec.tag == sealed[-16:]
            assert bytes(ct) != plain[b.page]
        assert len({rec.nonce for rec in records}) == len(records)
        for p in pages:
            r.poison(p)
        dev.launches.clear()
        assert backend.open_blocks(pool, blocks, records, region) == []
        kernels = [k for k, _ in dev.launches]
        assert kernels.count("kvseal_open") == 1 and kernels.count("kvseal_key_setup") == 0
        for p in pages:
            assert r.read(p) == plain[p]
        pool.close()
        region.close()
    finally:
        backend.close()


def test_both_ways_with_blocksealer_format(
    rig: tuple[CudaBackend, EmulatedDevice, DeviceSealer, Rig],
) -> None:
    """A block sealed by BlockSealer.seal_into (the CPU backend's format) opens on the
    device path, and a device-sealed block opens with BlockSealer.open_into."""
    backend, _dev, sealer, r = rig
    region = backend.make_region(1 << 20, None)
    pool = backend.map_pool(r.spec())
    blocks = r.blocks([1, 2])
    # CPU -> device
    plain = r.read(1)
    out = bytearray(len(plain) + 16)
    rec = sealer.seal_into(memoryview(bytearray(plain)), blocks[0].ad, memoryview(out))
    region.write(blocks[0].extent.offset, memoryview(out)[: len(plain)])
    r.poison(1)
    assert backend.open_blocks(pool, blocks[:1], [rec], region) == []
    assert r.read(1) == plain
    # device -> CPU
    (rec2,) = backend.seal_blocks(pool, blocks[1:], region)
    ct = bytearray(r.block_bytes)
    region.read_into(blocks[1].extent.offset, memoryview(ct))
    back = bytearray(r.block_bytes)
    sealer.open_into(rec2, blocks[1].ad, memoryview(bytes(ct) + rec2.tag), memoryview(back))
    assert bytes(back) == r.read(2)


@pytest.mark.parametrize("what", ["byte", "tag", "aad", "swap"])
def test_tampering_writes_nothing(
    rig: tuple[CudaBackend, EmulatedDevice, DeviceSealer, Rig], what: str
) -> None:
    backend, _dev, _sealer, r = rig
    region = backend.make_region(1 << 20, None)
    pool = backend.map_pool(r.spec())
    pages = [0, 1, 2, 3]
    blocks = r.blocks(pages)
    records = backend.seal_blocks(pool, blocks, region)
    for p in pages:
        r.poison(p)
    poisoned = {p: r.read(p) for p in pages}
    if what == "byte":
        one = bytearray(1)
        region.read_into(blocks[2].extent.offset + 77, memoryview(one))
        region.write(blocks[2].extent.offset + 77, memoryview(bytes([one[0] ^ 1])))
        want = [2]
    elif what == "tag":
        records[1] = type(records[1])(records[1].epoch, records[1].nonce, bytes(16))
        want = [1]
    elif what == "aad":
        b = blocks[3]
        blocks[3] = BlockIO(b.page, b.extent, BlockAD(NS, TENANT, b.ad.block_hash, 2), b.size)
        want = [3]
    else:
        blocks[0], blocks[1] = (
            BlockIO(blocks[0].page, blocks[1].extent, blocks[0].ad, blocks[0].size),
            BlockIO(blocks[1].page, blocks[0].extent, blocks[1].ad, blocks[1].size),
        )
        want = [0, 1]
    assert backend.open_blocks(pool, blocks, records, region) == want
    for p in pages:
        assert r.read(p) == poisoned[p], "a failed restore wrote to the pool"


def test_restore_across_key_epochs(emu: E.Emulator) -> None:
    dev = EmulatedDevice()
    sealer = DeviceSealer(rekey_after=3)
    backend = CudaBackend(sealer, 0, dev=dev, cc="off", min_chunk_bytes=1)
    try:
        r = Rig(backend, dev)
        region = backend.make_region(1 << 20, None)
        pool = backend.map_pool(r.spec())
        b1, b2 = r.blocks([0, 1, 2]), r.blocks([3, 4], first_slot=3)
        rec1 = backend.seal_blocks(pool, b1, region)
        rec2 = backend.seal_blocks(pool, b2, region)  # 3 + 2 > 3: a new epoch
        assert rec1[0].epoch == 0 and rec2[0].epoch == 1
        blocks = [b2[0], b1[0], b2[1], b1[1], b1[2]]
        records = [rec2[0], rec1[0], rec2[1], rec1[1], rec1[2]]
        plain = {b.page: r.read(b.page) for b in blocks}
        for b in blocks:
            r.poison(b.page)
        poisoned = {b.page: r.read(b.page) for b in blocks}
        # One bad block in one epoch: nothing at all is written, in either epoch.
        bad = list(records)
        bad[3] = type(bad[3])(bad[3].epoch, bad[3].nonce, bytes(16))
        assert backend.open_blocks(pool, blocks, bad, region) == [3]
        assert all(r.read(p) == poisoned[p] for p in poisoned)
        assert backend.open_blocks(pool, blocks, records, region) == []
        assert all(r.read(p) == plain[p] for p in plain)
        # Retired epochs' device key contexts are wiped and freed.
        for _ in range(3):
            sealer.forget(0)
        backend.seal_blocks(pool, r.blocks([5], first_slot=6), region)
        assert 0 not in backend._keys
    finally:
        backend.close()


def test_failed_seal_burns_every_nonce(
    rig: tuple[CudaBackend, EmulatedDevice, DeviceSealer, Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, dev, sealer, r = rig
    region = backend.make_region(1 << 20, None)
    pool = backend.map_pool(r.spec())
    backend.seal_blocks(pool, r.blocks([0]), region)  # key context exists now
    live = sealer.live_blocks(0)

    def boom(*a: object, **k: object) -> None:
        raise CudaError("cuLaunchKernel(kvseal_seal) failed: CUDA_ERROR_LAUNCH_FAILED (719)", 719)

    monkeypatch.setattr(dev, "launch", boom)
    with pytest.raises(CudaError):
        backend.seal_blocks(pool, r.blocks([1, 2, 3], first_slot=1), region)
    assert sealer.live_blocks(0) == live
    # A sticky error: the backend refuses further work with a clear message.
    with pytest.raises(CudaError, match="restart kvseal-server"):
        backend.seal_blocks(pool, r.blocks([4]), region)


def test_map_pool_dedupes_handles_and_checks_sizes(
    rig: tuple[CudaBackend, EmulatedDevice, DeviceSealer, Rig],
) -> None:
    backend, dev, _sealer, r = rig
    spec = r.spec()
    a = backend.map_pool(spec)
    b = backend.map_pool(r.spec("q"))  # same handles: opened once, refcounted
    assert dev.open_ipc_mappings == 2
    a.close()
    assert dev.open_ipc_mappings == 2
    b.close()
    assert dev.open_ipc_mappings == 0
    # A buffer larger than its allocation.
    g = spec.geometry
    big = (BufferSpec(None, r.handles[0], 64, len(r.bufs[0]), 0), g.buffers[1])
    bad = PoolSpec("x", b"m", Geometry(**{**_fields(g), "buffers": big}), "cuda")
    with pytest.raises(HandleUnusable, match="CUDA allocation has"):
        backend.map_pool(bad)
    assert dev.open_ipc_mappings == 0
    # The engine's device index is its own numbering (CUDA_VISIBLE_DEVICES): advisory.
    renum = (BufferSpec(None, r.handles[0], 0, len(r.bufs[0]), 3), g.buffers[1])
    backend.map_pool(
        PoolSpec("y", b"m", Geometry(**{**_fields(g), "buffers": renum}), "cuda")
    ).close()
    assert dev.open_ipc_mappings == 0
    # Memory that really lives on another GPU is refused after the open, and unmapped.
    far = bytearray(4096)
    other = (BufferSpec(None, dev.export(far, gpu=1), 0, len(far), 0), g.buffers[1])
    with pytest.raises(HandleUnusable, match=r"on GPU 1 .* one kvseal per GPU"):
        backend.map_pool(PoolSpec("y", b"m", Geometry(**{**_fields(g), "buffers": other}), "cuda"))
    assert dev.open_ipc_mappings == 0
    # A handle the driver cannot open.
    unknown = (BufferSpec(None, b"\x01" * 64, 0, 10, 0), g.buffers[1])
    with pytest.raises(HandleUnusable, match="expandable_segments:False"):
        backend.map_pool(
            PoolSpec("z", b"m", Geometry(**{**_fields(g), "buffers": unknown}), "cuda")
        )
    assert dev.open_ipc_mappings == 0


def test_map_pool_rejects_blocks_the_kernels_cannot_take(
    rig: tuple[CudaBackend, EmulatedDevice, DeviceSealer, Rig],
) -> None:
    backend, dev, _sealer, _r = rig
    big = bytearray(1 << 27)
    h = dev.export(big)
    g = Geometry(
        1,
        1,
        1,
        1,
        1,
        "uint8",
        "t",
        (BufferSpec(None, h, 0, len(big), 0),),
        (SegmentSpec(0, 0, 1 << 27, 1 << 27),),
    )
    with pytest.raises(BadRequest, match="CUDA backend cannot use"):
        backend.map_pool(PoolSpec("big", b"m", g, "cuda"))
    assert dev.open_ipc_mappings == 0


def _fields(g: Geometry) -> dict[str, object]:
    return {f: getattr(g, f) for f in Geometry.__dataclass_fields__}


def test_bad_event_handle_is_a_bad_request(
    rig: tuple[CudaBackend, EmulatedDevice, DeviceSealer, Rig],
) -> None:
    backend, _dev, _sealer, r = rig
    region = backend.make_region(1 << 20, None)
    pool = backend.map_pool(r.spec())
    with pytest.raises(BadRequest, match="64 bytes"):
        backend.seal_blocks(pool, r.blocks([0]), region, wait_event=b"short")
    recs = backend.seal_blocks(pool, r.blocks([0]), region, wait_event=b"\x00" * 64)
    assert backend.open_blocks(pool, r.blocks([0]), recs, region, wait_event=b"\x00" * 64) == []


def test_stuck_engine_event_times_out_without_blocking_other_requests(
    emu: E.Emulator,
) -> None:
    """An engine event that never completes: that request fails with EngineNotReady
    (DEADLINE_EXCEEDED) having drawn no nonce and touched nothing, every opened event
    is destroyed, and meanwhile other requests are served (the wait holds no lock)."""
    dev = EmulatedDevice()
    sealer = DeviceSealer()
    backend = CudaBackend(sealer, 0, dev=dev, cc="off", engine_event_timeout=0.2)
    try:
        r = Rig(backend, dev)
        region = backend.make_region(1 << 20, None)
        pool = backend.map_pool(r.spec())
        recs = backend.seal_blocks(pool, r.blocks([0]), region)
        stuck = b"\xee" * 64
        dev.pending_events.add(stuck)
        drawn = sealer.seals_under_current_key
        with pytest.raises(EngineNotReady, match=r"did not complete within 0\.2 s"):
            backend.seal_blocks(pool, r.blocks([1], first_slot=1), region, wait_event=stuck)
        assert sealer.seals_under_current_key == drawn  # no nonce drawn (not merely burnt)
        r.poison(0)
        poisoned = r.read(0)
        with pytest.raises(EngineNotReady):
            backend.open_blocks(pool, r.blocks([0]), recs, region, wait_event=stuck)
        assert r.read(0) == poisoned  # nothing written
        assert dev.events_opened == dev.events_destroyed == 2

        # A long wait in one thread does not hold up another request.
        backend.engine_event_timeout = 30.0
        result: list[object] = []

        def waiter() -> None:
            try:
                result.append(backend.seal_blocks(pool, r.blocks([2], first_slot=2), region, stuck))
            except Exception as e:
                result.append(e)

        t = threading.Thread(target=waiter)
        t.start()
        try:
            while dev.events_opened < 3:  # the waiter is in its poll now
                t.join(0.001)
            assert backend.open_blocks(pool, r.blocks([0]), recs, region) == []
            assert t.is_alive() and not result  # still waiting on the engine event
        finally:
            dev.pending_events.clear()  # the engine's stream gets going again
            t.join(10)
        assert len(result) == 1 and isinstance(result[0], list) and len(result[0]) == 1
        assert dev.events_opened == dev.events_destroyed == 3
        # Stopping (an integrity abort elsewhere) ends a wait at once.
        dev.pending_events.add(stuck)
        backend.stopping.set()
        with pytest.raises(ShuttingDown):
            backend.open_blocks(pool, r.blocks([0]), recs, region, wait_event=stuck)
    finally:
        backend.close()


def test_engine_object_errors_never_disable_the_backend(
    rig: tuple[CudaBackend, EmulatedDevice, DeviceSealer, Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A garbage or dead engine's handle may make the driver return anything (even a
    code that is sticky for our own work): that request fails, the daemon serves on."""
    backend, dev, _sealer, r = rig
    region = backend.make_region(1 << 20, None)
    pool = backend.map_pool(r.spec())
    recs = backend.seal_blocks(pool, r.blocks([0]), region)

    def unknown(*a: object) -> object:
        raise CudaError("CUDA_ERROR_UNKNOWN (999)", 999)

    for what in ("open_ipc_event", "query_event"):
        monkeypatch.setattr(dev, what, unknown)
        with pytest.raises(HandleUnusable):
            backend.open_blocks(pool, r.blocks([0]), recs, region, wait_event=b"\x01" * 64)
        monkeypatch.undo()
    fresh = [bytearray(len(b)) for b in r.bufs]  # handles not mapped yet
    handles = [dev.export(b) for b in fresh]
    monkeypatch.setattr(dev, "open_ipc_mem", unknown)
    with pytest.raises(HandleUnusable):
        backend.map_pool(r.spec("other", handles))
    monkeypatch.undo()
    assert backend.open_blocks(pool, r.blocks([0]), recs, region, wait_event=b"\x01" * 64) == []
    assert dev.events_opened == dev.events_destroyed


def test_failed_request_drains_both_streams_before_the_lock_is_released(
    rig: tuple[CudaBackend, EmulatedDevice, DeviceSealer, Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Work queued before a failure is waited for (a stale kernel must not read the
    next request's descriptors); if the streams cannot be drained, the backend
    refuses further work."""
    backend, dev, _sealer, r = rig
    region = backend.make_region(1 << 20, None)
    pool = backend.map_pool(r.spec())
    recs = backend.seal_blocks(pool, r.blocks([0, 1]), region)
    real_launch = dev.launch

    def fail_open(kernel: str, *a: object, **k: object) -> None:
        if kernel == "kvseal_open":
            raise CudaError("cuLaunchKernel(kvseal_open) failed: CUDA_ERROR_INVALID_VALUE (1)", 1)
        real_launch(kernel, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(dev, "launch", fail_open)
    before = dev.syncs
    with pytest.raises(CudaError, match="INVALID_VALUE"):
        backend.open_blocks(pool, r.blocks([0, 1]), recs, region)
    assert dev.syncs - before == 2  # compute and copy streams, on the error path
    monkeypatch.setattr(dev, "launch", real_launch)
    assert backend.open_blocks(pool, r.blocks([0, 1]), recs, region) == []  # not sticky

    def broken_sync(stream: object) -> None:
        raise CudaError("cuStreamSynchronize failed: CUDA_ERROR_INVALID_VALUE (1)", 1)

    monkeypatch.setattr(dev, "launch", fail_open)
    monkeypatch.setattr(dev, "sync", broken_sync)
    with pytest.raises(CudaError):
        backend.open_blocks(pool, r.blocks([0, 1]), recs, region)
    monkeypatch.undo()
    with pytest.raises(CudaError, match=r"streams could not be drained.*restart kvseal-server"):
        backend.seal_blocks(pool, r.blocks([2], first_slot=2), region)


def test_raw_key_passes_only_through_a_pinned_buffer_that_is_wiped(
    rig: tuple[CudaBackend, EmulatedDevice, DeviceSealer, Rig],
) -> None:
    backend, dev, _sealer, r = rig
    region = backend.make_region(1 << 20, None)
    pool = backend.map_pool(r.spec())
    staged = backend._keys._key_host
    assert staged in dev._mem  # allocated with host_alloc (pinned on a GPU)
    backend.seal_blocks(pool, r.blocks([0]), region)  # derives epoch 0's context
    assert ctypes.string_at(staged, 32) == bytes(32)
    assert ctypes.string_at(backend._keys._key_dev, 32) == bytes(32)  # the device copy too


# --------------------------------------------------------------------------------------
# Host region modes
# --------------------------------------------------------------------------------------


def test_region_file_is_registered_outside_cc(emu: E.Emulator, tmp_path: Path) -> None:
    path = tmp_path / "region.bin"
    region = CudaHostRegion(EmulatedDevice(), 1 << 16, str(path), cc="off")
    try:
        assert region.mode == "registered"
        assert region.description == f"{path} registered with cuMemHostRegister (CC off)"
        region.write(100, memoryview(b"abc"))
        with open(path, "r+b") as f:  # the hypervisor's view and hand
            f.seek(100)
            assert f.read(3) == b"abc"
            f.seek(101)
            f.write(b"X")
        out = bytearray(3)
        assert region.read_into(100, memoryview(out)) == 3 and out == b"aXc"
        assert oct(path.stat().st_mode & 0o777) == "0o600"
    finally:
        region.close()


def test_region_falls_back_when_register_is_refused(emu: E.Emulator, tmp_path: Path) -> None:
    region = CudaHostRegion(
        EmulatedDevice(refuse_register=True), 4096, str(tmp_path / "r"), cc="unknown: no NVML"
    )
    try:
        assert region.mode == "alloc"
        assert region.description.startswith(
            "pinned cuMemHostAlloc (CC unknown); cuMemHostRegister of"
        )
        assert "801" in region.description
    finally:
        region.close()


def test_region_in_cc_mode_never_registers(emu: E.Emulator, tmp_path: Path) -> None:
    dev = EmulatedDevice(refuse_register=True)
    region = CudaHostRegion(dev, 4096, str(tmp_path / "r"), cc="on")
    try:
        assert region.mode == "alloc" and region.device_ptr is None
        assert (
            region.description
            == f"pinned cuMemHostAlloc (CC on); --host-region {tmp_path / 'r'} ignored in CC mode"
        )
        assert not (tmp_path / "r").exists()
    finally:
        region.close()


def test_region_bounds(emu: E.Emulator) -> None:
    from kvseal.server.hostregion import RegionError

    region = CudaHostRegion(EmulatedDevice(), 1024, None, cc="off")
    with pytest.raises(RegionError):
        region.write(1000, memoryview(bytes(100)))
    out = bytearray(100)
    assert region.read_into(1000, memoryview(out)) == 24
    region.close()
    region.close()
    with pytest.raises(RegionError):
        region.read_into(0, memoryview(out))


def test_region_falls_back_to_unmapped_pinned_memory(emu: E.Emulator) -> None:
    class NoDeviceMap(EmulatedDevice):
        def host_alloc(self, nbytes: int, *, mapped: bool) -> int:
            if mapped:
                raise CudaError("cuMemHostAlloc failed: CUDA_ERROR_NOT_SUPPORTED (801)", 801)
            return super().host_alloc(nbytes, mapped=mapped)

    region = CudaHostRegion(NoDeviceMap(), 4096, None, cc="unknown: no NVML")
    try:
        assert region.mode == "alloc" and region.device_ptr is None
        region.write(0, memoryview(b"x"))
    finally:
        region.close()


# --------------------------------------------------------------------------------------
# CudaDevice through the real cuda-python bindings, over a fake libcuda (no GPU)
# --------------------------------------------------------------------------------------

FAKE_DRIVER = Path(__file__).parent / "gpu" / "fake_libcuda.c"
REPO = Path(__file__).resolve().parent.parent
# Where mk/cuda.mk installs the newest cuda-bindings release alone (`make test` does).
NEWEST_BINDINGS_DIR = REPO / ".venv" / "cuda-bindings-newest"


def _on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _unavailable(why: str) -> None:
    """Skip locally; fail under CI, where `make test` installs both bindings versions
    and a skip would hide that the conformance test did not run."""
    if _on_ci():
        pytest.fail(f"CI=true and {why}")
    pytest.skip(why)


def _pinned_bindings_version() -> str:
    m = re.search(
        r"^cuda-bindings==(\S+)", (REPO / "requirements-dev.txt").read_text(), re.MULTILINE
    )
    assert m, "requirements-dev.txt pins no cuda-bindings"
    return m.group(1)


def _newest_bindings_version() -> str:
    m = re.search(
        r"^CUDA_BINDINGS_NEWEST\s*:?=\s*(\S+)", (REPO / "mk" / "cuda.mk").read_text(), re.MULTILINE
    )
    assert m, "mk/cuda.mk sets no CUDA_BINDINGS_NEWEST"
    return m.group(1)


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory holding tests/gpu/fake_libcuda.c built as libcuda.so.1."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the fake libcuda")
    try:
        probe.driver_module()
        from kvseal.server.backends.cuda import compile as kc

        kc.nvrtc_version()
    except (ImportError, RuntimeError) as e:
        _unavailable(f"cuda-python / NVRTC unavailable: {e}")
    out = tmp_path_factory.mktemp("fakecuda")
    subprocess.run(
        [cc, "-O1", "-fPIC", "-shared", "-o", str(out / "libcuda.so.1"), str(FAKE_DRIVER), "-ldl"],
        check=True,
    )
    return out


@pytest.fixture(params=["pinned", "newest"])
def bindings(request: pytest.FixtureRequest) -> tuple[str, list[str]]:
    """(the cuda-bindings version the subprocess must load, what goes first on its
    PYTHONPATH): the venv's pinned release, or the newest one installed alone."""
    if request.param == "pinned":
        return _pinned_bindings_version(), []
    want = _newest_bindings_version()
    if not (NEWEST_BINDINGS_DIR / "cuda" / "bindings").is_dir():
        _unavailable(
            f"cuda-bindings {want} is not installed in {NEWEST_BINDINGS_DIR.relative_to(REPO)} "
            "(`make cuda-bindings-newest`; `make test` installs it)"
        )
    return want, [str(NEWEST_BINDINGS_DIR)]


@pytest.mark.parametrize(
    "args",
    [("dma", "off"), ("mapped", "off", "file"), ("dma", "on", "file"), ("dma", "off", "ptx")],
    ids=["dma", "mapped-registered", "cc-on", "ptx-fallback"],
)
def test_cuda_device_over_fake_driver(
    emu: E.Emulator,
    fake_libcuda: Path,
    bindings: tuple[str, list[str]],
    args: tuple[str, ...],
) -> None:
    """Every driver call of CudaDevice/CudaBackend parses in cuda-python and passes the
    fake driver's checks (contexts, handles, flags, device ranges of copies and kernel
    descriptors), the bytes equal AESGCM's, nothing leaks, and no driver call (or driver
    struct) raised AttributeError/TypeError, even one kvseal caught
    (tests/gpu/fake_driver_run.py); under the pinned and the newest cuda-bindings."""
    want, first = bindings
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": f"{fake_libcuda}:{os.environ.get('LD_LIBRARY_PATH', '')}",
        "FAKE_CUDA_EMULATOR": str(emu._lib._name),
        "PYTHONPATH": os.pathsep.join(
            [
                *first,
                str(REPO),
                str(REPO / "client"),
                str(REPO / "server"),
                os.environ.get("PYTHONPATH", ""),
            ]
        ),
    }
    r = subprocess.run(
        [sys.executable, str(REPO / "tests" / "gpu" / "fake_driver_run.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout[-3000:] + r.stderr[-3000:]
    loaded = re.search(r"^cuda-bindings (\S+) from (.+)$", r.stdout, re.MULTILINE)
    assert loaded, f"the run did not say which cuda-bindings it loaded: {out}"
    assert loaded.group(1) == want, f"expected cuda-bindings {want}, loaded {loaded.group(1)}"
    where = Path(loaded.group(2)).resolve()
    assert where.is_relative_to(NEWEST_BINDINGS_DIR.resolve()) == bool(first), where
    assert r.returncode == 0 and "ALL OK" in r.stdout, out


@pytest.mark.parametrize("defect", [False, True], ids=["ok", "defect"])
def test_ipc_preflight_child_over_fake_driver(
    fake_libcuda: Path, bindings: tuple[str, list[str]], defect: bool
) -> None:
    """scripts/ipc_preflight.py's daemon half (cuda-python only) passes every step over
    the fake driver under both bindings; a Python exception in a step is reported as a
    kvseal/cuda-bindings DEFECT (exit 3), not as a platform limitation."""
    want, first = bindings
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": f"{fake_libcuda}:{os.environ.get('LD_LIBRARY_PATH', '')}",
        "PYTHONPATH": os.pathsep.join(
            [*first, str(REPO), str(REPO / "client"), str(REPO / "server")]
        ),
    }
    argv = ["preflight", *(["defect"] if defect else [])]
    r = subprocess.run(
        [sys.executable, str(REPO / "tests" / "gpu" / "fake_driver_run.py"), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(rf"^cuda-bindings {re.escape(want)} from ", r.stdout, re.MULTILINE), out
    assert r.returncode == 0 and "ALL OK" in r.stdout, out
    steps = re.findall(r"^preflight: ([\w-]+): (OK|FAILED|DEFECT)", r.stdout, re.MULTILINE)
    if defect:
        assert ("ipc-mem-open", "DEFECT") in steps, out
    else:
        assert steps and all(v == "OK" for _, v in steps), out


def test_cuda_extra_declares_the_tested_bindings() -> None:
    """kvseal-server[cuda] admits both cuda-bindings releases the conformance test runs
    under, and nothing newer than the newest: a release past it may change the API
    again (13.4 made the IPC handle types opaque), so it must be tested before it is
    declared."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    project = tomllib.loads((REPO / "server" / "pyproject.toml").read_text())["project"]
    (spec,) = [
        r.specifier
        for r in map(Requirement, project["optional-dependencies"]["cuda"])
        if r.name == "cuda-bindings"
    ]
    pinned, newest = Version(_pinned_bindings_version()), Version(_newest_bindings_version())
    assert pinned in spec and newest in spec, (str(spec), pinned, newest)
    next_minor = Version(f"{newest.major}.{newest.minor + 1}.0")
    assert next_minor not in spec, f"{spec} admits {next_minor}, which no test ran"
    # The pin is the oldest release tested: nothing older may be declared.
    if pinned.micro > 0:
        older = Version(f"{pinned.major}.{pinned.minor}.{pinned.micro - 1}")
        assert older not in spec, f"{spec} admits {older}, older than the pinned {pinned}"


def test_nvrtc_compile_leaves_one_byte_bytes_alone() -> None:
    """NVRTC writes its (1-byte, empty) log into the buffer it is given: a ``b" " * 1``
    buffer is CPython's shared ``b" "`` object, which then reads b"\\0" process-wide."""
    from kvseal.server.backends.cuda import compile as kc

    try:
        kc.nvrtc_version()
    except RuntimeError as e:
        pytest.skip(f"NVRTC unavailable: {e}")
    root = Path(__file__).resolve().parent.parent
    code = (
        "from kvseal.server.backends.cuda import compile as kc\n"
        "k = kc.compile_kernels('sm_90', use_cache=False)\n"
        "space = b' '\n"
        "assert space[0] == 32, 'b\" \" was overwritten'\n"
        "assert k.image[:4] == b'\\x7fELF'\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root / "client"), str(root / "server")]),
    }
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_driver_module_falls_back_to_older_cuda_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe, "DRIVER_MODULES", ("no_such.driver", "ctypes"))
    assert probe.driver_module() is ctypes  # stand-in for cuda.cuda (cuda-python < 12.6)
    monkeypatch.setattr(probe, "DRIVER_MODULES", ("no_such.driver",))
    with pytest.raises(ImportError, match="no cuda-python driver bindings"):
        probe.driver_module()
    assert probe.cuda_available(0)[0] is False


# --------------------------------------------------------------------------------------
# The engine contract: a failed call touches no page afterwards (deferred device)
# --------------------------------------------------------------------------------------


class CountdownDeadline(Deadline):
    """A deadline that fails at its ``at``-th check (0: never), by ``how``: its cutoff
    passes, the call is cancelled, or the daemon stops. Counting checks instead of
    time puts the failure exactly at one chosen boundary of the request."""

    __slots__ = ("at", "calls", "how")

    def __init__(self, at: int = 0, how: str = "cutoff") -> None:
        super().__init__(None, threading.Event(), threading.Event())
        self.at, self.how, self.calls = at, how, 0

    def check(self, what: str = "the next page") -> None:
        self.calls += 1
        if self.calls == self.at:
            if self.how == "cutoff":
                self.cutoff = time.monotonic() - 1.0
            elif self.how == "cancel":
                assert self.cancelled is not None
                self.cancelled.set()
            else:
                assert self.stopping is not None
                self.stopping.set()
        super().check(what)


_RAISED = {"cutoff": DeadlinePassed, "cancel": RequestCancelled, "stop": ShuttingDown}


def check_raised(how: str) -> pytest.RaisesContext[Exception]:
    """The error a :class:`CountdownDeadline` failing ``how`` makes a call raise."""
    return pytest.raises(_RAISED[how])


def _deferred_rig(
    emu: E.Emulator, rekey_after: int = 2**32
) -> tuple[CudaBackend, EmulatedDevice, DeviceSealer, Rig]:
    dev = EmulatedDevice(deferred=True)
    sealer = DeviceSealer(rekey_after=rekey_after)
    backend = CudaBackend(sealer, 0, dev=dev, cc="off", min_chunk_bytes=1)
    return backend, dev, sealer, Rig(backend, dev)


def _live(sealer: DeviceSealer) -> int:
    return sum(sealer.live_blocks(e) for e in sealer.live_epoch_ids())


@pytest.mark.parametrize("how", ["cutoff", "cancel", "stop"])
@pytest.mark.parametrize("seal_mode", ["dma", "mapped"])
@pytest.mark.parametrize("event", [False, True], ids=["no-event", "engine-event"])
def test_seal_stops_at_every_boundary_and_leaves_nothing(
    emu: E.Emulator, how: str, seal_mode: str, event: bool
) -> None:
    """Whichever check fails (before the nonces, before each chunk's kernels, after
    the work), the seal raises it with nothing left queued on the GPU, returns no
    record and burns every nonce it drew; with no failure the bytes equal AESGCM's."""
    backend, dev, sealer, r = _deferred_rig(emu)
    backend.seal_mode = seal_mode
    try:
        region = backend.make_region(1 << 20, None)
        pool = backend.map_pool(r.spec())
        blocks = r.blocks([3, 0, 11, 5, 7])
        wait = b"\x01" * 64 if event else None
        chunks = len(split_chunks(len(blocks), r.block_bytes, backend.max_chunks, 1))
        assert chunks == 4
        counting = CountdownDeadline()
        plain = {b.page: r.read(b.page) for b in blocks}
        records = backend.seal_blocks(pool, blocks, region, wait, deadline=counting)
        # engine event poll + before the nonces + one per chunk + after the work
        assert counting.calls == int(event) + 1 + chunks + 1
        for b, rec in zip(blocks, records, strict=True):
            sealed = _expected(known_key(rec.epoch), rec.nonce, b.ad, plain[b.page])
            ct = bytearray(b.size)
            region.read_into(b.extent.offset, memoryview(ct))
            assert bytes(ct) + rec.tag == sealed
        for at in range(1, counting.calls + 1):
            live, drawn = _live(sealer), sealer.seals_under_current_key
            dev.launches.clear()
            dl = CountdownDeadline(at, how)
            with pytest.raises(_RAISED[how]):
                backend.seal_blocks(pool, blocks, region, wait, deadline=dl)
            assert dl.calls == at  # it stopped at the failed check
            assert not dev.queued, "GPU work was left queued after the call failed"
            assert _live(sealer) == live  # every nonce drawn was burnt
            seals = [k for k, _ in dev.launches if k == "kvseal_seal"]
            # chunk kernels queued only for the checks that passed before them
            assert len(seals) == max(0, min(chunks, at - 1 - int(event) - 1))
            if at <= int(event) + 1:
                assert sealer.seals_under_current_key == drawn  # failed before drawing any
    finally:
        backend.close()


@pytest.mark.parametrize("how", ["cutoff", "cancel", "stop"])
@pytest.mark.parametrize("epochs", [1, 2])
@pytest.mark.parametrize("event", [False, True], ids=["no-event", "engine-event"])
def test_restore_stops_at_every_boundary_and_writes_no_page(
    emu: E.Emulator, how: str, epochs: int, event: bool
) -> None:
    """Whichever check fails (before each chunk's snapshot + verify, while awaiting the
    engine's event, before the open pass), the restore raises it with nothing queued;
    pages poisoned after the raise stay poisoned once everything queued could have
    run; with no failure every page holds its plaintext."""
    backend, dev, _sealer, r = _deferred_rig(emu, rekey_after=3 if epochs == 2 else 2**32)
    try:
        region = backend.make_region(1 << 20, None)
        pool = backend.map_pool(r.spec())
        b1, b2 = r.blocks([0, 1, 2]), r.blocks([3, 4], first_slot=3)
        recs = backend.seal_blocks(pool, b1, region) + backend.seal_blocks(pool, b2, region)
        assert len({rec.epoch for rec in recs}) == epochs
        blocks = [b2[0], b1[0], b2[1], b1[1], b1[2]]
        records = [recs[3], recs[0], recs[4], recs[1], recs[2]]
        plain = {b.page: r.read(b.page) for b in blocks}
        wait = b"\x02" * 64 if event else None
        counting = CountdownDeadline()
        for b in blocks:
            r.poison(b.page)
        assert backend.open_blocks(pool, blocks, records, region, wait, deadline=counting) == []
        assert all(r.read(p) == plain[p] for p in plain)
        chunks = sum(
            len(split_chunks(n, r.block_bytes, backend.max_chunks, 1))
            for n in ([5] if epochs == 1 else [3, 2])
        )
        # one per chunk + engine event poll + before the open pass
        assert counting.calls == chunks + int(event) + 1
        for at in range(1, counting.calls + 1):
            for b in blocks:
                r.poison(b.page)
            dev.launches.clear()
            dl = CountdownDeadline(at, how)
            with pytest.raises(_RAISED[how]):
                backend.open_blocks(pool, blocks, records, region, wait, deadline=dl)
            assert dl.calls == at
            assert not dev.queued, "GPU work was left queued after the call failed"
            assert "kvseal_open" not in [k for k, _ in dev.launches]
            for b in blocks:  # the engine reuses the pages at once
                for s in r.segs:
                    start = s.offset + b.page * s.page_stride
                    r.bufs[s.buffer][start : start + s.bytes] = b"\x5a" * s.bytes
            after = {b.page: r.read(b.page) for b in blocks}
            dev.flush()  # anything still pending would run now
            assert all(r.read(p) == after[p] for p in after), "a page was written after"
        for b in blocks:
            r.poison(b.page)
        assert backend.open_blocks(pool, blocks, records, region, wait) == []
        assert all(r.read(p) == plain[p] for p in plain)
    finally:
        backend.close()


def test_seal_finished_past_the_cutoff_is_discarded(
    emu: E.Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cutoff passing while the queued work runs (no check in between): the seal
    completes on the GPU but raises DeadlinePassed, returns no record and burns its
    nonces, since its last chunk may have read pages the engine had reused."""
    backend, dev, sealer, r = _deferred_rig(emu)
    try:
        region = backend.make_region(1 << 20, None)
        pool = backend.map_pool(r.spec())
        backend.seal_blocks(pool, r.blocks([0]), region)
        live = _live(sealer)
        dl = Deadline.after(3600)
        real_sync = dev.sync

        def slow_sync(stream: object) -> None:
            real_sync(stream)
            dl.cutoff = time.monotonic() - 1.0  # the GPU took until after the cutoff

        monkeypatch.setattr(dev, "sync", slow_sync)
        with pytest.raises(DeadlinePassed, match="discarded"):
            backend.seal_blocks(pool, r.blocks([1, 2], first_slot=1), region, deadline=dl)
        assert _live(sealer) == live and not dev.queued
    finally:
        backend.close()


def test_engine_event_wait_ends_at_the_cutoff_or_on_cancellation(emu: E.Emulator) -> None:
    """A stuck engine event with a long --engine-event-timeout: the wait ends at the
    request's cutoff (DeadlinePassed, not ENGINE_NOT_READY after the timeout), or as
    soon as the call is cancelled; nothing is read, written or drawn."""
    dev = EmulatedDevice(deferred=True)
    sealer = DeviceSealer()
    backend = CudaBackend(sealer, 0, dev=dev, cc="off", engine_event_timeout=3600)
    try:
        r = Rig(backend, dev)
        region = backend.make_region(1 << 20, None)
        pool = backend.map_pool(r.spec())
        recs = backend.seal_blocks(pool, r.blocks([0]), region)
        stuck = b"\xee" * 64
        dev.pending_events.add(stuck)
        drawn = sealer.seals_under_current_key
        with pytest.raises(DeadlinePassed):
            backend.seal_blocks(
                pool, r.blocks([1], first_slot=1), region, stuck, deadline=Deadline.after(0.05)
            )
        assert sealer.seals_under_current_key == drawn
        r.poison(0)
        poisoned = r.read(0)
        with pytest.raises(DeadlinePassed):
            backend.open_blocks(pool, r.blocks([0]), recs, region, stuck, Deadline.after(0.05))
        assert not dev.queued and r.read(0) == poisoned
        # Cancelled from another thread (the RPC ended) while the request polls.
        cancelled = threading.Event()
        result: list[BaseException] = []

        def waiter() -> None:
            try:
                backend.open_blocks(
                    pool, r.blocks([0]), recs, region, stuck, Deadline(None, cancelled)
                )
            except BaseException as e:
                result.append(e)

        t = threading.Thread(target=waiter)
        opened = dev.events_opened
        t.start()
        while dev.events_opened == opened:  # the waiter is in its poll now
            t.join(0.001)
        cancelled.set()
        t.join(30)
        assert not t.is_alive()
        assert len(result) == 1 and isinstance(result[0], RequestCancelled)
        assert not dev.queued and r.read(0) == poisoned
        assert dev.events_opened == dev.events_destroyed
    finally:
        backend.close()


def test_deferred_device_round_trip_is_byte_exact(emu: E.Emulator) -> None:
    """The asynchronous model itself: with copies and kernels run only at sync, seal
    and restore still give AESGCM's bytes (no host buffer is reused too early)."""
    backend, dev, _sealer, r = _deferred_rig(emu)
    try:
        region = backend.make_region(1 << 20, None)
        pool = backend.map_pool(r.spec())
        blocks = r.blocks([4, 1, 9], gaps=True)
        plain = {b.page: r.read(b.page) for b in blocks}
        records = backend.seal_blocks(pool, blocks, region, deadline=Deadline.after(3600))
        for b, rec in zip(blocks, records, strict=True):
            ct = bytearray(b.size)
            region.read_into(b.extent.offset, memoryview(ct))
            assert bytes(ct) + rec.tag == _expected(
                known_key(rec.epoch), rec.nonce, b.ad, plain[b.page]
            )
            r.poison(b.page)
        assert (
            backend.open_blocks(pool, blocks, records, region, deadline=Deadline.after(3600)) == []
        )
        assert all(r.read(p) == plain[p] for p in plain) and not dev.queued
    finally:
        backend.close()


# --------------------------------------------------------------------------------------
# A backend that can no longer serve: reported once, health NOT_SERVING, exit 4
# --------------------------------------------------------------------------------------


class LosesContext(EmulatedDevice):
    """An emulated GPU whose context can be lost (as after an Xid / a reset): from then
    on every call that makes it current fails with CONTEXT_IS_DESTROYED (709)."""

    lost = False

    def make_current(self) -> None:
        if self.lost:
            raise CudaError("cuCtxSetCurrent failed: CUDA_ERROR_CONTEXT_IS_DESTROYED (709)", 709)


def test_sticky_error_reports_the_backend_broken_once(
    rig: tuple[CudaBackend, EmulatedDevice, DeviceSealer, Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    backend, dev, _sealer, r = rig
    region = backend.make_region(1 << 20, None)
    pool = backend.map_pool(r.spec())
    reports: list[str] = []
    backend.set_on_broken(reports.append)
    backend.seal_blocks(pool, r.blocks([0]), region)
    assert backend.broken is None and reports == []

    def trap(*a: object, **k: object) -> None:
        raise CudaError("cuStreamSynchronize failed: CUDA_ERROR_ILLEGAL_ADDRESS (700)", 700)

    monkeypatch.setattr(dev, "sync", trap)
    with pytest.raises(CudaError):
        backend.seal_blocks(pool, r.blocks([1], first_slot=1), region)
    monkeypatch.undo()
    assert len(reports) == 1 and "ILLEGAL_ADDRESS" in reports[0] and backend.broken
    with pytest.raises(CudaError, match="restart kvseal-server"):
        backend.seal_blocks(pool, r.blocks([2], first_slot=2), region)
    assert len(reports) == 1  # once
    late: list[str] = []
    backend.set_on_broken(late.append)  # registered after the fact: told at once
    assert late == reports


def test_lost_context_on_entry_breaks_the_backend(emu: E.Emulator) -> None:
    dev = LosesContext()
    backend = CudaBackend(DeviceSealer(), 0, dev=dev, cc="off")
    try:
        r = Rig(backend, dev)
        reports: list[str] = []
        backend.set_on_broken(reports.append)
        dev.lost = True
        with pytest.raises(CudaError, match="CONTEXT_IS_DESTROYED"):
            backend.map_pool(r.spec())
        assert len(reports) == 1 and "709" in reports[0]
    finally:
        dev.lost = False
        backend.close()


def _cuda_geometry() -> object:
    from kvseal.v1 import kvseal_pb2 as pb

    return pb.PoolGeometry(
        num_pages=4,
        tokens_per_page=1,
        num_layers=1,
        num_kv_heads=1,
        head_dim=64,
        dtype="uint8",
        layout="test",
        buffers=[pb.BufferHandle(cuda_ipc_handle=b"\x07" * 64, offset=0, size=4096)],
        segments=[pb.Segment(buffer=0, offset=0, page_stride=1024, bytes=1024)],
    )


def test_daemon_stops_serving_and_exits_4_when_the_backend_breaks(
    emu: E.Emulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The main loop's wiring, in-process: a real daemon (gRPC over a Unix socket) on
    the CUDA backend over a device that loses its context: the transfer that hits it
    fails INTERNAL, health turns NOT_SERVING, and the daemon ends with exit status 4."""
    from kvseal.client import ClientConfig, KVSealClient, KVSealRpcError
    from kvseal.server.daemon import cli
    from kvseal.server.daemon import daemon as m
    from kvseal.v1 import kvseal_pb2 as pb

    dev = LosesContext()
    monkeypatch.setattr(
        m, "make_backend", lambda cfg, sealer: CudaBackend(sealer, cfg.device, dev=dev, cc="off")
    )
    sock = tmp_path / "run" / "k.sock"
    cfg = cli.config_from_args(
        ["--listen", f"unix://{sock}", "--backend", "cuda", "--host-bytes", "1MiB", "--grace", "1"]
    )
    daemon = m.Daemon.create(cfg)
    daemon.start()
    try:
        with KVSealClient(ClientConfig(target=f"unix://{sock}", timeout_s=5)) as c:
            assert c.health() == "SERVING"
            dev.lost = True
            with pytest.raises(KVSealRpcError) as err:
                c.register_pool("p", b"m", _cuda_geometry(), pb.BACKEND_CUDA)  # type: ignore[arg-type]
            assert "INTERNAL" in str(err.value)
            assert c.health() == "NOT_SERVING"
            assert daemon.stop_event.is_set()
    finally:
        code = daemon.wait()
    assert code == m.EXIT_BACKEND == 4


DAEMON_ARGS = ("--backend", "cuda", "--host-bytes", "1MiB", "--grace", "1")
_BREAKABLE_DAEMON = """
import signal, sys
from kvseal.server import main as m
from kvseal.server.backends.cuda.backend import CudaBackend
from kvseal.server.daemon import daemon as d
from tests.test_cuda_backend_cpu import LosesContext
dev = LosesContext()
d.make_backend = lambda cfg, sealer: CudaBackend(sealer, cfg.device, dev=dev, cc="off")
signal.signal(signal.SIGUSR1, lambda *_: setattr(dev, "lost", True))
sys.exit(m.main(sys.argv[1:]))
"""


def test_daemon_process_exits_4_after_a_lost_context(emu: E.Emulator, tmp_path: Path) -> None:
    """The same as a process: kvseal-server's main() on the emulated CUDA backend;
    SIGUSR1 (this test's stand-in for an Xid) loses the context; the next request
    fails and the process exits with status 4 (systemd's Restart=on-failure and
    Kubernetes restart it)."""
    from kvseal.client import ClientConfig, KVSealClient, KVSealRpcError
    from kvseal.v1 import kvseal_pb2 as pb

    from tests.conftest import wait_serving

    root = Path(__file__).resolve().parent.parent
    sock = tmp_path / "run" / "k.sock"
    log_path = tmp_path / "daemon.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [
                str(root),
                str(root / "client"),
                str(root / "server"),
                os.environ.get("PYTHONPATH", ""),
            ]
        ),
    }
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-c", _BREAKABLE_DAEMON, "--listen", f"unix://{sock}", *DAEMON_ARGS],
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        wait_serving(f"unix://{sock}", proc, log_path)
        proc.send_signal(signal.SIGUSR1)
        with (
            KVSealClient(ClientConfig(target=f"unix://{sock}", timeout_s=5)) as c,
            pytest.raises(KVSealRpcError),
        ):
            c.register_pool("p", b"m", _cuda_geometry(), pb.BACKEND_CUDA)  # type: ignore[arg-type]
        assert proc.wait(timeout=60) == 4, log_path.read_text()
        assert "CUDA backend unusable" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------------------
# Pools must not alias: buffers resolved to their CUDA allocation before the check
# --------------------------------------------------------------------------------------


def _one_alloc_pool(handle: bytes, size: int, second_offset: int) -> PoolSpec:
    """Two buffer entries in ONE allocation (K and V tensors of one cudaMalloc block,
    as torch's caching allocator hands them out): the second at ``second_offset``."""
    half = size // 2
    buffers = (
        BufferSpec(None, handle, 0, half, 0),
        BufferSpec(None, handle, second_offset, half, 0),
    )
    segs = (SegmentSpec(0, 0, 256, 256), SegmentSpec(1, 0, 256, 256))
    g = Geometry(4, 1, 1, 1, 1, "uint8", "t", buffers, segs)
    return PoolSpec("alias", b"m", g, "cuda")


def test_map_pool_refuses_buffers_that_alias_in_one_allocation(
    rig: tuple[CudaBackend, EmulatedDevice, DeviceSealer, Rig],
) -> None:
    """Each buffer is resolved to its allocation (cuMemGetAddressRange) and absolute
    range: two entries over the same bytes are refused (a restore into one page would
    rewrite another) and nothing stays mapped; disjoint halves are fine."""
    backend, dev, _sealer, _r = rig
    mem = bytearray(4096)
    h = dev.export(mem)
    for overlap in (0, 256, 1000):  # second entry starts inside the first one's pages
        with pytest.raises(BadRequest, match="are the same memory"):
            backend.map_pool(_one_alloc_pool(h, len(mem), overlap))
        assert dev.open_ipc_mappings == 0
    pool = backend.map_pool(_one_alloc_pool(h, len(mem), 2048))  # [0, 1024) and [2048, 3072)
    assert pool.bases[1] - pool.bases[0] == 2048
    region = backend.make_region(1 << 16, None)
    blocks = [
        BlockIO(p, Extent(p * 4096, 4096), BlockAD(NS, TENANT, bytes([p]) * 32, 1), 512)
        for p in range(4)
    ]
    mem[:] = os.urandom(len(mem))
    before = bytes(mem)
    recs = backend.seal_blocks(pool, blocks, region)
    mem[:] = bytes(len(mem))
    assert backend.open_blocks(pool, blocks, recs, region) == []
    assert bytes(mem[:1024]) == before[:1024] and bytes(mem[2048:3072]) == before[2048:3072]
    pool.close()
    assert dev.open_ipc_mappings == 0


def test_check_no_alias_is_exact_about_extents() -> None:
    from kvseal.server.backends.cuda.ipc import check_no_alias

    segs = [SegmentSpec(0, 0, 100, 50), SegmentSpec(1, 0, 100, 50)]
    # Different allocations never alias, whatever the addresses.
    check_no_alias([(1, 0, 400), (2, 0, 400)], segs, 4)
    # Same allocation: buffer 1 starts where buffer 0's last page ends -> fine.
    check_no_alias([(1, 0, 350), (1, 350, 700)], segs, 4)
    # One byte earlier -> refused.
    with pytest.raises(BadRequest):
        check_no_alias([(1, 0, 350), (1, 349, 700)], segs, 4)
    # Interleaving is legal within one entry and across entries of one
    # allocation, as long as no byte is shared (the check is exact).
    inter = [SegmentSpec(0, 0, 100, 50), SegmentSpec(0, 50, 100, 50)]
    check_no_alias([(1, 0, 400)], inter, 4)
    two = [SegmentSpec(0, 0, 100, 50), SegmentSpec(1, 0, 100, 50)]
    check_no_alias([(1, 0, 400), (1, 50, 450)], two, 4)
    with pytest.raises(BadRequest):
        check_no_alias([(1, 0, 400), (1, 40, 440)], two, 4)


# --------------------------------------------------------------------------------------
# Key scopes: device batches are single-scope; a destroyed scope's device key contexts
# are wiped at once and nothing is restored under them
# --------------------------------------------------------------------------------------

TENANT_B = b"B" * 32


def _of_tenant(blocks: list[BlockIO], tenant: bytes) -> list[BlockIO]:
    return [
        BlockIO(b.page, b.extent, BlockAD(b.ad.namespace, tenant, b.ad.block_hash, 1), b.size)
        for b in blocks
    ]


def test_seal_batch_must_be_single_scope(
    rig: tuple[CudaBackend, EmulatedDevice, DeviceSealer, Rig],
) -> None:
    backend, _dev, sealer, r = rig
    region = backend.make_region(1 << 20, None)
    pool = backend.map_pool(r.spec())
    blocks = r.blocks([0, 1])
    mixed = [blocks[0], *_of_tenant(blocks[1:], TENANT_B)]
    with pytest.raises(ValueError, match="one namespace and one tenant"):
        backend.seal_blocks(pool, mixed, region)
    assert sealer.live_epochs == 0  # no nonce was drawn, no key made


def test_destroyed_scope_wipes_device_keys_at_once_and_never_restores(
    rig: tuple[CudaBackend, EmulatedDevice, DeviceSealer, Rig],
) -> None:
    backend, dev, sealer, r = rig
    region = backend.make_region(1 << 20, None)
    pool = backend.map_pool(r.spec())
    mine = r.blocks([0, 1])
    theirs = _of_tenant(r.blocks([2, 3], first_slot=2), TENANT_B)
    rec_a = backend.seal_blocks(pool, mine, region)
    rec_b = backend.seal_blocks(pool, theirs, region)
    assert backend.open_blocks(pool, mine, rec_a, region) == []  # both contexts exist
    ea, eb = rec_a[0].epoch, rec_b[0].epoch
    assert ea != eb and {ea, eb} <= set(backend._keys)
    ctx_a = backend._keys[ea]
    ctx_mem = dev._mem[ctx_a]  # the emulated device memory behind A's key context
    assert bytes(ctx_mem) != bytes(len(ctx_mem))

    assert sealer.destroy_scope(NS, TENANT) == 1
    backend.retire_keys()  # what the cache's Drop(all_of_tenant) does next
    assert ea not in backend._keys and ctx_a not in dev._mem
    assert bytes(ctx_mem) == bytes(len(ctx_mem)), "device key context freed unwiped"
    assert eb in backend._keys

    plain = {b.page: r.read(b.page) for b in mine + theirs}
    for b in mine + theirs:
        r.poison(b.page)
    poisoned = {b.page: r.read(b.page) for b in mine}
    with pytest.raises(KeyDestroyed):
        backend.open_blocks(pool, mine, rec_a, region)
    assert all(r.read(p) == poisoned[p] for p in poisoned), "a dropped tenant was restored"
    assert backend.open_blocks(pool, theirs, rec_b, region) == []
    assert all(r.read(b.page) == plain[b.page] for b in theirs)


def test_drop_after_verification_before_the_open_pass_writes_nothing(
    rig: tuple[CudaBackend, EmulatedDevice, DeviceSealer, Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race: the device key context is still there (the drop waits for the
    backend lock to retire it), the blocks verified, and only then the scope is
    destroyed. The open pass must not run."""
    backend, _dev, sealer, r = rig
    region = backend.make_region(1 << 20, None)
    pool = backend.map_pool(r.spec())
    blocks = r.blocks([0, 1, 2])
    records = backend.seal_blocks(pool, blocks, region)
    for b in blocks:
        r.poison(b.page)
    poisoned = {b.page: r.read(b.page) for b in blocks}
    real_await = backend._await_event

    def await_then_drop(engine: object, deadline: Deadline) -> None:
        real_await(engine, deadline)
        sealer.destroy_scope(NS, TENANT)

    monkeypatch.setattr(backend, "_await_event", await_then_drop)
    launches = backend.launches
    with pytest.raises(KeyDestroyed):
        backend.open_blocks(pool, blocks, records, region)
    assert backend.launches - launches == len(
        split_chunks(3, r.block_bytes, backend.max_chunks, backend.min_chunk_bytes)
    )  # verify launches only
    assert all(r.read(p) == poisoned[p] for p in poisoned)
