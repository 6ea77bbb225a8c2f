"""The trusted index of the host tier: the only place nonces and tags live.

Every operation here is atomic under one lock and does no I/O: the cache
reserves and pins under the lock, moves bytes outside it, then completes.
Lifecycle of an entry (vLLM ``OffloadingManager`` semantics)::

    begin_store -> PENDING (invisible to lookup, cannot be restored/evicted)
    complete_store(ok) -> READY (in the LRU)      complete_store(fail) -> freed
    abort_store -> freed (the store failed; its eviction is undone where it can be)
    begin_restore -> pinned (cannot be evicted)   complete_restore -> unpinned

Two-phase eviction. ``begin_store`` does not remove the blocks it evicts to
make room: it *dooms* them. A doomed entry is invisible (lookup says ABSENT,
restore says not present, touch ignores it, a new store of its key reports
IN_PROGRESS, a drop only marks it), nothing is announced, and its bytes are
reserved for the plan's new blocks: no other store can be placed there. The
store then settles the eviction: ``complete_store`` with every record
(success) removes the victims for good and announces them; ``abort_store``
(failure) removes only the victims whose bytes the backend may have
overwritten and reinstates every other one exactly as it was (same state,
record, generation, LRU position; unpinned, as it was when doomed).

Removal (evict, drop, write-back release, integrity failure) takes a block out
of the map at once, so a new store of the same hash can start, but its slot is
freed only when no restore pins it and no store is sealing into it.

Events: ``on_event(kind, reason, entries)`` is called *under the lock* at
each visible transition (STORED when an entry becomes READY; REMOVED when a
READY entry leaves, with the Removal reason), so the order watchers see is
the order things happened. PENDING entries are never announced; doomed ones
only when their store settles and they really leave.

Chains: an entry may link to its parent (the previous block of its chain)
when that parent is in the index. Eviction only takes *leaves* (entries with
no linked children), least recently used first, and drops cascade to
descendants, so the index never keeps orphaned descendants. A doomed leaf
still counts as its parent's child until its store settles (the parent is not
a leaf yet: the victim may be reinstated under it).

Cost: see ``leaves`` (which leaves to evict, in O(victims) per plan) and
``extents`` (the byte ranges a failed store may have overwritten).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Sequence

from kvseal.server.errors import BlockNotPresent
from kvseal.server.hostregion import Extent, ExtentAllocator
from kvseal.server.index.entry import (
    BlockKey,
    Entry,
    Eviction,
    IndexStats,
    Removal,
    State,
    StoreOutcome,
    StorePlan,
)
from kvseal.server.index.extents import overlapping, subtract
from kvseal.server.index.invariants import check_invariants
from kvseal.server.index.leaves import UNTRACKED, EvictableLeaves
from kvseal.server.sealing import SealRecord


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
        self._ready: dict[BlockKey, Entry] = {}  # visible READY entries (any order)
        # The entries of ``_map`` by key scope (namespace, tenant), in insertion
        # order, and counts of its PENDING and pinned entries: kept at every
        # change so that ``stats`` and a tenant's drop never walk the whole map
        # (at 1M blocks a walk held this lock for over 100 ms and stalled every
        # engine's Lookup behind a Stats call). A scope leaves the dict with its
        # last entry, so idle tenants cost nothing here.
        self._scopes: dict[tuple[bytes, bytes], dict[bytes, Entry]] = {}
        # Visible READY blocks and their bytes per key scope, for a caller's own
        # Stats (scope_usage); a scope leaves with its last visible block.
        self._scope_ready: dict[tuple[bytes, bytes], list[int]] = {}
        self._pending = 0
        self._pinned = 0
        self._leaves = EvictableLeaves()  # eviction candidates, in recency order
        self._clock = 0  # recency stamps
        self._evictions: set[Eviction] = set()  # not settled yet
        self._generation = 0
        self._on_free = on_free
        self._on_event = on_event

    @property
    def examined(self) -> int:
        """Instrumentation (tests, benchmark): candidates eviction planning looked at."""
        return self._leaves.examined

    def _announce(self, kind: str, reason: Removal | None, entries: list[Entry]) -> None:
        """Report READY entries (caller holds the lock; must not block)."""
        visible = [e for e in entries if e.state is State.READY]
        if visible and self._on_event is not None:
            self._on_event(kind, reason, visible)

    # ----------------------------------------------------------- queries

    def lookup(self, ns: bytes, tenant: bytes, hashes: Sequence[bytes]) -> tuple[int, list[State]]:
        """Length of the READY prefix, and each block's state. No LRU change.
        A doomed block (being evicted by a store in flight) is ABSENT."""
        with self._lock:
            states = []
            for h in hashes:
                e = self._map.get((ns, tenant, h))
                states.append(State.ABSENT if e is None or e.doomed_by is not None else e.state)
        hit = 0
        for s in states:
            if s is not State.READY:
                break
            hit += 1
        return hit, states

    def touch(self, ns: bytes, tenant: bytes, hashes: Iterable[bytes]) -> int:
        """Mark visible READY blocks most recently used (chain order: later
        blocks are touched last, so ancestors are never younger than
        descendants). Returns how many were touched."""
        n = 0
        with self._lock:
            for h in hashes:
                e = self._ready.get((ns, tenant, h))
                if e is not None:
                    self._use(e)
                    n += 1
        return n

    def stats(self) -> IndexStats:
        """Counts kept incrementally: O(1) under the lock, whatever the size."""
        with self._lock:
            return IndexStats(
                len(self._ready),
                self._pending,
                self._pinned,
                self._alloc.used,
                self._alloc.capacity,
            )

    def scope_blocks(self, ns: bytes, tenant: bytes) -> int:
        """Entries (any state) of one key scope: O(1)."""
        with self._lock:
            return len(self._scopes.get((ns, tenant), ()))

    def has_blocks(self, ns: bytes, tenant: bytes) -> bool:
        """Whether the key scope holds any entry (any state). One dictionary read,
        without the index lock: the answer may be stale by the time it is used."""
        return (ns, tenant) in self._scopes

    def scope_usage(self, ns: bytes, tenants: Iterable[bytes]) -> tuple[int, int]:
        """Visible READY blocks and their plaintext bytes over ``tenants`` in
        ``ns``: O(len(tenants)), read without the index lock (each count is one
        read under the GIL; the sum is not one snapshot, which a statistic need
        not be), so a caller's Stats never delays a Lookup."""
        blocks = nbytes = 0
        get = self._scope_ready.get
        for t in tenants:
            usage = get((ns, t))
            if usage is not None:
                blocks += usage[0]
                nbytes += usage[1]
        return blocks, nbytes

    def lru_order(self) -> list[BlockKey]:
        """Visible READY blocks, least recently used first (O(N log N):
        tests and diagnostics, not the data path)."""
        with self._lock:
            return [e.key for e in sorted(self._ready.values(), key=lambda e: e.last_use)]

    # ----------------------------------------------------------- store

    def begin_store(
        self,
        ns: bytes,
        tenant: bytes,
        parent_hash: bytes | None,
        hashes: Sequence[bytes],
        size: int,
    ) -> StorePlan:
        """Classify the blocks, doom LRU leaves if room is needed, and
        reserve slots for the absent ones (PENDING). All-or-nothing: raises
        CapacityExhausted and changes nothing if the new blocks cannot all be
        placed. Victims are only doomed (see the module docstring): nothing
        is announced until the plan settles."""
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
                        StoreOutcome.ALREADY_PRESENT if e.visible else StoreOutcome.IN_PROGRESS
                    )
            parent0 = self._map.get((ns, tenant, parent_hash)) if parent_hash else None
            if parent0 is not None:
                protected.add(id(parent0))
            victims = self._leaves.plan(self._alloc, len(new_positions), size, protected)
            # The victims' bytes are free in the allocator now; place the new blocks.
            new: list[Entry] = []
            for pos in new_positions:
                extent = self._alloc.allocate(size)
                if extent is None:  # pragma: no cover - the plan guarantees room
                    raise RuntimeError("eviction plan was wrong")
                self._generation += 1
                e = Entry((ns, tenant, hashes[pos]), extent, size, self._generation)
                self._insert(e)
                new.append(e)
            if victims:
                # Hold what the new blocks did not take, so that no other store
                # is placed over a victim that an abort may reinstate.
                holds = subtract([v.extent for v in victims], [e.extent for e in new])
                for x in holds:
                    self._alloc.reserve(x)
                ev = Eviction(victims, new, holds)
                self._evictions.add(ev)
                for v in victims:
                    self._untrack(v)  # a chosen heap item was popped: it is gone
                    v.doomed_by = ev
                    self._hide(v)
                for e in new:
                    e.eviction = ev
            # Link chains: parent of hashes[i] is hashes[i-1] (or parent_hash),
            # never a doomed block (it may be about to leave).
            for i, h in enumerate(hashes):
                if outcomes[i] is not StoreOutcome.STORED:
                    continue
                child = self._map[(ns, tenant, h)]
                parent = parent0 if i == 0 else self._map.get((ns, tenant, hashes[i - 1]))
                if parent is not None and not parent.removed and parent.doomed_by is None:
                    child.parent = parent
                    parent.children.add(child)
                    self._untrack(parent)  # not a leaf any more
            # Touch what was already there, in chain order.
            for i, h in enumerate(hashes):
                if outcomes[i] is StoreOutcome.ALREADY_PRESENT:
                    self._use(self._map[(ns, tenant, h)])
            return StorePlan(outcomes, new, new_positions, victims)

    def complete_store(
        self, entries: Sequence[Entry], records: Sequence[SealRecord | None]
    ) -> list[Entry]:
        """Publish sealed entries as READY (record given) or release them
        (None: sealing failed). ``entries`` is the plan's ``new``, exactly
        once. Entries removed meanwhile (e.g. dropped, or a cascade from
        their parent) are freed instead of published. A failed entry takes
        its descendants with it (another request may have linked READY
        children under it while it was pending): those are returned, and
        announced as REMOVED (DROPPED).

        The plan's eviction settles here. Every record present: the victims
        leave for good, announced REMOVED (EVICTED) just before the STORED
        events. Some record None: as :meth:`abort_store` with every position
        written (a victim overlapping any new block's slot leaves, the others
        are reinstated), but the sealed entries are still published."""
        with self._lock:
            ev = next((e.eviction for e in entries if e.eviction is not None), None)
            stored: list[Entry] = []
            cascaded: list[Entry] = []
            seen: list[Entry] = []  # cascaded entries that were READY (announced) then
            extents = [e.extent for e in entries]
            for e, rec in zip(entries, records, strict=True):
                e.eviction = None
                e.record = rec
                if rec is None or e.removed:
                    if not e.removed:
                        gone_now = [c for c in self._remove(e, cascade=True) if c is not e]
                        cascaded.extend(gone_now)
                        # A later entry of this batch may be in the cascade while
                        # still PENDING: it was never announced, so it must not be
                        # announced as removed when it turns READY below.
                        seen.extend(c for c in gone_now if c.state is State.READY)
                    if rec is not None:
                        e.state = State.READY  # sealed, but nobody will see it (not in _map)
                    self._free_if_idle(e, sealing_done=True)
                    continue
                e.state = State.READY
                self._pending -= 1  # in _map: it was not removed
                self._clock += 1
                e.last_use = self._clock
                self._show(e)
                stored.append(e)
            gone: list[tuple[Entry, Removal]] = []
            if ev is not None:
                ok = all(rec is not None for rec in records)
                gone = self._settle(ev, None if ok else extents)
            self._announce_gone(gone)
            self._announce("STORED", None, stored)
            self._announce("REMOVED", Removal.DROPPED, seen)
            for e in stored:
                self._consider(e)
            return cascaded

    def abort_store(
        self, plan: StorePlan, written: Collection[int]
    ) -> tuple[list[Entry], list[Entry]]:
        """Settle a store that failed: discard every new entry and undo the
        eviction where the bytes allow it. Instead of ``complete_store``,
        exactly once per plan.

        ``written`` are positions in ``plan.new`` whose slots the backend may
        have written (all of them when unsure). A victim whose bytes overlap
        such a slot leaves for good (its ciphertext may be destroyed), with
        its victim descendants; so does a victim dropped meanwhile. Both are
        announced REMOVED (EVICTED, or the drop's reason). Every other victim
        is reinstated exactly as it was: READY and visible, same record and
        generation, same LRU position, unpinned; nothing is announced for it.
        New entries are freed (never announced: they were never READY); READY
        blocks other requests linked under them leave with them, announced
        REMOVED (DROPPED).

        Returns (victims removed, descendants removed: entries of other
        requests, not ``plan.new``). Raises ValueError and
        changes nothing if a position is out of range."""
        positions = set(written)
        if any(not 0 <= i < len(plan.new) for i in positions):
            raise ValueError(f"written positions {sorted(positions)} outside plan.new")
        with self._lock:
            ev = next((e.eviction for e in plan.new if e.eviction is not None), None)
            hit = [plan.new[i].extent for i in sorted(positions)]
            mine = {id(e) for e in plan.new}
            cascaded: list[Entry] = []
            for e in plan.new:
                e.eviction = None
                e.record = None
                if not e.removed:
                    cascaded.extend(c for c in self._remove(e, cascade=True) if id(c) not in mine)
                self._free_if_idle(e, sealing_done=True)
            gone = self._settle(ev, hit) if ev is not None else []
            self._announce_gone(gone)
            self._announce("REMOVED", Removal.DROPPED, cascaded)
            return [v for v, _ in gone], cascaded

    def _settle(self, ev: Eviction, written: list[Extent] | None) -> list[tuple[Entry, Removal]]:
        """End a plan's eviction (lock held). ``written`` None: success, every
        victim leaves. Otherwise victims overlapping a ``written`` extent (or
        marked to go, or below one that goes) leave; the rest are reinstated.
        The new entries' slots must already be freed where they will not be
        kept. Returns the victims that left, with the reason to announce."""
        ev.settled = True
        self._evictions.discard(ev)
        for x in ev.holds:
            self._alloc.free(x)
        ev.holds = []
        going: dict[int, Removal] = {}
        hit = overlapping([v.extent for v in ev.victims], written or [])
        # Parents are chosen after their children: walk back so that a
        # parent's fate is known before its children's.
        for v, overwritten in zip(reversed(ev.victims), reversed(hit), strict=True):
            if written is None or overwritten:
                going[id(v)] = Removal.EVICTED
            elif v.doom_removal is not None:
                going[id(v)] = v.doom_removal
            elif v.parent is not None and id(v.parent) in going:
                going[id(v)] = going[id(v.parent)]
        gone: list[tuple[Entry, Removal]] = []
        for v in ev.victims:
            v.doomed_by = None
            v.doom_removal = None
            why = going.get(id(v))
            if why is None:
                self._alloc.reserve(v.extent)  # only holds and unwritten slots: free now
                self._show(v)
                self._consider(v)
                continue
            # Its bytes went back to the allocator when it was doomed.
            v.extent = Extent(v.extent.offset, 0)
            if self._on_free is not None and v.record is not None:
                self._on_free(v)
            self._remove(v, cascade=False)
            gone.append((v, why))
        return gone

    def _announce_gone(self, gone: list[tuple[Entry, Removal]]) -> None:
        for why in Removal:
            self._announce("REMOVED", why, [v for v, w in gone if w is why])

    # ----------------------------------------------------------- restore

    def begin_restore(self, ns: bytes, tenant: bytes, hashes: Sequence[bytes]) -> list[Entry]:
        """Pin every block (all must be visible READY) or raise
        BlockNotPresent and pin nothing."""
        with self._lock:
            entries = []
            for i, h in enumerate(hashes):
                e = self._map.get((ns, tenant, h))
                if e is None or not e.visible:
                    pending = e is not None and e.state is State.PENDING
                    what = "still being stored" if pending else "absent"
                    raise BlockNotPresent(f"block_hashes[{i}] is {what}; nothing was restored")
                entries.append(e)
            for e in entries:
                if e.pins == 0:
                    self._pinned += 1  # visible, so in _map
                e.pins += 1
                self._untrack(e)
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
                    bad.extend(self._remove(e, cascade=True, why=Removal.INTEGRITY))
            if release:
                for e in entries:
                    if id(e) not in failed_ids and not e.removed:
                        released.extend(self._remove(e, cascade=False, reparent=True))
            else:
                for e in entries:
                    if e.visible:
                        self._clock += 1
                        e.last_use = self._clock
            self._announce("REMOVED", Removal.INTEGRITY, bad)
            self._announce("REMOVED", Removal.RELEASED, released)
            for e in entries:
                e.pins -= 1
                if e.pins == 0 and not e.removed:
                    self._pinned -= 1
                self._free_if_idle(e)
                self._consider(e)
            return released, bad

    def release(self, ns: bytes, tenant: bytes, hashes: Sequence[bytes]) -> list[Entry]:
        """Write-back's release of blocks restored without it (the Release
        RPC): each named visible READY block leaves the tier as
        :meth:`complete_restore` with ``release`` takes it (children kept and
        unlinked), announced RELEASED. An absent, PENDING, doomed or removed
        block is skipped. A block another restore has pinned leaves the map
        now and its extent is freed when that restore unpins it. Returns the
        entries released."""
        with self._lock:
            released: list[Entry] = []
            for h in hashes:
                e = self._map.get((ns, tenant, h))
                if e is not None and e.visible:
                    released.extend(self._remove(e, cascade=False, reparent=True))
            self._announce("REMOVED", Removal.RELEASED, released)
            return released

    # ----------------------------------------------------------- drop

    def drop(self, ns: bytes, tenant: bytes, hashes: Sequence[bytes] | None) -> list[Entry]:
        """Remove the blocks (all of the tenant in ``ns`` when ``hashes`` is
        None) and their descendants. Returns every entry removed. A doomed
        block is only marked: it leaves when its store settles, whatever the
        outcome, and is announced then (not returned here)."""
        with self._lock:
            if hashes is None:
                targets = list(self._scopes.get((ns, tenant), {}).values())
            else:
                targets = [e for h in hashes if (e := self._map.get((ns, tenant, h))) is not None]
            removed: list[Entry] = []
            for e in targets:
                if e.doomed_by is not None:
                    if e.doom_removal is None:
                        e.doom_removal = Removal.DROPPED
                elif not e.removed:
                    removed.extend(self._remove(e, cascade=True))
            self._announce("REMOVED", Removal.DROPPED, removed)
            return removed

    # ----------------------------------------------------------- internals

    def _show(self, e: Entry) -> None:
        """Make ``e`` visible READY (lock held)."""
        self._ready[e.key] = e
        usage = self._scope_ready.setdefault(e.key[:2], [0, 0])
        usage[0] += 1
        usage[1] += e.size

    def _hide(self, e: Entry) -> None:
        """``e`` stops being visible READY (lock held; it was)."""
        del self._ready[e.key]
        usage = self._scope_ready[e.key[:2]]
        usage[0] -= 1
        usage[1] -= e.size
        if not usage[0]:
            del self._scope_ready[e.key[:2]]

    def _insert(self, e: Entry) -> None:
        """Put a new entry (PENDING, but for tests that rebuild a READY one) in
        the map, its scope and the counts (lock held)."""
        self._map[e.key] = e
        self._scopes.setdefault(e.key[:2], {})[e.key[2]] = e
        if e.state is State.PENDING:
            self._pending += 1

    def _forget(self, e: Entry) -> None:
        """Take an entry that is still in the map out of it and out of its
        scope and counts (lock held); ``e.removed`` is set by the caller."""
        del self._map[e.key]
        scope = self._scopes[e.key[:2]]
        del scope[e.key[2]]
        if not scope:
            del self._scopes[e.key[:2]]
        if e.state is State.PENDING:
            self._pending -= 1
        if e.pins:
            self._pinned -= 1

    def _use(self, e: Entry) -> None:
        """Make a visible READY entry the most recently used (lock held)."""
        self._untrack(e)
        self._clock += 1
        e.last_use = self._clock
        self._consider(e)

    def _evictable(self, e: Entry) -> bool:
        return e.visible and e.pins == 0 and not e.children

    def _untrack(self, e: Entry) -> None:
        """Forget ``e`` as an eviction candidate (it stops being an evictable
        leaf, or its stamp changes). O(1)."""
        self._leaves.untrack(e)

    def _consider(self, e: Entry) -> None:
        """Track ``e`` if it is an evictable leaf and not tracked yet. Called
        at every transition that can make it one."""
        if e.tracked == UNTRACKED and self._evictable(e):
            self._leaves.track(e)

    def _remove(
        self,
        e: Entry,
        *,
        cascade: bool,
        reparent: bool = False,
        why: Removal = Removal.DROPPED,
    ) -> list[Entry]:
        """Take ``e`` (and with ``cascade`` its descendants) out of the map.

        With ``reparent`` (write-back release of a restored block) children
        are kept and unlinked instead: the engine holds the block in GPU
        memory again, so its descendants are still a usable continuation.
        A doomed descendant is only marked to go (reason ``why``) and
        unlinked: its store settles it.
        """
        # Iterative (a chain can be far deeper than Python's recursion limit),
        # in the order the recursive walk had: pre-order out, frees post-order.
        out: list[Entry] = []
        parent = e.parent
        if parent is not None:
            parent.children.discard(e)
            e.parent = None
        stack = [e]
        while stack:
            x = stack.pop()
            out.append(x)
            self._untrack(x)
            if not x.removed:
                self._forget(x)
            x.removed = True
            if self._ready.get(x.key) is x:
                self._hide(x)
            children = list(x.children)
            x.children.clear()
            descend: list[Entry] = []
            for c in children:
                c.parent = None
                if cascade and not reparent and not c.removed:
                    if c.doomed_by is not None:
                        if c.doom_removal is None:
                            c.doom_removal = why
                    else:
                        descend.append(c)
            stack.extend(reversed(descend))
        for x in reversed(out):
            self._free_if_idle(x)
        if parent is not None:
            self._consider(parent)
        return out

    def _free_if_idle(self, e: Entry, *, sealing_done: bool = False) -> None:
        sealing = e.state is State.PENDING and not sealing_done
        if e.removed and e.pins == 0 and not sealing and e.extent.size:
            self._alloc.free(e.extent)
            e.extent = Extent(e.extent.offset, 0)  # freed exactly once
            if self._on_free is not None and e.record is not None:
                self._on_free(e)

    def check_invariants(self) -> None:
        """Raise AssertionError if the index is inconsistent (tests only; see
        :mod:`kvseal.server.index.invariants`)."""
        with self._lock:
            check_invariants(self)
