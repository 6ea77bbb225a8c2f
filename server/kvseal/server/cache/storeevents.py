"""The store tier's events on the WatchEvents stream (medium ``"storage"``).

A watcher (vLLM's KV-event publisher through the adapter, llm-d's indexer)
scores a storage hit below a host-memory one, so each tier's events are its
own: a block can be in both. This daemon says of the store what it can
truthfully say, and claims nothing it cannot see:

- BLOCK_STORED (``"storage"``, the daemon's ``--store-locality``) the first
  time this daemon knows a block is in the store: it wrote it (a spill or a
  write-through), a Lookup found its object, or a restore read it.
- BLOCK_REMOVED (``"storage"``) for a block this daemon saw leave the store:
  its own eviction to make room (EVICTED) or a Drop (DROPPED) of an announced
  block; an object that failed its checks (INTEGRITY: all of the tenant's
  announced blocks if it was the tenant's scope marker), or a restore that
  found it gone (EVICTED: another replica evicted it, or the host removed
  it), announced or not.
- Another replica's evictions are invisible until then: a watcher may still
  hold a block as in storage that a restore then misses (the engine
  recomputes; the removal is announced at that point).
- An announcement racing a drop of its tenant is not made after the drop:
  callers that checked the store without the spill lock pass the
  :meth:`StoreEvents.mark` they took before checking.

The host tier's BLOCK_REMOVED of a block announced here carries
``restorable`` (:meth:`StoreEvents.holds`, asked by the cache under the index
lock): a mirror of what is restorable keeps the block.

Bounded: the most recent :data:`MAX_KNOWN` announced blocks are remembered
(key and object name, about 250 bytes each). An older one is forgotten
silently (it is still in the store: retracting it would be false); its
eviction can then not be announced, and the first restore that misses it
announces the removal. Thread-safe: one lock, held while publishing (the
event bus's lock is a leaf), never while the filesystem is touched. It takes
the index lock through ``in_host`` (under its own lock), so **no method but
:meth:`holds` may be called with the index lock held**.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvseal.server.events import EventBus, EventKind
from kvseal.server.index import Entry, Removal
from kvseal.server.store.fsstore import FsStore

# (namespace, tenant, hashes) -> those of hashes READY in the host tier (takes
# the index lock: never called under it).
InHostFn = Callable[[bytes, bytes, list[bytes]], set[bytes]]
MAX_KNOWN = 1 << 17  # announced blocks remembered (see the module docstring)
MEDIUM = "storage"
LOCALITIES = ("local", "remote")


class StoreEvents:
    """See the module docstring. ``locality``: one of :data:`LOCALITIES`."""

    def __init__(
        self,
        bus: EventBus,
        store: FsStore,
        locality: str,
        *,
        in_host: InHostFn | None = None,
        max_known: int = MAX_KNOWN,
    ) -> None:
        if locality not in LOCALITIES:
            raise ValueError(f"store locality must be one of {LOCALITIES}, not {locality!r}")
        self._bus = bus
        self._in_host = in_host
        self._store = store
        self.locality = locality
        self._max_known = max_known
        self._lock = threading.Lock()
        # ns + tenant + hash -> object name (None: not known), oldest first
        self._known: OrderedDict[bytes, str | None] = OrderedDict()
        self._by_name: dict[str, bytes] = {}
        self._drops: dict[bytes, int] = {}  # ns + tenant -> drops announced (see mark)
        store.on_evict = self.evicted

    def __len__(self) -> int:
        return len(self._known)

    def holds(self, ns: bytes, tenant: bytes, block_hash: bytes) -> bool:
        """Whether the block is announced as in the store (no I/O: safe under
        the index lock)."""
        return ns + tenant + block_hash in self._known

    def mark(self, ns: bytes, tenant: bytes) -> int:
        """The tenant's drop count: pass it to :meth:`stored` when the blocks
        were found in the store without the spill lock held (a drop since
        then cancels the announcement)."""
        return self._drops.get(ns + tenant, 0)

    def stored(
        self, ns: bytes, tenant: bytes, hashes: Iterable[bytes], *, mark: int | None = None
    ) -> None:
        """These blocks are in the store: announce those not yet announced
        (none if ``mark`` is given and a drop of the tenant was announced
        since). Reads each one's object name (its tenant's scope, usually
        cached) before taking the lock."""
        prefix = ns + tenant
        new = [h for h in dict.fromkeys(hashes) if prefix + h not in self._known]
        if not new:
            return
        names = [self._store.name_of(ns, tenant, h) for h in new]
        with self._lock:
            if mark is not None and self._drops.get(prefix, 0) != mark:
                return  # the tenant was dropped since they were found
            fresh = []
            for h, name in zip(new, names, strict=True):
                k = prefix + h
                if k in self._known:
                    continue  # announced meanwhile
                self._known[k] = name
                if name is not None:
                    self._by_name[name] = k
                fresh.append(h)
            self._bus.publish(
                EventKind.STORED, "", ns, tenant, fresh, medium=MEDIUM, locality=self.locality
            )
            while len(self._known) > self._max_known:  # forgotten silently (docstring)
                _, name = self._known.popitem(last=False)
                if name is not None:
                    self._by_name.pop(name, None)

    def removed(
        self,
        ns: bytes,
        tenant: bytes,
        hashes: Sequence[bytes],
        reason: str,
        *,
        announced_only: bool = True,
    ) -> None:
        """These blocks left the store (``reason``: a removal name, e.g.
        ``"DROPPED"``): retract those that were announced (all of them with
        ``announced_only`` False: a restore saw them missing or failing)."""
        prefix = ns + tenant
        with self._lock:
            if reason == "DROPPED":
                self._drops[prefix] = self._drops.get(prefix, 0) + 1
            gone = [prefix + h for h in hashes if self._forget(prefix + h) or not announced_only]
            self._publish_removed(gone, reason)

    def dropped_tenant(self, ns: bytes, tenant: bytes) -> None:
        """A Drop(all_of_tenant): every announced block of the tenant is gone
        (its store epoch rotated)."""
        self.retract_tenant(ns, tenant, "DROPPED")

    def retract_tenant(self, ns: bytes, tenant: bytes, reason: str) -> None:
        """Every announced block of the tenant is gone (a drop, or its scope
        marker failed its checks). One pass over the remembered blocks."""
        prefix = ns + tenant
        with self._lock:
            if reason == "DROPPED":
                self._drops[prefix] = self._drops.get(prefix, 0) + 1
            gone = [k for k in self._known if k.startswith(prefix)]
            for k in gone:
                self._forget(k)
            self._publish_removed(gone, reason)

    def evicted(self, names: Sequence[str]) -> None:
        """``FsStore.on_evict``: records a put removed to make room."""
        with self._lock:
            gone = [k for k in (self._by_name.get(n) for n in names) if k is not None]
            for k in gone:
                self._forget(k)
            self._publish_removed(gone, "EVICTED")

    def _forget(self, k: bytes) -> bool:
        if k not in self._known:
            return False
        name = self._known.pop(k)
        if name is not None:
            self._by_name.pop(name, None)
        return True

    def _publish_removed(self, keys: list[bytes], reason: str) -> None:
        """One BLOCK_REMOVED per (namespace, tenant), in ``keys`` order."""
        groups: dict[bytes, list[bytes]] = {}
        for k in keys:
            groups.setdefault(k[:64], []).append(k[64:])
        for scope, hashes in groups.items():
            ns, tenant = scope[:32], scope[32:]
            # Still in the host tier (not dropped: a drop takes both copies)?
            held = set()
            if self._in_host is not None and reason != "DROPPED":
                held = self._in_host(ns, tenant, hashes)
            for hs, keep in (([h for h in hashes if h not in held], False), (list(held), True)):
                self._bus.publish(
                    EventKind.REMOVED, reason, ns, tenant, hs,
                    medium=MEDIUM, locality=self.locality, restorable=keep,
                )  # fmt: skip


def publish_host_event(
    bus: EventBus,
    events: StoreEvents | None,
    kind: str,
    reason: Removal | None,
    entries: Sequence[Entry],
) -> None:
    """The host tier's event (the index's ``on_event``: ``kind`` "STORED" or
    "REMOVED") on the bus, one per (namespace, tenant). A block the host tier
    evicted or released that this daemon announced in the store is
    ``restorable`` (not one that was dropped or failed its checks: the
    store's copy goes with it, or is suspect)."""
    groups: dict[tuple[bytes, bytes], list[bytes]] = {}
    for e in entries:
        groups.setdefault((e.key[0], e.key[1]), []).append(e.block_hash)
    ev_kind = EventKind.STORED if kind == "STORED" else EventKind.REMOVED
    why = reason.name if reason else ""
    held = events.holds if events is not None and why in ("EVICTED", "RELEASED") else None
    for (ns, tenant), hashes in groups.items():
        keep = [h for h in hashes if held(ns, tenant, h)] if held is not None else []
        if keep:
            kept = set(keep)
            bus.publish(ev_kind, why, ns, tenant, [h for h in hashes if h not in kept])
            bus.publish(ev_kind, why, ns, tenant, keep, restorable=True)
        else:
            bus.publish(ev_kind, why, ns, tenant, hashes)
