"""Backends move block bytes between an engine pool and the host region,
sealing on the way out and verifying on the way in.

The contract every backend keeps (the CUDA backend in ``cuda/`` too):

- ``seal_blocks`` gathers each block's pages, seals them with the shared
  :class:`~kvseal.server.sealing.BlockSealer` format, and publishes only
  ciphertext to its host extent. It returns one record per block (nonce, tag,
  epoch) for the trusted index, or raises (then the records are discarded and
  no extent is used).
- ``open_blocks`` snapshots each block's ciphertext into private memory,
  authenticates *every* block, and only if all of them authenticate scatters
  the plaintext into the destination pages. It returns the indices of blocks
  that failed; if any failed, not one byte was written to the engine's pool.

Page ids and extents are validated by the caller before these are called.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

from kvseal.server.errors import HandleUnusable
from kvseal.server.hostregion import Extent, HostRegion
from kvseal.server.pools import MappedPool, PoolSpec
from kvseal.server.sealing import (
    TAG_BYTES,
    AuthenticationFailed,
    BlockAD,
    BlockSealer,
    SealRecord,
)

T = TypeVar("T")
SHM_DIR = "/dev/shm"


@dataclass(frozen=True, slots=True)
class BlockIO:
    """One block of a batch: where it lives in the pool and in the region."""

    page: int
    extent: Extent
    ad: BlockAD
    size: int


class Backend(Protocol):
    kind: str  # "cpu" | "cuda"
    detail: str

    def map_pool(self, spec: PoolSpec) -> MappedPool: ...

    def seal_blocks(
        self, pool: MappedPool, blocks: Sequence[BlockIO], region: HostRegion
    ) -> list[SealRecord]: ...

    def open_blocks(
        self,
        pool: MappedPool,
        blocks: Sequence[BlockIO],
        records: Sequence[SealRecord],
        region: HostRegion,
    ) -> list[int]: ...

    def close(self) -> None: ...


class CpuMappedPool:
    """A pool whose buffers live in POSIX shared memory (``/dev/shm``).

    The daemon maps each shared-memory object once, read-write, and checks
    that every buffer fits inside it. Gather/scatter copy whole segments with
    one ``memcpy`` each (memoryview slice assignment).
    """

    def __init__(self, spec: PoolSpec) -> None:
        self.spec = spec
        self._maps: dict[str, mmap.mmap] = {}
        self._views: list[memoryview] = []
        try:
            for i, b in enumerate(spec.geometry.buffers):
                assert b.shm_name is not None  # validated: CPU buffers name shm objects
                m = self._maps.get(b.shm_name)
                if m is None:
                    m = self._map(b.shm_name)
                    self._maps[b.shm_name] = m
                if b.offset + b.size > len(m):
                    raise HandleUnusable(
                        f"geometry.buffers[{i}] spans bytes [{b.offset}, {b.offset + b.size}) "
                        f"but shared memory {b.shm_name!r} has {len(m)} bytes"
                    )
                self._views.append(memoryview(m)[b.offset : b.offset + b.size])
        except BaseException:
            self.close()
            raise
        g = spec.geometry
        self._segments = [(self._views[s.buffer], s.offset, s.page_stride, s.bytes) for s in g.segments]

    @staticmethod
    def _map(name: str) -> mmap.mmap:
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise HandleUnusable(f"cannot open shared memory {name!r}: {e.strerror}") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
                raise HandleUnusable(f"shared memory {name!r} is empty or not a memory object")
            return mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    def gather(self, page: int, out: memoryview) -> None:
        pos = 0
        for view, off, stride, n in self._segments:
            start = off + page * stride
            out[pos : pos + n] = view[start : start + n]
            pos += n

    def scatter(self, page: int, data: memoryview) -> None:
        pos = 0
        for view, off, stride, n in self._segments:
            start = off + page * stride
            view[start : start + n] = data[pos : pos + n]
            pos += n

    def close(self) -> None:
        for v in self._views:
            v.release()
        self._views.clear()
        self._segments = []
        for m in self._maps.values():
            m.close()
        self._maps.clear()


class _Scratch(threading.local):
    """Per-thread private buffers, grown on demand and reused."""

    def __init__(self) -> None:
        self.plain = bytearray()
        self.sealed = bytearray()

    def get(self, n: int) -> tuple[memoryview, memoryview]:
        if len(self.plain) < n:
            self.plain = bytearray(n)
            self.sealed = bytearray(n + TAG_BYTES)
        return memoryview(self.plain)[:n], memoryview(self.sealed)[: n + TAG_BYTES]


class CpuBackend:
    """AES-256-GCM with ``cryptography`` on a few threads (it releases the GIL).

    Offload per block: gather pages into private plaintext scratch, seal into
    private ciphertext scratch, publish the ciphertext with one write.
    Restore per request: snapshot each ciphertext into private memory, open it
    into a private per-request staging buffer (this both verifies and
    decrypts), and scatter into the pool only when every block verified.
    """

    kind = "cpu"

    def __init__(self, sealer: BlockSealer, workers: int) -> None:
        self._sealer = sealer
        self._workers = max(1, workers)
        self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="kvseal-seal")
        self._scratch = _Scratch()
        self.detail = f"cpu: AES-256-GCM (cryptography), {self._workers} sealing threads"

    def map_pool(self, spec: PoolSpec) -> CpuMappedPool:
        return CpuMappedPool(spec)

    def _parallel(self, n: int, fn: Callable[[int, int], list[T]]) -> list[T]:
        """Run ``fn(start, stop)`` over contiguous chunks of ``range(n)``."""
        chunks = min(self._workers, n)
        if chunks <= 1:
            return fn(0, n)
        bounds = [n * i // chunks for i in range(chunks + 1)]
        futures = [self._pool.submit(fn, a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
        out: list[T] = []
        for f in futures:  # wait for all before raising, so no thread outlives the call
            f.exception()
        for f in futures:
            out.extend(f.result())
        return out

    def seal_blocks(
        self, pool: MappedPool, blocks: Sequence[BlockIO], region: HostRegion
    ) -> list[SealRecord]:
        assert isinstance(pool, CpuMappedPool)

        def work(a: int, b: int) -> list[SealRecord]:
            records = []
            for blk in blocks[a:b]:
                plain, sealed = self._scratch.get(blk.size)
                pool.gather(blk.page, plain)
                rec = self._sealer.seal_into(plain, blk.ad, sealed)
                region.write(blk.extent.offset, sealed[: blk.size])
                records.append(rec)
            return records

        return self._parallel(len(blocks), work)

    def open_blocks(
        self,
        pool: MappedPool,
        blocks: Sequence[BlockIO],
        records: Sequence[SealRecord],
        region: HostRegion,
    ) -> list[int]:
        assert isinstance(pool, CpuMappedPool)
        offsets = [0]
        for blk in blocks:
            offsets.append(offsets[-1] + blk.size)
        staging = memoryview(bytearray(offsets[-1]))  # private plaintext until all verified

        def work(a: int, b: int) -> list[int]:
            failed = []
            for i in range(a, b):
                blk, rec = blocks[i], records[i]
                _, sealed = self._scratch.get(blk.size)
                got = region.read_into(blk.extent.offset, sealed[: blk.size])
                sealed[blk.size :] = rec.tag
                out = staging[offsets[i] : offsets[i + 1]]
                try:
                    if got != blk.size:  # host shrank the region: same as tampering
                        raise AuthenticationFailed("short read")
                    self._sealer.open_into(rec, blk.ad, sealed, out)
                except AuthenticationFailed:
                    failed.append(i)
            return failed

        failed = self._parallel(len(blocks), work)
        if not failed:
            for i, blk in enumerate(blocks):
                pool.scatter(blk.page, staging[offsets[i] : offsets[i + 1]])
        return failed

    def close(self) -> None:
        self._pool.shutdown(wait=True)
