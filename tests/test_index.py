"""kvseal.server.index.Index: the trusted index (pure, no I/O).

Unit tests pin down the documented semantics one by one; a hypothesis
state machine then drives random interleavings of every operation against a
small reference model (chains, pins, pending stores, LRU order) and checks
the index against it after every step.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)
from kvseal.server.errors import BlockNotPresent, CapacityExhausted
from kvseal.server.hostregion import SLOT_ALIGN, Extent
from kvseal.server.index import Entry, Index, Removal, State, StoreOutcome, StorePlan
from kvseal.server.sealing import SealRecord

NS = b"N" * 32
NS2 = b"M" * 32
T1 = b"t" * 32
T2 = b"u" * 32
BLOCK = SLOT_ALIGN  # one slot per block: capacity counts in blocks
_nonces = itertools.count()


def h(name: str) -> bytes:
    return name.encode().ljust(32, b".")


def record() -> SealRecord:
    return SealRecord(0, next(_nonces).to_bytes(12, "big"), bytes(16))


class Freed:
    """The ``on_free`` callback: remembers every call."""

    def __init__(self) -> None:
        self.calls: list[Entry] = []

    def __call__(self, e: Entry) -> None:
        self.calls.append(e)

    def hashes(self) -> list[bytes]:
        return [e.block_hash for e in self.calls]


def make(blocks: int) -> tuple[Index, Freed]:
    freed = Freed()
    return Index(blocks * BLOCK, on_free=freed), freed


def store(
    idx: Index,
    names: Sequence[str],
    parent: str | None = None,
    *,
    tenant: bytes = T1,
    ns: bytes = NS,
) -> list[Entry]:
    """begin_store + complete_store(success); returns the evicted entries."""
    plan = idx.begin_store(ns, tenant, h(parent) if parent else None, [h(n) for n in names], BLOCK)
    idx.complete_store(plan.new, [record() for _ in plan.new])
    idx.check_invariants()
    return plan.evicted


def states(idx: Index, names: Sequence[str], tenant: bytes = T1, ns: bytes = NS) -> list[State]:
    return idx.lookup(ns, tenant, [h(n) for n in names])[1]


def names_of(entries: Sequence[Entry]) -> list[str]:
    return [e.block_hash.rstrip(b".").decode() for e in entries]


def snapshot(idx: Index) -> tuple[object, ...]:
    """Everything observable about an index, for before/after comparisons
    (not the eviction heap: stale items may be cleaned up at any time)."""
    with idx._lock:
        entries = tuple(
            (
                k,
                e.state,
                e.extent,
                e.pins,
                e.removed,
                e.record,
                e.generation,
                e.last_use,
                e.doomed_by is not None,
                e.parent.key if e.parent else None,
                tuple(sorted(c.key for c in e.children)),
            )
            for k, e in idx._map.items()
        )
        return (
            entries,
            tuple(e.key for e in sorted(idx._ready.values(), key=lambda e: e.last_use)),
            tuple(idx._alloc._offsets),
            tuple(idx._alloc._sizes),
            idx._alloc.used,
            idx._generation,
        )


# ---------------------------------------------------------------- lookup


def test_lookup_ready_prefix_and_pending_stops_it() -> None:
    idx, _ = make(8)
    store(idx, ["a", "b", "c"])
    idx.begin_store(NS, T1, h("c"), [h("d")], BLOCK)  # d stays PENDING
    store(idx, ["e"], "d")
    hit, st_ = idx.lookup(NS, T1, [h(n) for n in "abcde"])
    assert hit == 3
    assert st_ == [State.READY] * 3 + [State.PENDING, State.READY]
    hit, st_ = idx.lookup(NS, T1, [h("d"), h("a")])
    assert (hit, st_) == (0, [State.PENDING, State.READY])
    hit, st_ = idx.lookup(NS, T1, [h("a"), h("x"), h("b")])
    assert (hit, st_) == (1, [State.READY, State.ABSENT, State.READY])
    assert idx.stats().pending == 1 and idx.stats().ready == 4


def test_lookup_does_not_change_lru() -> None:
    idx, _ = make(2)
    store(idx, ["a"])
    store(idx, ["b"])
    idx.lookup(NS, T1, [h("a")])
    assert names_of(store(idx, ["c"])) == ["a"]


def test_pending_is_invisible_to_restore() -> None:
    idx, _ = make(4)
    store(idx, ["a"])
    idx.begin_store(NS, T1, None, [h("p")], BLOCK)
    with pytest.raises(BlockNotPresent):
        idx.begin_restore(NS, T1, [h("p")])
    with pytest.raises(BlockNotPresent):
        idx.begin_restore(NS, T1, [h("a"), h("p")])  # all or nothing
    with pytest.raises(BlockNotPresent):
        idx.begin_restore(NS, T1, [h("a"), h("absent")])
    assert idx.stats().pinned == 0
    assert idx._map[(NS, T1, h("a"))].pins == 0
    idx.check_invariants()


def test_offload_of_present_block_is_already_present_and_touches() -> None:
    idx, _ = make(3)
    store(idx, ["a"])
    store(idx, ["b"])
    store(idx, ["c"])
    plan = idx.begin_store(NS, T1, None, [h("a"), h("x")], BLOCK)
    assert plan.outcomes == [StoreOutcome.ALREADY_PRESENT, StoreOutcome.STORED]
    assert names_of(plan.new) == ["x"] and plan.new_positions == [1]
    # a was touched (and protected): b, the oldest other leaf, made room.
    assert names_of(plan.evicted) == ["b"]
    idx.complete_store(plan.new, [record()])
    assert idx.lru_order() == [(NS, T1, h(n)) for n in ("c", "a", "x")]
    idx.check_invariants()


def test_offload_of_pending_block_is_in_progress() -> None:
    idx, _ = make(4)
    first = idx.begin_store(NS, T1, None, [h("a")], BLOCK)
    plan = idx.begin_store(NS, T1, None, [h("a"), h("b")], BLOCK)
    assert plan.outcomes == [StoreOutcome.IN_PROGRESS, StoreOutcome.STORED]
    assert names_of(plan.new) == ["b"]
    assert idx.stats().used_bytes == 2 * BLOCK
    idx.complete_store(first.new, [record()])
    idx.complete_store(plan.new, [record()])
    assert states(idx, ["a", "b"]) == [State.READY, State.READY]
    # b was linked to the pending a
    assert idx._map[(NS, T1, h("b"))].parent is idx._map[(NS, T1, h("a"))]


def test_touch_changes_lru_and_counts_only_ready() -> None:
    idx, _ = make(3)
    store(idx, ["a"])
    store(idx, ["b"])
    store(idx, ["c"])
    assert idx.touch(NS, T1, [h("a"), h("zz")]) == 1
    assert names_of(store(idx, ["d"])) == ["b"]
    assert names_of(store(idx, ["e"])) == ["c"]
    assert names_of(store(idx, ["f"])) == ["a"]


# ---------------------------------------------------------------- eviction


def test_eviction_is_leaf_first() -> None:
    idx, freed = make(3)
    store(idx, ["A", "B", "C"])  # A oldest, chain A <- B <- C
    assert names_of(store(idx, ["X"])) == ["C"]
    assert states(idx, ["A", "B", "C"]) == [State.READY, State.READY, State.ABSENT]
    assert names_of(store(idx, ["Y"])) == ["B"]  # B is now a leaf and older than X
    assert names_of(store(idx, ["Z"])) == ["A"]
    assert names_of(freed.calls) == ["C", "B", "A"]


def test_eviction_of_several_leaves_in_one_plan() -> None:
    idx, freed = make(4)
    store(idx, ["A", "B", "C"])
    store(idx, ["D"])
    plan = idx.begin_store(NS, T1, None, [h("X"), h("Y")], BLOCK)
    # C is the oldest leaf; then B becomes one (older than D).
    assert names_of(plan.evicted) == ["C", "B"]
    assert freed.calls == []  # only doomed until the store succeeds
    idx.complete_store(plan.new, [record(), record()])
    assert names_of(freed.calls) == ["C", "B"]
    assert states(idx, ["A", "B", "C", "D", "X", "Y"]) == [
        State.READY,
        State.ABSENT,
        State.ABSENT,
        State.READY,
        State.READY,
        State.READY,
    ]
    idx.check_invariants()


def test_eviction_never_takes_an_ancestor_of_a_present_block() -> None:
    idx, _ = make(3)
    store(idx, ["A", "B"])
    store(idx, ["C"], "B")
    idx.touch(NS, T1, [h("C"), h("B"), h("A")])  # reverse touch: A youngest
    # Every block is in one chain: only the leaf C can go, whatever the LRU says.
    assert names_of(store(idx, ["X"])) == ["C"]


def test_parent_of_request_is_protected() -> None:
    idx, _ = make(2)
    store(idx, ["A"])
    store(idx, ["B"])
    # Continue A's chain: A is the oldest leaf, but it is the new block's parent.
    ev = store(idx, ["A2"], "A")
    assert names_of(ev) == ["B"]
    assert idx._map[(NS, T1, h("A2"))].parent is idx._map[(NS, T1, h("A"))]


def test_pinned_blocks_are_never_evicted() -> None:
    idx, _ = make(3)
    store(idx, ["a"])
    store(idx, ["b"])
    store(idx, ["c"])
    pinned = idx.begin_restore(NS, T1, [h("a"), h("c")])
    assert names_of(store(idx, ["d"])) == ["b"]
    assert names_of(store(idx, ["e"])) == ["d"]
    idx.complete_restore(pinned, release=False)
    # a and c were touched by the restore: e is now the oldest
    assert names_of(store(idx, ["f"])) == ["e"]


def test_capacity_exhausted_is_atomic() -> None:
    idx, freed = make(3)
    store(idx, ["a"])
    store(idx, ["b"])
    store(idx, ["c"])
    idx.begin_restore(NS, T1, [h("a"), h("b")])
    before = snapshot(idx)
    stats_before = idx.stats()
    # Two new blocks need two slots; only c is evictable.
    with pytest.raises(CapacityExhausted):
        idx.begin_store(NS, T1, None, [h("x"), h("y")], BLOCK)
    assert snapshot(idx) == before
    assert idx.stats() == stats_before
    assert states(idx, ["a", "b", "c", "x", "y"]) == [State.READY] * 3 + [State.ABSENT] * 2
    assert freed.calls == []
    idx.check_invariants()
    # One block fits (c goes).
    assert names_of(store(idx, ["x"])) == ["c"]


def test_capacity_exhausted_when_everything_is_pinned_or_pending() -> None:
    idx, freed = make(2)
    store(idx, ["a"])
    idx.begin_store(NS, T1, None, [h("p")], BLOCK)
    idx.begin_restore(NS, T1, [h("a")])
    before = snapshot(idx)
    with pytest.raises(CapacityExhausted):
        idx.begin_store(NS, T1, None, [h("x")], BLOCK)
    assert snapshot(idx) == before and freed.calls == []


def test_capacity_exhausted_when_room_needs_a_protected_block() -> None:
    idx, _ = make(2)
    store(idx, ["a"])
    store(idx, ["b"])
    before = snapshot(idx)
    # Both present blocks are part of the request (a) or its parent (b).
    with pytest.raises(CapacityExhausted):
        idx.begin_store(NS, T1, h("b"), [h("a"), h("x")], BLOCK)
    assert snapshot(idx) == before


def test_block_larger_than_tier() -> None:
    idx, _ = make(2)
    before = snapshot(idx)
    with pytest.raises(CapacityExhausted):
        idx.begin_store(NS, T1, None, [h("x")], 2 * BLOCK + 1)
    assert snapshot(idx) == before


def test_unaligned_capacity_is_rounded_down() -> None:
    idx = Index(2 * BLOCK + BLOCK - 1)
    assert idx.stats().capacity_bytes == 2 * BLOCK
    store(idx, ["a", "b"])
    assert names_of(store(idx, ["c"])) == ["b"]


# ---------------------------------------------------------------- drop


def test_drop_cascades_to_descendants() -> None:
    idx, freed = make(8)
    store(idx, ["A", "B", "C", "D"])
    store(idx, ["E"], "B")  # a branch off B
    store(idx, ["Z"])
    removed = idx.drop(NS, T1, [h("B")])
    assert sorted(names_of(removed)) == ["B", "C", "D", "E"]
    assert sorted(names_of(freed.calls)) == ["B", "C", "D", "E"]
    assert states(idx, ["A", "B", "C", "D", "E", "Z"]) == [State.READY] + [State.ABSENT] * 4 + [
        State.READY
    ]
    assert idx._map[(NS, T1, h("A"))].children == set()
    assert idx.stats().used_bytes == 2 * BLOCK
    assert idx.drop(NS, T1, [h("B"), h("nothing")]) == []
    idx.check_invariants()


def test_drop_of_a_chain_far_deeper_than_the_recursion_limit() -> None:
    n = 20_000
    idx, freed = make(n)
    chain = [i.to_bytes(32, "big") for i in range(n)]
    plan = idx.begin_store(NS, T1, None, chain, BLOCK)
    idx.complete_store(plan.new, [record() for _ in plan.new])
    removed = idx.drop(NS, T1, [chain[0]])
    assert removed == plan.new  # the whole chain, root first
    assert freed.calls == plan.new[::-1]  # leaves first, as the recursive walk freed them
    assert idx.stats().used_bytes == 0
    # The same depth through a failed store and through an aborted one.
    plan = idx.begin_store(NS, T1, None, chain, BLOCK)
    idx.complete_store(plan.new, [None] * n)
    plan = idx.begin_store(NS, T1, None, chain, BLOCK)
    idx.abort_store(plan, set(range(n)))
    assert idx.stats().used_bytes == 0
    idx.check_invariants()


def test_drop_all_of_tenant() -> None:
    idx, _ = make(8)
    store(idx, ["a", "b"])
    store(idx, ["a", "c"], tenant=T2)
    store(idx, ["a"], ns=NS2)
    idx.begin_store(NS, T1, None, [h("p")], BLOCK)
    removed = idx.drop(NS, T1, None)
    assert sorted(names_of(removed)) == ["a", "b", "p"]
    assert states(idx, ["a", "b", "p"]) == [State.ABSENT] * 3
    assert states(idx, ["a", "c"], tenant=T2) == [State.READY] * 2
    assert states(idx, ["a"], ns=NS2) == [State.READY]


def test_drop_of_pinned_block_frees_its_slot_after_complete_restore() -> None:
    idx, freed = make(2)
    store(idx, ["a"])
    pinned = idx.begin_restore(NS, T1, [h("a")])
    old_extent = pinned[0].extent
    assert names_of(idx.drop(NS, T1, [h("a")])) == ["a"]
    assert states(idx, ["a"]) == [State.ABSENT]
    assert idx.stats().used_bytes == BLOCK  # still held by the restore
    assert freed.calls == []
    # A new store of the same hash can start, in another slot.
    plan = idx.begin_store(NS, T1, None, [h("a")], BLOCK)
    assert plan.outcomes == [StoreOutcome.STORED]
    assert plan.new[0].extent.offset != old_extent.offset
    # The tier is full now (pinned old copy + pending new one).
    with pytest.raises(CapacityExhausted):
        idx.begin_store(NS, T1, None, [h("b")], BLOCK)
    released, bad = idx.complete_restore(pinned, release=False)
    assert released == [] and bad == []
    assert freed.calls == pinned
    assert idx.stats().used_bytes == BLOCK
    idx.complete_store(plan.new, [record()])
    assert states(idx, ["a"]) == [State.READY]
    idx.check_invariants()


# ---------------------------------------------------------------- restore


def test_restore_pins_and_unpins() -> None:
    idx, _ = make(4)
    store(idx, ["a", "b"])
    e1 = idx.begin_restore(NS, T1, [h("a"), h("b")])
    e2 = idx.begin_restore(NS, T1, [h("b")])
    assert [e.pins for e in e1] == [1, 2]
    assert idx.stats().pinned == 2
    idx.complete_restore(e1, release=False)
    assert [e.pins for e in e1] == [0, 1]
    idx.complete_restore(e2, release=False)
    assert idx.stats().pinned == 0


def test_write_back_release_keeps_descendants_and_unlinks_them() -> None:
    idx, freed = make(4)
    store(idx, ["A", "B", "C"])
    entries = idx.begin_restore(NS, T1, [h("A")])
    released, bad = idx.complete_restore(entries, release=True)
    assert names_of(released) == ["A"] and bad == []
    assert names_of(freed.calls) == ["A"]
    assert idx.lookup(NS, T1, [h("A"), h("B"), h("C")]) == (
        0,
        [State.ABSENT, State.READY, State.READY],
    )
    b = idx._map[(NS, T1, h("B"))]
    assert b.parent is None
    assert entries[0].children == set() and entries[0].parent is None
    assert idx.stats().used_bytes == 2 * BLOCK
    idx.check_invariants()


def test_write_back_release_of_a_middle_block() -> None:
    idx, _ = make(4)
    store(idx, ["A", "B", "C"])
    entries = idx.begin_restore(NS, T1, [h("B")])
    released, _ = idx.complete_restore(entries, release=True)
    assert names_of(released) == ["B"]
    a, c = idx._map[(NS, T1, h("A"))], idx._map[(NS, T1, h("C"))]
    assert a.children == set() and c.parent is None
    # A is a leaf now and the oldest: it goes first.
    assert names_of(store(idx, ["X", "Y", "Z"])) == ["A"]


def test_release_apart_from_the_restore_is_a_release_restore() -> None:
    """``release`` (the Release RPC, after a restore without release): the
    block leaves as a release restore takes it, descendants kept and
    unlinked; a block another restore pins is freed when that one unpins;
    absent and pending blocks are skipped."""
    idx, freed = make(5)
    store(idx, ["A", "B", "C"])
    pinned = idx.begin_restore(NS, T1, [h("B")])
    pending = idx.begin_store(NS, T1, None, [h("P")], BLOCK).new
    assert names_of(idx.release(NS, T1, [h("A"), h("B"), h("P"), h("nope")])) == ["A", "B"]
    assert idx.lookup(NS, T1, [h("A"), h("B"), h("C")])[1] == [
        State.ABSENT, State.ABSENT, State.READY,
    ]  # fmt: skip
    assert idx._map[(NS, T1, h("C"))].parent is None
    assert names_of(freed.calls) == ["A"]  # B is still pinned by its restore
    assert idx.release(NS, T1, [h("A")]) == []
    idx.complete_restore(pinned, release=False)
    assert names_of(freed.calls) == ["A", "B"]
    idx.complete_store(pending, [record()])
    assert states(idx, ["P"]) == [State.READY]
    idx.check_invariants()


def test_failed_restore_removes_failed_blocks_with_descendants() -> None:
    idx, freed = make(6)
    store(idx, ["A", "B", "C"])
    store(idx, ["D"])
    entries = idx.begin_restore(NS, T1, [h("A"), h("B"), h("C"), h("D")])
    b = entries[1]
    released, bad = idx.complete_restore(entries, release=False, failed=[b])
    assert released == []
    assert sorted(names_of(bad)) == ["B", "C"]
    assert states(idx, ["A", "B", "C", "D"]) == [
        State.READY,
        State.ABSENT,
        State.ABSENT,
        State.READY,
    ]
    assert sorted(names_of(freed.calls)) == ["B", "C"]  # unpinned now: freed
    idx.check_invariants()


def test_failed_restore_descendant_pinned_by_another_restore() -> None:
    idx, freed = make(4)
    store(idx, ["A", "B"])
    other = idx.begin_restore(NS, T1, [h("B")])
    mine = idx.begin_restore(NS, T1, [h("A")])
    _, bad = idx.complete_restore(mine, release=False, failed=mine)
    assert sorted(names_of(bad)) == ["A", "B"]
    assert names_of(freed.calls) == ["A"]  # B is still pinned by the other restore
    assert idx.stats().used_bytes == BLOCK
    idx.complete_restore(other, release=False)
    assert names_of(freed.calls) == ["A", "B"]
    assert idx.stats().used_bytes == 0


# ---------------------------------------------------------------- store completion


def test_complete_store_with_none_frees_the_slot() -> None:
    idx, freed = make(2)
    plan = idx.begin_store(NS, T1, None, [h("a")], BLOCK)
    assert idx.stats().used_bytes == BLOCK
    idx.complete_store(plan.new, [None])
    assert idx.stats().used_bytes == 0
    assert states(idx, ["a"]) == [State.ABSENT]
    assert freed.calls == []  # no record, nothing to forget
    idx.check_invariants()
    store(idx, ["a", "b"])  # the space is really back


def test_failed_store_of_a_parent_cascades_to_the_rest_of_the_chain() -> None:
    idx, freed = make(4)
    plan = idx.begin_store(NS, T1, None, [h("A"), h("B"), h("C")], BLOCK)
    rb, rc = record(), record()
    idx.complete_store(plan.new, [None, rb, rc])
    assert states(idx, ["A", "B", "C"]) == [State.ABSENT] * 3
    assert idx.stats().used_bytes == 0
    assert names_of(freed.calls) == ["B", "C"]  # sealed ones: their epochs are released
    idx.check_invariants()


def test_removed_while_pending_is_freed_at_complete_store() -> None:
    idx, freed = make(2)
    plan = idx.begin_store(NS, T1, None, [h("a")], BLOCK)
    removed = idx.drop(NS, T1, [h("a")])
    assert removed == plan.new
    assert idx.stats().used_bytes == BLOCK  # the sealing thread still writes into it
    assert freed.calls == []
    plan2 = idx.begin_store(NS, T1, None, [h("a")], BLOCK)  # a new store may start
    assert plan2.outcomes == [StoreOutcome.STORED]
    assert plan2.new[0].extent != plan.new[0].extent
    idx.complete_store(plan.new, [record()])
    assert freed.calls == plan.new
    assert idx.stats().used_bytes == BLOCK
    assert states(idx, ["a"]) == [State.PENDING]  # the second store
    idx.complete_store(plan2.new, [record()])
    assert states(idx, ["a"]) == [State.READY]
    idx.check_invariants()


def test_child_of_pending_parent_removed_by_drop_of_parent() -> None:
    idx, freed = make(4)
    plan = idx.begin_store(NS, T1, None, [h("A")], BLOCK)
    store(idx, ["B"], "A")  # B READY, linked to the pending A
    removed = idx.drop(NS, T1, [h("A")])
    assert sorted(names_of(removed)) == ["A", "B"]
    assert names_of(freed.calls) == ["B"]
    idx.complete_store(plan.new, [record()])
    assert names_of(freed.calls) == ["B", "A"]
    assert idx.stats().used_bytes == 0


def test_generations_increase() -> None:
    idx, _ = make(4)
    p1 = idx.begin_store(NS, T1, None, [h("a"), h("b")], BLOCK)
    p2 = idx.begin_store(NS, T2, None, [h("a")], BLOCK)
    gens = [e.generation for e in p1.new + p2.new]
    assert gens == sorted(gens) and len(set(gens)) == 3


# ---------------------------------------------------------------- isolation


def test_tenants_and_namespaces_are_isolated() -> None:
    idx, _ = make(8)
    store(idx, ["a", "b"], tenant=T1)
    assert idx.lookup(NS, T2, [h("a")]) == (0, [State.ABSENT])
    assert idx.lookup(NS2, T1, [h("a")]) == (0, [State.ABSENT])
    with pytest.raises(BlockNotPresent):
        idx.begin_restore(NS, T2, [h("a")])
    with pytest.raises(BlockNotPresent):
        idx.begin_restore(NS2, T1, [h("a")])
    assert idx.touch(NS, T2, [h("a")]) == 0
    assert idx.drop(NS, T2, [h("a")]) == []
    assert idx.drop(NS, T2, None) == []
    assert idx.drop(NS2, T1, None) == []
    # Same hash in another tenant is a separate block, not ALREADY_PRESENT.
    plan = idx.begin_store(NS, T2, h("a"), [h("a"), h("b")], BLOCK)
    assert plan.outcomes == [StoreOutcome.STORED, StoreOutcome.STORED]
    idx.complete_store(plan.new, [record(), record()])
    # T1's chain is not the parent of T2's (parent_hash resolves per tenant)
    assert plan.new[0].parent is None
    assert states(idx, ["a", "b"], tenant=T1) == [State.READY] * 2
    assert len(idx.drop(NS, T1, None)) == 2
    assert states(idx, ["a", "b"], tenant=T2) == [State.READY] * 2


# ---------------------------------------------------------------- mixed block sizes


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["store", "pin", "unpin", "drop"]),
            st.sampled_from([NS, NS2]),
            st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True),
        ),
        max_size=40,
    )
)
def test_mixed_block_sizes_stay_consistent_and_atomic(
    ops: list[tuple[str, bytes, list[int]]],
) -> None:
    """Two namespaces with different block sizes (1 and 3 slots) fragment
    the tier; whatever happens, refusals change nothing, slots never overlap
    and everything is freed exactly once."""
    sizes = {NS: BLOCK, NS2: 3 * BLOCK - 7}
    freed = Freed()
    idx = Index(10 * BLOCK, on_free=freed)
    pins: list[list[Entry]] = []
    made: list[Entry] = []
    for op, ns, keys in ops:
        hashes = [h(f"m{k}") for k in keys]
        if op == "store":
            before = snapshot(idx)
            try:
                plan = idx.begin_store(ns, T1, None, hashes, sizes[ns])
            except CapacityExhausted:
                assert snapshot(idx) == before
                continue
            victims = set(plan.evicted)
            for v in plan.evicted:
                assert v.pins == 0 and not (v.children - victims) and v.doomed_by is not None
            idx.check_invariants()
            made.extend(plan.new)
            idx.complete_store(plan.new, [record() for _ in plan.new])
            assert all(v.removed and v.extent.size == 0 for v in plan.evicted)
        elif op == "pin":
            try:
                pins.append(idx.begin_restore(ns, T1, hashes))
            except BlockNotPresent:
                pass
        elif op == "unpin" and pins:
            idx.complete_restore(pins.pop(0), release=False)
        elif op == "drop":
            idx.drop(ns, T1, hashes)
        idx.check_invariants()
        held = sorted((e.extent.offset, e.extent.size) for e in made if e.extent.size)
        for (o1, s1), (o2, _) in itertools.pairwise(held):
            assert o1 + s1 <= o2
        assert sum(s for _, s in held) == idx.stats().used_bytes <= 10 * BLOCK
        for e in made:
            assert e.extent.size or e.removed
            if e.extent.size == 0:
                assert e.pins == 0
    for batch in pins:
        idx.complete_restore(batch, release=False)
    idx.drop(NS, T1, None)
    idx.drop(NS2, T1, None)
    assert idx.stats().used_bytes == 0
    assert Counter(id(e) for e in freed.calls) == Counter(id(e) for e in made)


# ================================================================ two-phase eviction


class Events:
    """The ``on_event`` callback: (kind, reason, block names) per call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Removal | None, list[str]]] = []

    def __call__(self, kind: str, reason: Removal | None, entries: list[Entry]) -> None:
        self.calls.append((kind, reason, names_of(entries)))

    def removed(self) -> list[str]:
        return [n for kind, _, names in self.calls if kind == "REMOVED" for n in names]


def make_ev(blocks: int) -> tuple[Index, Freed, Events]:
    freed, events = Freed(), Events()
    return Index(blocks * BLOCK, on_free=freed, on_event=events), freed, events


def keys(names: Sequence[str], tenant: bytes = T1, ns: bytes = NS) -> list[tuple[bytes, ...]]:
    return [(ns, tenant, h(n)) for n in names]


def test_doomed_victims_are_invisible_until_the_store_settles() -> None:
    idx, freed, events = make_ev(4)
    store(idx, ["A", "B"])  # chain A <- B
    store(idx, ["C"])
    store(idx, ["D"])
    events.calls.clear()
    plan = idx.begin_store(NS, T1, None, [h("X"), h("Y")], BLOCK)
    assert names_of(plan.evicted) == ["B", "A"]
    assert events.calls == [] and freed.calls == []  # doomed, not removed
    assert idx.lookup(NS, T1, [h("A"), h("B"), h("C")]) == (
        0,
        [State.ABSENT, State.ABSENT, State.READY],
    )
    with pytest.raises(BlockNotPresent):
        idx.begin_restore(NS, T1, [h("A")])
    assert idx.touch(NS, T1, [h("A"), h("B"), h("C")]) == 1
    again = idx.begin_store(NS, T1, None, [h("A")], BLOCK)  # no duplicate of a doomed block
    assert again.outcomes == [StoreOutcome.IN_PROGRESS] and again.new == []
    assert idx.stats().ready == 2  # C, D
    assert idx.drop(NS, T1, [h("B")]) == []  # only marked; announced when it settles
    assert events.calls == []
    idx.check_invariants()
    idx.complete_store(plan.new, [record(), record()])
    # Success: the victims leave for good, announced just before the STORED event.
    assert events.calls == [
        ("REMOVED", Removal.EVICTED, ["B", "A"]),
        ("STORED", None, ["X", "Y"]),
    ]
    assert names_of(freed.calls) == ["B", "A"]
    assert states(idx, ["A", "B", "X", "Y"]) == [State.ABSENT] * 2 + [State.READY] * 2
    idx.check_invariants()


def test_abort_with_nothing_written_reinstates_every_victim() -> None:
    idx, freed, events = make_ev(6)
    store(idx, ["A", "B", "C"])
    store(idx, ["D"])
    store(idx, ["E"])
    store(idx, ["F"], "E")
    idx.touch(NS, T1, [h("D")])
    lru_before, snap_before = idx.lru_order(), snapshot(idx)
    events.calls.clear()
    plan = idx.begin_store(NS, T1, h("F"), [h("X"), h("Y"), h("Z")], BLOCK)
    assert names_of(plan.evicted) == ["C", "B", "A"]
    evicted, cascaded = idx.abort_store(plan, set())
    assert evicted == [] and cascaded == []
    assert events.removed() == [] and events.calls == [] and freed.calls == []
    # Exactly as before: same lookups, LRU order, slots, records, links, stamps.
    assert idx.lru_order() == lru_before
    assert snapshot(idx)[:-1] == snap_before[:-1]  # all but the generation counter
    assert idx.lookup(NS, T1, [h(n) for n in "ABCDEF"])[0] == 6
    assert states(idx, ["X", "Y", "Z"]) == [State.ABSENT] * 3
    idx.check_invariants()
    # ...and evicted in the same order again afterwards.
    assert names_of(store(idx, ["X", "Y", "Z"], "F")) == ["C", "B", "A"]


def test_abort_removes_exactly_the_victims_whose_bytes_were_written() -> None:
    idx, freed, events = make_ev(4)
    for n in "ABCD":
        store(idx, [n])
    events.calls.clear()
    plan = idx.begin_store(NS, T1, None, [h("X"), h("Y")], BLOCK)
    a, b = plan.evicted
    assert names_of([a, b]) == ["A", "B"]
    y = plan.new[1]
    overwritten = a if a.extent == y.extent else b
    kept = b if overwritten is a else a
    evicted, cascaded = idx.abort_store(plan, {1})  # only Y's slot may have been written
    assert evicted == [overwritten] and cascaded == []
    assert events.calls == [("REMOVED", Removal.EVICTED, names_of([overwritten]))]
    assert freed.calls == [overwritten]
    assert states(idx, names_of([kept, overwritten])) == [State.READY, State.ABSENT]
    assert idx.lru_order() == keys([*names_of([kept]), "C", "D"])
    assert idx.stats().used_bytes == 3 * BLOCK
    idx.check_invariants()


def test_abort_takes_the_descendants_of_an_overwritten_victim() -> None:
    idx, _, events = make_ev(4)
    store(idx, ["A", "B"])
    store(idx, ["C"])
    store(idx, ["D"])
    plan = idx.begin_store(NS, T1, None, [h("X"), h("Y")], BLOCK)
    b, a = plan.evicted
    assert names_of([b, a]) == ["B", "A"]
    events.calls.clear()
    pos_a = next(i for i, e in enumerate(plan.new) if e.extent == a.extent)
    evicted, _ = idx.abort_store(plan, {pos_a})
    # A's bytes are gone; B (a leaf under A) would be an orphan: it goes too.
    assert set(evicted) == {a, b}
    assert sorted(events.removed()) == ["A", "B"]
    assert states(idx, ["A", "B", "C", "D"]) == [State.ABSENT] * 2 + [State.READY] * 2
    idx.check_invariants()
    # The other way round: B overwritten, A reinstated as a leaf.
    store(idx, ["A", "B"])
    plan = idx.begin_store(NS, T1, None, [h("X"), h("Y")], BLOCK)
    assert names_of(plan.evicted) == ["C", "D"]  # older than the new chain
    idx.abort_store(plan, set())
    idx.touch(NS, T1, [h("C"), h("D")])
    plan = idx.begin_store(NS, T1, None, [h("X"), h("Y")], BLOCK)
    b, a = plan.evicted
    pos_b = next(i for i, e in enumerate(plan.new) if e.extent == b.extent)
    evicted, _ = idx.abort_store(plan, {pos_b})
    assert evicted == [b]
    assert states(idx, ["A", "B"]) == [State.READY, State.ABSENT]
    assert a.children == set()
    assert names_of(store(idx, ["X", "Y"])) == ["A"]  # a leaf again, at its own recency
    idx.check_invariants()


def test_abort_of_a_dropped_victim_removes_it_and_announces_the_drop() -> None:
    idx, freed, events = make_ev(3)
    for n in "ABC":
        store(idx, [n])
    plan = idx.begin_store(NS, T1, None, [h("X")], BLOCK)
    assert names_of(plan.evicted) == ["A"]
    # A is only marked (not returned); the pending X goes at once.
    assert sorted(names_of(idx.drop(NS, T1, None))) == ["B", "C", "X"]
    events.calls.clear()
    idx.abort_store(plan, set())
    assert events.calls == [("REMOVED", Removal.DROPPED, ["A"])]
    assert states(idx, ["A", "B", "C", "X"]) == [State.ABSENT] * 4
    assert idx.stats().used_bytes == 0
    assert sorted(names_of(freed.calls)) == ["A", "B", "C"]
    idx.check_invariants()


def test_abort_discards_new_blocks_and_descendants_linked_under_them() -> None:
    idx, _, events = make_ev(4)
    plan = idx.begin_store(NS, T1, None, [h("A")], BLOCK)
    store(idx, ["B"], "A")  # another request links READY B under the pending A
    events.calls.clear()
    evicted, cascaded = idx.abort_store(plan, {0})
    assert evicted == [] and names_of(cascaded) == ["B"]
    assert events.calls == [("REMOVED", Removal.DROPPED, ["B"])]
    assert states(idx, ["A", "B"]) == [State.ABSENT] * 2
    assert idx.stats().used_bytes == 0
    with pytest.raises(ValueError):
        idx.abort_store(plan, {1})
    idx.check_invariants()


def test_complete_store_with_a_failed_block_keeps_untouched_victims() -> None:
    """A ``None`` record is a failure whose extent of writing is unknown:
    every victim overlapping a new slot leaves, the others come back."""
    idx, _, events = make_ev(4)
    for n in "ABCD":
        store(idx, [n])
    plan = idx.begin_store(NS, T1, None, [h("X"), h("Y")], BLOCK)
    events.calls.clear()
    idx.complete_store(plan.new, [record(), None])
    assert events.calls == [
        ("REMOVED", Removal.EVICTED, ["A", "B"]),
        ("STORED", None, ["X"]),
    ]
    assert states(idx, ["A", "B", "C", "D", "X", "Y"]) == [State.ABSENT] * 2 + [State.READY] * 3 + [
        State.ABSENT
    ]
    idx.check_invariants()


def test_concurrent_store_cannot_take_a_doomed_victims_bytes() -> None:
    """A 3-slot victim makes room for a 1-slot block: the 2 slots left over
    stay held for the victim, so a second store evicts elsewhere instead of
    landing on bytes an abort gives back."""
    idx, _, _ = make_ev(5)
    big = 3 * BLOCK
    plan_g = idx.begin_store(NS2, T1, None, [h("G")], big)
    idx.complete_store(plan_g.new, [record()])
    store(idx, ["a"])
    store(idx, ["b"])
    g = plan_g.new[0]
    p1 = idx.begin_store(NS, T1, None, [h("x")], BLOCK)
    assert p1.evicted == [g]
    assert idx.stats().used_bytes == 5 * BLOCK  # x + 2 held slots + a + b
    idx.check_invariants()
    p2 = idx.begin_store(NS, T1, None, [h("y")], BLOCK)
    assert names_of(p2.evicted) == ["a"]
    g_lo, g_hi = g.extent.offset, g.extent.offset + g.extent.size
    assert not g_lo <= p2.new[0].extent.offset < g_hi
    with pytest.raises(CapacityExhausted):  # b is the last evictable leaf; y's plan is open
        idx.begin_store(NS, T1, None, [h("z"), h("w")], BLOCK)
    idx.abort_store(p1, set())
    assert states(idx, ["G"], ns=NS2) == [State.READY]
    assert g.extent.size == big
    idx.complete_store(p2.new, [record()])
    assert states(idx, ["a", "b", "x", "y"]) == [
        State.ABSENT,
        State.READY,
        State.ABSENT,
        State.READY,
    ]
    assert idx.stats().used_bytes == 5 * BLOCK
    idx.check_invariants()
    # The same store succeeding: G leaves, its 2 held slots are free again.
    p3 = idx.begin_store(NS, T1, None, [h("x")], BLOCK)
    assert p3.evicted == [g]
    idx.complete_store(p3.new, [record()])
    assert idx.stats().used_bytes == 3 * BLOCK
    idx.check_invariants()


def test_allocator_reserve_and_fit_counts() -> None:
    from kvseal.server.hostregion import ExtentAllocator, RegionError

    alloc = ExtentAllocator(10 * BLOCK)
    assert alloc.fits(BLOCK) == 10 and alloc.fits(3 * BLOCK) == 3
    x = alloc.allocate(4 * BLOCK)
    assert x is not None
    alloc.reserve(Extent(6 * BLOCK, BLOCK))  # splits the free run [4, 10) into [4, 6) + [7, 10)
    assert (alloc._offsets, alloc._sizes) == ([4 * BLOCK, 7 * BLOCK], [2 * BLOCK, 3 * BLOCK])
    assert alloc.fits(BLOCK) == 5 and alloc.fits(3 * BLOCK) == 1 and alloc.fits(2 * BLOCK) == 2
    with pytest.raises(RegionError):
        alloc.reserve(Extent(5 * BLOCK, 2 * BLOCK))  # slot 6 is taken
    assert alloc.used == 5 * BLOCK
    alloc.free(Extent(6 * BLOCK, BLOCK))
    alloc.free(x)
    assert (alloc._offsets, alloc._sizes) == ([0], [10 * BLOCK])
    assert alloc.fits(BLOCK) == 10 and alloc.fits(3 * BLOCK) == 3 and alloc.fits(2 * BLOCK) == 5


# ================================================================ eviction cost


def old_plan(idx: Index, n: int, size: int, protected: set[int]) -> tuple[list[Entry] | None, int]:
    """The eviction planner as it was before the heap (the definition the
    heap must reproduce): rescan the LRU from the oldest for the first
    unchosen, unprotected, unpinned entry without live children, until a
    scratch allocator can place the new blocks. Returns (victims or None
    when they cannot fit, LRU entries examined)."""
    sizes = [size] * n
    if idx._alloc.can_allocate_all(sizes):
        return [], 0
    if size > idx._alloc.capacity:
        return None, 0
    lru = [idx._map[k] for k in idx.lru_order()]
    sim = idx._alloc.clone()
    victims: list[Entry] = []
    chosen: set[int] = set()
    gone: dict[int, int] = {}
    examined = 0
    while True:
        cand = None
        for e in lru:
            examined += 1
            if id(e) in chosen or id(e) in protected or e.pins:
                continue
            if len(e.children) - gone.get(id(e), 0) > 0:
                continue
            cand = e
            break
        if cand is None:
            return None, examined
        victims.append(cand)
        chosen.add(id(cand))
        if cand.parent is not None:
            gone[id(cand.parent)] = gone.get(id(cand.parent), 0) + 1
        sim.free(cand.extent)
        if sim.free_bytes() >= sum(sizes) and sim.can_allocate_all(sizes):
            return victims, examined


def protected_ids(idx: Index, ns: bytes, parent: bytes | None, hashes: Sequence[bytes]) -> set[int]:
    found = [idx._map.get((ns, T1, x)) for x in [*hashes, *([parent] if parent else [])]]
    return {id(e) for e in found if e is not None}


@pytest.mark.parametrize("seed", range(12))
def test_victims_are_the_old_definitions_on_random_workloads(seed: int) -> None:
    """Random workloads (seeded): chains, two block sizes (fragmentation),
    pins, write-back releases, drops, touches, and stores left in flight then
    completed or aborted. Every plan's victims are exactly what the old
    planner picks on the same state, in the same order; a refusal is refused
    by both."""
    import random

    rng = random.Random(seed)
    sizes = {NS: BLOCK, NS2: 3 * BLOCK - 7}
    idx = Index(10 * BLOCK)
    pins: list[list[Entry]] = []
    open_plans: list[StorePlan] = []
    with_victims = refused = 0
    for _ in range(400):
        op = rng.choice(["store"] * 4 + ["begin", "settle", "pin", "unpin", "drop", "touch"])
        ns = rng.choice([NS, NS, NS2])
        hashes = [h(f"m{k}") for k in rng.sample(range(14), rng.randint(1, 4))]
        parent = h(f"m{rng.randrange(14)}") if rng.random() < 0.6 else None
        if op in ("store", "begin") and len(open_plans) < 2:
            n_new = sum(1 for x in hashes if (ns, T1, x) not in idx._map)
            exp, _ = old_plan(idx, n_new, sizes[ns], protected_ids(idx, ns, parent, hashes))
            try:
                plan = idx.begin_store(ns, T1, parent, hashes, sizes[ns])
            except CapacityExhausted:
                assert exp is None
                refused += 1
                continue
            assert exp is not None and [id(e) for e in plan.evicted] == [id(e) for e in exp]
            with_victims += bool(exp)
            if op == "store":
                idx.complete_store(plan.new, [record() for _ in plan.new])
            else:
                open_plans.append(plan)
        elif op == "settle" and open_plans:
            plan = open_plans.pop(rng.randrange(len(open_plans)))
            if rng.random() < 0.4:
                idx.complete_store(plan.new, [record() for _ in plan.new])
            else:
                written = {i for i in range(len(plan.new)) if rng.random() < 0.5}
                idx.abort_store(plan, written)
        elif op == "pin" and len(pins) < 3:
            try:
                pins.append(idx.begin_restore(ns, T1, hashes))
            except BlockNotPresent:
                pass
        elif op == "unpin" and pins:
            idx.complete_restore(pins.pop(rng.randrange(len(pins))), release=rng.random() < 0.3)
        elif op == "drop" and rng.random() < 0.5:
            idx.drop(ns, T1, hashes)
        elif op == "touch":
            idx.touch(ns, T1, hashes)
        idx.check_invariants()
    assert with_victims > 20  # the workload really exercised eviction
    assert refused > 0


def chain_hashes(n: int, tag: bytes) -> list[bytes]:
    return [tag + i.to_bytes(32 - len(tag), "big") for i in range(n)]


def test_old_planner_examined_count_is_quadratic_and_the_heap_is_not() -> None:
    """On a 2,000-block chain evicting 100 the old planner rescans the LRU
    from the oldest block for every victim: sum(2000 - i) entries; the heap
    looks at one item per victim. (The same formula gives 401,213,440 for
    the issue's 100,000-block chain evicting 4,096.)"""
    chain, k = 2000, 100
    idx = Index(chain * BLOCK)
    plan = idx.begin_store(NS, T1, None, chain_hashes(chain, b"c"), BLOCK)
    idx.complete_store(plan.new, [record() for _ in plan.new])
    new = chain_hashes(k, b"n")
    victims, old_examined = old_plan(idx, k, BLOCK, set())
    assert old_examined == sum(chain - i for i in range(k)) == 195_050
    before = idx.examined
    plan = idx.begin_store(NS, T1, None, new, BLOCK)
    assert plan.evicted == victims
    assert idx.examined - before <= 2 * k


def test_long_chain_evicting_4096_examines_a_few_items_per_victim() -> None:
    """The issue's case: one chain of 100,000 blocks and a store that
    evicts 4,096 of them (the old planner: ~4e8 entries examined, 317 s
    under the lock)."""
    chain, k = 100_000, 4096
    idx = Index(chain * BLOCK)
    hashes = chain_hashes(chain, b"c")
    plan = idx.begin_store(NS, T1, None, hashes, BLOCK)
    chain_entries = plan.new
    idx.complete_store(plan.new, [record() for _ in plan.new])
    before = idx.examined
    plan = idx.begin_store(NS, T2, None, chain_hashes(k, b"n"), BLOCK)
    examined = idx.examined - before
    # Leaf first: the chain's tail, newest block first.
    assert plan.evicted == chain_entries[::-1][:k]
    assert examined <= 2 * k, examined
    old = sum(chain - i for i in range(k))
    assert old == 401_213_440 and examined * 50_000 < old
    idx.complete_store(plan.new, [record() for _ in plan.new])
    assert idx.lookup(NS, T1, hashes)[0] == chain - k


def test_many_short_chains_examine_a_few_items_per_victim() -> None:
    """4,000 chains of 5 blocks, half of them touched in random order and
    then all of them (touches must leave nothing stale behind): each
    2,048-block eviction looks at a couple of entries per victim, never a
    rescan of the cache, and picks what the old planner picks."""
    import random

    rng = random.Random(7)
    n_chains, length, k = 4_000, 5, 2048
    idx = Index(n_chains * length * BLOCK)
    chains = [chain_hashes(length, b"s" + i.to_bytes(3, "big")) for i in range(n_chains)]
    for c in chains:
        plan = idx.begin_store(NS, T1, None, c, BLOCK)
        idx.complete_store(plan.new, [record() for _ in plan.new])
    for rnd, touched in enumerate([rng.sample(chains, n_chains // 2), chains]):
        rng.shuffle(touched)
        for c in touched:
            idx.touch(NS, T1, c)
        exp, old_examined = old_plan(idx, k, BLOCK, set())
        before = idx.examined
        plan = idx.begin_store(NS, T2, None, chain_hashes(k, bytes([b"n"[0] + rnd])), BLOCK)
        examined = idx.examined - before
        assert exp is not None and [id(e) for e in plan.evicted] == [id(e) for e in exp]
        # One entry per victim from the ordered leaves or from the local heap
        # of parents whose last child was chosen; the old planner rescanned.
        assert examined <= 2 * k, examined
        assert old_examined > 10 * examined
        idx.complete_store(plan.new, [record() for _ in plan.new])
        idx.check_invariants()


def test_bench_index_runs_and_prints_its_table() -> None:
    """``make bench-index`` (small): it runs and reports; no speed is asserted."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench" / "bench_index.py"
    proc = subprocess.run(
        [sys.executable, str(bench), "--blocks", "20000", "--stall-seconds", "0.2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "## kvseal trusted-index eviction benchmark" in lines
    rows = [
        line for line in lines if line.startswith("| one long chain") or line.startswith("| chains")
    ]
    assert len(rows) == 8
    stalls = [line for line in lines if line.startswith(("| stats() in a loop", "| reference:"))]
    assert len(stalls) == 2
    assert lines[-1].startswith("| reference: a full walk of the map under the lock")


# ================================================================ state machine

HASHES = [h(f"k{i}") for i in range(8)]
TENANTS = [T1, T2]
CAPACITY_BLOCKS = 6
PARENTS = st.none() | st.sampled_from(HASHES)
STORE_HASHES = st.lists(st.sampled_from(HASHES), min_size=1, max_size=4, unique=True)


@dataclass(eq=False)
class MEntry:
    """The model's view of one entry (matched to the real one by identity)."""

    entry: Entry
    tenant: bytes
    hash: bytes
    state: State = State.PENDING
    parent: MEntry | None = None
    children: set[MEntry] = field(default_factory=set)
    pins: int = 0
    removed: bool = False
    sealing: bool = True
    has_record: bool = False
    stamp: int = 0  # model recency
    doomed: Batch | None = None  # victim of a store that has not settled
    doom_why: Removal | None = None  # must go at settlement whatever happens

    @property
    def freed(self) -> bool:
        return self.removed and self.pins == 0 and not self.sealing

    @property
    def visible(self) -> bool:
        return self.state is State.READY and self.doomed is None and not self.removed


@dataclass(eq=False)
class Batch:
    """One begin_store the model is waiting to settle."""

    plan: StorePlan
    new: list[MEntry]
    victims: list[MEntry]
    victim_extents: list[Extent]  # as they were when doomed


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.frees: Counter[int] = Counter()
        self.events: list[tuple[str, Removal | None, list[int]]] = []
        self.idx = Index(CAPACITY_BLOCKS * BLOCK + 17, on_free=self._on_free, on_event=self._ev)
        self.model: dict[int, MEntry] = {}  # id(entry) -> model, every entry ever made
        self.live: dict[tuple[bytes, bytes], MEntry] = {}  # (tenant, hash) -> model
        self.ready: set[MEntry] = set()  # visible READY; LRU order is by stamp
        self.clock = itertools.count(1)
        self.pending: list[Batch] = []
        self.restores: list[list[MEntry]] = []

    def _on_free(self, e: Entry) -> None:
        # Called under the index lock, before the model has caught up: only
        # count here; the invariant checks the count against the model.
        self.frees[id(e)] += 1
        assert id(e) in self.model or e.record is not None

    def _ev(self, kind: str, reason: Removal | None, entries: list[Entry]) -> None:
        self.events.append((kind, reason, [id(e) for e in entries]))

    def take_events(self) -> tuple[set[int], set[tuple[Removal | None, int]]]:
        """(STORED ids, {(reason, id)} REMOVED) since the last call."""
        stored = {i for k, _, ids in self.events if k == "STORED" for i in ids}
        removed = {(r, i) for k, r, ids in self.events if k == "REMOVED" for i in ids}
        self.events.clear()
        return stored, removed

    # ---------------------------------------------------------- model helpers

    def use(self, m: MEntry) -> None:
        m.stamp = next(self.clock)

    def m_remove(
        self, m: MEntry, *, cascade: bool, reparent: bool = False, why: Removal = Removal.DROPPED
    ) -> list[MEntry]:
        out = [m]
        m.removed = True
        self.live.pop((m.tenant, m.hash), None)
        self.ready.discard(m)
        if m.parent is not None:
            m.parent.children.discard(m)
            m.parent = None
        kids = list(m.children)
        m.children.clear()
        for c in kids:
            c.parent = None
            if cascade and not reparent and not c.removed:
                if c.doomed is not None:
                    c.doom_why = c.doom_why or why
                else:
                    out.extend(self.m_remove(c, cascade=True, why=why))
        return out

    def lru(self) -> list[MEntry]:
        return sorted(self.ready, key=lambda m: m.stamp)

    def expected_victims(self, n_new: int, protected: set[MEntry]) -> list[MEntry] | None:
        """The greedy LRU-leaf eviction on the model; None: cannot fit. A
        slot is in use while any unfreed entry holds it (a doomed victim
        shares its slot with its plan's new block, or holds it alone)."""
        used = len({m.entry.extent.offset for m in self.model.values() if not m.freed})
        free = CAPACITY_BLOCKS - used
        if free >= n_new:
            return []
        victims: list[MEntry] = []
        gone: set[MEntry] = set()
        order = self.lru()
        while free < n_new:
            cand = next(
                (
                    m
                    for m in order
                    if m not in gone
                    and m not in protected
                    and m.pins == 0
                    and not (m.children - gone)
                ),
                None,
            )
            if cand is None:
                return None
            victims.append(cand)
            gone.add(cand)
            free += 1
        return victims

    def settle(self, batch: Batch, written: list[Extent] | None) -> set[tuple[Removal, int]]:
        """The model of Index._settle; returns the expected REMOVED events."""
        going: dict[MEntry, Removal] = {}
        for v, ext in zip(reversed(batch.victims), reversed(batch.victim_extents), strict=True):
            if written is None or any(w.offset == ext.offset for w in written):
                going[v] = Removal.EVICTED
            elif v.doom_why is not None:
                going[v] = v.doom_why
            elif v.parent is not None and v.parent in going:
                going[v] = going[v.parent]
        kept = len(batch.victims) - len(going)
        event(
            f"settled {'success' if written is None else 'failure'}: {len(going)} gone, {kept} kept"
        )
        if any(v.doom_why is not None for v in batch.victims):
            event("a doomed victim was dropped before its store settled")
        for v in batch.victims:
            v.doomed = None
            v.doom_why = None
            if v in going:
                self.m_remove(v, cascade=False)
            else:
                self.ready.add(v)  # at its own recency: the stamp never changed
        return {(why, id(v.entry)) for v, why in going.items()}

    def ids(self, entries: Sequence[Entry]) -> list[MEntry]:
        return [self.model[id(e)] for e in entries]

    # ---------------------------------------------------------- rules

    @precondition(lambda self: len(self.pending) < 2)
    @rule(tenant=st.sampled_from(TENANTS), parent=PARENTS, hashes=STORE_HASHES)
    def begin_store(self, tenant: bytes, parent: bytes | None, hashes: list[bytes]) -> None:
        """A store whose sealing is still running (settled by a later rule)."""
        batch = self._begin_store(tenant, parent, hashes)
        if batch is not None:
            self.pending.append(batch)

    @rule(
        tenant=st.sampled_from(TENANTS),
        parent=PARENTS,
        hashes=STORE_HASHES,
        ok=st.lists(st.booleans() | st.just(True), min_size=4, max_size=4),
    )
    def store(
        self, tenant: bytes, parent: bytes | None, hashes: list[bytes], ok: list[bool]
    ) -> None:
        """The common case: begin_store and complete_store back to back."""
        batch = self._begin_store(tenant, parent, hashes)
        if batch is not None:
            self._complete_store(batch, ok[: len(batch.new)])

    @rule(
        tenant=st.sampled_from(TENANTS),
        parent=PARENTS,
        hashes=STORE_HASHES,
        written=st.lists(st.booleans(), min_size=4, max_size=4),
    )
    def store_fails(
        self, tenant: bytes, parent: bytes | None, hashes: list[bytes], written: list[bool]
    ) -> None:
        """begin_store then abort_store at once (the backend failed)."""
        batch = self._begin_store(tenant, parent, hashes)
        if batch is not None:
            self._abort_store(batch, [i for i, w in enumerate(written[: len(batch.new)]) if w])

    def _begin_store(
        self, tenant: bytes, parent: bytes | None, hashes: list[bytes]
    ) -> Batch | None:
        existing = [self.live.get((tenant, x)) for x in hashes]
        parent0 = self.live.get((tenant, parent)) if parent else None
        protected = {m for m in existing if m is not None}
        if parent0 is not None:
            protected.add(parent0)
        n_new = sum(1 for m in existing if m is None)
        expected = self.expected_victims(n_new, protected)
        before = snapshot(self.idx)
        frees_before = sum(self.frees.values())
        try:
            plan = self.idx.begin_store(NS, tenant, parent, hashes, BLOCK)
        except CapacityExhausted:
            assert expected is None, "refused although room could be made"
            assert snapshot(self.idx) == before, "a refused store changed the index"
            assert sum(self.frees.values()) == frees_before
            return None
        assert expected is not None, "accepted although nothing could be evicted"
        assert self.events == [], "begin_store announced something"
        assert sum(self.frees.values()) == frees_before, "a doomed victim was freed"
        exp_outcomes = [
            StoreOutcome.STORED
            if m is None
            else StoreOutcome.ALREADY_PRESENT
            if m.visible
            else StoreOutcome.IN_PROGRESS
            for m in existing
        ]
        assert plan.outcomes == exp_outcomes
        assert plan.new_positions == [i for i, m in enumerate(existing) if m is None]
        # Eviction: exactly the greedy choice; each victim a leaf, unpinned, READY.
        assert len(plan.evicted) == len(expected)
        batch = Batch(plan, [], expected, [e.extent for e in plan.evicted])
        for e, m in zip(plan.evicted, expected, strict=True):
            assert self.model[id(e)] is m, "wrong victim (not the LRU leaf)"
            assert m.pins == 0 and m.state is State.READY and not (m.children - set(expected))
            assert e.doomed_by is not None and not e.removed
            m.doomed = batch
            self.ready.discard(m)
        # New entries, linked like the index links them.
        for e, pos in zip(plan.new, plan.new_positions, strict=True):
            assert e.block_hash == hashes[pos] and e.state is State.PENDING
            m = MEntry(e, tenant, hashes[pos])
            self.model[id(e)] = m
            self.live[(tenant, hashes[pos])] = m
            batch.new.append(m)
        for i, x in enumerate(hashes):
            if exp_outcomes[i] is not StoreOutcome.STORED:
                continue
            child = self.live[(tenant, x)]
            par = parent0 if i == 0 else self.live.get((tenant, hashes[i - 1]))
            if par is not None and not par.removed and par.doomed is None:
                child.parent = par
                par.children.add(child)
        for i, x in enumerate(hashes):
            if exp_outcomes[i] is StoreOutcome.ALREADY_PRESENT:
                self.use(self.live[(tenant, x)])
        return batch if batch.new else None

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data())
    def complete_store(self, data: st.DataObject) -> None:
        batch = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        ok = data.draw(st.lists(st.booleans(), min_size=len(batch.new), max_size=len(batch.new)))
        self._complete_store(batch, ok)

    @precondition(lambda self: bool(self.pending))
    @rule(data=st.data())
    def abort_store(self, data: st.DataObject) -> None:
        batch = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        n = len(batch.new)
        written = data.draw(st.lists(st.integers(0, n - 1), max_size=n, unique=True))
        self._abort_store(batch, written)

    def _complete_store(self, batch: Batch, ok: list[bool]) -> None:
        records = [record() if good else None for good in ok]
        extents = [m.entry.extent for m in batch.new]
        self.idx.complete_store([m.entry for m in batch.new], records)
        stored: set[int] = set()
        exp_removed: set[tuple[Removal | None, int]] = set()
        for m, good in zip(batch.new, ok, strict=True):
            m.has_record = good
            if m.removed or not good:
                if not m.removed:
                    cascade = self.m_remove(m, cascade=True)[1:]
                    exp_removed |= {
                        (Removal.DROPPED, id(c.entry)) for c in cascade if c.state is State.READY
                    }
                m.sealing = False
                if good:
                    m.state = State.READY
                continue
            m.sealing = False
            m.state = State.READY
            self.use(m)
            self.ready.add(m)
            stored.add(id(m.entry))
        exp_removed |= self.settle(batch, None if all(ok) else extents)
        got_stored, got_removed = self.take_events()
        assert got_stored == stored
        assert got_removed == exp_removed

    def _abort_store(self, batch: Batch, written: list[int]) -> None:
        hit = [batch.new[i].entry.extent for i in written]
        evicted, cascaded = self.idx.abort_store(batch.plan, set(written))
        exp_cascade: list[MEntry] = []
        for m in batch.new:
            if not m.removed:
                exp_cascade.extend(c for c in self.m_remove(m, cascade=True) if c not in batch.new)
            m.sealing = False
        exp_removed = self.settle(batch, hit)
        assert {id(e) for e in evicted} == {i for _, i in exp_removed}
        assert len(evicted) == len(exp_removed)
        assert set(self.ids(cascaded)) == set(exp_cascade)
        exp_removed |= {
            (Removal.DROPPED, id(c.entry)) for c in exp_cascade if c.state is State.READY
        }
        got_stored, got_removed = self.take_events()
        assert got_stored == set()
        assert got_removed == exp_removed

    @precondition(lambda self: len(self.restores) < 3)
    @rule(
        tenant=st.sampled_from(TENANTS),
        hashes=st.lists(st.sampled_from(HASHES), min_size=1, max_size=4, unique=True),
    )
    def begin_restore(self, tenant: bytes, hashes: list[bytes]) -> None:
        """A restore of arbitrary hashes (mostly refused: absent, pending or doomed)."""
        self._begin_restore(tenant, hashes)

    @precondition(lambda self: len(self.restores) < 3 and bool(self.ready))
    @rule(data=st.data())
    def restore_present(self, data: st.DataObject) -> None:
        """A restore of blocks that are visible READY (a lookup hit): pins them."""
        m0 = data.draw(st.sampled_from(self.lru()))
        ready = sorted(m.hash for m in self.ready if m.tenant == m0.tenant)
        more = data.draw(st.lists(st.sampled_from(ready), max_size=3, unique=True))
        self._begin_restore(m0.tenant, [m0.hash, *(x for x in more if x != m0.hash)])

    def _begin_restore(self, tenant: bytes, hashes: list[bytes]) -> None:
        ms = [self.live.get((tenant, x)) for x in hashes]
        before = snapshot(self.idx)
        if any(m is None or not m.visible for m in ms):
            with pytest.raises(BlockNotPresent):
                self.idx.begin_restore(NS, tenant, hashes)
            assert snapshot(self.idx) == before
            return
        entries = self.idx.begin_restore(NS, tenant, hashes)
        got = self.ids(entries)
        assert got == ms
        for m in got:
            m.pins += 1
        self.restores.append(got)

    @precondition(lambda self: bool(self.restores))
    @rule(data=st.data(), release=st.booleans())
    def complete_restore(self, data: st.DataObject, release: bool) -> None:
        batch = self.restores.pop(data.draw(st.integers(0, len(self.restores) - 1)))
        failed = [m for m in batch if data.draw(st.integers(0, 4)) == 0]
        released, bad = self.idx.complete_restore(
            [m.entry for m in batch], release=release, failed=[m.entry for m in failed]
        )
        exp_bad: list[MEntry] = []
        for m in failed:
            if not m.removed:
                exp_bad.extend(self.m_remove(m, cascade=True, why=Removal.INTEGRITY))
        exp_rel: list[MEntry] = []
        failed_set = set(failed)
        if release:
            for m in batch:
                if m not in failed_set and not m.removed:
                    exp_rel.extend(self.m_remove(m, cascade=False, reparent=True))
        else:
            for m in batch:
                if m.visible:
                    self.use(m)
        for m in batch:
            m.pins -= 1
        assert set(self.ids(released)) == set(exp_rel)
        assert len(released) == len(exp_rel)
        assert set(self.ids(bad)) == set(exp_bad)
        assert len(bad) == len(exp_bad)
        self.events.clear()

    @rule(
        tenant=st.sampled_from(TENANTS),
        hashes=st.none() | st.lists(st.sampled_from(HASHES), min_size=1, max_size=3, unique=True),
    )
    def drop(self, tenant: bytes, hashes: list[bytes] | None) -> None:
        if hashes is None:
            targets = [m for (t, _), m in self.live.items() if t == tenant]
        else:
            targets = [m for x in hashes if (m := self.live.get((tenant, x))) is not None]
        exp: list[MEntry] = []
        for m in targets:
            if m.doomed is not None:
                m.doom_why = m.doom_why or Removal.DROPPED  # marked, not removed yet
            elif not m.removed:
                exp.extend(self.m_remove(m, cascade=True))
        removed = self.idx.drop(NS, tenant, hashes)
        assert set(self.ids(removed)) == set(exp)
        assert len(removed) == len(exp)
        _, got_removed = self.take_events()
        assert got_removed == {
            (Removal.DROPPED, id(m.entry)) for m in exp if m.state is State.READY
        }

    def doomed(self) -> list[MEntry]:
        return sorted(
            (m for b in self.pending for m in b.victims if not m.removed),
            key=lambda m: m.stamp,
        )

    @precondition(lambda self: bool(self.doomed()))
    @rule(data=st.data())
    def poke_doomed(self, data: st.DataObject) -> None:
        """Aim at a victim of a store in flight: it is invisible to lookup,
        restore and touch, a store of it is IN_PROGRESS, a drop (of it, of
        its tenant, or of an ancestor) only marks it."""
        m = data.draw(st.sampled_from(self.doomed()))
        what = data.draw(st.sampled_from(["drop", "drop_parent", "drop_all", "probe"]))
        if what == "probe":
            self.lookup(m.tenant, [m.hash])
            self.touch(m.tenant, [m.hash])
            self._begin_restore(m.tenant, [m.hash])
            if len(self.pending) < 2:
                self.begin_store(m.tenant, None, [m.hash])
            return
        if what == "drop_parent" and m.parent is not None:
            self.drop(m.tenant, [m.parent.hash])
        else:
            self.drop(m.tenant, None if what == "drop_all" else [m.hash])
        # Marked to go: it, or the doomed parent it will follow.
        assert m.doom_why is not None or (m.parent is not None and m.parent.doom_why is not None)

    @rule(
        tenant=st.sampled_from(TENANTS),
        hashes=st.lists(st.sampled_from(HASHES), min_size=1, max_size=4),
    )
    def touch(self, tenant: bytes, hashes: list[bytes]) -> None:
        n = 0
        for x in hashes:
            m = self.live.get((tenant, x))
            if m is not None and m.visible:
                self.use(m)
                n += 1
        assert self.idx.touch(NS, tenant, hashes) == n

    @rule(
        tenant=st.sampled_from(TENANTS),
        hashes=st.lists(st.sampled_from(HASHES), min_size=1, max_size=6),
    )
    def lookup(self, tenant: bytes, hashes: list[bytes]) -> None:
        lru_before = self.idx.lru_order()
        hit, got = self.idx.lookup(NS, tenant, hashes)
        exp = [
            State.ABSENT
            if (m := self.live.get((tenant, x))) is None or m.doomed is not None
            else m.state
            for x in hashes
        ]
        assert got == exp
        exp_hit = next((i for i, s in enumerate(exp) if s is not State.READY), len(exp))
        assert hit == exp_hit
        assert self.idx.lru_order() == lru_before

    # ---------------------------------------------------------- invariants

    @invariant()
    def consistent(self) -> None:
        idx = self.idx
        idx.check_invariants()
        stats = idx.stats()
        assert stats.used_bytes <= stats.capacity_bytes == CAPACITY_BLOCKS * BLOCK
        # The live map and the LRU order match the model exactly.
        assert {(k[1], k[2]): id(e) for k, e in idx._map.items()} == {
            k: id(m.entry) for k, m in self.live.items()
        }
        assert idx.lru_order() == [m.entry.key for m in self.lru()]
        # Every entry holding a slot holds a distinct one (a doomed victim
        # shares its slot only with a new block of the plan that doomed it),
        # and the allocator counts each slot in use once.
        holders = [m for m in self.model.values() if m.entry.extent.size and m.doomed is None]
        held = sorted((m.entry.extent.offset, m.entry.extent.size) for m in holders)
        for (o1, s1), (o2, _) in itertools.pairwise(held):
            assert o1 + s1 <= o2, "overlapping slots"
        owner = {m.entry.extent.offset: m for m in holders}
        for m in self.model.values():
            if m.doomed is not None:
                other = owner.get(m.entry.extent.offset)
                assert other is None or other in m.doomed.new, "a doomed slot was given away"
        slots = {m.entry.extent.offset for m in self.model.values() if m.entry.extent.size}
        assert len(slots) * BLOCK == stats.used_bytes
        for m in self.model.values():
            e = m.entry
            assert e.removed == m.removed
            assert e.pins == m.pins
            assert e.state is m.state or m.removed
            assert (e.doomed_by is not None) == (m.doomed is not None)
            assert e.doom_removal is m.doom_why
            assert (e.parent is None) == (m.parent is None)
            if m.parent is not None:
                assert e.parent is m.parent.entry
            assert {id(c) for c in e.children} == {id(c.entry) for c in m.children}
            # A slot is released exactly when the entry is removed and idle...
            assert (e.extent.size == 0) == m.freed, (m, e)
            # ...and on_free ran once for it iff it carried a record.
            assert self.frees[id(e)] == (1 if m.freed and m.has_record else 0)
        assert stats.pinned == sum(1 for m in self.live.values() if m.pins)
        assert stats.pending == sum(1 for m in self.live.values() if m.state is State.PENDING)
        assert stats.ready == len(self.ready)

    def teardown(self) -> None:
        # Finish everything in flight: the index must end empty of held slots
        # once all is dropped.
        for batch in self.pending:
            self.idx.complete_store([m.entry for m in batch.new], [record() for _ in batch.new])
        for b in self.restores:
            self.idx.complete_restore([m.entry for m in b], release=False)
        for t in TENANTS:
            self.idx.drop(NS, t, None)
        self.idx.check_invariants()
        assert self.idx.stats().used_bytes == 0
        assert self.idx._alloc.free_bytes() == self.idx._alloc.capacity


IndexMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIndexStateMachine = IndexMachine.TestCase


def test_stats_and_a_tenants_drop_need_no_walk_and_idle_scopes_leave() -> None:
    """Stats counts are kept as entries change (check_invariants recomputes
    them), ``drop(all_of_tenant)`` finds the tenant's blocks through its scope
    (not a walk of every entry), and a scope with no entry left is forgotten:
    thousands of tenants that come and go leave nothing behind."""
    idx, _ = make(64)
    tenants = [bytes([i]) * 32 for i in range(20)]
    for i, t in enumerate(tenants):
        store(idx, [f"a{i}", f"b{i}"], tenant=t)
    plan = idx.begin_store(NS, T2, None, [h("p")], BLOCK)  # stays PENDING
    pinned = idx.begin_restore(NS, tenants[0], [h("a0")])
    s = idx.stats()
    assert (s.ready, s.pending, s.pinned) == (40, 1, 1)
    assert idx.scope_blocks(NS, tenants[3]) == 2 and idx.scope_blocks(NS2, tenants[3]) == 0
    idx.check_invariants()
    # A drop of a tenant with no block, in another namespace: nothing moves.
    assert idx.drop(NS2, tenants[1], None) == []
    assert [e.block_hash for e in idx.drop(NS, tenants[1], None)] == [h("a1"), h("b1")]
    assert idx.scope_blocks(NS, tenants[1]) == 0 and idx.stats().ready == 38
    # The pinned block's tenant is dropped: it leaves the map (and the pinned
    # count) at once; its slot waits for the restore.
    idx.drop(NS, tenants[0], None)
    assert idx.stats().pinned == 0
    idx.complete_restore(pinned, release=False)
    idx.complete_store(plan.new, [record()])
    for t in tenants[2:]:
        idx.drop(NS, t, None)
    idx.drop(NS, T2, None)
    idx.check_invariants()
    s = idx.stats()
    assert (s.ready, s.pending, s.pinned, s.used_bytes) == (0, 0, 0, 0)
    assert idx._scopes == {} and idx._map == {}
