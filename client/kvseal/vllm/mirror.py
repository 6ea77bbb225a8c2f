"""The scheduler's local copy of what a kvseal daemon holds for this engine.

vLLM asks ``OffloadingManager.lookup`` once per block, synchronously, on the
scheduler thread; a gRPC round trip there (~0.8 ms) would stall every step.
So lookups are answered from memory: a :class:`DaemonMirror` per rank keeps
the set of READY blocks (tenant, 32-byte hash) of this engine's namespace on
that rank's daemon, fed by the daemon's ``WatchEvents`` stream in a background
thread. The scheduler thread only reads a Python set.

How the mirror stays honest:

- The namespace is learnt from the daemon, not recomputed: the mirror
  registers an *observer pool* (``RegisterPoolRequest.observer``: no memory,
  on any backend) with the same model fingerprint and block geometry as the
  worker's KV pool, so the daemon gives it the same namespace, and keeps it
  held for the life of the process. Its pool id scopes the event stream and
  the resynchronising lookups.
- It subscribes first, then resynchronises, so no event falls in between.
- A watcher that fell behind is disconnected by the daemon (RESOURCE_EXHAUSTED):
  the mirror resubscribes and re-checks every block it believes READY with
  batched ``Lookup`` calls from its own thread, dropping the rest.
- A daemon that went away (UNAVAILABLE) or restarted (new ``server_instance``,
  a new key and an empty cache) empties the mirror.
- The mirror may still be briefly wrong (an eviction not yet announced): then
  the worker's ``Restore`` fails, nothing was written to the KV pool (the
  daemon's all-or-nothing restore), and vLLM recomputes the blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext, suppress
from typing import Any

import grpc
from kvseal.client import ClientConfig, KVSealClient, KVSealRpcError, PoolHold
from kvseal.v1 import kvseal_pb2 as pb

log = logging.getLogger("kvseal.vllm")

RESYNC_BATCH = 1024  # hashes per resynchronising Lookup (below the daemon's batch limit)
MAX_ABSENT = 1 << 20  # known-absent blocks remembered for discovery before starting over

# (rank, tenant, hash, present) -> None: called on every change, under no lock
# but the ``update_lock`` the mirror was given (if any).
ChangeFn = Callable[[int, bytes, bytes, bool], None]


# Any 32-byte hash: a Touch of it only names the tenant on the observer pool
# (touching a block that is absent changes nothing; a Touch, unlike a Lookup,
# is not counted as a lookup by the daemon's statistics).
_INTRO_HASH = bytes(32)


def observer_geometry(geometry: pb.PoolGeometry) -> pb.PoolGeometry:
    """The observer-pool geometry of a pool geometry (buffers, if any, ignored):
    the same block geometry (tokens_per_page, layers, heads, head_dim, dtype,
    layout) and ``block_bytes`` (the segments' sum, or ``geometry.block_bytes``
    when it has no segments), no pages, buffers or segments. The daemon derives
    the namespace from exactly these fields and the fingerprint, so the observer
    shares the namespace of every pool with this block geometry."""
    block_bytes = sum(s.bytes for s in geometry.segments) or geometry.block_bytes
    return pb.PoolGeometry(
        num_pages=0,
        tokens_per_page=geometry.tokens_per_page,
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        dtype=geometry.dtype,
        layout=geometry.layout,
        block_bytes=block_bytes,
    )


class DaemonMirror:
    """READY blocks of one namespace on one daemon, kept current in the background.

    ``contains`` and ``blocks`` are safe from any thread; ``on_change`` (given at
    construction) is called from the mirror's thread for every block that
    appears or disappears (and from the caller's thread for :meth:`forget`).
    ``close`` stops the thread and unregisters the observer pool.

    ``update_lock`` (optional, e.g. the vLLM manager's ``lock``) is held while
    one batch of changes (one event, one resync batch, one discovery answer,
    one reset) is applied to the mirror and passed to ``on_change``: whoever
    holds it sees either none or all of a batch, and no batch lands while it
    is held. It is never held across an RPC, and it must be reentrant if the
    holder itself calls :meth:`forget`.

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
        self._update_lock: AbstractContextManager[Any] = update_lock or nullcontext()
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._ready: dict[bytes, set[bytes]] = {}  # tenant -> hashes READY on the daemon
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
        self.synced = threading.Event()  # set while the stream is live and resynced
        # Discovery (opt-in): blocks the daemon held before this mirror subscribed.
        self._absent: set[tuple[bytes, bytes]] = set()  # checked absent (or failed)
        self._asked: set[tuple[bytes, bytes]] = set()  # queued or in flight
        self._discover_q: queue.SimpleQueue[tuple[bytes, bytes]] = queue.SimpleQueue()
        self._discoverer: threading.Thread | None = None
        # Tenants named on the observer pool, so its event stream carries them.
        self._introduced: set[bytes] = set()
        # ...and those the daemon has confirmed named on the current registration
        # (replaced, not cleared, on a new one: readers need no lock).
        self.named: frozenset[bytes] = frozenset()
        # (tenant, hashes): hashes empty = only name the tenant (introduce)
        self._intro_q: queue.SimpleQueue[tuple[bytes, list[bytes]]] = queue.SimpleQueue()
        self._introducer: threading.Thread | None = None
        self.touched = 0  # hashes the daemon confirmed touched (recency), for tests
        self.resyncs = 0
        self.resets = 0
        self._thread = threading.Thread(target=self._run, name=f"kvseal-mirror-{rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ reads

    def contains(self, tenant: bytes, h: bytes) -> bool:
        s = self._ready.get(tenant)
        return s is not None and h in s

    def introduce(self, tenant: bytes) -> None:
        """The daemon scopes a pool's event stream to the tenants that requests
        on that pool named (README "Event and tenant metadata"); the worker's
        transfers go through the worker's pool, so the first time the scheduler
        meets a tenant the mirror names it on its own pool, in the background
        (one Touch), and from then on receives that tenant's events. Cheap and
        idempotent: call it for every new request. ``named`` holds the tenants
        the daemon confirmed; a failed introduction is retried."""
        if tenant in self._introduced:
            return
        self._introduced.add(tenant)
        self._intro_q.put((tenant, []))
        self._start_introducer()

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
            self._start_introducer()

    def _start_introducer(self) -> None:
        if self._introducer is None:
            self._introducer = threading.Thread(
                target=self._introduce_run, name=f"kvseal-introduce-{self.rank}", daemon=True
            )
            self._introducer.start()

    def _introduce_run(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._intro_q.get(timeout=0.2)
            except queue.Empty:
                continue
            # Coalesce whatever else is queued: one Touch per tenant per round.
            todo: dict[bytes, dict[bytes, None]] = {}  # ordered, deduplicated
            item: tuple[bytes, list[bytes]] | None = first
            while item is not None:
                tenant, hs = item
                todo.setdefault(tenant, {}).update(dict.fromkeys(hs or [_INTRO_HASH]))
                try:
                    item = self._intro_q.get_nowait()
                except queue.Empty:
                    item = None
            pool_id = self.pool_id
            if pool_id is None:
                continue  # tenants are re-introduced after the next registration
            retry = False
            for tenant, hset in todo.items():
                hl = list(hset)
                for i in range(0, len(hl), RESYNC_BATCH):
                    try:
                        n = self._client.touch(pool_id, tenant, hl[i : i + RESYNC_BATCH])
                    except KVSealRpcError as e:
                        log.info("kvseal mirror %d: Touch failed: %s", self.rank, e)
                        if tenant not in self.named and pool_id == self.pool_id:
                            # Unnamed, the tenant's events never reach this mirror:
                            # name it again (recency alone is not worth a retry).
                            self._intro_q.put((tenant, []))
                            retry = True
                        break
                    self.touched += n
                    if pool_id == self.pool_id:
                        self.named = self.named | {tenant}
            if retry:
                self._stop.wait(self._retry_s)

    def known_absent(self, tenant: bytes, h: bytes) -> bool:
        return (tenant, h) in self._absent

    def discover(self, tenant: bytes, h: bytes) -> bool:
        """Ask the daemon, in the background, whether it holds a block this mirror
        has no word of (stored before it subscribed, e.g. by this engine's previous
        incarnation). False when the mirror cannot ask now (not subscribed): treat
        the block as a miss. Each block is asked about once; the answer (or a
        failed call, taken as absent) lands in the mirror."""
        if not self.synced.is_set():
            return False
        k = (tenant, h)
        if k not in self._asked:
            if self._discoverer is None:
                self._discoverer = threading.Thread(
                    target=self._discover_run, name=f"kvseal-discover-{self.rank}", daemon=True
                )
                self._discoverer.start()
            self._asked.add(k)
            self._discover_q.put(k)
        return True

    def forget(self, tenant: bytes, hashes: Iterable[bytes]) -> None:
        """Drop blocks the daemon could not restore (see the manager's load_failed)."""
        self._set(tenant, hashes, False)

    def blocks(self) -> int:
        with self._lock:
            return sum(len(s) for s in self._ready.values())

    # ------------------------------------------------------------ updates

    def _set(self, tenant: bytes, hashes: Iterable[bytes], present: bool) -> None:
        changed: list[bytes] = []
        # The update lock first (the order every thread takes them in): the
        # batch reaches the mirror and on_change as one step for its holder.
        with self._update_lock:
            with self._lock:
                s = self._ready.setdefault(tenant, set())
                for h in hashes:
                    if present and h not in s:
                        s.add(h)
                        changed.append(h)
                    elif not present and h in s:
                        s.discard(h)
                        changed.append(h)
                    if not present:
                        self._absent.add((tenant, h))
                if not s:
                    self._ready.pop(tenant, None)
            for h in changed:
                self._on_change(self.rank, tenant, h, present)

    def _forget_discovery(self) -> None:
        self._absent = set()  # replaced, not cleared: readers need no lock

    def _clear(self) -> None:
        self._forget_discovery()
        with self._update_lock:
            with self._lock:
                old, self._ready = self._ready, {}
            for tenant, hashes in old.items():
                for h in hashes:
                    self._on_change(self.rank, tenant, h, False)

    # ------------------------------------------------------------ thread

    def _register(self) -> None:
        # An observer pool maps nothing, on any backend (a CUDA daemon refuses
        # shared memory): the registration is only a namespace and a pool id.
        h = self._client.register_pool(
            self._pool_name, self._fingerprint, self._geometry, observer=True
        )
        if self.server_instance is not None and h.server_instance != self.server_instance:
            self.resets += 1
            self._clear()  # a restarted daemon: new key, empty cache
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
        except KVSealRpcError as e:
            log.info("kvseal mirror %d: Stats failed: %s", self.rank, e)
        if self._hold is not None:
            self._hold.close(wait=0)
        self._hold = PoolHold(self._client._stub, h.pool_id, retry=True)
        # A new registration has named no tenant yet: name every one we know.
        self.named = frozenset()
        for tenant in list(self._introduced):
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
        return call

    def _resync(self) -> None:
        """Keep only the blocks the daemon still reports READY."""
        assert self.pool_id is not None
        self._forget_discovery()  # blocks stored during the gap may be known again
        with self._lock:
            snapshot = {t: list(s) for t, s in self._ready.items()}
        for tenant, hashes in snapshot.items():
            for i in range(0, len(hashes), RESYNC_BATCH):
                batch = hashes[i : i + RESYNC_BATCH]
                states = self._client.lookup(self.pool_id, tenant, batch).states
                gone = [h for h, st in zip(batch, states, strict=False) if st != pb.BLOCK_READY]
                if gone:
                    self._set(tenant, gone, False)
        self.resyncs += 1

    def _run(self) -> None:
        need_resync = False
        while not self._stop.is_set():
            try:
                if self.pool_id is None or self._hold is None or self._hold.ended.is_set():
                    self._register()
                stream = self._watch()
                if need_resync:
                    self._resync()
                    need_resync = False
                self.synced.set()
                for ev in stream:
                    if ev.namespace != self.namespace:
                        continue
                    if ev.kind == pb.BLOCK_STORED:
                        self._set(ev.tenant, ev.block_hashes, True)
                    elif ev.kind == pb.BLOCK_REMOVED:
                        self._set(ev.tenant, ev.block_hashes, False)
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
                # The daemon is gone or refused us: nothing it held can be
                # trusted to survive; register again when it answers.
                log.info("kvseal mirror %d: %s; emptied, retrying", self.rank, e)
                self._clear()
                self.pool_id = None
                need_resync = False
            except Exception:  # the mirror must never take the scheduler down
                self.synced.clear()
                log.exception("kvseal mirror %d failed; emptied, retrying", self.rank)
                self._clear()
                self.pool_id = None
            self._stop.wait(self._retry_s)

    def _discover_run(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._discover_q.get(timeout=0.2)
            except queue.Empty:
                continue
            batch = [first]
            while len(batch) < RESYNC_BATCH:
                try:
                    batch.append(self._discover_q.get_nowait())
                except queue.Empty:
                    break
            by_tenant: dict[bytes, list[bytes]] = {}
            for tenant, h in batch:
                by_tenant.setdefault(tenant, []).append(h)
            for tenant, hashes in by_tenant.items():
                ready: list[bytes] = []
                pool_id = self.pool_id
                try:
                    if pool_id is not None:
                        states = self._client.lookup(pool_id, tenant, hashes).states
                        ready = [
                            h for h, st in zip(hashes, states, strict=False) if st == pb.BLOCK_READY
                        ]
                except KVSealRpcError as e:
                    log.info("kvseal mirror %d: discovery lookup failed: %s", self.rank, e)
                if ready:
                    self._set(tenant, ready, True)
                got = set(ready)
                for h in hashes:
                    if h not in got:
                        self._absent.add((tenant, h))  # absent, or unknown: a miss
                    self._asked.discard((tenant, h))
            if len(self._absent) > MAX_ABSENT:
                self._forget_discovery()

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
