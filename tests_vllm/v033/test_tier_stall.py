"""vLLM 0.33's own scheduler during a tier resync (issue 28, "a scheduler stall
in vLLM's tier events"): with KV events on and a daemon with a store tier, a
stream gap and a large removal must not make the scheduler's lock wait on
work proportional to the tier's size.

The real path: vLLM 0.33's ``Scheduler`` (tests_vllm/v033/engine.py) steps on
its own thread, taking kvseal's manager lock as vLLM does (its step region,
its ``take_events``) and publishing the connector's KV events through vLLM's
publisher; the mirror's callback (``on_tier``) is called with the mirror's
lock, as its thread does for each event of the daemon's stream and for a gap
(``None``). The work done inside one locked section is counted, not timed:
the manager's name map (``_reverse``, which the tier events consult once per
block they announce or forget) counts its uses per thread, and the lock
records the most uses its holder made inside one acquisition."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvseal.client import tenant_digest
from kvseal.v1 import kvseal_pb2 as pb
from vllm.config import KVEventsConfig, VllmConfig
from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from tests_vllm.daemon import Daemon
from tests_vllm.helpers import wait_for
from tests_vllm.v033 import engine as engine_mod
from tests_vllm.v033.engine import Engine, write_model_config

N = 1 << 16  # tracked blocks
BOUND = 4096  # the most name-map uses one locked section may make (a chunk, not N)


class CountedLock:
    """The manager's own lock, recording per outermost acquisition how many
    counted calls its holder made inside it (``worst``)."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self._depth: dict[int, int] = {}
        self._start: dict[int, int] = {}
        self.calls: dict[int, int] = {}
        self.worst = 0

    def count(self) -> None:
        t = threading.get_ident()
        self.calls[t] = self.calls.get(t, 0) + 1

    def acquire(self, *a: Any, **k: Any) -> bool:
        got = bool(self.raw.acquire(*a, **k))
        if got:
            t = threading.get_ident()
            if not self._depth.get(t):
                self._start[t] = self.calls.get(t, 0)
            self._depth[t] = self._depth.get(t, 0) + 1
        return got

    def release(self) -> None:
        t = threading.get_ident()
        self._depth[t] -= 1
        if not self._depth[t]:
            self.worst = max(self.worst, self.calls.get(t, 0) - self._start[t])
        self.raw.release()

    def __enter__(self) -> CountedLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class CountedNames(dict):  # type: ignore[type-arg]
    """The manager's kvseal -> vLLM name map, counting its reads and removals."""

    def __init__(self, lock: CountedLock, *a: Any) -> None:
        super().__init__(*a)
        self._lock = lock

    def get(self, *a: Any) -> Any:
        self._lock.count()
        return super().get(*a)

    def pop(self, *a: Any) -> Any:
        self._lock.count()
        return super().pop(*a)


def _h(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


@pytest.fixture
def tiered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    """vLLM 0.33's scheduler with KV events on (the null publisher), on a daemon
    with a store tier."""
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    d = Daemon(
        tmp_path / "d",
        extra=(
            "--store-dir", str(tmp_path / "store"), "--store-key", f"file:{key}",
            "--store-bytes", "64MiB", "--store-max-block-bytes", "1MiB",
        ),
    ).start()  # fmt: skip
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    monkeypatch.setattr(
        engine_mod, "VllmConfig", functools.partial(VllmConfig, kv_events_config=events)
    )
    e = Engine(write_model_config(tmp_path / "model"), d.target)
    try:
        m = e.manager.mirrors[0]
        assert wait_for(lambda: m.synced.is_set() and bool(m.store_policy), 60)
        yield e
    finally:
        e.shutdown()
        d.stop()


def test_a_resync_and_a_large_removal_do_not_hold_the_schedulers_lock(tiered: Engine) -> None:
    """N blocks announced in the store; then one removal event naming half of
    them (a Drop), a gap (the mirror's resync) and the announcements that
    follow it, while vLLM's scheduler steps: no locked section does more than a
    chunk of the work, and the events vLLM publishes end in the truth (the
    re-announced blocks stored, every other one removed)."""
    e = tiered
    mgr = e.manager
    m = mgr.mirrors[0]
    lock = CountedLock(mgr._lock)
    mgr._lock = lock  # what vLLM's scheduler takes (manager.lock)
    mgr._reverse = CountedNames(lock, mgr._reverse)
    published: list[Any] = []
    e.scheduler.kv_event_publisher.publish = lambda batch: published.extend(batch.events)
    tenant = tenant_digest(None)
    hs = [_h(i) for i in range(N)]

    def deliver(ev: pb.BlockEvent | None) -> None:
        with lock:  # as the mirror's thread does (its update lock is this lock)
            m._on_tier(m.rank, ev)

    def ev(kind: int, hashes: list[bytes]) -> pb.BlockEvent:
        return pb.BlockEvent(
            kind=kind, medium="storage", locality="local", tenant=tenant, block_hashes=hashes
        )

    stop = threading.Event()
    failed: list[BaseException] = []

    def scheduler() -> None:
        try:
            while not stop.is_set():
                e.step()
                time.sleep(0.002)
        except BaseException as err:  # reported by the test, not lost
            failed.append(err)

    want_stored = {maybe_convert_block_hash(BlockHash(h)) for h in hs}
    state: dict[Any, bool] = {}

    def view() -> dict[Any, bool]:
        while published:
            x = published.pop(0)
            if isinstance(x, BlockStored | BlockRemoved) and x.medium == MEDIUM_STORAGE:
                for bh in x.block_hashes:
                    state[bh] = isinstance(x, BlockStored)
        return state

    t = threading.Thread(target=scheduler, name="vllm-scheduler", daemon=True)
    t.start()
    try:
        for i in range(0, N, 512):  # the daemon's announcements, event by event
            deliver(ev(pb.BLOCK_STORED, hs[i : i + 512]))
        assert wait_for(lambda: {k for k, v in view().items() if v} == want_stored, 120)
        lock.worst = 0
        deliver(ev(pb.BLOCK_REMOVED, hs[N // 2 :]))  # one event: half the tier
        deliver(None)  # a gap: the mirror's resync
        back = hs[:100]
        deliver(ev(pb.BLOCK_STORED, back))  # what the daemon announces after it
        assert lock.worst <= BOUND, f"{lock.worst} name-map uses inside one locked section"
        want = {maybe_convert_block_hash(BlockHash(h)): i < 100 for i, h in enumerate(hs)}
        assert wait_for(lambda: view() == want, 120), "vLLM's events did not end in the truth"
        assert not failed, failed
    finally:
        stop.set()
        t.join(30)
