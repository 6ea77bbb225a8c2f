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
import os
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvseal.server import telemetry
from kvseal.server.backends.base import BlockIO, Region, note_written
from kvseal.server.deadline import NO_DEADLINE, Deadline
from kvseal.server.errors import BadRequest, HandleUnusable, ShuttingDown
from kvseal.server.hostregion import HostRegion
from kvseal.server.pools import BufferMemory, MappedPool, PoolSpec, check_disjoint
from kvseal.server.sealing import (
    TAG_BYTES,
    AuthenticationFailed,
    BlockSealer,
    SealRecord,
)

T = TypeVar("T")
SHM_DIR = "/dev/shm"  # noqa: S108 - POSIX shm objects live here on Linux


class CpuMappedPool:
    """A pool whose buffers live in POSIX shared memory (``/dev/shm``).

    The daemon opens each shared-memory object once, read-write, and never
    maps it: ``gather`` and ``scatter`` are ``os.preadv``/``os.pwritev`` on
    the object's fd (they release the GIL). So the engine's memory can never
    raise a signal in the daemon: an object the engine shrinks, even while a
    copy runs, makes the read come back short, which fails that request with
    HandleUnusable (nothing sealed from it is published), and a write past
    its end extends the engine's own object. Other pools are not affected.

    Whose memory: the daemon opens objects with its own privileges, so it
    accepts only objects owned by an allowed peer uid (else engine A could
    name engine B's pool: a confused deputy), and never its own ciphertext
    region. Names are resolved to the object behind them (``st_dev``,
    ``st_ino``), and :func:`~kvseal.server.pools.check_disjoint` refuses a
    geometry in which two (segment, page) pairs share a byte of one object,
    whatever names the buffers use (the same name twice, hard links,
    overlapping ranges): a restore into one page never writes another.
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
        self._fds: dict[str, int] = {}
        self._sizes: dict[str, int] = {}  # each object's size when it was opened
        # Per page, the reads/writes of one block: (fd, file offset of page 0,
        # stride, offset in the block, bytes, object name); consecutive
        # segments that are adjacent in one object are merged into one run.
        self._runs: list[tuple[int, int, int, int, int, str]] = []
        g = spec.geometry
        try:
            memory = []
            for i, b in enumerate(g.buffers):
                if b.shm_name is None:  # pragma: no cover - validated at registration
                    raise HandleUnusable(f"geometry.buffers[{i}] has no shm_name")
                if b.shm_name not in self._fds:
                    self._open(b.shm_name)
                st = os.fstat(self._fds[b.shm_name])
                size = self._sizes[b.shm_name]
                if b.offset + b.size > size:
                    raise HandleUnusable(
                        f"geometry.buffers[{i}] spans bytes [{b.offset}, {b.offset + b.size}) "
                        f"but shared memory {b.shm_name!r} has {size} bytes"
                    )
                memory.append(BufferMemory((st.st_dev, st.st_ino), b.offset, b.size))
            check_disjoint(memory, g.segments, g.num_pages)
        except BaseException:
            self.close()
            raise
        pos = 0
        for s in g.segments:
            b = g.buffers[s.buffer]
            assert b.shm_name is not None
            fd = self._fds[b.shm_name]
            stride = s.page_stride if g.num_pages > 1 else 0
            at = b.offset + s.offset
            if self._runs:
                pfd, pat, pstride, ppos, pn, name = self._runs[-1]
                if pfd == fd and pstride == stride and pat + pn == at:
                    self._runs[-1] = (pfd, pat, pstride, ppos, pn + s.bytes, name)
                    pos += s.bytes
                    continue
            self._runs.append((fd, at, stride, pos, s.bytes, b.shm_name))
            pos += s.bytes

    def _open(self, name: str) -> None:
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
        except BaseException:
            os.close(fd)
            raise
        self._fds[name] = fd
        self._sizes[name] = st.st_size

    def check(self) -> None:
        """Raise HandleUnusable if an object shrank since it was opened (an
        early, clear refusal; a shrink during the batch is caught by the
        short read itself)."""
        for name, fd in self._fds.items():
            size = os.fstat(fd).st_size
            if size < self._sizes[name]:
                raise HandleUnusable(
                    f"shared memory {name!r} shrank to {size} bytes while registered: "
                    "register the pool again"
                )

    def gather(self, page: int, dst: memoryview) -> None:
        """Read page ``page`` (checked by the caller) into the first block's
        bytes of ``dst`` (private to the caller). Raises HandleUnusable if the
        engine's object ends early or cannot be read; ``dst`` is then partly
        filled and must not be used."""
        run = None
        try:
            for run in self._runs:
                fd, at, stride, pos, n, _ = run
                if os.preadv(fd, (dst[pos : pos + n],), at + page * stride) != n:
                    _read_rest(fd, dst[pos : pos + n], at + page * stride)
        except (OSError, _ShortRead) as e:
            assert run is not None
            raise HandleUnusable(
                f"reading page {page} of shared memory {run[5]!r} failed ({_why(e)}): "
                "the engine shrank or broke its pool; register it again"
            ) from e

    def scatter(self, page: int, src: memoryview) -> None:
        """Write one block of plaintext (the first block's bytes of ``src``)
        into page ``page``. Raises
        HandleUnusable if a write fails (e.g. no space to re-extend an object
        the engine shrank); the page is then partly written."""
        run = None
        try:
            for run in self._runs:
                fd, at, stride, pos, n, _ = run
                if os.pwritev(fd, (src[pos : pos + n],), at + page * stride) != n:
                    _write_rest(fd, src[pos : pos + n], at + page * stride)
        except (OSError, _ShortRead) as e:
            assert run is not None
            raise HandleUnusable(
                f"writing page {page} of shared memory {run[5]!r} failed ({_why(e)}): "
                "register the pool again"
            ) from e

    def close(self) -> None:
        self._runs = []
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class _ShortRead(Exception):
    """The object ended before the bytes a page needs."""


def _why(e: BaseException) -> str:
    return e.strerror or str(e) if isinstance(e, OSError) else str(e)


def _read_rest(fd: int, view: memoryview, at: int) -> None:
    """Finish a read that came back short: a regular file reads short only at
    its end, so this normally finds the end and raises _ShortRead."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, (view[done:],), at + done)
        if got == 0:
            raise _ShortRead(f"object ends before byte {at + len(view)}")
        done += got


def _write_rest(fd: int, view: memoryview, at: int) -> None:
    done = 0
    while done < len(view):
        put = os.pwritev(fd, (view[done:],), at + done)
        if put == 0:
            raise _ShortRead("write made no progress")
        done += put


class _Scratch(threading.local):
    """One private buffer per sealing thread (block + tag), grown on demand.

    Sealing runs in place in it (``cryptography``/OpenSSL support exact
    in-place AES-GCM; a test pins that down): one buffer instead of two
    keeps the working set in cache.
    """

    def __init__(self) -> None:
        self.buf = bytearray()

    def get(self, n: int) -> memoryview:
        """A view of n + 16 bytes (the block, then room for its tag)."""
        if len(self.buf) < n + TAG_BYTES:
            self.buf = bytearray(n + TAG_BYTES)
        return memoryview(self.buf)[: n + TAG_BYTES]


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
        try:
            self._no_event(wait_event)
            pool.check()
        except BaseException as e:
            note_written(e, set())  # nothing reached the region
            raise

        started: list[set[int]] = []  # per chunk: blocks whose region write began

        def work(a: int, b: int) -> list[SealRecord]:
            records: list[SealRecord] = []
            writes: set[int] = set()
            started.append(writes)
            try:
                for i, blk in enumerate(blocks[a:b], start=a):
                    # Before every page read: past the cutoff the engine may
                    # already own this page again (see kvseal.server.deadline).
                    deadline.check(f"page {blk.page}")
                    sealed = self._scratch.get(blk.size)
                    pool.gather(blk.page, sealed)
                    rec = self._sealer.seal_into(sealed[: blk.size], blk.ad, sealed)
                    records.append(rec)
                    writes.add(i)
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
            note_written(errors[0], set().union(*started))
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
                # Last, right before the first page write: a drop that destroyed these
                # keys since they opened makes the restore serve nothing (KeyDestroyed);
                # once the scatter starts, the restore counts as done before the drop.
                self._sealer.require_live({r.epoch for r in records})
                with telemetry.stage("scatter"):

                    def scatter(a: int, b: int) -> list[None]:
                        for i in range(a, b):
                            deadline.check_commit("writing the verified blocks")
                            pool.scatter(blocks[i].page, staging[offsets[i] : offsets[i + 1]])
                        return []

                    # pwritev drops the GIL: both threads' copies overlap.
                    for outcome in self._parallel(len(blocks), scatter):
                        if isinstance(outcome, BaseException):
                            raise outcome
        finally:
            staging.release()
            self._staging.give(staging_buf)
        return failed

    def retire_keys(self) -> None:
        """Nothing to do: the CPU backend keeps no key copies of its own (the
        sealer's ``AESGCM`` objects are the only ones, dropped with the scope)."""

    def close(self) -> None:
        self._pool.shutdown(wait=True)
