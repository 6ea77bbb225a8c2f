"""The trusted index of the host tier: the only place nonces and tags live.

Every operation here is atomic under one lock and does no I/O: the cache
reserves and pins under the lock, moves bytes outside it, then completes.
Lifecycle of an entry (vLLM ``OffloadingManager`` semantics)::

    begin_store -> PENDING (invisible to lookup, cannot be restored/evicted)
    complete_store(ok) -> READY (in the LRU)      complete_store(fail) -> freed
    begin_restore -> pinned (cannot be evicted)   complete_restore -> unpinned

Removal (evict, drop, write-back release, integrity failure) takes a block out
of the map at once, so a new store of the same hash can start, but its slot is
freed only when no restore pins it and no store is sealing into it.

Events: ``on_event(kind, reason, entries)`` is called *under the lock* at
each visible transition (STORED when an entry becomes READY; REMOVED when a
READY entry leaves, with the Removal reason), so the order watchers see is
the order things happened. PENDING entries are never announced.

Chains: an entry may link to its parent (the previous block of its chain)
when that parent is in the index. Eviction only takes *leaves* (entries with
no linked children), least recently used first, and drops cascade to
descendants, so the index never keeps orphaned descendants.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum

from kvseal.server.errors import BlockNotPresent, CapacityExhausted
from kvseal.server.hostregion import Extent, ExtentAllocator
from kvseal.server.sealing import SealRecord

BlockKey = tuple[bytes, bytes, bytes]  # (namespace, tenant, block hash)


class State(Enum):
    ABSENT = 1
    PENDING = 2
    READY = 3


class StoreOutcome(Enum):
    STORED = 1
    ALREADY_PRESENT = 2
    IN_PROGRESS = 3


class Removal(Enum):
    EVICTED = 1
    DROPPED = 2
    RELEASED = 3
    INTEGRITY = 4


@dataclass(eq=False, slots=True)
class Entry:
    key: BlockKey
    extent: Extent
    size: int  # ciphertext bytes (== plaintext bytes)
    generation: int
    state: State = State.PENDING
    record: SealRecord | None = None
    parent: Entry | None = None
    children: set[Entry] = field(default_factory=set)
    pins: int = 0
    removed: bool = False

    @property
    def block_hash(self) -> bytes:
        return self.key[2]


@dataclass(slots=True)
class StorePlan:
    """Result of :meth:`Index.begin_store`; the caller seals ``new`` entries
    and must call :meth:`Index.complete_store` with them exactly once."""

    outcomes: list[StoreOutcome]
    new: list[Entry]  # PENDING, in request order, parallel to new_positions
    new_positions: list[int]  # index into the request's hashes
    evicted: list[Entry]


@dataclass(slots=True)
class IndexStats:
    ready: int
    pending: int
    pinned: int
    used_bytes: int
    capacity_bytes: int


class Index:
    """Block key -> entry, LRU order, slot allocation. Thread-safe.

    ``on_free`` is called (under the lock, must not block) with each entry
    whose slot is actually released, e.g. to drop its key epoch reference.
    """

    def __init__(
        self,
        capacity: int,
        on_free: Callable[[Entry], None] | None = None,
        on_event: Callable[[str, Removal | None, list[Entry]], None] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._alloc = ExtentAllocator(capacity)
        self._map: dict[BlockKey, Entry] = {}
        self._lru: OrderedDict[BlockKey, Entry] = OrderedDict()  # READY only, oldest first
        self._generation = 0
        self._on_free = on_free
        self._on_event = on_event

    def _announce(self, kind: str, reason: Removal | None, entries: list[Entry]) -> None:
        """Report READY entries (caller holds the lock; must not block)."""
        visible = [e for e in entries if e.state is State.READY]
        if visible and self._on_event is not None:
            self._on_event(kind, reason, visible)

    # ----------------------------------------------------------- queries

    def lookup(self, ns: bytes, tenant: bytes, hashes: Sequence[bytes]) -> tuple[int, list[State]]:
        """Length of the READY prefix, and each block's state. No LRU change."""
        with self._lock:
            states = []
            for h in hashes:
                e = self._map.get((ns, tenant, h))
                states.append(State.ABSENT if e is None else e.state)
        hit = 0
        for s in states:
            if s is not State.READY:
                break
            hit += 1
        return hit, states

    def touch(self, ns: bytes, tenant: bytes, hashes: Iterable[bytes]) -> int:
        """Mark READY blocks most recently used (chain order: later blocks are
        touched last, so ancestors are never younger than descendants)."""
        n = 0
        with self._lock:
            for h in hashes:
                key = (ns, tenant, h)
                if key in self._lru:
                    self._lru.move_to_end(key)
                    n += 1
        return n

    def stats(self) -> IndexStats:
        with self._lock:
            ready = len(self._lru)
            pending = sum(1 for e in self._map.values() if e.state is State.PENDING)
            pinned = sum(1 for e in self._map.values() if e.pins)
            return IndexStats(ready, pending, pinned, self._alloc.used, self._alloc.capacity)

    # ----------------------------------------------------------- store

    def begin_store(
        self,
        ns: bytes,
        tenant: bytes,
        parent_hash: bytes | None,
        hashes: Sequence[bytes],
        size: int,
    ) -> StorePlan:
        """Classify the blocks, evict if needed, and reserve slots for the
        absent ones (PENDING). All-or-nothing: raises CapacityExhausted and
        changes nothing if the new blocks cannot all be placed."""
        with self._lock:
            outcomes: list[StoreOutcome] = []
            new_positions: list[int] = []
            protected: set[int] = set()
            for i, h in enumerate(hashes):
                e = self._map.get((ns, tenant, h))
                if e is None:
                    outcomes.append(StoreOutcome.STORED)
                    new_positions.append(i)
                else:
                    protected.add(id(e))
                    outcomes.append(
                        StoreOutcome.ALREADY_PRESENT
                        if e.state is State.READY
                        else StoreOutcome.IN_PROGRESS
                    )
            parent0 = self._map.get((ns, tenant, parent_hash)) if parent_hash else None
            if parent0 is not None:
                protected.add(id(parent0))
            sizes = [size] * len(new_positions)
            evicted = self._plan_eviction(sizes, protected)
            for victim in evicted:
                self._remove(victim, cascade=False)
            self._announce("REMOVED", Removal.EVICTED, evicted)
            new: list[Entry] = []
            for pos in new_positions:
                extent = self._alloc.allocate(size)
                if extent is None:  # pragma: no cover - the plan guarantees room
                    raise RuntimeError("eviction plan was wrong")
                self._generation += 1
                e = Entry((ns, tenant, hashes[pos]), extent, size, self._generation)
                self._map[e.key] = e
                new.append(e)
            # Link chains: parent of hashes[i] is hashes[i-1] (or parent_hash).
            for i, h in enumerate(hashes):
                child = self._map[(ns, tenant, h)]
                if outcomes[i] is not StoreOutcome.STORED:
                    continue
                parent = parent0 if i == 0 else self._map.get((ns, tenant, hashes[i - 1]))
                if parent is not None and not parent.removed:
                    child.parent = parent
                    parent.children.add(child)
            # Touch what was already there, in chain order.
            for i, h in enumerate(hashes):
                if outcomes[i] is StoreOutcome.ALREADY_PRESENT:
                    self._lru.move_to_end((ns, tenant, h))
            return StorePlan(outcomes, new, new_positions, evicted)

    def _plan_eviction(self, sizes: list[int], protected: set[int]) -> list[Entry]:
        """Choose LRU leaves to evict so that ``sizes`` fit. Changes nothing."""
        if self._alloc.can_allocate_all(sizes):
            return []
        if any(s > self._alloc.capacity for s in sizes):
            raise CapacityExhausted(
                f"a block of {sizes[0]} bytes is larger than the host tier "
                f"({self._alloc.capacity} bytes)"
            )
        need = sum(sizes)
        sim = self._alloc.clone()
        victims: list[Entry] = []
        chosen: set[int] = set()
        gone_children: dict[int, int] = {}
        while True:
            cand = None
            for e in self._lru.values():
                if id(e) in chosen or id(e) in protected or e.pins:
                    continue
                live_children = len(e.children) - gone_children.get(id(e), 0)
                if live_children > 0:
                    continue
                cand = e
                break
            if cand is None:
                raise CapacityExhausted(
                    f"host tier full: {len(sizes)} new block(s) of {sizes[0]} bytes do not fit "
                    f"and every other block is pinned, pending, or part of this request"
                )
            victims.append(cand)
            chosen.add(id(cand))
            if cand.parent is not None:
                gone_children[id(cand.parent)] = gone_children.get(id(cand.parent), 0) + 1
            sim.free(cand.extent)
            if sim.free_bytes() >= need and sim.can_allocate_all(sizes):
                return victims

    def complete_store(
        self, entries: Sequence[Entry], records: Sequence[SealRecord | None]
    ) -> list[Entry]:
        """Publish sealed entries as READY (record given) or release them
        (None: sealing failed). Entries removed meanwhile (e.g. dropped, or a
        cascade from their parent) are freed instead of published. A failed
        entry takes its descendants with it (another request may have linked
        READY children under it while it was pending): those are returned,
        and announced as REMOVED (DROPPED)."""
        with self._lock:
            stored: list[Entry] = []
            cascaded: list[Entry] = []
            for e, rec in zip(entries, records, strict=True):
                e.record = rec
                if rec is None or e.removed:
                    if not e.removed:
                        cascaded.extend(c for c in self._remove(e, cascade=True) if c is not e)
                    if rec is not None:
                        e.state = State.READY  # sealed, but nobody will see it
                    self._free_if_idle(e, sealing_done=True)
                    continue
                e.state = State.READY
                self._lru[e.key] = e
                stored.append(e)
            self._announce("STORED", None, stored)
            self._announce("REMOVED", Removal.DROPPED, cascaded)
            return cascaded

    # ----------------------------------------------------------- restore

    def begin_restore(self, ns: bytes, tenant: bytes, hashes: Sequence[bytes]) -> list[Entry]:
        """Pin every block (all must be READY) or raise BlockNotPresent and
        pin nothing."""
        with self._lock:
            entries = []
            for i, h in enumerate(hashes):
                e = self._map.get((ns, tenant, h))
                if e is None or e.state is not State.READY:
                    what = "absent" if e is None else "still being stored"
                    raise BlockNotPresent(f"block_hashes[{i}] is {what}; nothing was restored")
                entries.append(e)
            for e in entries:
                e.pins += 1
            return entries

    def complete_restore(
        self, entries: Sequence[Entry], *, release: bool, failed: Sequence[Entry] = ()
    ) -> tuple[list[Entry], list[Entry]]:
        """Unpin. With ``release`` (write-back) the restored blocks leave the
        tier; ``failed`` blocks (integrity, drop policy) leave it with their
        descendants. Returns (released, removed_for_integrity)."""
        with self._lock:
            released: list[Entry] = []
            bad: list[Entry] = []
            failed_ids = {id(e) for e in failed}
            for e in failed:
                if not e.removed:
                    bad.extend(self._remove(e, cascade=True))
            if release:
                for e in entries:
                    if id(e) not in failed_ids and not e.removed:
                        released.extend(self._remove(e, cascade=False, reparent=True))
            else:
                for e in entries:
                    if not e.removed and e.key in self._lru:
                        self._lru.move_to_end(e.key)
            self._announce("REMOVED", Removal.INTEGRITY, bad)
            self._announce("REMOVED", Removal.RELEASED, released)
            for e in entries:
                e.pins -= 1
                self._free_if_idle(e)
            return released, bad

    # ----------------------------------------------------------- drop

    def drop(self, ns: bytes, tenant: bytes, hashes: Sequence[bytes] | None) -> list[Entry]:
        """Remove the blocks (all of the tenant in ``ns`` when ``hashes`` is
        None) and their descendants. Returns every entry removed."""
        with self._lock:
            if hashes is None:
                targets = [e for k, e in self._map.items() if k[0] == ns and k[1] == tenant]
            else:
                targets = [e for h in hashes if (e := self._map.get((ns, tenant, h))) is not None]
            removed: list[Entry] = []
            for e in targets:
                if not e.removed:
                    removed.extend(self._remove(e, cascade=True))
            self._announce("REMOVED", Removal.DROPPED, removed)
            return removed

    # ----------------------------------------------------------- internals

    def _remove(self, e: Entry, *, cascade: bool, reparent: bool = False) -> list[Entry]:
        """Take ``e`` (and with ``cascade`` its descendants) out of the map.

        With ``reparent`` (write-back release of a restored block) children
        are kept and unlinked instead: the engine holds the block in GPU
        memory again, so its descendants are still a usable continuation.
        """
        out = [e]
        e.removed = True
        self._map.pop(e.key, None)
        self._lru.pop(e.key, None)
        if e.parent is not None:
            e.parent.children.discard(e)
            e.parent = None
        children = list(e.children)
        e.children.clear()
        for c in children:
            c.parent = None
            if cascade and not reparent and not c.removed:
                out.extend(self._remove(c, cascade=True))
        self._free_if_idle(e)
        return out

    def _free_if_idle(self, e: Entry, *, sealing_done: bool = False) -> None:
        sealing = e.state is State.PENDING and not sealing_done
        if e.removed and e.pins == 0 and not sealing and e.extent.size:
            self._alloc.free(e.extent)
            e.extent = Extent(e.extent.offset, 0)  # freed exactly once
            if self._on_free is not None and e.record is not None:
                self._on_free(e)

    def check_invariants(self) -> None:
        """Raise AssertionError if the index is inconsistent (tests only)."""
        with self._lock:
            live = list(self._map.values())
            used = sum(e.extent.size for e in live)
            if used > self._alloc.used or self._alloc.used > self._alloc.capacity:
                raise AssertionError("allocator accounting")
            for k, e in self._map.items():
                if e.key != k or e.removed:
                    raise AssertionError("map entry mismatch")
                if e.parent is not None and (e.parent.removed or e not in e.parent.children):
                    raise AssertionError("orphaned descendant")
                if (e.state is State.READY) != (k in self._lru):
                    raise AssertionError("LRU holds exactly the READY entries")
            spans = sorted((e.extent.offset, e.extent.size) for e in live)
            for (o1, s1), (o2, _) in itertools.pairwise(spans):
                if o1 + s1 > o2:
                    raise AssertionError("overlapping slots")
