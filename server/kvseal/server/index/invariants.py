"""The trusted index's invariants, checked by the tests after every step of
their model checks (:meth:`kvseal.server.index.Index.check_invariants`): a
separate room, so that the index itself holds only what requests run."""

from __future__ import annotations

import itertools
from typing import Any

from kvseal.server.hostregion import Extent
from kvseal.server.index.entry import State
from kvseal.server.index.extents import subtract


def check_invariants(ix: Any) -> None:
    """Raise AssertionError if ``ix`` (an ``Index``: not imported, which would
    make a cycle) is inconsistent. The caller holds its lock."""
    live = list(ix._map.values())
    for k, e in ix._map.items():
        if e.key != k or e.removed:
            raise AssertionError("map entry mismatch")
        if e.parent is not None and (e.parent.removed or e not in e.parent.children):
            raise AssertionError("orphaned descendant")
        if e.visible != (k in ix._ready):
            raise AssertionError("_ready holds exactly the visible READY entries")
        if e.doomed_by is not None and (
            e.doomed_by.settled or e.pins or e.state is not State.READY
        ):
            raise AssertionError("doomed entry is pinned, not READY, or settled")
    for k, e in ix._ready.items():
        if ix._map.get(k) is not e:
            raise AssertionError("_ready entry not in the map")
    usage: dict[tuple[bytes, bytes], list[int]] = {}
    for e in ix._ready.values():
        u = usage.setdefault(e.key[:2], [0, 0])
        u[0] += 1
        u[1] += e.size
    if usage != ix._scope_ready:
        raise AssertionError("per-scope READY usage")
    if sum(len(d) for d in ix._scopes.values()) != len(ix._map) or any(
        not d or ix._map.get((*k, h)) is not e for k, d in ix._scopes.items() for h, e in d.items()
    ):
        raise AssertionError("_scopes holds exactly the map's entries, by scope")
    if ix._pending != sum(1 for e in live if e.state is State.PENDING):
        raise AssertionError("pending count")
    if ix._pinned != sum(1 for e in live if e.pins):
        raise AssertionError("pinned count")
    stamps = [e.last_use for e in ix._ready.values()]
    if len(set(stamps)) != len(stamps) or any(s <= 0 for s in stamps):
        raise AssertionError("recency stamps are not distinct")
    # Every evictable leaf is tracked exactly once, and nothing else is.
    ix._leaves.check(live, ix._evictable)
    # Slots: visible/pending holders, new entries of open plans (even if
    # dropped meanwhile: still being written) and holds never overlap;
    # a doomed victim's bytes are covered by its plan's slots and holds.
    holders: dict[int, Extent] = {
        id(e): e.extent for e in live if e.doomed_by is None and e.extent.size
    }
    spans = []
    for ev in ix._evictions:
        for e in ev.new:
            if e.extent.size:
                holders[id(e)] = e.extent
        spans.extend(ev.holds)
        cover = [e.extent for e in ev.new if e.extent.size] + list(ev.holds)
        for v in ev.victims:
            if v.doomed_by is not ev or subtract([v.extent], cover):
                raise AssertionError("doomed victim's bytes not held by its plan")
    spans.extend(holders.values())
    if sum(x.size for x in spans) > ix._alloc.used:
        raise AssertionError("allocator accounting")
    if ix._alloc.used > ix._alloc.capacity:
        raise AssertionError("allocator accounting")
    ordered = sorted((x.offset, x.size) for x in spans)
    for (o1, s1), (o2, _) in itertools.pairwise(ordered):
        if o1 + s1 > o2:
            raise AssertionError("overlapping slots")
