"""Block stored/removed events for WatchEvents subscribers (llm-d's KV-event
indexer consumes the same facts from vLLM: BlockStored / BlockRemoved).

A subscription is scoped to one registered pool: it receives only events of
that pool's namespace, and only for tenants that pool's requests have named
(``Pool.tenants``), optionally narrowed to one tenant. A peer therefore learns
nothing about namespaces or tenants it does not itself use.

Each subscriber has a bounded queue and its own sequence numbers (1, 2, ...
per subscription: a gap would mean a lost event, and the numbers say nothing
about other tenants' activity). A subscriber that falls behind is cut off (its
stream ends with RESOURCE_EXHAUSTED) rather than silently losing events or
making the data path wait: it must resubscribe and resync.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Container
from dataclasses import dataclass
from enum import Enum


class EventKind(Enum):
    STORED = 1
    REMOVED = 2


@dataclass(frozen=True, slots=True)
class BlockEvent:
    sequence: int
    kind: EventKind
    reason: str  # "", or the index.Removal name for REMOVED
    namespace: bytes
    tenant: bytes
    block_hashes: tuple[bytes, ...]
    medium: str = "cpu"  # "cpu" (host tier) or "storage" (store tier)
    locality: str = ""  # "storage": "local" or "remote"
    restorable: bool = False  # REMOVED: still restorable from the other tier


class Subscription:
    """Owned by one WatchEvents call; ``close`` when the call ends.

    ``tenants`` is a live view (the pool's used-tenant set, read without a lock:
    membership tests are atomic); ``tenant`` (empty: no narrowing) narrows it."""

    def __init__(
        self,
        bus: EventBus,
        namespace: bytes,
        tenants: Container[bytes],
        tenant: bytes,
        capacity: int,
    ) -> None:
        self.namespace = namespace
        self.tenants = tenants
        self.tenant = tenant
        self.queue: queue.Queue[BlockEvent] = queue.Queue(capacity)
        self.overflowed = False
        self.sequence = 0  # last sequence number queued (under the bus lock)
        self._bus = bus

    def accepts(self, ns: bytes, tenant: bytes) -> bool:
        if ns != self.namespace or (self.tenant and tenant != self.tenant):
            return False
        return tenant in self.tenants

    def close(self) -> None:
        self._bus._unsubscribe(self)


class EventBus:
    def __init__(self, max_subscribers: int, queue_capacity: int = 65536) -> None:
        self._lock = threading.Lock()
        self._subs: list[Subscription] = []
        self._max = max_subscribers
        self._capacity = queue_capacity

    def subscribe(
        self, namespace: bytes, tenants: Container[bytes], tenant: bytes = b""
    ) -> Subscription | None:
        """A new subscription, or None when the subscriber limit is reached."""
        with self._lock:
            if len(self._subs) >= self._max:
                return None
            sub = Subscription(self, namespace, tenants, tenant, self._capacity)
            self._subs.append(sub)
            return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def publish(
        self,
        kind: EventKind,
        reason: str,
        ns: bytes,
        tenant: bytes,
        hashes: list[bytes],
        *,
        medium: str = "cpu",
        locality: str = "",
        restorable: bool = False,
    ) -> None:
        """Never blocks: a full subscriber queue marks that subscriber overflowed."""
        if not hashes:
            return
        block_hashes = tuple(hashes)
        extra = (medium, locality, restorable)
        with self._lock:
            for sub in self._subs:
                if sub.overflowed or not sub.accepts(ns, tenant):
                    continue
                event = BlockEvent(sub.sequence + 1, kind, reason, ns, tenant, block_hashes, *extra)
                try:
                    sub.queue.put_nowait(event)
                except queue.Full:
                    sub.overflowed = True
                    continue
                sub.sequence += 1
