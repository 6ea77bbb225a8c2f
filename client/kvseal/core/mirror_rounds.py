"""Three of :class:`~kvseal.core.mirror.DaemonMirror`'s background rounds (its
introducer thread runs them; they read and write the mirror's state under the
mirror's own locks, exactly as its methods would)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence
from typing import Protocol

from kvseal.client import KVSealClient, KVSealRpcError
from kvseal.v1 import kvseal_pb2 as pb

log = logging.getLogger("kvseal.core")

RESYNC_BATCH = 1024  # hashes per Lookup or Touch of a round (below the daemon's batch limit)
MAX_TENANTS = 1 << 16  # tenants remembered by one mirror (the mirror's module doc)


class DaemonMirror(Protocol):
    """What the rounds use of :class:`kvseal.core.mirror.DaemonMirror`."""

    rank: int
    pool_id: str | None
    named: set[bytes]
    touched: int
    tenant_idle_s: float
    forgotten_tenants: int
    _client: KVSealClient
    _intro_q: queue.SimpleQueue[tuple[bytes, list[bytes]]]
    _tenants: dict[bytes, float]
    _tenants_lock: threading.Lock
    _ready: dict[bytes, set[bytes]]
    _unverified: dict[bytes, dict[bytes, None]]
    _suspended: dict[bytes, set[bytes]]
    _lock: threading.Lock
    _stream_gen: int
    synced: threading.Event
    verified: int

    def _watch_begin(self) -> set[tuple[bytes, bytes]]: ...

    def _watch_end(self, w: set[tuple[bytes, bytes]]) -> None: ...

    def _answer(
        self,
        tenant: bytes,
        hashes: Sequence[bytes],
        ready: Sequence[bool],
        watch: set[tuple[bytes, bytes]],
        *,
        add: bool = True,
        drop: bool = True,
    ) -> None: ...


def touch_round(m: DaemonMirror, todo: dict[bytes, dict[bytes, None]]) -> bool:
    pool_id = m.pool_id
    if pool_id is None or not todo:
        return False  # tenants are named again after the next registration
    retry = False
    for tenant, hset in todo.items():
        hl = list(hset)
        for i in range(0, len(hl), RESYNC_BATCH):
            try:
                n = m._client.touch(pool_id, tenant, hl[i : i + RESYNC_BATCH])
            except KVSealRpcError as e:
                log.info("kvseal mirror %d: Touch failed: %s", m.rank, e)
                if tenant not in m.named and pool_id == m.pool_id:
                    # Unnamed, the tenant's events (others' stores, evictions)
                    # never reach this mirror: name it again (recency alone is
                    # not worth a retry).
                    m._intro_q.put((tenant, []))
                    retry = True
                break
            m.touched += n
            if pool_id == m.pool_id:
                m.named.add(tenant)
    return retry


def sweep_tenants(m: DaemonMirror, now: float) -> None:
    """Forget idle tenants (module doc): from the least recently used on, each
    one unused for ``tenant_idle_s`` (or beyond :data:`MAX_TENANTS`) with no
    block here and nothing to verify. A tenant still holding blocks stays
    (its evictions must keep reaching the mirror) and goes to the back."""
    with m._tenants_lock:
        for _ in range(len(m._tenants)):
            tenant, last = next(iter(m._tenants.items()))
            if len(m._tenants) <= MAX_TENANTS and now - last < m.tenant_idle_s:
                return
            del m._tenants[tenant]
            if tenant in m._ready or tenant in m._unverified or tenant in m._suspended:
                m._tenants[tenant] = now
            else:
                m.named.discard(tenant)
                m.forgotten_tenants += 1


def verify_round(m: DaemonMirror) -> bool:
    """One Lookup per tenant (per batch) of the blocks a mirror must verify
    (its ``stored`` and ``forget``); only while subscribed, so that every change after the
    answer reaches the mirror as an event. True when some must be re-asked."""
    pool_id, gen = m.pool_id, m._stream_gen
    if pool_id is None or not m.synced.is_set():
        return False  # kept queued: asked once the stream is back
    with m._lock:
        work, m._unverified = m._unverified, {}
    retry = False
    for tenant, hs in work.items():
        hl = list(hs)
        for i in range(0, len(hl), RESYNC_BATCH):
            batch = hl[i : i + RESYNC_BATCH]
            watch = m._watch_begin()
            try:
                states = m._client.lookup(pool_id, tenant, batch).states
            except KVSealRpcError as e:
                log.info("kvseal mirror %d: verifying Lookup failed: %s", m.rank, e)
                states = None
            finally:
                m._watch_end(watch)
            if (
                states is None
                or pool_id != m.pool_id
                or gen != m._stream_gen
                or not m.synced.is_set()
            ):
                # Not answered, or not across one live subscription: ask again.
                with m._lock:
                    m._unverified.setdefault(tenant, {}).update(dict.fromkeys(batch))
                retry = True
                continue
            m.named.add(tenant)  # the Lookup named it before it answered
            m.verified += len(batch)
            ready = [st == pb.BLOCK_READY for st in states]
            m._answer(tenant, batch, ready, watch)
    return retry
