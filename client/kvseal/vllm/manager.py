"""The scheduler side of kvseal's vLLM spec (:mod:`kvseal.vllm.spec`, which
re-exports everything here): :class:`KVSealOffloadingManager` answers vLLM's
``lookup`` from the daemons' mirrors and describes the blocks of each store
and load (:class:`KVSealLoadStoreSpec`); requests' ``cache_salt`` reach it
through :func:`note_request_salt`. Nothing here blocks on a daemon.

The manager's ``lock`` (vLLM 0.33's protocol; 0.32 never takes it) is a real,
reentrant lock: vLLM 0.33's scheduler holds it across a whole scheduling step
(every ``lookup``, the ``prepare_load`` that follows a hit, ``prepare_store``)
and around every other manager call, and the mirrors' threads hold it while
they apply one batch of the daemon's changes. So within a step the set of
blocks the manager calls held does not change: a block a step's ``lookup``
found (``HIT``) is still one when ``prepare_load`` describes it, and an event's
blocks appear all at once. It is never held across an RPC (the mirrors make
their calls first, then take it to apply what they learnt). It cannot make the
daemon keep a block: one it evicts after the lookup fails that restore, and
vLLM recomputes the blocks (as before)."""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "CONFIG_INFO_KEYS",
    "LOAD_FAILED_BLOCKS",
    "SHARED_TENANT",
    "TIER_BLOCKS",
    "KVSealLoadStoreSpec",
    "KVSealOffloadingManager",
    "config_info_keys",
    "metric_definitions",
    "note_request_salt",
]

from kvseal.client import load_tenant_key, tenant_digest
from kvseal.core.mirror import DaemonMirror
from kvseal.v1 import kvseal_pb2 as pb
from kvseal.vllm import compat, keys, pd
from kvseal.vllm.evict import new_eviction
from kvseal.vllm.metrics import (  # re-exported
    CONFIG_INFO_KEYS,
    LOAD_FAILED_BLOCKS,
    TIER_BLOCKS,
    config_info_keys,
    metric_definitions,
)
from kvseal.vllm.tier_events import TierEvents

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)

# The deployment's tenant key ($KVSEAL_TENANT_KEY_FILE; docs/security-model.md,
# "Tenants"), read once when the adapter is imported, so a key file others can
# read fails the engine's start (ValueError) instead of silently weakening
# every tenant digest. Unset: the unkeyed digests.
TENANT_KEY = load_tenant_key()
SHARED_TENANT = tenant_digest(None, key=TENANT_KEY)

log = logging.getLogger("kvseal.vllm")

# request -> cache_salt (vLLM's ReqContext carries no salt), filled in by the
# connector through note_request_salt before the manager sees the request.
_salts: dict[str, str | None] = {}


def note_request_salt(req_id: str, cache_salt: str | None) -> None:
    """Record a request's ``cache_salt`` (scheduler process, before the
    manager sees the request). Called by the connector."""
    _salts[req_id] = cache_salt


class ManagerSpec(Protocol):
    """What the manager reads of its spec (:class:`kvseal.vllm.spec.KVSealOffloadingSpec`)."""

    @property
    def world_size(self) -> int: ...

    @property
    def discovery(self) -> bool: ...

    @property
    def groups(self) -> tuple[int, ...]: ...

    @property
    def hit_ranks(self) -> int: ...

    @property
    def discovery_setting(self) -> bool | None: ...

    @property
    def engine_id(self) -> str: ...

    @property
    def dp_index(self) -> int: ...

    @property
    def extra_config(self) -> dict[str, Any]: ...

    @property
    def kv_events_config(self) -> Any: ...

    @property
    def tokens_per_block(self) -> Any: ...

    def socket(self, rank: int) -> str: ...

    def fingerprint(self, rank: int, group: int | None = None) -> bytes: ...

    def identity(self, rank: int, tenant_key: bytes | None) -> pb.DeploymentIdentity: ...

    def geometry_template(self, group: int | None = None) -> pb.PoolGeometry: ...


@dataclass
class KVSealLoadStoreSpec(LoadStoreSpec):
    """What the worker needs to store or load blocks: the tenant digest (never
    the salt), the blocks' 32-byte kvseal hashes in chain order (one per vLLM
    block, matching the GPU spec's block ids one to one) and, for a store, the
    hash of the block that precedes the first one in its chain.

    A model with several KV-cache groups: the hashes are ordered by group, as
    vLLM orders the GPU block ids, ``group_sizes`` gives how many belong to
    each offloaded group (in the config's order, zeros included, like vLLM's
    ``GPULoadStoreSpec.group_sizes``) and ``parents`` each group's parent hash
    (a store). Empty: every hash is the first group's."""

    tenant: bytes
    hashes: list[bytes]
    parent_hash: bytes = b""
    group_sizes: list[int] = field(default_factory=list)
    parents: list[bytes] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"KVSealLoadStoreSpec({len(self.hashes)} blocks)"


@dataclass
class _ReqState:
    tenant: bytes
    # (group index, end token) -> kvseal hash of the block stored there
    stored_at: dict[tuple[int, int], bytes] = field(default_factory=dict)
    handoff_until: float = 0.0  # a P/D handoff's absent blocks are asked again until then


@dataclass
class _Group:
    """The manager's view of one offloaded KV-cache group: its mirrors (one per
    rank a hit needs) and the blocks every one of them holds."""

    index: int  # position in the offloading config (vLLM's group_sizes order)
    group_id: int
    tokens_per_block: int
    mirrors: list[DaemonMirror] = field(default_factory=list)
    # (tenant, hash) -> ranks whose daemon holds the block; a hit needs all.
    held: dict[tuple[bytes, bytes], int] = field(default_factory=dict)
    ready: dict[bytes, set[bytes]] = field(default_factory=dict)  # tenant -> hashes
    tiers: TierEvents | None = None


class KVSealOffloadingManager(OffloadingManager):
    """Scheduler side (see module doc). ``lookup`` costs a few dictionary and
    set operations; nothing here blocks on the daemon."""

    def __init__(self, spec: ManagerSpec) -> None:
        self.spec = spec
        # vLLM 0.33's manager lock (see module doc). Reentrant: a holder that
        # calls load_failed reaches _changed through the mirror on its own thread.
        self._lock = threading.RLock()
        self._ready_blocks = 0  # blocks on every needed rank, all groups: TIER_BLOCKS
        self._reported_blocks = 0  # its value in the last get_stats
        self.resets_flushed = 0  # on_reset_flushed calls (vLLM >= 0.33)
        self._reqs: dict[str, _ReqState] = {}
        self._events: queue.SimpleQueue[OffloadingEvent] = queue.SimpleQueue()
        self._reverse: dict[bytes, bytes] = {}  # kvseal hash -> vLLM hash (non-identity)
        # (group index, hash) -> tenant -> (until when a block being stored is a
        # pending hit, when its store began). Keyed by block first: complete_store
        # may come after on_request_finished, when the request's tenant is no
        # longer known. Only the scheduler thread (prepare_store, complete_store,
        # lookup, reset_cache) touches it.
        self._storing: dict[tuple[int, bytes], dict[bytes, tuple[float, float]]] = {}
        self._load_failed_blocks = 0  # since the last get_stats (scheduler thread)
        # A job in flight ends within the transfer timeout (the worker's bound).
        self._store_bound_s = float(spec.extra_config.get("kvseal_transfer_timeout_s", 10.0)) + 5
        # A hit needs every rank's daemon, except for an MLA latent stored once.
        self.world = spec.hit_ranks
        tpb = list(spec.tokens_per_block)
        self.groups = [
            _Group(i, gid, int(tpb[i] if i < len(tpb) else tpb[0]))
            for i, gid in enumerate(spec.groups)
        ]
        # OffloadKey suffix (the 4-byte group id) -> group: lookup's dispatch.
        self._by_suffix = {
            gid.to_bytes(keys.OFFLOAD_GROUP_BYTES, "big"): g
            for gid, g in zip(spec.groups, self.groups, strict=True)
        }
        setting = spec.discovery_setting
        self.mirrors: list[DaemonMirror] = []  # every group's, rank-major per group
        for g in self.groups:
            # Daemons with a store: vLLM's events come from their streams, per tier.
            g.tiers = TierEvents(
                self.world,
                g.group_id,
                self._events,
                lambda h: self._reverse.get(h, h),
                lambda h: self._reverse.pop(h, None) if len(self.groups) == 1 else None,
            )
            role = "probe" if len(self.groups) == 1 else f"probe{g.group_id}"
            g.mirrors = [
                DaemonMirror(
                    rank,
                    spec.socket(rank),
                    keys.pool_name(spec.engine_id, spec.dp_index, rank, role),
                    spec.fingerprint(rank, g.group_id),
                    spec.geometry_template(g.group_id),
                    functools.partial(self._changed, g),
                    update_lock=self._lock,
                    discovery=setting is not False,
                    identity=spec.identity(rank, TENANT_KEY),
                    on_tier=functools.partial(self._tier_event, g),
                )
                for rank in range(self.world)
            ]
            self.mirrors.extend(g.mirrors)
        self._first = self.groups[0]
        # "kvseal_offload": "eviction": stores happen at eviction (kvseal.vllm.evict).
        self.evict = new_eviction(self, spec.extra_config, getattr(spec, "max_step_tokens", None))

    @property
    def discovery(self) -> bool:
        """Whether lookups discover blocks the mirrors have no word of:
        ``kvseal_lookup_discovery`` if set, else whether rank 0's daemon has a
        store tier (as its mirror last learnt): blocks that outlive a restart
        must be found after one with the documented one-line configuration."""
        setting = self.spec.discovery_setting
        if setting is not None:
            return setting
        return bool(self._first.mirrors[0].store_policy)

    # ------------------------------------------------------------ mirror feed

    def _changed(self, g: _Group, rank: int, tenant: bytes, h: bytes, present: bool) -> None:
        with self._lock:
            k = (tenant, h)
            n = g.held.get(k, 0)
            n = n + 1 if present else max(0, n - 1)
            before = h in g.ready.get(tenant, ())
            if n:
                g.held[k] = n
            else:
                g.held.pop(k, None)
            after = n >= self.world
            if after and not before:
                g.ready.setdefault(tenant, set()).add(h)
                self._ready_blocks += 1
            elif before and not after:
                s = g.ready[tenant]
                s.discard(h)
                self._ready_blocks -= 1
                if not s:
                    del g.ready[tenant]
            else:
                return
            # Removed: its vLLM hash is not needed after this event (bounded map;
            # with tiers, the tier events still name it: they drop it; another
            # group may still hold a block of the same hash: then it stays).
            tiered = self._tiered(g, rank)
            keep = after or tiered or any(k in o.held for o in self.groups if o is not g)
            vh = self._reverse.get(h, h) if keep else self._reverse.pop(h, h)
        if self.spec.kv_events_config.enable_kv_cache_events and not tiered:
            okey = OffloadKey(keys.make_offload_key(vh, g.group_id))
            self._events.put(OffloadingEvent(keys=[okey], medium=Medium.CPU, removed=not after))

    def _tiered(self, g: _Group, rank: int) -> bool:
        """Whether rank's daemon has a store tier (its events name their tier)."""
        mirrors = g.mirrors  # empty during construction
        return rank < len(mirrors) and bool(mirrors[rank].store_policy)

    def _tier_event(self, g: _Group, rank: int, ev: pb.BlockEvent | None) -> None:
        """A daemon with a store tier: vLLM's KV events come from the daemons'
        streams, a medium per tier (kvseal.vllm.tier_events); ``None``: rank's
        stream had a gap. Under the manager's lock (the mirrors' update lock)."""
        if not self.spec.kv_events_config.enable_kv_cache_events or g.tiers is None:
            return
        if ev is None:
            g.tiers.reset(rank)
        elif self._tiered(g, rank):
            g.tiers.event(rank, ev)

    # ------------------------------------------------------------ helpers

    def _tenant(self, req_context: ReqContext) -> bytes:
        st = self._reqs.get(req_context.req_id)
        if st is None:  # a request we were not told about (e.g. request_finished)
            st = self._reqs[req_context.req_id] = _ReqState(self._tenant_of(req_context.req_id))
        return st.tenant

    def _tenant_of(self, req_id: str) -> bytes:
        salt = _salts.get(req_id)
        tenant = tenant_digest(salt, key=TENANT_KEY) if salt else SHARED_TENANT
        for m in self.mirrors:  # so each daemon streams this tenant's events to us
            m.introduce(tenant)
        return tenant

    def _h(self, key: OffloadKey, remember: bool = False) -> bytes:
        """The kvseal hash of ``key``. ``remember``: a block being stored, whose
        events must name vLLM's hash (kept until the block is removed; lookups
        of blocks never stored add nothing, so the map stays bounded)."""
        vh = key[: -keys.OFFLOAD_GROUP_BYTES]
        if len(vh) == keys.HASH_BYTES:
            return bytes(vh)
        h = keys.kvseal_hash(vh)
        if remember:
            self._reverse[h] = bytes(vh)
        return h

    # ------------------------------------------------------------ vLLM API

    @property
    def lock(self) -> AbstractContextManager[Any]:
        """vLLM 0.33: held by the scheduler across a step's lookups, prepare_load
        and prepare_store, and by the mirrors' threads while they apply a batch of
        the daemons' changes (module doc). A real lock, reentrant; no RPC is made
        under it. vLLM 0.32 never takes it."""
        return self._lock

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        if self.evict is not None and self.evict.state == "unbound":  # before any store
            self.evict.bind(compat.caller_frame())
        # _tenant_of also names the tenant on every mirror's pool: the daemon
        # scopes their event streams to tenants named there.
        st = self._reqs[req_context.req_id] = _ReqState(self._tenant_of(req_context.req_id))
        st.handoff_until = pd.handoff_deadline(
            req_context.kv_transfer_params, self.spec.extra_config
        )
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._reqs.pop(req_context.req_id, None)
        _salts.pop(req_context.req_id, None)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # The hot path (once per block, scheduler thread): _tenant and _h inlined
        # for their common cases (a known request, a 32-byte vLLM hash).
        st = self._reqs.get(req_context.req_id)
        tenant = st.tenant if st is not None else self._tenant(req_context)
        g = self._by_suffix.get(key[-keys.OFFLOAD_GROUP_BYTES :])
        if g is None:  # a group the spec does not offload: never a hit
            return LookupResult.MISS
        h = key[: -keys.OFFLOAD_GROUP_BYTES]
        h = bytes(h) if len(h) == keys.HASH_BYTES else self._h(key)
        s = g.ready.get(tenant)
        if s is not None and h in s:
            return LookupResult.HIT
        pending = self._storing.get((g.index, h))
        job = pending.get(tenant) if pending is not None else None
        if job is not None:
            if time.monotonic() < job[0]:
                return LookupResult.HIT_PENDING
            self._forget_store(g.index, h, tenant)
        if not self.discovery:
            return LookupResult.MISS
        # Discovery: a block some rank's mirror has no word of is asked about in
        # the background, and the request is looked up again next step (RETRY;
        # vLLM keeps scanning, so all of the request's blocks are asked at
        # once). Never for a block known absent, never waiting for a daemon away.
        retry = False
        for m in g.mirrors:
            if m.contains(tenant, h):
                continue
            # A P/D handoff's block may be absent only until the prefill's publish
            # lands (kvseal.vllm.pd): asked again until the request's bound.
            late = st is None or time.monotonic() >= st.handoff_until
            if m.discovery.known_absent(tenant, h) and (late or not m.discovery.reask(tenant, h)):
                return LookupResult.MISS
            if not m.discovery.discover(tenant, h):
                return LookupResult.MISS
            retry = True
        return LookupResult.RETRY if retry else LookupResult.MISS

    def _by_group(
        self, keys_: Collection[OffloadKey], remember: bool = False
    ) -> list[tuple[_Group, list[OffloadKey], list[bytes]]]:
        """``keys_`` split by group, in the config's group order (the order of
        vLLM's GPU block ids), each group's keys in the order given; keys of a
        group not offloaded are dropped."""
        parts: dict[int, tuple[_Group, list[OffloadKey], list[bytes]]] = {}
        for k in keys_:
            g = self._by_suffix.get(k[-keys.OFFLOAD_GROUP_BYTES :])
            if g is None:
                continue
            part = parts.get(g.index)
            if part is None:
                part = parts[g.index] = (g, [], [])
            part[1].append(k)
            part[2].append(self._h(k, remember))
        return [parts[i] for i in sorted(parts)]

    def _spec(
        self,
        tenant: bytes,
        parts: Sequence[tuple[_Group, Sequence[bytes]]],
        parents: Mapping[int, bytes] | None = None,
    ) -> KVSealLoadStoreSpec:
        hashes = [h for _g, hs in parts for h in hs]
        if len(self.groups) == 1:
            parent = (parents or {}).get(0, b"")
            return KVSealLoadStoreSpec(tenant, hashes, parent)
        sizes = [0] * len(self.groups)
        for g, hs in parts:
            sizes[g.index] = len(hs)
        par = [(parents or {}).get(i, b"") for i in range(len(self.groups))]
        return KVSealLoadStoreSpec(tenant, hashes, par[0], sizes, par)

    def load_failed(self, keys_: Collection[OffloadKey], req_context: ReqContext) -> None:
        """A restore of these blocks failed (evicted meanwhile, failed verification,
        daemon unreachable or slow): stop claiming them, so vLLM recomputes them
        once and does not try (and fail) again. They come back if the daemon
        announces them anew. Called by the connector, on the scheduler thread."""
        tenant = self._tenant(req_context)
        for g, _ks, hashes in self._by_group(keys_):
            for m in g.mirrors:
                m.forget(tenant, hashes)

    def prepare_load(self, keys_: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        # The daemon pins blocks only for the Restore itself; a block evicted in
        # between fails the restore (the worker restores what it can of a
        # single-group prefix; vLLM recomputes the rest). To make that rare, the
        # blocks become the most recent in the daemon's LRU now, in the background
        # (vLLM's own CPU manager pins them from here until the load ends).
        tenant = self._tenant(req_context)
        parts = self._by_group(keys_)
        for g, ks, hashes in parts:
            for m in g.mirrors:
                m.touch(tenant, hashes)
            if self.evict is not None and self.evict.active:  # stored again at eviction
                self.evict.restored(tenant, ks, hashes)
        return self._spec(tenant, [(g, hs) for g, _ks, hs in parts])

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # Eviction mode binds to vLLM's scheduler objects (the caller's, vLLM's
        # OffloadingConnectorScheduler) at the first request or step, or falls back.
        if self.evict is not None and self.evict.state == "unbound":
            self.evict.bind(compat.caller_frame())

    def has_pending_work(self) -> bool:
        return self.evict is not None and self.evict.busy

    def mark_storing(self, g: _Group, tenant: bytes, hashes: Sequence[bytes]) -> None:
        """These blocks' store is in flight: pending hits until it ends."""
        now = time.monotonic()
        job = (now + self._store_bound_s, now)
        for h in hashes:
            self._storing.setdefault((g.index, h), {})[tenant] = job

    def store_spec(self, tenant: bytes, hashes: list[bytes], parent: bytes) -> KVSealLoadStoreSpec:
        """The spec of a store of one chain of the first group's blocks."""
        return self._spec(tenant, [(self._first, hashes)], {0: parent})

    def touch(self, keys_: Collection[OffloadKey], req_context: ReqContext) -> None:
        # vLLM 0.32/0.33 only (0.34 has no touch; compat.NAMES). Recency is the
        # daemon's business (restores and re-offloads touch);
        # an RPC per touch would put the daemon back on the scheduler thread.
        return

    def prepare_store(
        self, keys_: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        tenant = self._tenant(req_context)
        st = self._reqs[req_context.req_id]
        to_store: list[OffloadKey] = []
        parts: list[tuple[_Group, list[bytes]]] = []
        parents: dict[int, bytes] = {}
        now = time.monotonic()
        job = (now + self._store_bound_s, now)
        for g, ks, hs in self._by_group(keys_, remember=True):
            ready = g.ready.get(tenant, set())
            held = [h for h in hs if h in ready]
            if held:  # held already: no copy, but their use still counts
                for m in g.mirrors:
                    m.touch(tenant, held)
            new = [(k, h) for k, h in zip(ks, hs, strict=True) if h not in ready]
            if self.evict is not None and self.evict.active:  # stored at eviction instead
                self.evict.offered_by(req_context, st.stored_at, g, tenant, ks, hs)
                continue
            if not new:
                continue
            for _k, h in new:
                self._storing.setdefault((g.index, h), {})[tenant] = job
            pos = req_context.get_offload_key_position(new[0][0])
            if pos is not None:
                parents[g.index] = st.stored_at.get((g.index, pos - g.tokens_per_block), b"")
                for k, h in new:
                    p = req_context.get_offload_key_position(k)
                    if p is not None:
                        st.stored_at[(g.index, p)] = h
            to_store.extend(k for k, _h in new)
            parts.append((g, [h for _k, h in new]))
        return PrepareStoreOutput(
            keys_to_store=to_store,
            store_spec=self._spec(tenant, parts, parents),
            evicted_keys=[],  # the daemon evicts; removals arrive as events
        )

    def complete_store(
        self, keys_: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        """The store job of these blocks ended. Done: each block is a hit at once,
        on every rank (:meth:`DaemonMirror.stored`: the mirrors do not wait for
        the daemon's announcement, which never comes for a tenant the daemon had
        not yet named on their pool; each verifies the block in the background
        and drops it if the daemon does not hold it). Failed: a miss at once.

        vLLM may call this after ``on_request_finished``, so the request's
        tenant is not looked up (that would re-create its state): every
        tenant with this block's store pending gets the same treatment (the
        same hash in two tenants' stores at once is rare; a wrong claim is
        dropped by the verification)."""
        # (group index, tenant, began) -> hashes
        done: dict[tuple[int, bytes, float], list[bytes]] = {}
        for g, _ks, hashes in self._by_group(keys_):
            for h in hashes:
                for tenant, (_until, began) in list(self._storing.get((g.index, h), {}).items()):
                    if success:
                        done.setdefault((g.index, tenant, began), []).append(h)
                    self._forget_store(g.index, h, tenant)
        for (gi, tenant, began), hashes in done.items():
            for m in self.groups[gi].mirrors:
                m.stored(tenant, hashes, began)
        if len(self._storing) > 4096:  # stale ones (e.g. jobs that never completed)
            now = time.monotonic()
            self._storing = {
                k: kept
                for k, ts in self._storing.items()
                if (kept := {t: j for t, j in ts.items() if j[0] > now})
            }

    def _forget_store(self, gi: int, h: bytes, tenant: bytes) -> None:
        pending = self._storing.get((gi, h))
        if pending is not None:
            pending.pop(tenant, None)
            if not pending:
                del self._storing[(gi, h)]

    def take_events(self) -> Iterable[OffloadingEvent]:
        while True:
            try:
                yield self._events.get_nowait()
            except queue.Empty:
                return

    def note_load_errors(self, n_blocks: int) -> None:
        """``n_blocks`` GPU blocks failed to load this step (vLLM recomputes them):
        counted for :data:`LOAD_FAILED_BLOCKS`. Called by the connector, on the
        scheduler thread."""
        self._load_failed_blocks += n_blocks

    def get_stats(self) -> OffloadingConnectorStats | None:
        """vLLM's hook for connector metrics, once per scheduler step: the failed
        blocks counted since the last call, and the tier's block count when it
        changed since the last report (a gauge keeps its last value); None when
        neither."""
        n, self._load_failed_blocks = self._load_failed_blocks, 0
        blocks = self._ready_blocks
        if not n and blocks == self._reported_blocks:
            return None
        stats = OffloadingConnectorStats()
        if n:
            stats.increase_counter(LOAD_FAILED_BLOCKS, n)
        if blocks != self._reported_blocks:
            stats.set_gauge(TIER_BLOCKS, blocks)
            self._reported_blocks = blocks
        return stats

    def config_info(self) -> Sequence[Mapping[str, str | int | float | bool]]:
        """vLLM 0.33's ``vllm:kv_offload_config_info``: one series, labelled with
        :data:`CONFIG_INFO_KEYS`. vLLM reads it once, at the first scheduler
        step's stats, and it must not change afterwards: the daemon's facts are
        those rank 0's mirror learnt by then ("unknown", 0 or "" if it had not
        reached its daemon yet; the mirror registers at engine start, long
        before the first step as a rule). Reads only what the mirror holds: no
        RPC."""
        m = self.mirrors[0]
        extra = self.spec.extra_config
        return [
            {
                "kvseal_backend": m.backend or "unknown",
                "kvseal_daemon_instance": m.server_instance or "",
                "kvseal_socket": self.spec.socket(0),
                "kvseal_ranks": self.world,
                "kvseal_host_bytes": m.host_bytes_capacity,
                "kvseal_block_bytes": sum(
                    seg.bytes
                    for g in self.groups
                    for seg in self.spec.geometry_template(g.group_id).segments
                ),
                "kvseal_write_mode": "write-back"
                if bool(extra.get("kvseal_write_back", False))
                else "eviction"
                if self.evict is not None and self.evict.active
                else "write-through",
                "kvseal_integrity_policy": m.integrity_policy,
                "kvseal_lookup_discovery": self.discovery,
                "kvseal_transfer_timeout_s": float(extra.get("kvseal_transfer_timeout_s", 10.0)),
            }
        ]

    def reset_cache(self) -> None:
        """vLLM's prefix-cache reset. vLLM's reset drops its own view; the sealed
        tier keeps serving restores it can verify (its blocks are the daemon's,
        not this engine's), so only the per-request state goes: pending stores
        included (a store job in flight at the reset is never completed by vLLM;
        its block becomes a hit once the daemon announces it: the tenant is
        named by then, its request having been seen)."""
        self._reqs.clear()
        self._storing.clear()

    def on_reset_flushed(self) -> None:
        """vLLM 0.33: every job in flight at the last ``reset_cache`` has been
        reported by the workers. kvseal frees no host slot on a reset (the
        daemon owns them), so nothing waits for this fence; it is counted
        (``resets_flushed``) and logged."""
        self.resets_flushed += 1
        log.info("kvseal: the transfers in flight at vLLM's cache reset have ended")

    def shutdown(self) -> None:
        for m in self.mirrors:
            m.close()
