"""``StoreEvents`` (the store's ``"storage"`` events) in process, on a real
``FsStore`` in a real directory and the daemon's real ``EventBus``: what it
announces, what it retracts, and what it refuses to claim."""

from __future__ import annotations

import hashlib
from pathlib import Path

from kvseal.server.cache.storeevents import StoreEvents
from kvseal.server.events import BlockEvent, EventBus, EventKind, Subscription
from kvseal.server.store.fsstore import FsStore, StoreConfig
from kvseal.server.store.keysource import DeploymentKey

NS = hashlib.sha256(b"ns").digest()
T1, T2 = hashlib.sha256(b"t1").digest(), hashlib.sha256(b"t2").digest()
BLOCK = 4096


def h(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "big")).digest()


def _rig(tmp_path: Path, **kw: object) -> tuple[FsStore, EventBus, Subscription]:
    cfg = StoreConfig(
        str(tmp_path / "store"),
        capacity_bytes=64 * 1024,  # one shard of 16 records: puts evict
        max_object_bytes=BLOCK,
        fanout=1,
    )
    store = FsStore(cfg, DeploymentKey(bytearray(range(1, 33)), "test"))
    bus = EventBus(4)
    sub = bus.subscribe(NS, {T1, T2})
    assert sub is not None
    return store, bus, sub


def _drain(sub: Subscription) -> list[BlockEvent]:
    out = []
    while not sub.queue.empty():
        out.append(sub.queue.get_nowait())
    return out


def _hashes(evs: list[BlockEvent], kind: EventKind, reason: str | None = None) -> list[bytes]:
    return [
        x for e in evs if e.kind is kind and (reason is None or e.reason == reason)
        for x in e.block_hashes
    ]  # fmt: skip


def test_announced_once_retracted_on_eviction_and_drop(tmp_path: Path) -> None:
    store, bus, sub = _rig(tmp_path)
    ev = StoreEvents(bus, store, "remote")
    for i in range(4):
        store.put(NS, T1, h(i), bytes([i]) * BLOCK)
    ev.stored(NS, T1, [h(0), h(1), h(2), h(3)])
    ev.stored(NS, T1, [h(1)])  # announced already: nothing new
    got = _drain(sub)
    assert _hashes(got, EventKind.STORED) == [h(0), h(1), h(2), h(3)]
    assert all(e.medium == "storage" and e.locality == "remote" for e in got)
    assert ev.holds(NS, T1, h(0)) and not ev.holds(NS, T2, h(0))
    # Puts that make room evict the oldest records: each announced one that
    # goes is retracted (EVICTED), through FsStore.on_evict.
    for i in range(4, 40):
        store.put(NS, T2, h(i), bytes([i]) * BLOCK)
    evicted = _hashes(_drain(sub), EventKind.REMOVED, "EVICTED")
    assert set(evicted) == {h(0), h(1), h(2), h(3)}
    assert not ev.holds(NS, T1, h(0))
    # A drop retracts what was announced of the tenant, and an announcement
    # based on a check made before the drop is not made after it.
    ev.stored(NS, T2, [h(38), h(39)])
    mark = ev.mark(NS, T2)
    _drain(sub)
    ev.dropped_tenant(NS, T2)
    assert set(_hashes(_drain(sub), EventKind.REMOVED, "DROPPED")) == {h(38), h(39)}
    ev.stored(NS, T2, [h(39)], mark=mark)
    assert _drain(sub) == [] and not ev.holds(NS, T2, h(39))
    ev.stored(NS, T2, [h(39)], mark=ev.mark(NS, T2))  # a check after the drop: announced
    assert _hashes(_drain(sub), EventKind.STORED) == [h(39)]
    store.close()


def test_misses_are_retracted_announced_or_not_and_the_bound_is_silent(tmp_path: Path) -> None:
    store, bus, sub = _rig(tmp_path)
    ev = StoreEvents(bus, store, "local", max_known=2)
    ev.stored(NS, T1, [h(1), h(2), h(3)])  # the oldest is forgotten, not retracted
    got = _drain(sub)
    assert _hashes(got, EventKind.STORED) == [h(1), h(2), h(3)]
    assert not _hashes(got, EventKind.REMOVED) and len(ev) == 2
    ev.removed(NS, T1, [h(1)], "EVICTED")  # only announced ones by default
    assert _drain(sub) == []
    ev.removed(NS, T1, [h(1)], "EVICTED", announced_only=False)  # a restore missed it
    assert _hashes(_drain(sub), EventKind.REMOVED, "EVICTED") == [h(1)]
    ev.retract_tenant(NS, T1, "INTEGRITY")  # the tenant's marker failed
    assert set(_hashes(_drain(sub), EventKind.REMOVED, "INTEGRITY")) == {h(2), h(3)}
    store.close()


def test_a_block_the_host_tier_holds_is_retracted_restorable(tmp_path: Path) -> None:
    store, bus, sub = _rig(tmp_path)
    ev = StoreEvents(bus, store, "local", in_host=lambda ns, t, hs: {x for x in hs if x == h(1)})
    ev.stored(NS, T1, [h(1), h(2)])
    _drain(sub)
    ev.removed(NS, T1, [h(1), h(2)], "EVICTED")
    got = [e for e in _drain(sub) if e.kind is EventKind.REMOVED]
    assert {(x, e.restorable) for e in got for x in e.block_hashes} == {
        (h(1), True),
        (h(2), False),
    }
    ev.stored(NS, T1, [h(1)])
    _drain(sub)
    ev.removed(NS, T1, [h(1)], "DROPPED")  # a drop takes both copies: never restorable
    assert [e.restorable for e in _drain(sub)] == [False]
    store.close()


def test_plaintext_buffers_are_wiped_and_bounded() -> None:
    from kvseal.server.cache.storestate import PlaintextBuffers

    pool = PlaintextBuffers(3 * BLOCK)
    bufs = [pool.take(BLOCK) for _ in range(4)]
    for b in bufs:
        b[:] = b"\xaa" * BLOCK
    pool.give(bufs)
    assert pool.kept_bytes == 3 * BLOCK  # the fourth is not kept
    assert all(b == bytes(BLOCK) for b in bufs)  # every one wiped, kept or not
    again = pool.take(BLOCK)
    assert any(again is b for b in bufs) and pool.kept_bytes == 2 * BLOCK
    assert pool.take(100) is not None and pool.kept_bytes == 2 * BLOCK  # another size: new
