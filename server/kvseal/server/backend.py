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

Both take a :class:`~kvseal.server.deadline.Deadline` and call its ``check``
before every block they read from or write to the pool (each touch is one
block, so bounded); when it raises they stop, wait for every thread or stream
they started, and raise it: a request that failed touches no page afterwards
(the engine contract, ``kvseal.server.deadline``).

Page ids and extents are validated by the caller before these are called.
"""

from __future__ import annotations

import itertools
import mmap
import os
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol, TypeVar

from kvseal.server import telemetry
from kvseal.server.deadline import NO_DEADLINE, Deadline
from kvseal.server.errors import BadRequest, HandleUnusable, ShuttingDown
from kvseal.server.hostregion import Extent, HostRegion
from kvseal.server.memcopy import Pinned, memmove
from kvseal.server.pools import MappedPool, PoolSpec
from kvseal.server.sealing import (
    TAG_BYTES,
    AuthenticationFailed,
    BlockAD,
    BlockSealer,
    SealRecord,
)

T = TypeVar("T")
SHM_DIR = "/dev/shm"  # noqa: S108 - POSIX shm objects live here on Linux


@dataclass(frozen=True, slots=True)
class BlockIO:
    """One block of a batch: where it lives in the pool and in the region."""

    page: int
    extent: Extent
    ad: BlockAD
    size: int


class Region(Protocol):
    """The host region as the cache and the stats see it. ``HostRegion`` is
    the CPU backend's; the CUDA backend brings pinned host memory of its own
    with the same surface (and the same rule: only ciphertext goes in)."""

    capacity: int
    description: str

    def write(self, offset: int, data: memoryview) -> None: ...

    def read_into(self, offset: int, out: memoryview) -> int: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """See the module docstring for the contract of each method.

    ``wait_event`` is the engine's CUDA IPC event handle (CUDA backend only):
    the backend must wait on it before touching the pool's pages.
    """

    kind: str  # "cpu" | "cuda"
    detail: str
    # Set when the daemon stops serving (shutdown, integrity abort): a request
    # in flight must not write to an engine pool after it is set.
    stopping: threading.Event

    def make_region(self, capacity: int, path: str | None) -> Region: ...

    def map_pool(self, spec: PoolSpec) -> MappedPool: ...

    def seal_blocks(
        self,
        pool: MappedPool,
        blocks: Sequence[BlockIO],
        region: Region,
        wait_event: bytes | None = None,
        deadline: Deadline = NO_DEADLINE,
    ) -> list[SealRecord]: ...

    def open_blocks(
        self,
        pool: MappedPool,
        blocks: Sequence[BlockIO],
        records: Sequence[SealRecord],
        region: Region,
        wait_event: bytes | None = None,
        deadline: Deadline = NO_DEADLINE,
    ) -> list[int]: ...

    def close(self) -> None: ...


class CpuMappedPool:
    """A pool whose buffers live in POSIX shared memory (``/dev/shm``).

    The daemon maps each shared-memory object once, read-write, and checks
    that every buffer fits inside it (the segments were checked against the
    buffers at registration), so gather/scatter can copy by address with
    ``memmove``, which releases the GIL.

    Whose memory: the daemon opens objects with its own privileges, so it
    accepts only objects owned by an allowed peer uid (else engine A could
    name engine B's pool: a confused deputy), and never its own ciphertext
    region. A mapped object that shrinks would turn the next copy into
    SIGBUS: ``check`` re-reads the sizes before every batch (an engine that
    truncates its own pool *during* a copy can still crash the daemon; that
    needs fd passing of sealed memfds, not done yet).
    """

    def __init__(
        self,
        spec: PoolSpec,
        allowed_uids: frozenset[int] = frozenset(),
        forbidden: frozenset[tuple[int, int]] = frozenset(),
    ) -> None:
        self.spec = spec
        self._allowed = allowed_uids
        self._forbidden = forbidden
        self._maps: dict[str, mmap.mmap] = {}
        self._fds: dict[str, int] = {}
        self._pins: dict[str, Pinned] = {}
        self._segments: list[tuple[int, int, int]] = []  # (address of page 0, stride, bytes)
        try:
            bases = []
            for i, b in enumerate(spec.geometry.buffers):
                if b.shm_name is None:  # pragma: no cover - validated at registration
                    raise HandleUnusable(f"geometry.buffers[{i}] has no shm_name")
                m = self._maps.get(b.shm_name)
                if m is None:
                    m = self._map(b.shm_name)
                    self._maps[b.shm_name] = m
                    self._pins[b.shm_name] = Pinned(m)
                if b.offset + b.size > len(m):
                    raise HandleUnusable(
                        f"geometry.buffers[{i}] spans bytes [{b.offset}, {b.offset + b.size}) "
                        f"but shared memory {b.shm_name!r} has {len(m)} bytes"
                    )
                bases.append(self._pins[b.shm_name].address + b.offset)
        except BaseException:
            self.close()
            raise
        self._segments = [
            (bases[s.buffer] + s.offset, s.page_stride, s.bytes) for s in spec.geometry.segments
        ]

    def _map(self, name: str) -> mmap.mmap:
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise HandleUnusable(f"cannot open shared memory {name!r}: {e.strerror}") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
                raise HandleUnusable(f"shared memory {name!r} is empty or not a memory object")
            if self._allowed and st.st_uid not in self._allowed:
                raise HandleUnusable(
                    f"shared memory {name!r} is owned by uid {st.st_uid}, which is not an "
                    "allowed peer (--allow-uid): the engine must own its pool"
                )
            if (st.st_dev, st.st_ino) in self._forbidden:
                raise HandleUnusable(f"{name!r} is kvseal's own ciphertext region")
            m = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fds[name] = fd
        return m

    def check(self) -> None:
        """Raise HandleUnusable if a mapped object shrank since it was mapped."""
        for name, fd in self._fds.items():
            size = os.fstat(fd).st_size
            if size < len(self._maps[name]):
                raise HandleUnusable(
                    f"shared memory {name!r} shrank to {size} bytes while registered: "
                    "register the pool again"
                )

    def gather(self, page: int, dst: int) -> None:
        """Copy page ``page`` (checked by the caller) to private memory at ``dst``."""
        pos = 0
        for base, stride, n in self._segments:
            memmove(dst + pos, base + page * stride, n)
            pos += n

    def scatter(self, page: int, src: int) -> None:
        """Copy one block of plaintext at ``src`` into page ``page``."""
        pos = 0
        for base, stride, n in self._segments:
            memmove(base + page * stride, src + pos, n)
            pos += n

    def close(self) -> None:
        self._segments = []
        for pin in self._pins.values():
            pin.release()
        self._pins.clear()
        for m in self._maps.values():
            m.close()
        self._maps.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class _Scratch(threading.local):
    """One private buffer per sealing thread (block + tag), grown on demand.

    Sealing runs in place in it (``cryptography``/OpenSSL support exact
    in-place AES-GCM; a test pins that down): one buffer instead of two
    keeps the working set in cache.
    """

    def __init__(self) -> None:
        self.buf = bytearray()
        self.pin: Pinned | None = None

    def get(self, n: int) -> tuple[memoryview, int]:
        """(view of n + 16 bytes, its address)."""
        if len(self.buf) < n + TAG_BYTES:
            if self.pin is not None:
                self.pin.release()
            self.buf = bytearray(n + TAG_BYTES)
            self.pin = Pinned(self.buf)
        assert self.pin is not None
        return memoryview(self.buf)[: n + TAG_BYTES], self.pin.address


class _StagingPool:
    """Reusable private restore buffers: a fresh 64 MiB ``bytearray`` costs
    a zero-fill and page faults (slower than the AES itself). Keeps at most
    ``limit`` bytes idle; larger or surplus buffers are simply dropped."""

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self._free: list[bytearray] = []
        self._limit = limit

    def take(self, n: int) -> bytearray:
        with self._lock:
            for i, b in enumerate(self._free):
                if len(b) >= n:
                    return self._free.pop(i)
        return bytearray(n)

    def give(self, buf: bytearray) -> None:
        with self._lock:
            if sum(len(b) for b in self._free) + len(buf) <= self._limit:
                self._free.append(buf)
                self._free.sort(key=len)


class CpuBackend:
    """AES-256-GCM with ``cryptography`` on a few threads (it releases the GIL).

    Offload per block: gather pages into private plaintext scratch, seal into
    private ciphertext scratch, publish the ciphertext with one write.
    Every step releases the GIL, so the threads run in parallel.
    Restore per request: snapshot each ciphertext into a private per-request
    staging buffer, open it there in place (this both verifies and decrypts),
    and scatter into the pool only when every block verified.
    """

    kind = "cpu"

    def __init__(
        self, sealer: BlockSealer, workers: int, allowed_uids: frozenset[int] = frozenset()
    ) -> None:
        self._sealer = sealer
        self._allowed = allowed_uids
        self._region_ids: frozenset[tuple[int, int]] = frozenset()
        self.stopping = threading.Event()
        self._workers = max(1, workers)
        self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="kvseal-seal")
        self._scratch = _Scratch()
        self._staging = _StagingPool(limit=1 << 30)
        self.detail = f"cpu: AES-256-GCM (cryptography), {self._workers} sealing threads"

    def make_region(self, capacity: int, path: str | None) -> HostRegion:
        region = HostRegion(capacity, path)
        if path is not None:
            st = os.stat(path)
            self._region_ids = frozenset({(st.st_dev, st.st_ino)})
        return region

    def map_pool(self, spec: PoolSpec) -> CpuMappedPool:
        return CpuMappedPool(spec, self._allowed, self._region_ids)

    @staticmethod
    def _no_event(wait_event: bytes | None) -> None:
        if wait_event:
            raise BadRequest("cuda_event_ipc_handle is only meaningful on the CUDA backend")

    def _parallel(self, n: int, fn: Callable[[int, int], list[T]]) -> list[list[T] | BaseException]:
        """Run ``fn(start, stop)`` over contiguous chunks of ``range(n)``;
        returns each chunk's result or exception, after all have finished
        (no thread outlives the call)."""
        chunks = max(1, min(self._workers, n))
        bounds = [n * i // chunks for i in range(chunks + 1)]
        if chunks == 1:
            try:
                return [fn(0, n)]
            except BaseException as e:
                return [e]
        futures = [self._pool.submit(fn, a, b) for a, b in itertools.pairwise(bounds)]
        out: list[list[T] | BaseException] = []
        for f in futures:
            exc = f.exception()
            out.append(exc if exc is not None else f.result())
        return out

    def seal_blocks(
        self,
        pool: MappedPool,
        blocks: Sequence[BlockIO],
        region: Region,
        wait_event: bytes | None = None,
        deadline: Deadline = NO_DEADLINE,
    ) -> list[SealRecord]:
        assert isinstance(pool, CpuMappedPool)
        self._no_event(wait_event)
        pool.check()

        def work(a: int, b: int) -> list[SealRecord]:
            records: list[SealRecord] = []
            try:
                for blk in blocks[a:b]:
                    # Before every page read: past the cutoff the engine may
                    # already own this page again (see kvseal.server.deadline).
                    deadline.check(f"page {blk.page}")
                    sealed, addr = self._scratch.get(blk.size)
                    pool.gather(blk.page, addr)
                    rec = self._sealer.seal_into(sealed[: blk.size], blk.ad, sealed)
                    records.append(rec)
                    region.write(blk.extent.offset, sealed[: blk.size])
            except BaseException:
                # Their blocks will not be kept: release their epochs' references
                # (the nonces stay burnt) so retired keys can still be destroyed.
                for r in records:
                    self._sealer.forget(r.epoch)
                raise
            return records

        results = self._parallel(len(blocks), work)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for r in results:
                if not isinstance(r, BaseException):
                    for rec in r:
                        self._sealer.forget(rec.epoch)
            raise errors[0]
        return [rec for r in results if not isinstance(r, BaseException) for rec in r]

    def open_blocks(
        self,
        pool: MappedPool,
        blocks: Sequence[BlockIO],
        records: Sequence[SealRecord],
        region: Region,
        wait_event: bytes | None = None,
        deadline: Deadline = NO_DEADLINE,
    ) -> list[int]:
        assert isinstance(pool, CpuMappedPool)
        self._no_event(wait_event)
        pool.check()
        offsets = [0]
        for blk in blocks:
            offsets.append(offsets[-1] + blk.size + TAG_BYTES)
        # Private staging for the whole request: ciphertext is snapshotted
        # here, then opened in place; plaintext stays here until every block
        # has verified, so a failure anywhere writes nothing to the pool.
        staging_buf = self._staging.take(offsets[-1])
        staging = memoryview(staging_buf)

        def work(a: int, b: int) -> list[int]:
            failed = []
            for i in range(a, b):
                deadline.check("verification")  # no page is touched here: stop early
                blk, rec = blocks[i], records[i]
                sealed = staging[offsets[i] : offsets[i + 1]]
                got = region.read_into(blk.extent.offset, sealed[: blk.size])
                sealed[blk.size :] = rec.tag
                try:
                    if got != blk.size:  # host shrank the region: same as tampering
                        raise AuthenticationFailed("short read")
                    self._sealer.open_into(rec, blk.ad, sealed, sealed[: blk.size])
                except AuthenticationFailed:
                    failed.append(i)
            return failed

        try:
            with telemetry.stage("copy_verify"):
                results = self._parallel(len(blocks), work)
            for r in results:
                if isinstance(r, BaseException):
                    raise r
            failed = [i for r in results if not isinstance(r, BaseException) for i in r]
            if not failed:
                if self.stopping.is_set():  # e.g. another request saw an integrity failure
                    raise ShuttingDown("kvseal stopped serving; nothing was restored")
                # The scatter is the restore's commit: it starts only before the
                # cutoff, then runs to ``commit_by`` (see kvseal.server.deadline).
                deadline.check("the first destination page")
                pool.check()
                with telemetry.stage("scatter"):
                    pin = Pinned(staging_buf)
                    base = pin.address

                    def scatter(a: int, b: int) -> list[None]:
                        for i in range(a, b):
                            deadline.check_commit("writing the verified blocks")
                            pool.scatter(blocks[i].page, base + offsets[i])
                        return []

                    try:
                        # memmove drops the GIL: both threads' copies overlap.
                        for outcome in self._parallel(len(blocks), scatter):
                            if isinstance(outcome, BaseException):
                                raise outcome
                    finally:
                        pin.release()
        finally:
            staging.release()
            self._staging.give(staging_buf)
        return failed

    def close(self) -> None:
        self._pool.shutdown(wait=True)
