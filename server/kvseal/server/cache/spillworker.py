"""The spill side of the store tier: eviction snapshots and the spill thread.

:class:`SpillWorker` is the part of :class:`~kvseal.server.cache.storetier.StoreTier`
that moves blocks from the host tier into the store (split out of it for
size; ``StoreTier`` owns every attribute declared here and documents the
contract: spills never run on a handler thread nor under the index lock, a
queued spill publishes only if no drop of its tenant touched it, plaintext
exists only in the daemon's private memory).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from kvseal.server.backends.base import Region
from kvseal.server.cache.storeevents import StoreEvents
from kvseal.server.cache.storestate import Fence, NamedDrops, ScopeKey, Spill, StoreCounts
from kvseal.server.config import StorePolicy
from kvseal.server.errors import BlockNotPresent
from kvseal.server.index import Entry, Index, State
from kvseal.server.sealing import (
    TAG_BYTES,
    AuthenticationFailed,
    BlockAD,
    BlockSealer,
    KeyDestroyed,
    SealingError,
)
from kvseal.server.store.errors import StoreError, StoreIntegrityError
from kvseal.server.store.fsstore import FsStore
from kvseal.server.store.keysource import wipe
from kvseal.server.threads import name_os_thread

log = logging.getLogger("kvseal.store")
# The spill queue's bounds: hashes are cheap (write-through), snapshots are
# whole blocks of ciphertext (spill policy), so both are capped.
MAX_QUEUED_BLOCKS = 65536
MAX_QUEUED_BYTES = 256 * 1024**2
# How often the spill thread rescans the directory for the usage gauges (a
# full listing: never on a scrape, never on a request).
USAGE_REFRESH_S = 10.0


class SpillWorker:
    """Eviction snapshots (spill policy) and the ``kvseal-spill`` thread."""

    store: FsStore
    events: StoreEvents
    policy: StorePolicy
    _index: Index
    _region: Region
    _sealer: BlockSealer
    _abort_on_integrity: bool
    _on_abort: Callable[[], None]
    _queue: deque[Spill]
    _queued_bytes: int
    _cv: threading.Condition
    _spill_lock: threading.Lock
    _fences: dict[ScopeKey, Fence]
    _copying: list[Spill]
    _named: NamedDrops
    _running: Spill | None
    _closed: bool
    _counts: StoreCounts
    _usage: tuple[int, int]

    def _drops_of(self, ns: bytes, tenant: bytes) -> int:
        """The tenant's drop count (under ``_cv``)."""
        fence = self._fences.get((ns, tenant))
        return 0 if fence is None else fence.drops

    def drop_mark(self) -> int:
        """Taken before the index chooses eviction victims, and handed to
        :meth:`evicting`: a ``Drop(block_hashes)`` naming a victim that begins
        after it (or runs meanwhile) skips that victim's snapshot."""
        with self._cv:
            return self._named.mark()

    def evicting(self, victims: Sequence[Entry], mark: int) -> None:
        """An offload (or a promotion) doomed ``victims`` and is about to reuse
        their slots (spill policy: snapshot their ciphertext now). Runs on the
        request's thread: a copy of host memory per victim, nothing more.

        All or nothing: a copy that fails (an ``OSError`` from the region,
        ``MemoryError``) propagates after every snapshot this call took has
        been released (reservations, retained key epochs, wiped buffers), so
        the caller can undo its plan exactly (``Index.abort_store``: the
        victims come back) and nothing of it is queued. A victim without a
        record, too large for the store, over the queue's bounds or whose key
        is gone (its tenant dropped) is skipped and counted."""
        if self.policy is not StorePolicy.SPILL or not victims:
            return
        mine: list[Spill] = []  # this call's snapshots, listed in _copying until queued
        try:
            for v in victims:
                self._snapshot_victim(v, mine, mark)
        except BaseException:
            with self._cv:
                for job in mine:
                    self._copying.remove(job)
                    self._counts.spills_skipped += 1
                    if job.sealed is not None:
                        self._discard(job)
                    else:  # reserved, not yet copied
                        self._queued_bytes -= job.size
            raise
        with self._cv:
            for job in mine:
                self._copying.remove(job)
                if job.cancelled:  # a Drop(block_hashes) of it meanwhile
                    self._discard(job)
                    self._counts.spills_skipped += 1
                else:
                    self._queue.append(job)
            self._cv.notify()

    def _snapshot_victim(self, v: Entry, mine: list[Spill], mark: int) -> None:
        """Reserve room for ``v``'s snapshot and copy its ciphertext (listed in
        ``mine`` from its reservation on; see :meth:`evicting`)."""
        rec = v.record
        if rec is None or v.size > self.store.config.max_object_bytes:
            self._add(spills_skipped=1)
            return
        ns, tenant, h = v.key
        with self._cv:
            if (
                self._named.dropped_since(mark, (ns, tenant), h)
                or len(self._queue) + len(self._copying) >= MAX_QUEUED_BLOCKS
                or self._queued_bytes + v.size > MAX_QUEUED_BYTES
            ):
                self._counts.spills_skipped += 1
                return
            self._queued_bytes += v.size  # reserved before the copy
            # The drop count is taken *before* the key is retained: a drop
            # after this point makes the job stale, one before it destroyed
            # the key (retain fails). Listed while copying so a
            # Drop(block_hashes) can cancel it.
            job = Spill(ns, tenant, h, self._drops_of(ns, tenant), v.size, None, None, v.generation)
            self._copying.append(job)
            mine.append(job)
        if not self._sealer.retain(rec.epoch):  # the victim's key is gone: skip it
            with self._cv:
                self._copying.remove(job)
                mine.remove(job)
                self._queued_bytes -= v.size
                self._counts.spills_skipped += 1
            return
        try:
            sealed = bytearray(v.size + TAG_BYTES)
            n = self._region.read_into(v.extent.offset, memoryview(sealed)[: v.size])
            sealed[v.size :] = rec.tag
        except BaseException:
            self._sealer.forget(rec.epoch)  # the caller releases the reservation
            raise
        with self._cv:
            job.sealed, job.record = sealed, rec
            if n != v.size:  # the host shrank the region: nothing to spill
                self._copying.remove(job)
                mine.remove(job)
                self._discard(job)
                self._counts.spills_skipped += 1

    def _add(self, **deltas: int) -> None:
        with self._cv:
            for k, v in deltas.items():
                setattr(self._counts, k, getattr(self._counts, k) + v)

    def _in_host(self, ns: bytes, tenant: bytes, hashes: list[bytes]) -> set[bytes]:
        _, states = self._index.lookup(ns, tenant, hashes)
        return {h for h, s in zip(hashes, states, strict=True) if s is State.READY}

    def _note_error(self, what: str, e: BaseException) -> None:
        self._add(errors=1)
        log.warning("store %s: %s: %s (treated as a miss)", what, type(e).__name__, e)

    def _publishable(self, job: Spill) -> bool:
        """Whether no drop has touched ``job`` since it was queued (under ``_cv``)."""
        fence = self._fences.get((job.ns, job.tenant))
        if fence is None:
            return not job.cancelled and job.drops == 0
        return not job.cancelled and job.drops == fence.drops and not fence.dropping_all

    def _discard(self, job: Spill) -> None:
        """A queued spill that will not run: release what it holds."""
        if job.sealed is not None and job.record is not None:
            self._queued_bytes -= job.size
            wipe(job.sealed)
            self._sealer.forget(job.record.epoch)

    def _run(self) -> None:
        name_os_thread("kvseal-spill")
        next_scan = 0.0
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    if time.monotonic() >= next_scan:
                        break
                    self._cv.wait(max(0.0, next_scan - time.monotonic()))
                if self._closed:
                    return
                job = self._queue.popleft() if self._queue else None
                if job is not None and job.sealed is not None:
                    self._queued_bytes -= job.size
                self._running = job
            if job is not None:
                try:
                    self._spill(job)
                except Exception:
                    log.exception("store: a spill failed unexpectedly; the block stays host-only")
                    self._add(spills_skipped=1)
                finally:
                    with self._cv:
                        self._running = None
            if time.monotonic() >= next_scan:  # also while spills keep coming
                next_scan = time.monotonic() + USAGE_REFRESH_S
                self._rescan()

    def _rescan(self) -> None:
        try:
            u = self.store.usage()
        except OSError as e:
            self._note_error("usage scan", e)
            return
        self._usage = (u.objects, u.total_bytes)

    def _snapshot(self, job: Spill) -> bool:
        """Write-through: pin the block, copy its ciphertext and retain its key
        epoch; False if it already left the host tier."""
        try:
            (e,) = self._index.begin_restore(job.ns, job.tenant, [job.block_hash])
        except BlockNotPresent:
            return False
        try:
            rec = e.record
            if rec is None or e.size > self.store.config.max_object_bytes:
                return False
            if not self._sealer.retain(rec.epoch):
                return False
            try:
                sealed = bytearray(e.size + TAG_BYTES)
                n = self._region.read_into(e.extent.offset, memoryview(sealed)[: e.size])
                sealed[e.size :] = rec.tag
            except BaseException:
                self._sealer.forget(rec.epoch)  # retained above: released on every path
                raise
            job.size, job.sealed, job.record, job.generation = e.size, sealed, rec, e.generation
        finally:
            self._index.complete_restore([e], release=False)
        if n != e.size:
            self._sealer.forget(rec.epoch)
            job.sealed = None
            return False
        return True

    def _spill(self, job: Spill) -> None:
        if job.sealed is None and not self._snapshot(job):
            self._add(spills_skipped=1)
            return
        sealed, rec = job.sealed, job.record
        assert sealed is not None and rec is not None
        plaintext = memoryview(sealed)[: job.size]
        try:
            ad = BlockAD(job.ns, job.tenant, job.block_hash, job.generation)
            self._sealer.open_into(rec, ad, memoryview(sealed), plaintext)
            with self._spill_lock:
                with self._cv:
                    stale = not self._publishable(job)
                if stale:
                    self._add(spills_skipped=1)  # a drop since it was queued, or running
                    return
                self.store.put(job.ns, job.tenant, job.block_hash, plaintext)
                # Under the spill lock: a drop (which holds it) cannot slip between.
                self.events.stored(job.ns, job.tenant, [job.block_hash])
        except KeyDestroyed:
            self._add(spills_skipped=1)  # its tenant was dropped
        except AuthenticationFailed:
            # Left to the host tier's own restore path, which applies the policy.
            self._add(host_auth_failures=1, spills_skipped=1)
            log.error("store: block %s failed to open for a spill", job.block_hash.hex()[:16])
        except StoreIntegrityError as e:  # the tenant's scope marker failed its checks
            log.critical("store: a scope marker failed its checks while spilling: %s", e)
            if self._abort_on_integrity:
                self._on_abort()
        except (OSError, StoreError, SealingError) as e:
            self._add(spills_skipped=1)
            self._note_error("spill", e)
        finally:
            plaintext.release()
            wipe(sealed)
            self._sealer.forget(rec.epoch)
