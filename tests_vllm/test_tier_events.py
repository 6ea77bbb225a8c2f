"""kvseal.vllm.tier_events under a stream gap and a large removal (issue 28,
"a scheduler stall in vLLM's tier events"): what the caller does while it
holds the manager's lock is bounded by a chunk, whatever the tier's size, and
the events vLLM sees still end in the truth (never a stale claim).

The work done inside a locked section is counted, not timed: every call the
tier events make back into the manager (naming a block by its vLLM hash,
forgetting that name) is counted per thread, and a lock wrapper records the
most calls the holder made inside one acquisition. The old code walked every
tracked block inside the caller's section (2 calls per block)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from kvseal.v1 import kvseal_pb2 as pb
from kvseal.vllm import keys
from kvseal.vllm.tier_events import TierEvents
from vllm.v1.kv_offload.base import Medium, OffloadingEvent

N = 1 << 16  # tracked blocks: well above any chunk
BOUND = 4096  # the most manager calls one locked section may make (a chunk, not N)
TENANT = bytes(32)
S, R = pb.BLOCK_STORED, pb.BLOCK_REMOVED


class SectionCounter:
    """A reentrant lock that records, per outermost acquisition, how many
    counted calls the holding thread made inside it (``worst``)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth: dict[int, int] = {}
        self._start: dict[int, int] = {}
        self.calls: dict[int, int] = {}  # thread id -> counted calls
        self.worst = 0
        self.sections = 0

    def count(self) -> None:
        t = threading.get_ident()
        self.calls[t] = self.calls.get(t, 0) + 1

    def __enter__(self) -> SectionCounter:
        self._lock.acquire()
        t = threading.get_ident()
        if not self._depth.get(t):
            self._start[t] = self.calls.get(t, 0)
        self._depth[t] = self._depth.get(t, 0) + 1
        return self

    def __exit__(self, *exc: object) -> None:
        t = threading.get_ident()
        self._depth[t] -= 1
        if not self._depth[t]:
            self.worst = max(self.worst, self.calls.get(t, 0) - self._start[t])
            self.sections += 1
        self._lock.release()


class Names:
    """The manager's kvseal -> vLLM name map (``_reverse``), counting its use."""

    def __init__(self, lock: SectionCounter) -> None:
        self.map: dict[bytes, bytes] = {}
        self._lock = lock

    def vllm_hash(self, h: bytes) -> bytes:
        self._lock.count()
        return self.map.get(h, h)

    def forget(self, h: bytes) -> object:
        self._lock.count()
        return self.map.pop(h, None)


def _h(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def _ev(kind: int, hashes: list[bytes], medium: str = "storage") -> pb.BlockEvent:
    loc = "local" if medium == "storage" else ""
    return pb.BlockEvent(kind=kind, medium=medium, locality=loc, tenant=TENANT, block_hashes=hashes)


@contextmanager
def _tiers(world: int) -> Iterator[tuple[TierEvents, SectionCounter, Names, queue.SimpleQueue]]:
    lock = SectionCounter()
    names = Names(lock)
    out: queue.SimpleQueue[OffloadingEvent] = queue.SimpleQueue()
    t = TierEvents(world, 0, out, names.vllm_hash, names.forget)
    yield t, lock, names, out
    _settle(t)


def _settle(t: TierEvents) -> None:
    wait = getattr(t, "wait_idle", None)  # the old code applied everything at once
    if wait is not None:
        assert wait(120), "the tier events' queue never drained"


def _feed(t: TierEvents, lock: SectionCounter, rank: int, kind: int, hs: list[bytes]) -> None:
    """As a mirror's thread delivers a stream: one event per 512 blocks, each
    under the manager's lock."""
    for i in range(0, len(hs), 512):
        with lock:
            t.event(rank, _ev(kind, hs[i : i + 512]))


def _claims(out: queue.SimpleQueue, claimed: dict[bytes, bool], largest: list[int]) -> None:
    """Apply vLLM's view: each key's last event says whether it is claimed."""
    while not out.empty():
        e = out.get()
        largest[0] = max(largest[0], len(e.keys))
        for k in e.keys:
            claimed[bytes(k)] = not e.removed


def _key(vh: bytes) -> bytes:
    return keys.make_offload_key(vh, 0)


def test_a_reset_of_many_blocks_does_bounded_work_under_the_lock() -> None:
    """A gap on rank 0 of a TP=2 engine whose tier holds N blocks on both ranks:
    the reset itself (under the lock) makes a bounded number of calls; the
    removals still reach vLLM, and the blocks rank 0 announces again after the
    gap are claimed again, after their removal, never before."""
    hs = [_h(i) for i in range(N)]
    with _tiers(2) as (t, lock, _names, out):
        _feed(t, lock, 0, S, hs)
        _feed(t, lock, 1, S, hs)
        _settle(t)
        claimed: dict[bytes, bool] = {}
        largest = [0]
        _claims(out, claimed, largest)
        assert len(claimed) == N and all(claimed.values())
        lock.worst = 0
        with lock:  # the mirror's thread, on the gap (mirror._resync)
            t.reset(0)
        back = hs[: N // 4]  # what rank 0's daemon announces again after the gap
        _feed(t, lock, 0, S, back)
        assert lock.worst <= BOUND, f"{lock.worst} manager calls inside one locked section"
        _settle(t)
        _claims(out, claimed, largest)
        want = {_key(h): i < N // 4 for i, h in enumerate(hs)}
        assert claimed == want
        assert largest[0] <= BOUND  # vLLM gets the removals in bounded events too
        assert len(t) == N  # rank 1 still holds every block


def test_a_large_removal_event_does_bounded_work_under_the_lock() -> None:
    """One BLOCK_REMOVED naming every tracked block (a Drop of the whole
    tenant), then a block stored again: bounded work per locked section, every
    block retracted, the re-stored one claimed last, and every vLLM name that
    is no longer needed forgotten."""
    hs = [_h(i) for i in range(N)]
    with _tiers(1) as (t, lock, names, out):
        vnames = {h: b"v" * 12 + h[:4] for h in hs[:8]}  # 16-byte vLLM hashes
        names.map.update(vnames)
        _feed(t, lock, 0, S, hs)
        _settle(t)
        lock.worst = 0
        with lock:
            t.event(0, _ev(R, hs))
        with lock:  # vLLM stores it again (the manager learns its name anew) and
            names.map[hs[3]] = vnames[hs[3]]  # the daemon announces it, while the
            t.event(0, _ev(S, [hs[3]]))  # removal is still being applied
        assert lock.worst <= BOUND, f"{lock.worst} manager calls inside one locked section"
        _settle(t)
        claimed: dict[bytes, bool] = {}
        _claims(out, claimed, [0])
        assert claimed[_key(vnames[hs[3]])] is True
        assert not any(v for k, v in claimed.items() if k != _key(vnames[hs[3]]))
        assert len(claimed) == N
        assert len(t) == 1
        assert not set(names.map) - {hs[3]}  # the others' names went with their blocks
        with lock:  # its removal names it as vLLM does, whatever the manager forgot
            t.event(0, _ev(R, [hs[3]]))
        _settle(t)
        _claims(out, claimed, [0])
        assert claimed[_key(vnames[hs[3]])] is False


def test_events_queued_behind_a_reset_keep_their_order() -> None:
    """While a reset's walk is still queued, a removal and a store of other
    blocks, a second gap and the rank's re-announcements: vLLM's view ends as
    an immediate application would have left it, in both tiers."""
    hs = [_h(i) for i in range(N // 4)]
    with _tiers(1) as (t, lock, _names, out):
        _feed(t, lock, 0, S, hs)
        with lock:
            t.event(0, _ev(S, hs[:100], "cpu"))
        _settle(t)
        with lock:
            t.reset(0)
        deferred = getattr(t, "pending", lambda: 1)()
        with lock:
            t.event(0, _ev(S, [_h(N)]))  # a new block, after the gap
            t.event(0, _ev(S, hs[10:20], "cpu"))
        with lock:
            t.reset(0)  # a second gap before the first reset's walk ended
            t.event(0, _ev(S, hs[:5]))
        _settle(t)
        assert deferred >= 1  # the first reset was too large to apply in the call
        claimed: dict[bytes, bool] = {}
        got: list[OffloadingEvent] = []
        while not out.empty():
            got.append(out.get())
        for e in got:
            for k in e.keys:
                claimed[bytes(k) + bytes([e.medium is Medium.CPU])] = not e.removed
        storage = {k[:-1] for k, v in claimed.items() if v and not k[-1]}
        cpu = {k[:-1] for k, v in claimed.items() if v and k[-1]}
        assert storage == {_key(h) for h in hs[:5]}
        assert cpu == set()  # the cpu re-announcement came before the second gap
        assert len(t) == 5


def test_the_bound_retracts_the_oldest_in_constant_work() -> None:
    """Beyond ``max_blocks`` the oldest block is retracted (announced removed)
    for each new one, also when one event brings more than a chunk."""
    out: queue.SimpleQueue[OffloadingEvent] = queue.SimpleQueue()
    t = TierEvents(1, 0, out, lambda h: h, lambda h: None, max_blocks=3000)
    hs = [_h(i) for i in range(5000)]
    t.event(0, _ev(S, hs))
    _settle(t)
    claimed: dict[bytes, bool] = {}
    _claims(out, claimed, [0])
    assert len(t) == 3000
    assert {k for k, v in claimed.items() if v} == {_key(h) for h in hs[2000:]}
    assert getattr(t, "max_section", 0) <= 1024


@pytest.mark.parametrize("chunk", [2, 7])
def test_tiny_chunks_give_the_same_events(chunk: int) -> None:
    """The same streams through chunks of 2 and 7 units: the same final view."""
    views: list[set[bytes]] = []
    for c in (chunk, 1 << 20):
        out: queue.SimpleQueue[OffloadingEvent] = queue.SimpleQueue()
        t: Any = TierEvents(2, 0, out, lambda h: h, lambda h: None, chunk=c)
        hs = [_h(i) for i in range(40)]
        t.event(0, _ev(S, hs))
        t.event(1, _ev(S, hs[5:]))
        t.reset(1)
        t.event(1, _ev(S, hs[:30]))
        t.event(0, _ev(R, hs[20:25]))
        t.reset(0)
        t.event(0, _ev(S, hs[::2]))
        _settle(t)
        claimed: dict[bytes, bool] = {}
        _claims(out, claimed, [0])
        views.append({k for k, v in claimed.items() if v})
    assert views[0] == views[1] == {_key(h) for h in hs[:30:2]}
