"""The scheduler's local copy of what a kvseal daemon holds for this engine.

vLLM asks ``OffloadingManager.lookup`` once per block, synchronously, on the
scheduler thread; a gRPC round trip there (~0.8 ms) would stall every step.
So lookups are answered from memory: a :class:`DaemonMirror` per rank keeps
the set of READY blocks (tenant, 32-byte hash) of this engine's namespace on
that rank's daemon, fed by the daemon's ``WatchEvents`` stream in a background
thread. The scheduler thread only reads a Python set.

How the mirror stays honest (each path in docs/vllm.md, "Many tenants"):

- The namespace is learnt from the daemon: the mirror registers and holds an
  *observer pool* (``RegisterPoolRequest.observer``: no memory) with the
  worker pool's fingerprint and block geometry; its pool id scopes the event
  stream and the mirror's lookups.
- The daemon streams a tenant's events to that pool only once a request on it
  named the tenant, which a new tenant's first store may precede. So this
  engine's own stores do not wait for the stream: the manager reports every
  store job that ended (:meth:`DaemonMirror.stored`), such a block is a hit at
  once, and a background ``Lookup`` (which names the tenant before it
  answers) keeps or drops it. The stream adds others' blocks and removes
  evicted ones.
- A ``Lookup``'s answer (resync, verification, discovery) is applied only to
  blocks the mirror heard nothing newer of while it was in flight.
- It subscribes, then resynchronises (also after falling behind); a daemon
  gone sets the blocks aside (the same daemon back gives them back after a
  re-check, a restarted one drops them).
- Still briefly wrong (an eviction not yet announced), a restore fails with
  nothing written, vLLM recomputes, and the manager has the mirror forget the
  blocks.

Per-tenant state is bounded: a tenant with no block, nothing to verify and no
request for ``tenant_idle_s`` is forgotten (at most :data:`MAX_TENANTS`; the
least recently used idle ones first); its next request names it again, and
its stores are verified as above, so forgetting loses no hit.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext, suppress
from typing import Any

import grpc
from kvseal.client import ClientConfig, KVSealClient, KVSealRpcError, PoolHold
from kvseal.core.discovery import Discovery
from kvseal.core.geometry import observer_geometry
from kvseal.core.mirror_rounds import RESYNC_BATCH, sweep_tenants, touch_round, verify_round
from kvseal.v1 import kvseal_pb2 as pb

__all__ = ["DaemonMirror", "observer_geometry"]

log = logging.getLogger("kvseal.core")

# Recent removals remembered (at most this many, none older than TOMBSTONE_S,
# well above a store job's bound): a store reported done after its block was
# announced removed must not bring it back unverified.
TOMBSTONES = 1 << 12
TOMBSTONE_S = 60.0
TENANT_IDLE_S = 300.0  # unused this long, with no block and nothing to verify: forgotten
SET_CHUNK = 1024  # blocks of one event applied per hold of the update lock
SWEEP_S = 1.0  # how often the background thread looks for idle tenants

# (rank, tenant, hash, present) -> None: called on every change, under no lock
# but the ``update_lock`` the mirror was given (if any).
ChangeFn = Callable[[int, bytes, bytes, bool], None]
# (rank, event): every event of the stream, as the daemon sent it (its medium,
# locality, restorable), before its presence changes reach on_change; None:
# the stream had a gap (a new registration, a resubscription), events may have
# been lost. Under ``update_lock``.
TierFn = Callable[[int, pb.BlockEvent | None], None]
Key = tuple[bytes, bytes]  # (tenant, hash)


# Any 32-byte hash: a Touch of it only names the tenant on the observer pool
# (touching a block that is absent changes nothing; a Touch, unlike a Lookup,
# is not counted as a lookup by the daemon's statistics).
_INTRO_HASH = bytes(32)
_WAKE: tuple[bytes, list[bytes]] = (b"", [])  # a no-op item: wakes the background thread


class DaemonMirror:
    """READY blocks of one namespace on one daemon, kept current in the background.

    ``contains`` and ``blocks`` are safe from any thread; ``on_change`` (given at
    construction) is called from the mirror's threads for every block that
    appears or disappears (and from the caller's thread for :meth:`forget` and
    :meth:`stored`). ``close`` stops the threads and unregisters the observer pool.

    ``update_lock`` (optional, e.g. the vLLM manager's ``lock``) is held while
    one batch of changes (one event, one Lookup answer, one store report, one
    reset) is applied to the mirror and passed to ``on_change``: whoever holds
    it sees either none or all of a batch (an event of more than
    :data:`SET_CHUNK` blocks: of each chunk of it), and no batch lands while it
    is held.
    It is never held across an RPC, and it must be reentrant if the holder
    itself calls :meth:`forget` or :meth:`stored`.

    ``discovery``: remember blocks found absent, for :meth:`discover` (off:
    nothing is remembered). ``tenant_idle_s``: see the module doc.

    What the mirror learnt of the daemon at its last registration (for the
    engine's dashboards): ``server_instance``, ``backend`` (``"cpu"``,
    ``"cuda"``; None before the first registration), ``host_bytes_capacity``,
    ``block_bytes`` and ``integrity_policy`` (0 / "" when the daemon's Stats
    could not be read).
    """

    def __init__(
        self,
        rank: int,
        target: str,
        pool_name: str,
        fingerprint: bytes,
        geometry: pb.PoolGeometry,
        on_change: ChangeFn,
        *,
        retry_s: float = 0.5,
        update_lock: AbstractContextManager[Any] | None = None,
        discovery: bool = True,
        tenant_idle_s: float = TENANT_IDLE_S,
        identity: pb.DeploymentIdentity | None = None,
        on_tier: TierFn | None = None,
    ) -> None:
        self.rank = rank
        self.target = target
        # Every call of the mirror runs on its own threads, never the scheduler's:
        # a lookup may take as long as any other call (the hot-path 0.2 s bound
        # would make a discovery on a busy daemon a permanent miss).
        self._client = KVSealClient(
            ClientConfig(target=target, timeout_s=2.0, lookup_timeout_s=2.0)
        )
        self._pool_name = pool_name
        self._fingerprint = fingerprint
        self._geometry = observer_geometry(geometry)
        self._on_change = on_change
        self._on_tier = on_tier
        self._identity = identity
        self.warnings: tuple[str, ...] = ()  # the daemon's, at the last registration
        self._update_lock: AbstractContextManager[Any] = update_lock or nullcontext()
        self._retry_s = retry_s
        self._discovery = discovery
        self.tenant_idle_s = tenant_idle_s
        # _lock guards _ready, _unverified, _suspended, _watches and _removed_at
        # (taken after update_lock, never across an RPC).
        self._lock = threading.Lock()
        self._ready: dict[bytes, set[bytes]] = {}  # tenant -> hashes READY on the daemon
        # tenant -> blocks a Lookup must confirm (stores this engine completed
        # that the stream has not announced): the background thread's work.
        self._unverified: dict[bytes, dict[bytes, None]] = {}
        # Blocks held when the daemon went away: back after a re-check if the
        # same daemon answers again, dropped if a restarted one does.
        self._suspended: dict[bytes, set[bytes]] = {}
        # One set per Lookup in flight: every block the mirror hears of meanwhile
        # (its answer is older than that fact and must not override it).
        self._watches: list[set[Key]] = []
        # Recent removals (TOMBSTONES), oldest first. An OrderedDict: trimming a
        # plain dict from its front rescans deleted slots (quadratic on one big event).
        self._removed_at: OrderedDict[Key, float] = OrderedDict()
        self._stream_gen = 0  # +1 per subscription: an answer across two is re-asked
        self._stop = threading.Event()
        self._call: object | None = None
        self._hold: PoolHold | None = None
        self.namespace: bytes | None = None
        self.pool_id: str | None = None
        self.server_instance: str | None = None
        self.backend: str | None = None
        self.host_bytes_capacity = 0
        self.block_bytes = 0
        self.integrity_policy = ""
        self.store_policy = ""  # "" = the daemon has no store tier
        self.store_locality = ""
        self.synced = threading.Event()  # set while the stream is live and resynced
        # Discovery (opt-in): blocks the daemon held before this mirror subscribed.
        self.discovery = Discovery(self)
        # Tenants this mirror names on its observer pool -> when last used (LRU
        # order: the least recent first). The scheduler thread adds; the
        # background thread forgets idle ones (_sweep).
        self._tenants: dict[bytes, float] = {}
        self._tenants_lock = threading.Lock()
        # ...and those the daemon confirmed named on the current registration
        # (mutated by the background thread only; replaced on a new registration).
        self.named: set[bytes] = set()
        # (tenant, hashes): hashes empty = only name the tenant (introduce)
        self._intro_q: queue.SimpleQueue[tuple[bytes, list[bytes]]] = queue.SimpleQueue()
        self._introducer: threading.Thread | None = None
        self.touched = 0  # hashes the daemon confirmed touched (recency), for tests
        self.resyncs = 0
        self.resets = 0
        self.verified = 0  # blocks a verification Lookup answered (kept or dropped)
        self.forgotten_tenants = 0  # tenants reclaimed as idle
        self._thread = threading.Thread(target=self._run, name=f"kvseal-mirror-{rank}", daemon=True)
        self._thread.start()
        self._start_introducer()

    # ------------------------------------------------------------ reads

    def contains(self, tenant: bytes, h: bytes) -> bool:
        s = self._ready.get(tenant)
        return s is not None and h in s

    def tenants(self) -> int:
        """Tenants this mirror remembers (named, or to be named)."""
        return len(self._tenants)

    def introduce(self, tenant: bytes) -> None:
        """The daemon scopes a pool's event stream to the tenants that requests
        on that pool named (README "Event and tenant metadata"); the worker's
        transfers go through the worker's pool, so the first time the scheduler
        meets a tenant the mirror names it on its own pool, in the background
        (one Touch), and from then on receives that tenant's events. Cheap (a
        short lock, no RPC) and idempotent: call it for every new request (it
        also marks the tenant used, for the idle sweep). ``named`` holds the
        tenants the daemon confirmed; a failed naming is retried. This engine's
        own stores do not wait for it (:meth:`stored`)."""
        now = time.monotonic()
        with self._tenants_lock:
            known = self._tenants.pop(tenant, None) is not None
            self._tenants[tenant] = now
        if not known:
            self._intro_q.put((tenant, []))

    def touch(self, tenant: bytes, hashes: Iterable[bytes]) -> None:
        """Mark blocks as just used in the daemon's LRU, in the background.

        vLLM offers every block of a request for store, also those the tier
        already holds; the manager skips those (no re-encryption), and this is
        how their use still counts: without it, a prefix the engine keeps
        serving from its own cache ages in the tier and is evicted first, just
        before the engine evicts it too (vLLM's own CPU manager touches such
        blocks at request end). Never on the scheduler thread: one coalesced
        Touch per tenant per round of the background thread; a failed Touch
        changes nothing but recency and is logged, not retried."""
        hs = list(hashes)
        if hs:
            self._intro_q.put((tenant, hs))

    def stored(self, tenant: bytes, hashes: Sequence[bytes], since: float) -> None:
        """This engine's store of ``hashes`` (begun at ``since``, ``time.monotonic``)
        ended as done. Each block the mirror has not heard of is a hit at once,
        and is verified by a background ``Lookup`` (which also names the tenant,
        before it answers): kept if the daemon holds it, dropped if not (a
        dropped store, an eviction the stream could not announce). A block the
        stream announced removed after ``since`` only gets the Lookup (the
        removal may be this very block's eviction). While the mirror is not
        subscribed nothing is claimed: the Lookup decides once it is."""
        live = self.synced.is_set()
        add: list[bytes] = []
        with self._update_lock:
            with self._lock:
                s = self._ready.get(tenant)
                todo = None
                for h in hashes:
                    if s is not None and h in s:
                        continue  # announced (or already claimed and being verified)
                    if todo is None:
                        todo = self._unverified.setdefault(tenant, {})
                    todo[h] = None
                    removed = self._removed_at.get((tenant, h))
                    if live and (removed is None or removed < since):
                        add.append(h)
                if add:
                    self._apply_locked(tenant, add, True)
            for h in add:
                self._on_change(self.rank, tenant, h, True)
        if todo is not None:
            self._intro_q.put(_WAKE)

    def forget(self, tenant: bytes, hashes: Iterable[bytes]) -> None:
        """Drop blocks a restore could not bring back (see the manager's
        load_failed) now, and have a background ``Lookup`` re-check them: those
        the daemon still holds (the rest of a restore that one evicted or
        tampered block failed: the daemon evicts only the blocks that failed)
        come back; the others stay away until the daemon announces them anew.
        vLLM does not offer a block it believes offloaded again, so without
        the re-check an intact block would stay a miss."""
        hs = list(hashes)
        self._set(tenant, hs, False)
        with self._lock:
            self._unverified.setdefault(tenant, {}).update(dict.fromkeys(hs))
        self._intro_q.put(_WAKE)

    def released(self, tenant: bytes, hashes: Iterable[bytes]) -> None:
        """Drop blocks the daemon freed on a write-back restore (``release``).
        Unlike :meth:`forget` nothing is re-checked: the daemon said it no
        longer holds them, so a background ``Lookup`` could only confirm it."""
        hs = list(hashes)
        self._set(tenant, hs, False)
        with self._lock:
            pending = self._unverified.get(tenant)
            if pending:
                for h in hs:
                    pending.pop(h, None)

    def blocks(self) -> int:
        with self._lock:
            return sum(len(s) for s in self._ready.values())

    # ------------------------------------------------------------ updates

    def _apply_locked(self, tenant: bytes, hashes: Iterable[bytes], present: bool) -> list[bytes]:
        """Apply one fact to ``_ready`` (under ``_lock``): the blocks whose state
        changed. Every block is noted in the Lookups in flight (their answers
        are older) and, removed, in the tombstones and (discovery) as absent."""
        changed: list[bytes] = []
        s = self._ready.setdefault(tenant, set())
        now = time.monotonic()
        for h in hashes:
            k = (tenant, h)
            for w in self._watches:
                w.add(k)
            if present:
                if h not in s:
                    s.add(h)
                    changed.append(h)
            else:
                if h in s:
                    s.discard(h)
                    changed.append(h)
                self._removed_at.pop(k, None)
                self._removed_at[k] = now
                if self._discovery:
                    self.discovery.absent.add(k)
        if not s:
            del self._ready[tenant]
        rm = self._removed_at  # oldest first (a removal re-inserts its key)
        while rm and (len(rm) > TOMBSTONES or next(iter(rm.values())) < now - TOMBSTONE_S):
            rm.popitem(last=False)
        return changed

    def _set(
        self,
        tenant: bytes,
        hashes: Iterable[bytes],
        present: bool,
        event: pb.BlockEvent | None = None,
    ) -> None:
        # The update lock first (the order every thread takes them in): the
        # batch reaches the mirror and on_change as one step for its holder.
        # ``event``: the stream's event this is (passed on to on_tier, with the
        # first chunk). A batch of more than SET_CHUNK blocks is applied a chunk
        # per lock hold, so that no scheduler step waits on one large event.
        hs = list(hashes)
        for i in range(0, max(1, len(hs)), SET_CHUNK):
            with self._update_lock:
                with self._lock:
                    changed = self._apply_locked(tenant, hs[i : i + SET_CHUNK], present)
                if i == 0 and event is not None and self._on_tier is not None:
                    self._on_tier(self.rank, event)  # first: it may still need the hashes
                for h in changed:
                    self._on_change(self.rank, tenant, h, present)

    def _watch_begin(self) -> set[Key]:
        w: set[Key] = set()
        with self._lock:
            self._watches.append(w)
        return w

    def _watch_end(self, w: set[Key]) -> None:
        with self._lock:
            self._watches = [x for x in self._watches if x is not w]

    def _answer(
        self,
        tenant: bytes,
        hashes: Sequence[bytes],
        ready: Sequence[bool],
        watch: set[Key],
        *,
        add: bool = True,
        drop: bool = True,
    ) -> None:
        """Apply a Lookup's answer, block by block, except to the blocks the mirror
        heard something newer of while it was in flight (``watch``). ``add``/
        ``drop``: whether READY / not-READY answers are applied."""
        up = [
            h for h, r in zip(hashes, ready, strict=True) if r and add and (tenant, h) not in watch
        ]
        down = [
            h
            for h, r in zip(hashes, ready, strict=True)
            if not r and drop and (tenant, h) not in watch
        ]
        with self._update_lock:
            with self._lock:
                gained = self._apply_locked(tenant, up, True) if up else []
                lost = self._apply_locked(tenant, down, False) if down else []
            for h in gained:
                self._on_change(self.rank, tenant, h, True)
            for h in lost:
                self._on_change(self.rank, tenant, h, False)

    def _suspend(self) -> None:
        """The daemon went away: its blocks leave the lookups (a restore could not
        reach it) and are kept aside for :meth:`_register`."""
        self.discovery.forget_all()
        with self._update_lock:
            with self._lock:
                old, self._ready = self._ready, {}
                for tenant, hashes in old.items():
                    self._suspended.setdefault(tenant, set()).update(hashes)
            for tenant, hashes in old.items():
                for h in hashes:
                    self._on_change(self.rank, tenant, h, False)

    def _clear(self) -> None:
        """A restarted daemon (new key, empty cache): nothing it was said to hold
        is there. Blocks still to verify stay queued (stores that may have ended
        on the new daemon); the verification decides."""
        self.discovery.forget_all()
        with self._update_lock:
            with self._lock:
                old, self._ready = self._ready, {}
                self._suspended = {}
            for tenant, hashes in old.items():
                for h in hashes:
                    self._on_change(self.rank, tenant, h, False)

    # ------------------------------------------------------------ background

    def _start_introducer(self) -> None:
        if self._introducer is None:
            self._introducer = threading.Thread(
                target=self._introduce_run, name=f"kvseal-introduce-{self.rank}", daemon=True
            )
            self._introducer.start()

    def _introduce_run(self) -> None:
        """Names tenants, touches blocks, verifies stores and forgets idle tenants:
        every RPC of the scheduler's requests, off the scheduler thread."""
        last_sweep = time.monotonic()
        while not self._stop.is_set():
            try:
                first: tuple[bytes, list[bytes]] | None = self._intro_q.get(timeout=0.2)
            except queue.Empty:
                first = None
            # Coalesce whatever else is queued: one Touch per tenant per round.
            todo: dict[bytes, dict[bytes, None]] = {}  # ordered, deduplicated
            item = first
            while item is not None:
                tenant, hs = item
                if tenant:
                    todo.setdefault(tenant, {}).update(dict.fromkeys(hs or [_INTRO_HASH]))
                try:
                    item = self._intro_q.get_nowait()
                except queue.Empty:
                    item = None
            try:
                retry = self._touch_round(todo)
                retry = self._verify_round() or retry
                now = time.monotonic()
                if now - last_sweep >= SWEEP_S:
                    last_sweep = now
                    self._sweep(now)
            except Exception:  # never let this thread die: naming would stop
                log.exception("kvseal mirror %d: background round failed", self.rank)
                retry = True
            if retry:
                self._stop.wait(self._retry_s)

    def _touch_round(self, todo: dict[bytes, dict[bytes, None]]) -> bool:
        return touch_round(self, todo)

    def _verify_round(self) -> bool:
        """One Lookup per tenant (per batch) of the blocks to verify (see
        :meth:`stored`, :meth:`forget`); True when some must be re-asked."""
        return verify_round(self)

    def _sweep(self, now: float) -> None:
        sweep_tenants(self, now)

    # ------------------------------------------------------------ stream

    def _register(self) -> None:
        # An observer pool maps nothing, on any backend (a CUDA daemon refuses
        # shared memory): the registration is only a namespace and a pool id.
        h = self._client.register_pool(
            self._pool_name,
            self._fingerprint,
            self._geometry,
            observer=True,
            identity=self._identity,
        )
        for w in h.warnings:
            if w not in self.warnings:  # once per mirror, not per reconnection
                log.warning("kvseal daemon %d (%s): %s", self.rank, self.target, w)
        self.warnings = h.warnings
        if self.server_instance is not None and h.server_instance != self.server_instance:
            self.resets += 1
            self._clear()  # a restarted daemon: new key, empty cache
        else:
            # The same daemon: what was set aside comes back (re-checked by the
            # resync that follows every registration).
            with self._update_lock:
                with self._lock:
                    back, self._suspended = self._suspended, {}
                    gained = {t: self._apply_locked(t, hs, True) for t, hs in back.items()}
                for t, hs in gained.items():
                    for x in hs:
                        self._on_change(self.rank, t, x, True)
        self.namespace, self.pool_id, self.server_instance = (
            h.namespace,
            h.pool_id,
            h.server_instance,
        )
        self.block_bytes = int(h.block_bytes)
        try:  # facts for dashboards only: a failed Stats costs nothing else
            st = self._client.stats()
            self.backend = pb.Backend.Name(st.backend).removeprefix("BACKEND_").lower()
            self.host_bytes_capacity = int(st.host_bytes_capacity)
            self.integrity_policy = st.integrity_policy
            self.store_policy, self.store_locality = st.store_policy, st.store_locality
        except KVSealRpcError as e:
            log.info("kvseal mirror %d: Stats failed: %s", self.rank, e)
        if self._hold is not None:
            self._hold.close(wait=0)
        self._hold = PoolHold(self._client._stub, h.pool_id, retry=True)
        # A new registration has named no tenant yet: name every one we know
        # (those with blocks are named by the resync's Lookups as well).
        self.named = set()
        with self._tenants_lock:
            known = list(self._tenants)
        for tenant in known:
            self._intro_q.put((tenant, []))

    def _watch(self) -> Any:
        """Open the event stream and return once the daemon has subscribed it (its
        "kvseal-watch" header): from then on no event is missed, so the resync
        that follows cannot race a store. The raw call, not
        ``KVSealClient.watch_events``: ``close`` cancels it from another thread."""
        req = pb.WatchEventsRequest()
        scope = "pool_id"  # the field of pool-scoped watches, where the proto has it
        if scope in pb.WatchEventsRequest.DESCRIPTOR.fields_by_name:
            setattr(req, scope, self.pool_id)
        call = self._client._stub.WatchEvents(req)
        self._call = call
        call.initial_metadata()
        self._stream_gen += 1
        return call

    def _resync(self) -> None:
        """Keep only the blocks the daemon still reports READY (each Lookup also
        names its tenant on the observer pool, before it answers)."""
        assert self.pool_id is not None
        self.discovery.forget_all()  # blocks stored during the gap may be known again
        if self._on_tier is not None:  # the tiers' events of the gap are lost
            with self._update_lock:
                self._on_tier(self.rank, None)
        with self._lock:
            snapshot = {t: list(s) for t, s in self._ready.items()}
        for tenant, hashes in snapshot.items():
            for i in range(0, len(hashes), RESYNC_BATCH):
                batch = hashes[i : i + RESYNC_BATCH]
                watch = self._watch_begin()
                try:
                    states = self._client.lookup(self.pool_id, tenant, batch).states
                finally:
                    self._watch_end(watch)
                ready = [st == pb.BLOCK_READY for st in states]
                self._answer(tenant, batch, ready, watch, add=False)
            self.named.add(tenant)
        self.resyncs += 1

    def _run(self) -> None:
        need_resync = False
        while not self._stop.is_set():
            try:
                if self.pool_id is None or self._hold is None or self._hold.ended.is_set():
                    self._register()
                    need_resync = True  # a new pool id names no tenant: re-check all
                stream = self._watch()
                if need_resync:
                    self._resync()
                    need_resync = False
                self.synced.set()
                self._intro_q.put(_WAKE)  # stores waiting for a live stream
                for ev in stream:
                    if ev.namespace != self.namespace:
                        continue
                    # A removal from one tier of a block the other still holds
                    # (restorable) changes nothing here: the other tier's own
                    # STORED made it present, and a later removal of it there
                    # says when it is gone.
                    if ev.kind == pb.BLOCK_STORED:
                        self._set(ev.tenant, ev.block_hashes, True, ev)
                    elif ev.kind == pb.BLOCK_REMOVED and not ev.restorable:
                        self._set(ev.tenant, ev.block_hashes, False, ev)
                    elif self._on_tier is not None:
                        with self._update_lock:
                            self._on_tier(self.rank, ev)
                    if self._stop.is_set():
                        return
                need_resync = True  # the stream ended: resubscribe and re-check
            except (KVSealRpcError, grpc.RpcError) as err:
                e = err if isinstance(err, KVSealRpcError) else KVSealRpcError.from_rpc(err)
                self.synced.clear()
                if self._stop.is_set():
                    return
                if e.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                    need_resync = True  # fell behind: events were lost
                    continue
                # The daemon is gone or refused us: set its blocks aside until it
                # answers again (the same daemon gives them back, re-checked).
                log.info("kvseal mirror %d: %s; blocks set aside, retrying", self.rank, e)
                self._suspend()
                self.pool_id = None
            except Exception:  # the mirror must never take the scheduler down
                self.synced.clear()
                log.exception("kvseal mirror %d failed; blocks set aside, retrying", self.rank)
                self._suspend()
                self.pool_id = None
            self._stop.wait(self._retry_s)

    def close(self) -> None:
        self._stop.set()
        call = self._call
        cancel = getattr(call, "cancel", None)
        if cancel is not None:
            with suppress(Exception):
                cancel()
        hold = self._hold
        if hold is not None:
            hold.close(wait=0)
        if self.pool_id is not None:
            with suppress(KVSealRpcError):
                self._client.unregister_pool(self.pool_id)
        self._thread.join(2.0)
        self._client.close()
