"""Which blocks the index may evict, and in what order: the evictable leaves.

Recency is a stamp from a clock. The evictable leaves (READY, visible,
unpinned, childless) are tracked eagerly, at every transition, in one of two
structures: an ordered dict for leaves that became evictable with the newest
stamp (published, touched, restored: the common case, O(1) in and out, no
stale entries), and a binary heap keyed by stamp for leaves that became
evictable at an *older* stamp (a parent whose last child left, a reinstated
victim). Heap items are invalidated lazily (an item is current while its
sequence number is the entry's ``heaped``), and the heap is rebuilt when stale
items outnumber current ones (amortised O(1) per push). Planning an eviction
merges the two in stamp order and looks at O(victims + protected + stale heap
items) entries, each O(1) or O(log N): independent of how many blocks the tier
holds, and touches never leave stale items.

Not thread-safe: the index calls it under its lock.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable

from kvseal.server.errors import CapacityExhausted
from kvseal.server.hostregion import ExtentAllocator, align_up
from kvseal.server.index.entry import BlockKey, Entry

HeapItem = tuple[int, int, Entry]  # (last_use stamp, sequence number, entry)
# Where the eviction planner finds an entry (``Entry.tracked``).
UNTRACKED, ORDERED, HEAP = 0, 1, 2


class EvictableLeaves:
    """The evictable leaves, in stamp order across two structures (see the module
    docstring). ``examined`` counts the candidates eviction planning looked at
    (instrumentation for tests and the benchmark)."""

    def __init__(self) -> None:
        # Those that became evictable with the newest stamp, in stamp order; and
        # the others, in a heap by stamp (stale items invalidated lazily).
        self._ordered: OrderedDict[BlockKey, Entry] = OrderedDict()
        self._last_appended = 0  # stamp of the newest leaf ever appended to _ordered
        self._heap: list[HeapItem] = []
        self._heap_live = 0  # current items in _heap
        self._seq = itertools.count(1)  # heap item identities (never reused)
        self.examined = 0

    def untrack(self, e: Entry) -> None:
        """Forget ``e`` as an eviction candidate (it stops being an evictable
        leaf, or its stamp changes). O(1)."""
        if e.tracked == ORDERED:
            del self._ordered[e.key]
        elif e.tracked == HEAP:
            e.heaped = 0  # its item is stale from now on
            self._heap_live -= 1
        e.tracked = UNTRACKED

    def track(self, e: Entry) -> None:
        """Track ``e``, an evictable leaf not tracked yet (the index checks both).
        O(1), or O(log N) for a leaf at an older stamp than the newest one
        tracked in order."""
        if e.last_use > self._last_appended:
            self._ordered[e.key] = e
            self._last_appended = e.last_use
            e.tracked = ORDERED
            return
        e.heaped = next(self._seq)
        e.tracked = HEAP
        self._heap_live += 1
        heapq.heappush(self._heap, (e.last_use, e.heaped, e))
        if len(self._heap) > 2 * self._heap_live + 64:
            self._compact()

    def _compact(self) -> None:
        """Drop stale heap items (more than half): O(heap), amortised O(1)
        per push."""
        self._heap = [item for item in self._heap if item[1] == item[2].heaped]
        heapq.heapify(self._heap)

    def plan(self, alloc: ExtentAllocator, n: int, size: int, protected: set[int]) -> list[Entry]:
        """Choose LRU leaves so that ``n`` blocks of ``size`` bytes fit, and
        free their extents in the allocator. On CapacityExhausted nothing has
        changed (the extents are reserved again, the heap items put back).

        The choice is the old definition, exactly: repeatedly the least
        recently used entry that is visible READY, unpinned, not
        ``protected`` and has no children other than victims already chosen.
        Candidates come, in stamp order, from the ordered leaves, the heap of
        older leaves, and a local heap of parents whose last child was just
        chosen (each such parent enters at its own recency)."""
        if n == 0:
            return []
        need = align_up(size)
        if need > alloc.capacity:
            raise CapacityExhausted(
                f"a block of {size} bytes is larger than the host tier ({alloc.capacity} bytes)"
            )
        if alloc.fits(need) >= n:
            return []
        victims: list[Entry] = []
        chosen: set[int] = set()
        gone: dict[int, int] = {}  # id(parent) -> children chosen so far
        local: list[HeapItem] = []
        put_back: list[HeapItem] = []  # heap items of chosen victims (restored on failure)
        aside: list[HeapItem] = []  # heap items skipped (always restored)
        heap = self._heap
        ordered = iter(self._ordered.values())  # not changed while planning
        head = next(ordered, None)

        def leaf_now(e: Entry) -> bool:
            return e.visible and e.pins == 0 and len(e.children) == gone.get(id(e), 0)

        while alloc.fits(need) < n:
            cand: Entry | None = None
            while cand is None and (head is not None or heap or local):
                # The oldest of the three sources (stamps are unique).
                src, best = 0, head.last_use if head is not None else None
                if heap and (best is None or heap[0][0] < best):
                    src, best = 1, heap[0][0]
                if local and (best is None or local[0][0] < best):
                    src = 2
                self.examined += 1
                if src == 0:
                    assert head is not None
                    e, head = head, next(ordered, None)
                    if id(e) not in protected and leaf_now(e):
                        cand = e
                elif src == 1:
                    item = heapq.heappop(heap)
                    e = item[2]
                    if item[1] != e.heaped:
                        continue  # stale (touched, pinned, gained a child, or gone since)
                    if id(e) in protected or not leaf_now(e):
                        aside.append(item)
                        continue
                    put_back.append(item)
                    cand = e
                else:
                    _, _, e = heapq.heappop(local)
                    if id(e) not in chosen and id(e) not in protected and leaf_now(e):
                        cand = e
            if cand is None:
                for v in reversed(victims):
                    alloc.reserve(v.extent)
                for item in put_back + aside:
                    heapq.heappush(heap, item)
                raise CapacityExhausted(
                    f"host tier full: {n} new block(s) of {size} bytes do not fit "
                    f"and every other block is pinned, pending, or part of this request"
                )
            victims.append(cand)
            chosen.add(id(cand))
            alloc.free(cand.extent)
            p = cand.parent
            if p is not None:
                g = gone[id(p)] = gone.get(id(p), 0) + 1
                if g == len(p.children):
                    heapq.heappush(local, (p.last_use, next(self._seq), p))
        for item in aside:
            heapq.heappush(heap, item)
        return victims

    def check(self, live: list[Entry], evictable: Callable[[Entry], bool]) -> None:
        """Raise AssertionError unless every evictable leaf among ``live`` is
        tracked exactly once, and nothing else is (tests only)."""
        current = {item[1]: item for item in self._heap if item[1] == item[2].heaped}
        if len(current) != self._heap_live:
            raise AssertionError("heap live count")
        order = [e.last_use for e in self._ordered.values()]
        if order != sorted(order) or (order and order[-1] > self._last_appended):
            raise AssertionError("ordered leaves out of stamp order")
        for k, e in self._ordered.items():
            if e.key != k or e.tracked != ORDERED or not evictable(e):
                raise AssertionError("ordered leaf is not an evictable leaf")
        for item in current.values():
            e = item[2]
            if e.tracked != HEAP or item[0] != e.last_use or not evictable(e):
                raise AssertionError("heap item is not a current evictable leaf")
        for e in live:
            if evictable(e) and e.tracked == UNTRACKED:
                raise AssertionError("evictable leaf not tracked")
