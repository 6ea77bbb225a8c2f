"""The sealed store tier under the host tier, as the cache uses it.

:class:`StoreTier` joins a :class:`~kvseal.server.store.fsstore.FsStore` (a
directory the host owns, shared by replicas and restarts) to the host tier
(the index, the region, the block sealer). The cache calls it at five points;
everything else here runs on one background thread. Contract:

- **Spills** (host tier -> store) never run on a gRPC handler thread nor under
  the index lock. ``write-through`` (the default, :meth:`stored`): after an
  offload commits, its new blocks' hashes are queued; the spill thread pins
  each block in the index, snapshots its ciphertext from the region into
  private memory, unpins, opens it there with the host tier's key, and puts
  the plaintext (a private ``bytearray``, wiped after) into the store, which
  seals it under the deployment key. ``spill`` (write-back, :meth:`evicting`):
  an offload's eviction victims are snapshotted (ciphertext: a copy of host
  memory, no plaintext) on the offload's thread before their slots are
  reused, their key epochs retained, and the rest happens on the spill
  thread. Plaintext therefore exists only in the daemon's private memory,
  never in the region, the engine's pool or the directory. The queue is
  bounded (blocks and snapshot bytes): a spill that does not fit is skipped
  and counted, never waited for. A block the host tier let go before its
  turn, or whose tenant was dropped meanwhile, is skipped.
- **Lookups** (:meth:`extend_lookup`) report every block present in the
  store READY (a name check, nothing read), after the host tier's READY
  prefix too, and extend the prefix with them.
- **Restores** (:meth:`promote`): blocks absent from the host tier are read
  from the store and verified there (``FsStore.get``: the whole record
  authenticated against namespace, tenant, epoch and hash), then sealed into
  the host tier (new index entries) before the cache's normal restore pins
  and opens every block (verified again by the backend) and only then writes
  the engine's pages: every byte is verified before any reaches the pool,
  all or nothing, on both backends, through the one write path they have.
  A store object that fails its checks is returned to the cache, which
  applies ``--on-integrity-failure`` exactly as for the host region (the
  store already removed the object). A miss or an ``OSError`` (EIO, EACCES,
  an NFS hiccup: not tampering) is a miss, counted and logged.
- **Drops** (:meth:`begin_drop` before the host tier's keys and entries go,
  :meth:`end_drop` after the index drop; both under the spill lock, so a
  spill's check-and-put is never split by them). Each (namespace, tenant)
  has a *fence* (:class:`Fence`): a drop counter every spill carries from
  the moment it is queued (or, for an eviction snapshot, reserved), a count
  of drops in progress, and a change counter promotions carry.

  ``Drop(all_of_tenant)``: ``begin_drop`` bumps the tenant's counter,
  rotates its store epoch (``FsStore.delete_tenant``) and waits up to
  ``DROP_WAIT_S`` for the tenant's promotions in flight (a promotion still
  running then fails the drop with UNAVAILABLE: the host tier is dropped
  anyway, the caller retries). ``end_drop`` bumps the counter again and
  discards the tenant's queued spills. A spill publishes only if its counter
  is still current and no drop of its tenant is in progress, so nothing
  queued before the drop *or inside its window* (an offload of the tenant
  committing between the epoch rotation and the index drop) ever publishes a
  pre-drop block under the new epoch; a spill queued after ``end_drop`` is
  either post-drop data (a fresh key) or finds its block gone. Other
  tenants' spills are untouched.

  ``Drop(block_hashes)``: ``end_drop`` discards the queued (and running)
  spills of those hashes and deletes each one's object in the tenant's
  current epoch (``FsStore.delete``). An eviction victim chosen before the
  drop began and snapshotted after it is neither in the index nor in the
  queue when the drop looks: the offload took a mark (:meth:`drop_mark`)
  before the index chose its victims, and a victim that a drop named since
  (or names meanwhile) is never snapshotted (``NamedDrops``). Descendants the index drop removed
  are not deleted from the store: a Lookup no longer reaches them through
  the dropped block's prefix, but a restore naming a descendant's hash
  directly may still promote it.

  Promotions check the change counter (bumped at both ends of every drop of
  the tenant) in the same critical section as their ``begin_store``: a
  promotion either reserved its entries before the drop began (the index
  drop removes them) or is abandoned, so no block read from the store before
  a drop is sealed back into the host tier after it.

  The fence of a tenant dropped with ``all_of_tenant`` is kept for the
  daemon's life (a few dozen bytes; such drops are rare, and a queued spill
  compares against it); other fences go when no drop or promotion uses them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from kvseal.server import telemetry
from kvseal.server.backends.base import Region
from kvseal.server.cache.spillworker import MAX_QUEUED_BLOCKS, SpillWorker
from kvseal.server.cache.storeevents import StoreEvents
from kvseal.server.cache.storestate import (
    DropFence,
    Fence,
    NamedDrops,
    PlaintextBuffers,
    ScopeKey,
    Spill,
    StoreCounts,
)
from kvseal.server.config import StorePolicy
from kvseal.server.deadline import Deadline
from kvseal.server.errors import CapacityExhausted, StoreUnavailable
from kvseal.server.events import EventBus
from kvseal.server.index import Entry, Index, State
from kvseal.server.sealing import (
    TAG_BYTES,
    BlockAD,
    BlockSealer,
    SealRecord,
)
from kvseal.server.store.errors import StoreError, StoreIntegrityError
from kvseal.server.store.fsstore import FsStore

log = logging.getLogger("kvseal.store")
# How long a drop waits for promotions that read the store before it.
DROP_WAIT_S = 5.0
# Store reads a promotion asks the kernel to start ahead of the one it decrypts.
PREFETCH = 16
# Wiped plaintext buffers kept for promotions (all sizes together).
FREE_BUFFER_BYTES = 64 * 1024**2


class StoreTier(SpillWorker):
    """See the module docstring. ``on_abort`` is called (from the spill
    thread) when the store's checks fail there under the ``abort`` policy."""

    def __init__(
        self,
        store: FsStore,
        policy: StorePolicy,
        index: Index,
        region: Region,
        sealer: BlockSealer,
        *,
        abort_on_integrity: bool,
        on_abort: Callable[[], None],
        bus: EventBus,
        locality: str = "local",
    ) -> None:
        self.store = store
        self.events = StoreEvents(bus, store, locality, in_host=self._in_host)
        self.policy = policy
        self._index = index
        self._region = region
        self._sealer = sealer
        self._abort_on_integrity = abort_on_integrity
        self._on_abort = on_abort
        self._queue: deque[Spill] = deque()
        self._queued_bytes = 0
        self._cv = threading.Condition()  # queue, fences, jobs in flight
        self._spill_lock = threading.Lock()  # a spill's check-and-put vs a drop
        # A promotion's fence check and begin_store vs a drop's bump (taken
        # after _spill_lock, before _cv; never while the index lock is held).
        self._fence_lock = threading.Lock()
        self._fences: dict[ScopeKey, Fence] = {}
        self._buffers = PlaintextBuffers(FREE_BUFFER_BYTES)  # for promotions
        self._copying: list[Spill] = []  # eviction snapshots being copied
        self._named = NamedDrops()  # Drop(block_hashes) vs snapshots of chosen victims
        self._running: Spill | None = None  # the spill thread's current job
        self._closed = False
        self._counts = StoreCounts()
        self._usage = (0, 0)  # (records, bytes) at the last rescan
        self._thread = threading.Thread(target=self._run, name="kvseal-spill", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ the cache's hooks

    def extend_lookup(
        self, ns: bytes, tenant: bytes, hashes: Sequence[bytes], hit: int, states: list[State]
    ) -> int:
        """The READY prefix of ``hashes`` counting blocks the store holds, with
        ``states`` updated in place: from ``hit`` (the host tier's READY prefix)
        on, *every* ABSENT block whose object is in the store is reported READY
        (one name check each, nothing read), not only those up to the first
        miss, so a caller that reads ``states`` sees store blocks past a gap
        (the vLLM mirror's discovery asks about several requests' blocks in
        one Lookup). The returned prefix is the leading run of READY states
        (host or store) and is never shorter than ``hit``. A filesystem error
        ends the checks there: the later blocks keep the host tier's states.
        The tenant's scope marker and floor are read (once per
        ``scope_ttl_s``): one that fails its checks raises
        :class:`StoreIntegrityError` (removed, the tenant's announced store
        blocks retracted), for the cache to apply the integrity policy."""
        found: list[bytes] = []
        mark = self.events.mark(ns, tenant)  # before the checks: a drop since cancels
        try:
            for i in range(hit, len(hashes)):
                if states[i] is State.ABSENT and self.store.contains(ns, tenant, hashes[i]):
                    states[i] = State.READY
                    found.append(hashes[i])
        except OSError as e:
            self._note_error("lookup", e)
        except StoreIntegrityError as e:
            log.error("store: the tenant's scope marker failed its checks in a lookup: %s", e)
            self.events.retract_tenant(ns, tenant, "INTEGRITY")
            raise
        if found:
            self._add(lookup_hits=len(found))
            self.events.stored(ns, tenant, found, mark=mark)
        while hit < len(states) and states[hit] is State.READY:
            hit += 1
        return hit

    def stored(self, ns: bytes, tenant: bytes, entries: Sequence[Entry]) -> None:
        """An offload committed ``entries`` (write-through: queue them)."""
        if self.policy is not StorePolicy.WRITE_THROUGH or not entries:
            return
        with self._cv:
            for e in entries:
                if len(self._queue) >= MAX_QUEUED_BLOCKS:
                    self._counts.spills_skipped += 1
                    continue
                self._queue.append(Spill(ns, tenant, e.block_hash, self._drops_of(ns, tenant)))
            self._cv.notify()

    def promote(
        self, ns: bytes, tenant: bytes, hashes: Sequence[bytes], size: int, deadline: Deadline
    ) -> list[bytes]:
        """Bring the blocks of ``hashes`` that the host tier lacks in from the
        store (see the module docstring). Returns the hashes whose store
        objects failed their checks (the caller applies the integrity
        policy); otherwise every missing block was promoted, or one was a
        miss and nothing was (the restore then fails as it would without a
        store: all or nothing)."""
        _, states = self._index.lookup(ns, tenant, hashes)
        absent = [h for h, s in zip(hashes, states, strict=True) if s is State.ABSENT]
        if not absent:
            return []
        got: dict[bytes, bytearray] = {}
        key = (ns, tenant)
        mark = self.events.mark(ns, tenant)
        with self._cv:
            fence = self._fences.setdefault(key, Fence())
            fence.promoting += 1
            changes = fence.changes
        try:
            for i, h in enumerate(absent):
                deadline.check("reading the store")
                buf = self._buffers.take(size)
                try:
                    plaintext = self.store.get(ns, tenant, h, buf)
                    # The device reads the next blocks while this one decrypts: a
                    # window ahead, once the first was a hit.
                    ahead = absent[i + 1 : i + 1 + PREFETCH] if i == 0 else []
                    ahead = ahead or absent[i + PREFETCH : i + PREFETCH + 1]
                    if plaintext is not None and ahead:
                        self.store.prefetch(ns, tenant, ahead)
                except StoreIntegrityError as e:
                    log.error("store object of block %s failed its checks: %s", h.hex()[:16], e)
                    if self.store.name_of(ns, tenant, h) is None:
                        # It was the tenant's scope marker (removed): every block
                        # of the tenant is gone, not only this one.
                        self.events.retract_tenant(ns, tenant, "INTEGRITY")
                    else:
                        self.events.removed(ns, tenant, [h], "INTEGRITY", announced_only=False)
                    return [h]
                except (OSError, StoreError) as e:
                    self._note_error("restore", e)
                    return []
                if plaintext is None:  # gone (another replica evicted it), or another size
                    self._buffers.give([buf])
                    self.events.removed(ns, tenant, [h], "EVICTED", announced_only=False)
                    return []
                got[h] = plaintext
            if self._seal_into_host(ns, tenant, hashes, got, size, fence, changes):
                self.events.stored(ns, tenant, got, mark=mark)
            return []
        finally:
            self._buffers.give(got.values())
            with self._cv:
                fence.promoting -= 1
                if fence.idle() and self._fences.get(key) is fence:
                    del self._fences[key]
                self._cv.notify_all()

    def begin_drop(
        self, ns: bytes, tenant: bytes, hashes: Sequence[bytes], *, all_of_tenant: bool
    ) -> DropFence:
        """A drop's first fence, before the host tier's keys and entries go
        (see the module docstring). For ``all_of_tenant``: rotates the
        tenant's store epoch and waits for its promotions in flight. Never
        raises for the store: what failed is carried to :meth:`end_drop`,
        which the caller must call after the index drop, whatever happened."""
        key = (ns, tenant)
        failed: str | None = None
        named_seq = 0
        with self._spill_lock:
            with self._fence_lock, self._cv:
                fence = self._fences.setdefault(key, Fence())
                fence.changes += 1
                fence.dropping += 1
                if all_of_tenant:
                    fence.drops += 1
                    fence.dropping_all += 1
                else:
                    named_seq = self._named.begin(key, hashes)
            if all_of_tenant:
                try:
                    self.store.delete_tenant(ns, tenant)
                except (OSError, StoreError) as e:
                    failed = f"its store epoch could not be replaced ({type(e).__name__})"
                    log.error(
                        "store: dropping tenant %s failed: %s: %s",
                        telemetry.tenant_label(tenant), type(e).__name__, e,
                    )  # fmt: skip
        if all_of_tenant:
            give_up = time.monotonic() + DROP_WAIT_S
            with self._cv:
                while fence.promoting and (left := give_up - time.monotonic()) > 0:
                    self._cv.wait(left)
                if fence.promoting and failed is None:
                    # Abandoned at their check (never sealed back), but still
                    # reading: do not claim the drop complete while they run.
                    failed = f"{fence.promoting} store read(s) of the tenant still running"
        return DropFence(
            key, () if all_of_tenant else tuple(hashes), all_of_tenant, failed, named_seq
        )

    def end_drop(self, drop: DropFence) -> StoreUnavailable | None:
        """The drop's second fence, after the index drop: discard the spills
        queued for what was dropped (all of the tenant's, or those of the
        named hashes), delete the named blocks' objects, and close the
        window. Returns the error to report (UNAVAILABLE: the host tier's
        part was done; retrying the drop completes the store's)."""
        ns, tenant = drop.key
        failed = drop.failed
        with self._spill_lock:
            named = set(drop.hashes)
            with self._cv:
                self._cancel(drop.key, None if drop.all_of_tenant else named)
            for h in drop.hashes:
                try:
                    self.store.delete(ns, tenant, h)
                except (OSError, StoreError) as e:
                    if isinstance(e, StoreIntegrityError) and self._abort_on_integrity:
                        log.critical("store: a scope marker failed its checks in a drop: %s", e)
                        self._on_abort()  # read here too: the policy applies
                    failed = (
                        failed
                        or f"a block's store object could not be deleted ({type(e).__name__})"
                    )
                    log.error(
                        "store: deleting block %s failed: %s: %s", h.hex()[:16], type(e).__name__, e
                    )
            with self._fence_lock, self._cv:
                fence = self._fences[drop.key]
                fence.changes += 1  # promotions that read during the window are abandoned
                fence.dropping -= 1
                if drop.all_of_tenant:
                    fence.drops += 1  # anything queued inside the window is stale
                    fence.dropping_all -= 1
                else:
                    self._named.end(drop.named_seq)
                if fence.idle():  # Drop(block_hashes) is frequent: keep no state for it
                    del self._fences[drop.key]
            if drop.all_of_tenant:
                self.events.dropped_tenant(ns, tenant)
            else:
                self.events.removed(ns, tenant, drop.hashes, "DROPPED")
        if failed is None:
            return None
        return StoreUnavailable(f"the host tier dropped the blocks, but {failed}; retry the drop")

    def sample(self) -> telemetry.StoreSample:
        """The store's counters and the last usage scan, for the metrics."""
        s = self.store.stats()
        c = self._counts
        records, nbytes = self._usage
        return telemetry.StoreSample(
            bytes_used=nbytes,
            objects=records,
            capacity_bytes=self.store.config.capacity_bytes,
            queued=len(self._queue),
            lookup_hits=c.lookup_hits,
            hits=s.hits,
            misses=s.misses,
            promoted=c.promoted,
            spills=s.puts,
            spills_present=s.put_present,
            spills_skipped=c.spills_skipped,
            evictions=s.evictions,
            evicted_bytes=s.evicted_bytes,
            integrity_failures=s.integrity_failures,
            replays=s.replays,
            scope_rollbacks=s.scope_rollbacks,
            tenant_drops=s.tenant_drops,
            errors=c.errors,
            host_auth_failures=c.host_auth_failures,
        )

    def close(self, timeout: float = 10.0) -> None:
        """Stop the spill thread (queued spills are discarded: the store is a
        cache) and wipe the store's keys."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)
        with self._cv:
            while self._queue:
                self._discard(self._queue.popleft())
        if not self._thread.is_alive():
            self.store.close()

    # ------------------------------------------------------------ internals

    def _cancel(self, key: ScopeKey, hashes: set[bytes] | None) -> None:
        """Discard the queued spills of ``key`` (only of ``hashes`` unless
        None) and mark those being copied or run cancelled (under ``_cv``)."""

        def hit(job: Spill) -> bool:
            return (job.ns, job.tenant) == key and (hashes is None or job.block_hash in hashes)

        kept: deque[Spill] = deque()
        while self._queue:
            job = self._queue.popleft()
            if hit(job):
                self._discard(job)
                self._counts.spills_skipped += 1
            else:
                kept.append(job)
        self._queue = kept
        for job in [*self._copying, *([self._running] if self._running else [])]:
            if hit(job):
                job.cancelled = True

    def _seal_into_host(
        self, ns: bytes, tenant: bytes, hashes: Sequence[bytes], got: dict[bytes, bytearray],
        size: int, fence: Fence, changes: int,
    ) -> bool:  # fmt: skip
        """Seal the verified plaintexts into new host-tier entries (the
        request's own chain, so the parents link as an offload's would),
        unless a drop of the tenant began since ``changes`` was read: the
        check and the reservation are one step under the fence lock, so a
        drop either sees the entries (its index drop removes them) or the
        promotion sees the drop. True if the blocks were sealed in."""
        with self._fence_lock:
            with self._cv:
                if fence.changes != changes or fence.dropping:
                    return False  # a drop ran meanwhile: serve nothing read before it
                mark = self._named.mark()  # before the victims are chosen
            try:
                plan = self._index.begin_store(ns, tenant, None, hashes, size)
            except CapacityExhausted:
                return False  # everything pinned: the restore fails as a miss would
        records: list[SealRecord | None] = []
        written = 0  # slots of plan.new that may hold new bytes (the victims there are lost)
        try:
            self.evicting(plan.evicted, mark)  # all or nothing: a failure undoes the plan below
            out = bytearray(size + TAG_BYTES)
            for i, e in enumerate(plan.new):
                plaintext = got.get(e.block_hash)
                if plaintext is None:  # left the host tier after the lookup above
                    records.append(None)
                    continue
                ad = BlockAD(ns, tenant, e.block_hash, e.generation)
                rec = self._sealer.seal_into(memoryview(plaintext), ad, memoryview(out))
                records.append(rec)
                written = i + 1
                self._region.write(e.extent.offset, memoryview(out)[:size])
        except BaseException:
            self._index.abort_store(plan, range(written))
            for r in records:
                if r is not None:
                    self._sealer.forget(r.epoch)
            raise
        self._index.complete_store(plan.new, records)
        self._add(promoted=sum(r is not None for r in records))
        return True
