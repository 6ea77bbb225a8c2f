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
import time
from collections.abc import Callable, Container, Iterator
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


class TenantScope(Container[bytes]):
    """The tenants a pool's requests named, for its event watchers
    (``Pool.tenants``): bounded, and reclaimed when a tenant goes idle.

    ``in`` is lock-free (the publisher tests membership under the bus lock
    only). :meth:`note` (every block RPC on the pool) costs a dict lookup and
    a clock read; it takes the lock only to add a tenant or to refresh one not
    refreshed for a quarter of ``idle_s``. A tenant is *idle* when it was not
    named for ``idle_s`` and ``held(tenant)`` says the pool's namespace holds
    none of its blocks: :meth:`reclaim` forgets those (forgetting one that
    still holds blocks would hide their evictions from the watchers). Beyond
    ``limit`` tenants the least recently named one without blocks is forgotten
    first (the least recent of all if every one holds blocks: a watcher then
    misses that tenant's removals until it is named again; the vLLM mirror
    drops such a block at its first failed restore). A forgotten tenant is
    named again by its next request, before that request runs."""

    def __init__(self, limit: int = 65536, idle_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.limit = limit
        self.idle_s = idle_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[bytes, float] = {}  # tenant -> last named; least recent first

    def __contains__(self, tenant: object) -> bool:
        return tenant in self._last

    def __len__(self) -> int:
        return len(self._last)

    def __iter__(self) -> Iterator[bytes]:
        return iter(list(self._last))

    def note(self, tenant: bytes, held: Callable[[bytes], bool] | None = None) -> None:
        """``tenant`` was named by a request on the pool (``held``: see
        :meth:`reclaim`; used only when the scope is over ``limit``)."""
        now = self._clock()
        last = self._last.get(tenant)
        if last is not None and now - last < self.idle_s / 4:
            return  # the common case: no lock
        with self._lock:
            # Updated in place, never removed and re-added: a reader must not
            # see a known tenant missing (so the dict is not in LRU order; the
            # rare shrink sorts).
            self._last[tenant] = now
            if len(self._last) > self.limit:
                self._shrink(held or (lambda _t: False), now)

    def reclaim(self, held: Callable[[bytes], bool], now: float | None = None) -> int:
        """Forget the idle tenants (class doc); returns how many were forgotten."""
        with self._lock:
            return self._reclaim_locked(held, self._clock() if now is None else now)

    def _reclaim_locked(self, held: Callable[[bytes], bool], now: float) -> int:
        gone = [t for t, last in self._last.items() if now - last >= self.idle_s and not held(t)]
        for t in gone:
            del self._last[t]
        return len(gone)

    def _shrink(self, held: Callable[[bytes], bool], now: float) -> None:
        """Down to 7/8 of ``limit`` at once (so that the sort is paid once per
        ``limit / 8`` new tenants, not per tenant): idle ones first, then the
        least recently named without blocks, then any."""
        self._reclaim_locked(held, now)
        target = self.limit - self.limit // 8
        if len(self._last) <= self.limit:
            return
        order = sorted(self._last.items(), key=lambda kv: kv[1])
        excess = len(self._last) - target
        for t, _last in order:
            if excess <= 0:
                return
            if not held(t):
                del self._last[t]
                excess -= 1
        for t, _last in order:
            if excess <= 0:
                return
            if t in self._last:
                del self._last[t]
                excess -= 1


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
        self, kind: EventKind, reason: str, ns: bytes, tenant: bytes, hashes: list[bytes]
    ) -> None:
        """Never blocks: a full subscriber queue marks that subscriber overflowed."""
        if not hashes:
            return
        block_hashes = tuple(hashes)
        with self._lock:
            for sub in self._subs:
                if sub.overflowed or not sub.accepts(ns, tenant):
                    continue
                event = BlockEvent(sub.sequence + 1, kind, reason, ns, tenant, block_hashes)
                try:
                    sub.queue.put_nowait(event)
                except queue.Full:
                    sub.overflowed = True
                    continue
                sub.sequence += 1
