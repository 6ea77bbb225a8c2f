"""Block stored/removed events for WatchEvents subscribers (llm-d's KV-event
indexer consumes the same facts from vLLM: BlockStored / BlockRemoved).

Each subscriber has a bounded queue. A subscriber that falls behind is cut off
(its stream ends with RESOURCE_EXHAUSTED) rather than silently losing events
or making the data path wait: it must resubscribe and resync, and sequence
numbers let it check that it saw every event.
"""

from __future__ import annotations

import queue
import threading
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


class Subscription:
    """Owned by one WatchEvents call; ``close`` when the call ends."""

    def __init__(self, bus: EventBus, tenant: bytes, capacity: int) -> None:
        self.tenant = tenant
        self.queue: queue.Queue[BlockEvent] = queue.Queue(capacity)
        self.overflowed = False
        self._bus = bus

    def close(self) -> None:
        self._bus._unsubscribe(self)


class EventBus:
    def __init__(self, max_subscribers: int, queue_capacity: int = 65536) -> None:
        self._lock = threading.Lock()
        self._subs: list[Subscription] = []
        self._sequence = 0
        self._max = max_subscribers
        self._capacity = queue_capacity

    def subscribe(self, tenant: bytes) -> Subscription | None:
        """A new subscription, or None when the subscriber limit is reached."""
        with self._lock:
            if len(self._subs) >= self._max:
                return None
            sub = Subscription(self, tenant, self._capacity)
            self._subs.append(sub)
            return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def publish(
        self, kind: EventKind, reason: str, ns: bytes, tenant: bytes, hashes: list[bytes]
    ) -> None:
        """Never blocks: a full subscriber queue marks that subscriber overflowed."""
        if not hashes:
            return
        with self._lock:
            self._sequence += 1
            event = BlockEvent(self._sequence, kind, reason, ns, tenant, tuple(hashes))
            for sub in self._subs:
                if sub.overflowed or (sub.tenant and sub.tenant != tenant):
                    continue
                try:
                    sub.queue.put_nowait(event)
                except queue.Full:
                    sub.overflowed = True
