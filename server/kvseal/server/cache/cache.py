"""The sealed host tier: request semantics on top of index, backend, region.

Each public method validates its whole request before changing anything (so
bad input leaves the cache exactly as it was), then runs the index's atomic
reserve/pin step, moves bytes through the backend without holding the index
lock, and completes. Failure at any point releases what was reserved.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvseal.server import telemetry
from kvseal.server.backends.base import Backend, BlockIO, Region, written_positions
from kvseal.server.cache.admission import request
from kvseal.server.cache.checks import check_event, check_hashes, check_pages, check_tenant
from kvseal.server.cache.results import (
    Counters,
    Observer,
    OffloadResult,
    Registered,
    RestoreResult,
    tier_sample,
)
from kvseal.server.cache.storeevents import publish_host_event
from kvseal.server.cache.storetier import StoreTier
from kvseal.server.cache.tenants import TENANT_IDLE_S, TenantBook
from kvseal.server.config import IntegrityPolicy, ServerConfig
from kvseal.server.deadline import NO_DEADLINE, Deadline
from kvseal.server.errors import (
    BackendMismatch,
    BadRequest,
    CapacityExhausted,
    IntegrityFailure,
    ShuttingDown,
    TenantDropped,
    UnknownPool,
)
from kvseal.server.events import EventBus, Subscription
from kvseal.server.index import Entry, Index, Removal, State
from kvseal.server.pools import MappedPool, NoMemory, Pool, PoolRegistry, PoolSpec
from kvseal.server.sealing import HASH_BYTES, TENANT_BYTES, BlockAD, BlockSealer, KeyDestroyed
from kvseal.server.store.errors import StoreIntegrityError
from kvseal.server.store.fsstore import FsStore

log = logging.getLogger("kvseal.cache")
MAX_OWNER_TOKEN = 64
__all__ = ["TENANT_IDLE_S", "SealedCache"]


class SealedCache(TenantBook):
    """Owns the index, the region and the pools; thread-safe.

    ``on_integrity_abort`` is called once, from the request thread that saw
    the failure, when the policy is ``abort``: the caller stops serving.
    ``store``: the sealed store tier under the host tier (``cache.storetier``;
    this cache owns it from here on), or None (no store: nothing changes).
    """

    def __init__(
        self,
        config: ServerConfig,
        backend: Backend,
        region: Region,
        sealer: BlockSealer,
        on_integrity_abort: Callable[[], None] | None = None,
        observer: Observer | None = None,
        store: FsStore | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.region = region
        self.sealer = sealer
        self.pools = PoolRegistry(config.max_pools)
        self.events = EventBus(config.max_watchers)
        self.draining = threading.Event()
        self._holds: dict[str, int] = {}  # pool id -> open HoldPool streams
        self._holds_lock = threading.Lock()
        self._tenants_lock = threading.Lock()
        self.index = Index(region.capacity, on_free=self._on_free, on_event=self._on_event)
        self.counters = Counters()
        self._counter_lock = threading.Lock()
        self._serving = True
        self._inflight = 0
        self._inflight_cv = threading.Condition()
        self._on_integrity_abort = on_integrity_abort
        self.observer = observer or Observer()
        self.store = None if store is None else StoreTier(
            store, config.store_policy, self.index, region, sealer,
            abort_on_integrity=config.integrity_policy is IntegrityPolicy.ABORT,
            on_abort=self._store_abort, bus=self.events, locality=config.store_locality,
        )  # fmt: skip

    def _store_abort(self) -> None:
        """The store failed its checks on the spill thread under ``abort``."""
        self.stop_serving()
        if self._on_integrity_abort is not None:
            self._on_integrity_abort()

    def _on_free(self, e: Entry) -> None:
        if e.record is not None:
            self.sealer.forget(e.record.epoch)

    def _on_event(self, kind: str, reason: Removal | None, entries: list[Entry]) -> None:
        """Called by the index under its lock: publish in index order."""
        tier = self.store.events if self.store is not None else None
        publish_host_event(self.events, tier, kind, reason, entries)

    # ---------------------------------------------------------------- state

    @property
    def serving(self) -> bool:
        return self._serving

    def stop_serving(self) -> None:
        """No new request is admitted; requests in flight stop before they
        write to an engine pool or publish a block (ShuttingDown)."""
        self._serving = False
        self.draining.set()
        self.backend.stopping.set()

    def begin_drain(self) -> None:
        """Shutdown has begun: requests in flight finish, but long-lived streams
        (event watchers, pool holds) end now (UNAVAILABLE) instead of holding the
        drain for its whole grace period, and a hold that ends is not taken for
        its engine going away."""
        self.draining.set()

    def _check_serving(self) -> None:
        if not self._serving:
            raise ShuttingDown(
                "kvseal is not serving (shutting down or stopped after an integrity failure)"
            )

    def _count(self, pool: Pool | None = None, **deltas: int) -> None:
        """Add to the daemon's counters and, for a request on ``pool``, to that
        pool's own (its scoped Stats)."""
        with self._counter_lock:
            for k, v in deltas.items():
                setattr(self.counters, k, getattr(self.counters, k) + v)
                if pool is not None:
                    pool.counters[k] = pool.counters.get(k, 0) + v

    # ---------------------------------------------------------------- pools

    @request
    def register_pool(self, spec: PoolSpec, owner_token: bytes = b"") -> Registered:
        """Map the engine's pool and register it (see PoolRegistry.add for names,
        owners and holds). A registration that fails, at any step, leaves nothing
        open: the backend releases what it mapped before failing, and a mapping
        the registry then refuses (full, name taken) is closed here."""
        spec.validate()
        if len(owner_token) > MAX_OWNER_TOKEN:
            raise BadRequest(f"owner_token is at most {MAX_OWNER_TOKEN} bytes")
        if spec.backend != self.backend.kind:
            raise BackendMismatch(
                f"pool registered for the {spec.backend} backend "
                f"but this daemon runs {self.backend.kind}"
            )
        ns = spec.namespace()
        # An observer pool has no memory: no backend maps anything for it.
        mapped: MappedPool = NoMemory(spec) if spec.observer else self.backend.map_pool(spec)
        try:
            pool, old = self.pools.add(spec, ns, mapped, owner_token)
        except BaseException:
            # Not registered: nothing else will ever close this mapping (fds, shm
            # maps, CUDA IPC mappings of the engine's memory).
            mapped.close()
            raise
        if old is not None:
            log.info("pool %s replaced by %s", old.pool_id, pool.pool_id)
        log.info(
            "registered %s %s: %d pages of %d bytes, layout %s",
            "observer pool" if spec.observer else "pool",
            pool.pool_id,
            pool.num_pages,
            pool.block_bytes,
            spec.geometry.layout,
        )
        return Registered(pool.pool_id, ns, pool.block_bytes, pool.owner_token)

    @request
    def unregister_pool(self, pool_id: str) -> None:
        pool = self.pools.remove(pool_id)
        log.info("unregistered pool %s", pool.pool_id)

    # ---------------------------------------------------------------- holds

    def expire_unheld(self, pool_id: str, waited_s: float) -> None:
        """A registration whose client announced a hold (``hold_within``) that never
        came: its engine died between RegisterPool and HoldPool. Unregister it (it
        would otherwise map the dead engine's memory until its name is reused)."""
        if self.pools.remove_if_never_held(pool_id) is not None:
            log.info(
                "unregistered pool %s: not held within %.1f s of its registration "
                "(its engine went away before it could hold it)",
                pool_id,
                waited_s,
            )

    def hold_pool(self, pool_id: str) -> None:
        """Count one more HoldPool stream on a registered pool. ShuttingDown while
        draining; UnknownPool if it is not registered; CapacityExhausted beyond
        ``max_holds`` open holds. The caller must :meth:`release_hold` exactly once."""
        if self.draining.is_set():
            raise ShuttingDown("kvseal is shutting down")
        with self._holds_lock:
            if sum(self._holds.values()) >= self.config.max_holds:
                raise CapacityExhausted(
                    f"too many open pool holds (limit {self.config.max_holds}, --max-holds)"
                )
            self.pools.hold(pool_id)  # UnknownPool; a held name is not taken over
            self._holds[pool_id] = self._holds.get(pool_id, 0) + 1

    def release_hold(self, pool_id: str, *, holder_left: bool) -> None:
        """End one hold. If the holder went away (``holder_left``), the daemon is
        serving and no other hold on the pool is open, unregister the pool, which
        releases its mappings once no request uses it."""
        self.pools.release(pool_id)
        with self._holds_lock:
            left = self._holds.get(pool_id, 0) - 1
            if left > 0:
                self._holds[pool_id] = left
                return
            self._holds.pop(pool_id, None)
        if not holder_left or self.draining.is_set():
            return
        try:
            self.unregister_pool(pool_id)  # a request: close() waits for it
        except (UnknownPool, ShuttingDown):
            return  # unregistered or replaced meanwhile, or stopping: nothing to do
        log.info("unregistered pool %s: its holder (the engine) went away", pool_id)

    @property
    def open_holds(self) -> int:
        with self._holds_lock:
            return sum(self._holds.values())

    def metrics_sample(self) -> telemetry.TierSample:
        """The counters and gauges the metrics families export (this cache is
        telemetry's ``MetricsSource``; see ``results.tier_sample``)."""
        store = self.store.sample() if self.store is not None else None
        return tier_sample(
            self.counters, self.index.stats(), len(self.pools), self.open_holds, store
        )

    def pool_stats(self, pool_id: str) -> tuple[dict[str, int], int, int]:
        """What a Stats call scoped to ``pool_id`` reports: the pool's own request
        counts (a copy), and the visible READY blocks and their bytes, in its
        namespace, of the tenants its requests named. Cheap: no index lock, one
        dictionary read per named tenant. Raises UnknownPool."""
        with self.pools.use(pool_id) as pool:
            with self._counter_lock:
                counts = dict(pool.counters)
            tenants = list(pool.tenants)  # a copy: requests may name more meanwhile
            blocks, nbytes = self.index.scope_usage(pool.namespace, tenants)
        return counts, blocks, nbytes

    # ---------------------------------------------------------------- events

    def subscribe_events(self, pool_id: str, tenant: bytes) -> tuple[Pool, Subscription]:
        """A WatchEvents subscription scoped to the pool (see ``events``): its
        namespace, the tenants its requests named, optionally one ``tenant``.
        BadRequest for an empty pool id or a tenant that is neither empty nor 32
        bytes, UnknownPool, CapacityExhausted beyond ``max_watchers``, ShuttingDown
        while draining. The caller must close the subscription; the pool is not
        leased (its ``closed`` flag tells when it is unregistered or replaced)."""
        if self.draining.is_set():
            raise ShuttingDown("kvseal is shutting down")
        if not pool_id:
            raise BadRequest(
                "pool_id is required: a watcher sees only events of its own pool's "
                "namespace and of tenants that pool's requests named"
            )
        if tenant and len(tenant) != TENANT_BYTES:
            raise BadRequest(
                f"tenant must be empty or a {TENANT_BYTES}-byte digest, got {len(tenant)} bytes"
            )
        with self.pools.use(pool_id) as pool:
            sub = self.events.subscribe(pool.namespace, pool.tenants, tenant)
        if sub is None:
            raise CapacityExhausted(f"too many event watchers (limit {self.config.max_watchers})")
        return pool, sub

    # ---------------------------------------------------------------- blocks

    @request
    def lookup(
        self, pool_id: str, tenant: bytes, hashes: Sequence[bytes]
    ) -> tuple[int, list[State]]:
        """Length of the READY prefix of ``hashes``, and each block's state. Names
        ``tenant`` on the pool for its event watchers (``note_tenant``), in the
        same lease. The hot path of every engine step: one lease, one index
        lock, one counter lock; span attributes only while tracing."""
        check_tenant(tenant)
        check_hashes(hashes, self.config.max_batch_blocks)
        with self.pools.use(pool_id) as pool, telemetry.stage("lookup"):
            self._note_tenant(pool, tenant)
            hit, states = self.index.lookup(pool.namespace, tenant, hashes)
            if self.store is not None and hit < len(hashes):  # blocks only the store holds
                try:
                    hit = self.store.extend_lookup(pool.namespace, tenant, hashes, hit, states)
                except StoreIntegrityError:  # the tenant's scope marker (or floor): removed
                    self._store_marker_failure(pool)
        self._count(pool, lookups=1, lookup_blocks=len(hashes), lookup_hit_blocks=hit)
        if telemetry.enabled():
            telemetry.annotate(
                pool=pool_id, tenant=telemetry.tenant_label(tenant), blocks=len(hashes), hits=hit
            )
        return hit, states

    @request
    def touch(self, pool_id: str, tenant: bytes, hashes: Sequence[bytes]) -> int:
        check_tenant(tenant)
        check_hashes(hashes, self.config.max_batch_blocks)
        with self.pools.use(pool_id) as pool:
            return self.index.touch(pool.namespace, tenant, hashes)

    @request
    def offload(
        self,
        pool_id: str,
        tenant: bytes,
        parent_hash: bytes | None,
        hashes: Sequence[bytes],
        pages: Sequence[int],
        wait_event: bytes | None = None,
        deadline: Deadline = NO_DEADLINE,
    ) -> OffloadResult:
        """Seal and store pages. ``deadline``: the engine contract (see
        ``kvseal.server.deadline``): no page is read once it has passed, and
        the sealed blocks are published only while the commit window is open;
        on any failure nothing read for this request is published."""
        check_tenant(tenant)
        check_hashes(hashes, self.config.max_batch_blocks)
        if parent_hash is not None and len(parent_hash) != HASH_BYTES:
            raise BadRequest(
                f"parent_hash has {len(parent_hash)} bytes; hashes are {HASH_BYTES} bytes"
            )
        check_event(wait_event, self.backend.kind)
        with self.pools.use(pool_id) as pool:
            check_pages(pool, hashes, pages, self.config.max_batch_bytes)
            ns, size = pool.namespace, pool.block_bytes
            # What can fail before sealing fails before anything is reserved.
            deadline.check("the first page")
            # Before the victims are chosen: a Drop naming one after this
            # point skips its snapshot (StoreTier.drop_mark).
            mark = self.store.drop_mark() if self.store is not None else 0
            with telemetry.stage("reserve"):
                plan = self.index.begin_store(ns, tenant, parent_hash, hashes, size)
                telemetry.annotate(evicted_blocks=len(plan.evicted), new_blocks=len(plan.new))
            if self.store is not None:  # before the victims' slots are reused
                try:
                    self.store.evicting(plan.evicted, mark)
                except BaseException:  # a snapshot failed (EIO, MemoryError): undo it all
                    self.index.abort_store(plan, ())  # nothing written: every victim back
                    raise
            blocks = [
                BlockIO(
                    pages[pos],
                    e.extent,
                    BlockAD(ns, tenant, e.block_hash, e.generation),
                    size,
                )
                for e, pos in zip(plan.new, plan.new_positions, strict=True)
            ]
            t0 = time.perf_counter()
            try:
                with telemetry.stage("seal", blocks=len(blocks), bytes=len(blocks) * size):
                    records = (
                        self.backend.seal_blocks(
                            pool.mapped, blocks, self.region, wait_event, deadline=deadline
                        )
                        if blocks
                        else []
                    )
            except BaseException as exc:
                # Victims whose bytes no new block may have overwritten come
                # back exactly as they were: a failed store evicts nothing else.
                self.index.abort_store(plan, written_positions(exc, len(plan.new)))
                if isinstance(exc, KeyDestroyed):  # a Drop of the tenant won the race
                    raise TenantDropped(
                        "a Drop of the tenant destroyed its keys while the blocks were "
                        "sealed; nothing was stored"
                    ) from exc
                raise
            try:
                if not self._serving:  # stopped (abort) while sealing: publish nothing
                    raise ShuttingDown("kvseal stopped serving while this offload ran")
                # Publishing is this request's commit (kvseal.server.deadline).
                deadline.check_commit("publishing the sealed blocks")
            except BaseException:
                self.index.abort_store(plan, range(len(plan.new)))  # every block was written
                for rec in records:
                    self.sealer.forget(rec.epoch)
                raise
            with telemetry.stage("commit"):
                self.index.complete_store(plan.new, records)
            if self.store is not None:
                self.store.stored(ns, tenant, plan.new)
            elapsed = time.perf_counter() - t0
        telemetry.annotate(
            pool=pool_id,
            tenant=telemetry.tenant_label(tenant),
            blocks=len(hashes),
            stored_blocks=len(blocks),
            bytes=len(blocks) * size,
            evicted_blocks=len(plan.evicted),
        )
        nbytes = len(blocks) * size
        self._count(
            pool,
            offloaded_blocks=len(blocks),
            offloaded_bytes=nbytes,
            evicted_blocks=len(plan.evicted),
        )
        if blocks and self.observer.on_transfer:
            self.observer.on_transfer("offload", len(blocks), nbytes, elapsed)
        return OffloadResult(plan.outcomes, len(blocks), nbytes, len(plan.evicted))

    @request
    def restore(
        self,
        pool_id: str,
        tenant: bytes,
        hashes: Sequence[bytes],
        pages: Sequence[int],
        *,
        release: bool,
        wait_event: bytes | None = None,
        deadline: Deadline = NO_DEADLINE,
    ) -> RestoreResult:
        """Verify blocks and write them into pages, all or none. ``deadline``:
        the engine contract (``kvseal.server.deadline``): the writes start only
        before the cutoff, and no page is written once a failure can have
        reached the engine."""
        check_tenant(tenant)
        check_hashes(hashes, self.config.max_batch_blocks)
        check_event(wait_event, self.backend.kind)
        with self.pools.use(pool_id) as pool:
            check_pages(pool, hashes, pages, self.config.max_batch_bytes)
            deadline.check("the first page")
            ns = pool.namespace
            telemetry.annotate(
                pool=pool_id,
                tenant=telemetry.tenant_label(tenant),
                blocks=len(hashes),
                release=release,
            )
            if self.store is not None:  # blocks only the store holds: into the host tier
                with telemetry.stage("store"):
                    bad = self.store.promote(ns, tenant, hashes, pool.block_bytes, deadline)
                if bad:
                    abort = self.config.integrity_policy is IntegrityPolicy.ABORT
                    self._integrity_failure(pool, bad, abort=abort, where="the store")
            with telemetry.stage("pin"):
                entries = self.index.begin_restore(ns, tenant, hashes)
            failed_idx: list[int] = []
            try:
                records = []
                for e in entries:
                    assert e.record is not None  # READY entries always have a record
                    records.append(e.record)
                blocks = [
                    BlockIO(p, e.extent, BlockAD(ns, tenant, e.block_hash, e.generation), e.size)
                    for e, p in zip(entries, pages, strict=True)
                ]
                t0 = time.perf_counter()
                with telemetry.stage("open", blocks=len(blocks)):
                    failed_idx = self.backend.open_blocks(
                        pool.mapped, blocks, records, self.region, wait_event, deadline=deadline
                    )
                elapsed = time.perf_counter() - t0
            except KeyDestroyed:
                # A Drop(all_of_tenant) raced this restore and won: the keys are
                # gone, nothing was written, and the drop removes the entries.
                self.index.complete_restore(entries, release=False)
                self._count(pool, restores_of_dropped=1)
                raise
            except BaseException:
                self.index.complete_restore(entries, release=False)
                raise
            failed = [entries[i] for i in failed_idx]
            if failed and self.config.integrity_policy is IntegrityPolicy.ABORT:
                self.index.complete_restore(entries, release=False)
                self._integrity_failure(pool, [e.block_hash for e in failed], abort=True)
            self.index.complete_restore(
                entries,
                release=release and not failed,
                failed=failed,
            )
        if failed:
            self._integrity_failure(pool, [e.block_hash for e in failed], abort=False)
        nbytes = sum(e.size for e in entries)
        telemetry.annotate(restored_blocks=len(entries), bytes=nbytes)
        self._count(pool, restored_blocks=len(entries), restored_bytes=nbytes)
        if self.observer.on_transfer:
            self.observer.on_transfer("restore", len(entries), nbytes, elapsed)
        return RestoreResult(len(entries), nbytes)

    def _integrity_failure(
        self, pool: Pool, failed: list[bytes], *, abort: bool, where: str = "host memory",
        msg: str | None = None,
    ) -> None:  # fmt: skip
        n = len(failed) or 1  # a scope marker (msg) counts as one
        self._count(pool, integrity_failures=n)
        telemetry.event(
            "kvseal.integrity_failure",
            pool=pool.pool_id,
            blocks=len(failed),
            policy="abort" if abort else "drop",
        )
        if self.observer.on_integrity_failure:
            self.observer.on_integrity_failure(pool.pool_id, n)
        which = ", ".join(h.hex()[:16] for h in failed[:8])
        msg = msg or (
            f"{len(failed)} block(s) failed authentication ({where} was altered, swapped, "
            f"replayed or truncated): {which}; nothing was written to the pool"
        )
        if abort:
            log.critical(
                "INTEGRITY FAILURE in pool %s: %s; policy abort: stopping", pool.pool_id, msg
            )
            self.stop_serving()
            if self._on_integrity_abort is not None:
                self._on_integrity_abort()
            raise IntegrityFailure(msg + "; kvseal is stopping (policy abort)")
        log.error(
            "INTEGRITY FAILURE in pool %s: %s; policy drop: blocks evicted", pool.pool_id, msg
        )
        raise IntegrityFailure(msg + "; the blocks were evicted (policy drop)")

    def _store_marker_failure(self, pool: Pool) -> None:
        """A Lookup read the tenant's scope marker (or floor) and it failed its
        checks: an integrity failure like any other. ``abort`` stops the
        daemon (IntegrityFailure); ``drop`` counts it and the Lookup answers
        what the host tier holds (the store's blocks of the tenant are gone)."""
        abort = self.config.integrity_policy is IntegrityPolicy.ABORT
        msg = "the tenant's scope marker in the store failed its checks (altered or replaced)"
        if abort:
            self._integrity_failure(pool, [], abort=True, where="the store", msg=msg)
        self._count(pool, integrity_failures=1)
        if self.observer.on_integrity_failure:
            self.observer.on_integrity_failure(pool.pool_id, 1)
        log.error("INTEGRITY FAILURE in pool %s: %s; policy drop: removed", pool.pool_id, msg)

    @request
    def release(self, pool_id: str, tenant: bytes, hashes: Sequence[bytes]) -> int:
        """Release restored blocks' host copies (write-back, see the proto's
        ReleaseRequest): what a Restore with ``release`` does after its
        writes, without a restore. Blocks absent or not READY are skipped;
        returns how many left the tier. Only the index changes (the store's
        copies are not touched), so nothing here can fail half-way."""
        check_tenant(tenant)
        check_hashes(hashes, self.config.max_batch_blocks)
        with self.pools.use(pool_id) as pool:
            released = self.index.release(pool.namespace, tenant, hashes)
        return len(released)

    @request
    def drop(
        self, pool_id: str, tenant: bytes, hashes: Sequence[bytes], *, all_of_tenant: bool
    ) -> int:
        """Remove blocks (and their descendants). With ``all_of_tenant`` also
        crypto-erase: every key of the scope (pool namespace, tenant) is wiped
        first, so none of the tenant's ciphertext in this namespace can be opened
        again, whoever kept it and its index entries; the same tenant in another
        namespace, and every other tenant, keep their keys and blocks.

        Order matters: the keys go *before* the index entries. A store of the
        tenant that reserved its entries before the index drop is removed by it
        (whatever key it sealed under); one that reserves after it draws its
        nonces after the keys were destroyed, so under a fresh key. No entry
        that survives the drop refers to a destroyed key. A restore pinning
        blocks of the scope meanwhile fails with KeyDestroyed (NOT_FOUND,
        nothing written, not counted as an integrity failure) unless it had
        already begun writing pages, in which case it completed before the drop
        (see ``BlockSealer.require_live``). Device key copies are wiped before
        this returns (the CUDA backend may first finish a request in flight)."""
        check_tenant(tenant)
        if all_of_tenant and hashes:
            raise BadRequest("give either block_hashes or all_of_tenant, not both")
        if not all_of_tenant:
            check_hashes(hashes, self.config.max_batch_blocks)
        destroyed, tier = 0, self.store
        with self.pools.use(pool_id) as pool:
            ns = pool.namespace  # the store's fences go around the host tier's drop
            fence = tier and tier.begin_drop(ns, tenant, hashes, all_of_tenant=all_of_tenant)
            try:
                if all_of_tenant:
                    destroyed = self.sealer.destroy_scope(ns, tenant)
                removed = self.index.drop(ns, tenant, None if all_of_tenant else hashes)
            finally:  # always: an open fence would stop the tenant's spills for good
                store_failed = tier.end_drop(fence) if tier and fence else None
        if destroyed:
            self.backend.retire_keys()
            log.info(
                "dropped tenant %s of pool %s: %d block(s), %d key epoch(s) destroyed",
                telemetry.tenant_label(tenant),
                pool_id,
                len(removed),
                destroyed,
            )
        self._count(pool, dropped_blocks=len(removed), key_scopes_destroyed=1 if destroyed else 0)
        if store_failed is not None:
            raise store_failed
        return len(removed)

    def close(self, timeout: float = 30.0) -> bool:
        """Stop serving, wait up to ``timeout`` seconds for requests in flight,
        then release pools, backend and region. Returns False (and releases
        nothing: memory a request may still touch stays mapped until the
        process exits) if requests were still running at the deadline."""
        self.stop_serving()
        deadline = time.monotonic() + timeout
        with self._inflight_cv:
            while self._inflight:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.error("%d request(s) still running; not releasing memory", self._inflight)
                    return False
                self._inflight_cv.wait(left)
        for pool in self.pools.all():
            try:
                self.pools.remove(pool.pool_id)
            except Exception:  # noqa: S112 - best effort at shutdown
                continue
        if self.store is not None:  # its spill thread reads the region and the sealer
            self.store.close()
        # The region first: on the CUDA backend it is pinned/registered host memory
        # whose release needs the context that backend.close() gives back.
        self.region.close()
        self.backend.close()
        self.sealer.close()  # last: wipe the keys (the backend no longer needs them)
        return True
