"""The copies a sealed transfer cannot avoid, timed without the AES: what
bounds ``sealed / raw`` on this machine whatever the cipher costs.

The security model fixes the memory passes (see ``docs/architecture.md``):

- offload: the engine's pages into private memory (the gather), then the
  ciphertext out to the host region (the publish). The AES runs in between
  on the private copy; chunked through a cache-sized bounce buffer, neither
  copy adds DRAM traffic over a raw ``encrypt_into``, but both cost core time.
- restore: the host's ciphertext into private staging (the snapshot, each
  byte once), then, only once every block of the request verified, the
  staging out to the engine's pages (the scatter). The staging holds the
  whole request, so on a request larger than the cache this is two more
  DRAM passes than a raw ``decrypt_into`` makes.

Each is timed twice, on the batch's pages, with the backend's thread count:
with the copies the CPU backend makes (``preadv``/``pwritev`` on the
engine's shared memory, which it never maps, plus ``memmove`` to and from the
region), and with the fastest copy there is (``memmove`` on a mapping of the
pool, which the daemon could only use on memory the engine cannot shrink
under it). ``raw / copies`` is then an upper bound on ``sealed / raw`` for
that design: the AES comes on top.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvseal.client.shm import SharedKVPool
from kvseal.server.backends.cpu.backend import CHUNK_BYTES
from kvseal.server.backends.cpu.shmpool import CpuMappedPool
from kvseal.server.backends.cpu.staging import PrivateBuffer
from kvseal.server.hostregion import HostRegion, align_up

FLOOR_KINDS = (
    "floor_offload_kernel",
    "floor_offload_mapped",
    "floor_restore_kernel",
    "floor_restore_mapped",
    "floor_restore_per_block",
)


class Floor:
    """The four copy-only passes over pages ``0..n-1`` (see the module doc).

    Owns its bounce buffers and staging; the pool, the daemon-side view of it
    and the region belong to the caller and must outlive it.
    """

    def __init__(
        self, pool: SharedKVPool, mapped: CpuMappedPool, region: HostRegion, workers: int
    ) -> None:
        if not region.mapped:
            raise ValueError("the floor needs the memfd region")
        self._pool, self._mapped, self._region = pool, mapped, region
        self._workers = max(1, workers)
        self._threads = ThreadPoolExecutor(self._workers, thread_name_prefix="floor")
        self._size = mapped.block_bytes
        self._slot = align_up(self._size)
        g = pool.geometry()
        # Exports of the pool's maps: their addresses stay valid until close().
        self._anchors: list[ctypes.c_char] | None = [
            ctypes.c_char.from_buffer(b.map) for b in pool.buffers
        ]
        bases = [ctypes.addressof(a) for a in self._anchors]
        # Per segment: (address of page 0, page stride, bytes), in block order.
        self._segments = [
            (bases[s.buffer] + g.buffers[s.buffer].offset + s.offset, s.page_stride, s.bytes)
            for s in g.segments
        ]
        self._bounces = [PrivateBuffer(CHUNK_BYTES) for _ in range(self._workers)]
        self._blocks = [PrivateBuffer(self._size) for _ in range(self._workers)]
        self._staging: PrivateBuffer | None = None
        self.n = 0

    def use(self, n: int) -> None:
        self.n = n
        if self._staging is None or self._staging.size < n * self._size:
            if self._staging is not None:
                self._staging.close()
            self._staging = PrivateBuffer(n * self._size)
            ctypes.memset(self._staging.address, 1, self._staging.size)  # fault it in once

    def _parallel(self, fn: Callable[[int, int, int], None]) -> None:
        chunks = max(1, min(self._workers, self.n))
        bounds = [self.n * i // chunks for i in range(chunks + 1)]
        futures = [
            self._threads.submit(fn, k, a, b) for k, (a, b) in enumerate(itertools.pairwise(bounds))
        ]
        for f in futures:
            f.result()

    def offload_kernel(self) -> None:
        def work(k: int, a: int, b: int) -> None:
            bounce = self._bounces[k]
            chunks = self._mapped.bound(CHUNK_BYTES, bounce.view)
            for page in range(a, b):
                for chunk in chunks:
                    self._mapped.read_chunk(page, chunk)
                    self._region.write_at(page * self._slot + chunk[0], bounce.address, chunk[1])

        self._parallel(work)

    def offload_mapped(self) -> None:
        memmove, segs, chunk = ctypes.memmove, self._segments, CHUNK_BYTES

        def work(k: int, a: int, b: int) -> None:
            bounce = self._bounces[k].address
            for page in range(a, b):
                filled, start = 0, 0
                for addr, stride, n in segs:
                    # Segments are never split: a chunk is whole segments (32 KiB each here).
                    memmove(bounce + filled, addr + page * stride, n)
                    filled += n
                    if filled + n > chunk:
                        self._region.write_at(page * self._slot + start, bounce, filled)
                        start, filled = start + filled, 0
                if filled:
                    self._region.write_at(page * self._slot + start, bounce, filled)

        self._parallel(work)

    def _snapshot(self) -> None:
        staging, size, chunk = self._staging, self._size, CHUNK_BYTES
        assert staging is not None

        def work(k: int, a: int, b: int) -> None:
            for page in range(a, b):
                for c0 in range(0, size, chunk):
                    n = min(chunk, size - c0)
                    self._region.read_at(
                        page * self._slot + c0, staging.address + page * size + c0, n
                    )

        self._parallel(work)

    def restore_kernel(self) -> None:
        self._snapshot()
        staging, size = self._staging, self._size
        assert staging is not None

        def work(k: int, a: int, b: int) -> None:
            pages = list(range(a, b))
            rotate = a * self._mapped.segment_runs // max(1, self.n)
            self._mapped.write_pages(
                pages, staging.view, [p * size for p in pages], lambda: None, rotate
            )

        self._parallel(work)

    def restore_mapped(self) -> None:
        self._snapshot()
        staging, size, memmove, segs = self._staging, self._size, ctypes.memmove, self._segments
        assert staging is not None

        def work(k: int, a: int, b: int) -> None:
            for page in range(a, b):
                at = staging.address + page * size
                for addr, stride, n in segs:
                    memmove(addr + page * stride, at, n)
                    at += n

        self._parallel(work)

    def restore_per_block(self) -> None:
        """Not the contract (which verifies the whole request before the first
        write): each block snapshotted into a per-thread staging of one block
        and written out from there at once, so the staging stays in cache.
        What restore could reach if a request could commit block by block."""
        size, memmove, segs, chunk = self._size, ctypes.memmove, self._segments, CHUNK_BYTES

        def work(k: int, a: int, b: int) -> None:
            block = self._blocks[k].address
            for page in range(a, b):
                for c0 in range(0, size, chunk):
                    n = min(chunk, size - c0)
                    self._region.read_at(page * self._slot + c0, block + c0, n)
                at = block
                for addr, stride, n in segs:
                    memmove(addr + page * stride, at, n)
                    at += n

        self._parallel(work)

    def run(self, kind: str) -> None:
        {
            "floor_offload_kernel": self.offload_kernel,
            "floor_offload_mapped": self.offload_mapped,
            "floor_restore_kernel": self.restore_kernel,
            "floor_restore_mapped": self.restore_mapped,
            "floor_restore_per_block": self.restore_per_block,
        }[kind]()

    def close(self) -> None:
        self._threads.shutdown(wait=True)
        self._anchors = None  # the pool's maps can be closed again
        for b in self._bounces + self._blocks:
            b.close()
        if self._staging is not None:
            self._staging.close()
