"""The CPU backend: AES-256-GCM with ``cryptography`` on a few threads, engine
pools read and written by fd (``shmpool``), never mapped.

It keeps the contract of :mod:`kvseal.server.backends.base` (seal in private
memory and publish only ciphertext; verify every block of a restore before any
page is written; check the deadline before every block).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import wait
from typing import TypeVar

from kvseal.server import telemetry
from kvseal.server.backends.base import BlockIO, Region, note_written
from kvseal.server.backends.cpu.shmpool import CpuMappedPool
from kvseal.server.backends.cpu.staging import Bounce, StagingPool, publisher, snapshotter
from kvseal.server.deadline import NO_DEADLINE, Deadline
from kvseal.server.errors import BadRequest, DeadlinePassed, ShuttingDown
from kvseal.server.hostregion import HostRegion
from kvseal.server.pools import MappedPool, PoolSpec
from kvseal.server.sealing import AuthenticationFailed, BlockSealer, SealRecord
from kvseal.server.threads import FixedPool

T = TypeVar("T")


# Bytes of a block handled at a time per sealing thread: read from the pool,
# sealed and published (offload), or snapshotted and opened (restore) while
# they stay in the core's L2 cache (any size works; whole 4 KiB pages are fastest).
CHUNK_BYTES = 256 * 1024
# Restore staging kept for reuse (kvseal.server.staging): requests up to this
# size pay their page faults once, not per request.
STAGING_IDLE_BYTES = 1 << 30


class CpuBackend:
    """AES-256-GCM with ``cryptography`` on a few threads (it releases the GIL,
    as do ``preadv``/``pwritev`` and ``memmove``).

    Offload, per block, a chunk (:data:`CHUNK_BYTES`) at a time through a
    per-thread private bounce buffer: read the chunk's pages from the
    engine's pool (each byte once), encrypt it in place
    (:meth:`BlockSealer.begin_seal`), publish the ciphertext with one copy.
    The chunk stays in cache from the read to the publish, so the block
    crosses memory once on the way in and once on the way out, as in a plain
    ``encrypt_into``.

    Restore, per request, into one private staging buffer: per block and
    chunk, snapshot the ciphertext from the region (each byte once) and
    decrypt it in place while it is in cache (:meth:`BlockSealer.begin_open`),
    then check the block's tag. Only when every block of the request
    verified are the pages written, from the staging, segment by segment
    across consecutive pages. Nothing unauthenticated, and nothing the host
    could change after it was read, reaches the engine's pool.
    """

    kind = "cpu"

    def __init__(
        self,
        sealer: BlockSealer,
        workers: int,
        allowed_uids: frozenset[int] = frozenset(),
        *,
        chunk_bytes: int = CHUNK_BYTES,
        staging_idle_bytes: int = STAGING_IDLE_BYTES,
    ) -> None:
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        self._sealer = sealer
        self._allowed = allowed_uids
        self._region_ids: frozenset[tuple[int, int]] = frozenset()
        self.stopping = threading.Event()
        self._workers = max(1, workers)
        # Every sealing thread exists from the start (kvseal.server.threads).
        self._pool = FixedPool(self._workers, "kvseal-seal")
        self._chunk = chunk_bytes
        self._bounce = Bounce()
        self._staging = StagingPool(staging_idle_bytes)
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

    def _parallel(
        self, n: int, fn: Callable[[int, int], list[T]], until: float | None = None
    ) -> list[list[T] | BaseException]:
        """Run ``fn(start, stop)`` over contiguous chunks of ``range(n)``;
        returns each chunk's result or exception, after all have finished
        (no thread outlives the call).

        ``until`` (``time.monotonic()``; None: no limit) bounds the wait for a
        sealing thread: the threads are shared by every request, and a chunk
        still queued behind other requests' work at ``until`` is cancelled (it
        never runs, so it touches nothing) and reported as DeadlinePassed.
        Running chunks check the request's deadline before every block, so
        they end by themselves. This is what lets a request give its verdict at
        its cutoff, before the client's deadline, however busy the threads are:
        waiting on for a queued chunk could outlast the client's deadline, and
        the engine would get a failure without the daemon's reason."""
        chunks = max(1, min(self._workers, n))
        bounds = [n * i // chunks for i in range(chunks + 1)]
        if chunks == 1:
            try:
                return [fn(0, n)]
            except BaseException as e:
                return [e]
        futures = [self._pool.submit(fn, a, b) for a, b in itertools.pairwise(bounds)]
        wait(futures, timeout=None if until is None else max(0.0, until - time.monotonic()))
        out: list[list[T] | BaseException] = []
        for f in futures:
            if f.cancel():  # still queued: it will never start
                out.append(
                    DeadlinePassed(
                        "the request's deadline passed while its blocks waited for a sealing "
                        "thread (all were busy with other requests); nothing was read or "
                        "written for them"
                    )
                )
                continue
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

        started: list[set[int]] = []  # per thread: blocks whose region write began
        publish = publisher(region)

        def work(a: int, b: int) -> list[SealRecord]:
            records: list[SealRecord] = []
            writes: set[int] = set()
            started.append(writes)
            bounce = self._bounce.get(self._chunk)
            chunks = pool.bound(self._chunk, bounce.view)
            try:
                for i, blk in enumerate(blocks[a:b], start=a):
                    # Before every page read: past the cutoff the engine may
                    # already own this page again (see kvseal.server.deadline).
                    deadline.check(f"page {blk.page}")
                    stream = self._sealer.begin_seal(blk.ad, blk.size)
                    try:
                        for chunk in chunks:
                            start, n = chunk[0], chunk[1]
                            pool.read_chunk(blk.page, chunk)
                            stream.update(bounce.view[:n])
                            writes.add(i)
                            publish(blk.extent.offset + start, bounce, n)
                        records.append(stream.finish())
                    except BaseException:
                        stream.abort()
                        raise
            except BaseException:
                # Their blocks will not be kept: release their epochs' references
                # (the nonces stay burnt) so retired keys can still be destroyed.
                for r in records:
                    self._sealer.forget(r.epoch)
                raise
            return records

        results = self._parallel(len(blocks), work, deadline.cutoff)
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
        # No pool.check() yet: verification touches no page, and the check
        # right before the first write is the one that refuses a shrunk pool
        # (a size read per object: 64 of them for a 64-layer model).
        starts = [0]
        for blk in blocks:
            starts.append(starts[-1] + blk.size)
        # Private staging for the whole request: plaintext stays here until
        # every block has verified, so a failure anywhere writes nothing to the pool.
        staging = self._staging.take(starts[-1])
        snapshot = snapshotter(region)
        chunk = self._chunk

        def verify(a: int, b: int) -> list[int]:
            failed = []
            for i in range(a, b):
                deadline.check("verification")  # no page is touched here: stop early
                blk, at = blocks[i], starts[i]
                stream = self._sealer.begin_open(records[i], blk.ad, blk.size)
                try:
                    for c0 in range(0, blk.size, chunk):
                        n = min(chunk, blk.size - c0)
                        # One copy of the host's bytes into private memory; only
                        # that copy is authenticated and decrypted.
                        if snapshot(blk.extent.offset + c0, staging, at + c0, n) != n:
                            raise AuthenticationFailed("short read")  # the host shrank it
                        stream.update(staging.view[at + c0 : at + c0 + n])
                    stream.finish()
                except AuthenticationFailed:
                    failed.append(i)
                finally:
                    stream.abort()  # nothing to do once finished
            return failed

        try:
            with telemetry.stage("copy_verify"):
                results = self._parallel(len(blocks), verify, deadline.cutoff)
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
                pages = [blk.page for blk in blocks]

                def check() -> None:
                    deadline.check_commit("writing the verified blocks")

                def scatter(a: int, b: int) -> list[None]:
                    # Each thread starts at another segment (see write_pages).
                    rotate = a * pool.segment_runs // max(1, len(blocks))
                    pool.write_pages(pages[a:b], staging.view, starts[a:b], check, rotate)
                    return []

                with telemetry.stage("scatter"):
                    for outcome in self._parallel(len(blocks), scatter, deadline.commit_by):
                        if isinstance(outcome, BaseException):
                            raise outcome
        finally:
            self._staging.give(staging)
        return failed

    def check_device(self) -> None:
        """No device to lose: nothing to check (see ``Backend.check_device``)."""

    def retire_keys(self) -> None:
        """Nothing to do: the CPU backend keeps no key copies of its own (the
        sealer's ``AESGCM`` objects are the only ones, dropped with the scope)."""

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._staging.close()
