"""EnginePool's registration contract, against a real daemon process.

- A refused RegisterPool leaves nothing open in the daemon (fds, shm mappings).
- Hot-path calls never register: registration runs on a background thread, and a
  call without a handle degrades at once.
- A refused registration is retried with bounded exponential back-off and logged
  once per change of state.
- A name held by another engine is not taken over (ALREADY_EXISTS,
  POOL_NAME_TAKEN); the owner of a registration may replace it (owner token).
- A failure of a call made with an old handle never discards the current one.

The client used here is the real one; ``HookedClient`` only adds gates (to hold
a call at a chosen point) and a fault to inject into one lookup.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from kvseal.client import ClientConfig, EnginePool, KVSealClient, KVSealRpcError, tenant_digest
from kvseal.client.engine_pool import _Backoff
from kvseal.client.results import LookupResult, PoolHandle
from kvseal.client.shm import SharedKVPool
from kvseal.v1 import kvseal_pb2 as pb

from .conftest import DaemonProc, is_poisoned, poison
from .conftest import until as _until

FP = b"model:test"
TENANT = tenant_digest(None)
HASH = [bytes([7]) * 32]


def _in_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on another thread and return its result; fails (instead of
    hanging) if it blocks, e.g. on a registration held at a gate."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "a hot-path call blocked"
    return out[0]


class HookedClient(KVSealClient):
    """The real client, with test hooks: ``register_gate`` (cleared: RegisterPool
    waits until it is set), the names of the threads that registered, a
    ``lookup_gate`` that holds the next lookup after it chose its pool id, and
    ``fail_next_lookup`` (raised instead of the next lookup's RPC)."""

    def __init__(self, config: ClientConfig) -> None:
        super().__init__(config)
        self.register_gate = threading.Event()
        self.register_gate.set()
        self.registering = threading.Event()
        self.register_threads: list[str] = []
        self.lookup_gate: threading.Event | None = None
        self.lookup_waiting = threading.Event()
        self.fail_next_lookup: KVSealRpcError | None = None

    def register_pool(self, *args: Any, **kwargs: Any) -> PoolHandle:
        self.register_threads.append(threading.current_thread().name)
        self.registering.set()
        assert self.register_gate.wait(30)
        return super().register_pool(*args, **kwargs)

    def lookup(self, pool_id: str, tenant: bytes, block_hashes: Sequence[bytes]) -> LookupResult:
        err, self.fail_next_lookup = self.fail_next_lookup, None
        if err is not None:
            raise err
        gate, self.lookup_gate = self.lookup_gate, None
        if gate is not None:
            self.lookup_waiting.set()
            assert gate.wait(30)
        return super().lookup(pool_id, tenant, block_hashes)


def _hooked(d: DaemonProc, **kw: float) -> HookedClient:
    cfg: dict[str, Any] = {"backoff_initial_s": 0.05, "backoff_max_s": 0.2, **kw}
    return HookedClient(ClientConfig(target=d.target, **cfg))


def _stats(d: DaemonProc) -> pb.StatsReply:
    with d.client() as c:
        return c.stats()


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_rejected_registrations_leave_nothing_open(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    """200 refused registrations of three kinds (registry full, name held by
    another engine, a buffer that cannot be mapped after another one was): the
    daemon's open fds and mappings are exactly what they were."""
    filler, other = pool_factory(num_pages=2), pool_factory(num_pages=2)
    assert len(other.buffers) >= 2  # the partial-mapping case needs two buffers
    half_mappable = pb.PoolGeometry()
    half_mappable.CopyFrom(other.geometry())
    half_mappable.buffers[1].shm_name = f"kvseal-test-absent-{os.getpid()}"
    pid = daemon.proc.pid
    with daemon.client() as c:
        first = c.register_pool("fill-0", FP, filler.geometry())
        hold = c.hold_pool(first.pool_id)
        for i in range(1, 64):  # max_pools defaults to 64
            c.register_pool(f"fill-{i}", FP, filler.geometry())
        expected = [
            ("extra", other.geometry(), grpc.StatusCode.RESOURCE_EXHAUSTED, "CAPACITY_EXHAUSTED"),
            ("fill-0", other.geometry(), grpc.StatusCode.ALREADY_EXISTS, "POOL_NAME_TAKEN"),
            ("extra", half_mappable, grpc.StatusCode.FAILED_PRECONDITION, "HANDLE_UNUSABLE"),
        ]

        def reject(n: int) -> None:
            for i in range(n):
                name, geometry, code, reason = expected[i % len(expected)]
                with pytest.raises(KVSealRpcError) as ei:
                    c.register_pool(name, FP, geometry)
                assert (ei.value.code, ei.value.reason) == (code, reason)

        reject(6)  # the connection and the daemon's threads are set up by now
        before = _fds(pid)
        reject(200)
        assert _fds(pid) == before
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert not any(b.name in maps for b in other.buffers)  # no mapping left behind
        st = c.stats()
        assert st.pools == 64 and st.pool_holds == 1 and hold.active  # nothing replaced
        c.lookup(first.pool_id, TENANT, HASH)  # the holder's pool is untouched
        with pytest.raises(KVSealRpcError, match=r"too many pools registered \(limit 64\)"):
            c.register_pool("x", FP, other.geometry())
        hold.close()


def test_hot_path_never_registers(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    """With no handle (first use, or after the hold was lost) hot-path calls
    degrade at once while the registration, held at a gate here, waits on the
    background thread; no RegisterPool is ever made from the engine's thread."""
    pool = pool_factory(num_pages=2)
    poison(pool, [0, 1])
    client = _hooked(daemon)
    engine = EnginePool(client, "engine", FP, pool.geometry())
    try:
        client.register_gate.clear()
        assert _in_thread(lambda: engine.lookup(TENANT, HASH)) == 0
        assert client.registering.wait(10)  # the registration is under way, and stuck
        assert _in_thread(lambda: engine.offload(TENANT, HASH, [0])) is False
        assert _in_thread(lambda: engine.restore(TENANT, HASH, [1])) is False
        assert engine.failures == 3 and engine.handle is None
        assert is_poisoned(pool, 1)  # no RPC was made: the daemon never saw the pages
        client.register_gate.set()
        first = engine.wait_ready(10)
        assert first is not None
        _until(lambda: engine.held, "the hold")
        assert engine.offload(TENANT, HASH, [0]) is True

        # The hold is lost (here: an operator unregisters the pool): the background
        # thread registers again; meanwhile the hot path degrades without waiting.
        client.register_gate.clear()
        client.registering.clear()
        with daemon.client() as c:
            c.unregister_pool(first.pool_id)
        assert client.registering.wait(10)
        assert engine.handle is None
        assert _in_thread(lambda: engine.lookup(TENANT, HASH)) == 0
        assert _in_thread(lambda: engine.restore(TENANT, HASH, [1])) is False
        client.register_gate.set()
        _until(lambda: engine.held, "the new hold")
        assert engine.lookup(TENANT, HASH) == 1  # blocks outlive pools
        assert client.register_threads == ["kvseal-register-engine"] * 2
    finally:
        client.register_gate.set()
        engine.close()
        client.close()
    assert _stats(daemon).pools == 0


def test_backoff_policy() -> None:
    b = _Backoff(0.1, 0.5)
    assert [b.next() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    b.reset()
    assert b.next() == 0.1


def test_refused_registration_backs_off_and_logs_once(
    daemon: DaemonProc,
    pool_factory: Callable[..., SharedKVPool],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """1000 lookups while the registration is refused: one RegisterPool (the next
    attempt is 60 s away), one log line, and no lookup RPC."""
    pool = pool_factory(num_pages=2)
    with daemon.client() as holder:
        taken = holder.register_pool("engine", FP, pool.geometry())
        hold = holder.hold_pool(taken.pool_id)
        client = _hooked(daemon, backoff_initial_s=60.0, backoff_max_s=60.0)
        engine = EnginePool(client, "engine", FP, pool.geometry())
        try:
            with caplog.at_level(logging.INFO, logger="kvseal.client"):
                assert engine.lookup(TENANT, HASH) == 0
                _until(lambda: engine.registration_error is not None, "the refusal")
                assert all(engine.lookup(TENANT, HASH) == 0 for _ in range(1000))
            err = engine.registration_error
            assert err is not None and err.code is grpc.StatusCode.ALREADY_EXISTS
            assert err.reason == "POOL_NAME_TAKEN"
            assert engine.registrations == 1 and engine.failures == 1001
            lines = [r for r in caplog.records if r.name == "kvseal.client"]
            assert len(lines) == 1 and lines[0].levelno == logging.ERROR
            assert "'engine' is held by another engine" in lines[0].getMessage()
            assert _stats(daemon).lookups == 0  # degraded without an RPC
        finally:
            engine.close()
            client.close()
            hold.close()


def test_backoff_resets_after_a_success(
    daemon: DaemonProc,
    pool_factory: Callable[..., SharedKVPool],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Refused several times (back-off growing, one log line), then the name is
    free: registered and held, the back-off is back at its start, and the recovery
    is logged once."""
    pool = pool_factory(num_pages=2)
    holder = daemon.client()
    taken = holder.register_pool("engine", FP, pool.geometry())
    hold = holder.hold_pool(taken.pool_id)
    client = _hooked(daemon, backoff_initial_s=0.02, backoff_max_s=0.08)
    engine = EnginePool(client, "engine", FP, pool.geometry())
    try:
        with caplog.at_level(logging.INFO, logger="kvseal.client"):
            engine.lookup(TENANT, HASH)
            _until(lambda: engine.registrations >= 4, "a few refused attempts")
            assert engine._reg_backoff.current == 0.08  # grew, and is bounded
            hold.close()  # the holder (another engine) leaves: its pool is unregistered
            _until(lambda: engine.held, "the name to be ours")
        assert engine.registration_error is None and engine._reg_backoff.current == 0.02
        messages = [r.getMessage() for r in caplog.records if r.name == "kvseal.client"]
        assert sum("held by another engine" in m for m in messages) == 1
        assert sum("registered again" in m for m in messages) == 1
    finally:
        engine.close()
        client.close()
        holder.close()


def test_two_engines_with_one_name(
    daemon: DaemonProc,
    pool_factory: Callable[..., SharedKVPool],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The second engine is refused and says so once; the first keeps its pool
    through 200 offloads (no re-registration, nothing replaced). When the first
    engine goes, the second gets the name."""
    pa, pb_ = pool_factory(num_pages=2), pool_factory(num_pages=2)
    ca, cb = _hooked(daemon), _hooked(daemon)
    a = EnginePool(ca, "engine", FP, pa.geometry())
    b = EnginePool(cb, "engine", FP, pb_.geometry())
    try:
        first = a.wait_ready(10)
        assert first is not None
        _until(lambda: a.held, "a's hold")
        with caplog.at_level(logging.INFO, logger="kvseal.client"):
            assert b.lookup(TENANT, HASH) == 0
            _until(lambda: b.registration_error is not None, "b to be refused")
            results = [a.offload(TENANT, [bytes([i]) * 32], [i % 2]) for i in range(200)]
            assert b.offload(TENANT, HASH, [0]) is False
        assert all(results) and a.handle is first and a.registrations == 1
        err = b.registration_error
        assert err is not None and err.reason == "POOL_NAME_TAKEN"
        assert err.code is grpc.StatusCode.ALREADY_EXISTS and b.handle is None
        taken = [r for r in caplog.records if "held by another engine" in r.getMessage()]
        assert len(taken) == 1  # however many times b retried
        st = _stats(daemon)
        assert st.pools == 1 and st.offloaded_blocks == 200
        assert "replaced by" not in daemon.log()

        a.close()
        _until(lambda: b.held, "b to get the name")
        assert b.registration_error is None and _stats(daemon).pools == 1
        assert b.lookup(TENANT, [bytes([5]) * 32]) == 1  # same model: a's blocks are found
    finally:
        a.close()
        b.close()
        ca.close()
        cb.close()


def test_owner_replaces_its_own_held_registration(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    """A call fails as if the daemon were unreachable, so the engine drops its
    handle although its registration is still held: it registers again with its
    owner token and is not refused as a stranger."""
    pool = pool_factory(num_pages=2)
    client = _hooked(daemon)
    engine = EnginePool(client, "engine", FP, pool.geometry())
    try:
        first = engine.wait_ready(10)
        assert first is not None
        _until(lambda: engine.held, "the hold")
        client.fail_next_lookup = KVSealRpcError(grpc.StatusCode.UNAVAILABLE, "", "injected")
        assert engine.lookup(TENANT, HASH) == 0
        _until(lambda: engine.held and engine.handle not in (None, first), "the new registration")
        assert engine.registration_error is None and engine.registrations == 2
        assert _stats(daemon).pools == 1
        assert f"pool {first.pool_id} replaced by" in daemon.log()
    finally:
        engine.close()
        client.close()


def test_a_stale_failure_keeps_the_fresh_handle(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    """A lookup picks the handle, then its pool is replaced before the RPC is
    sent (held at a gate here); the new handle is in place when the old call
    fails with UNKNOWN_POOL. That failure must not clear the new handle."""
    pool = pool_factory(num_pages=2)
    client = _hooked(daemon)
    engine = EnginePool(client, "engine", FP, pool.geometry())
    try:
        first = engine.wait_ready(10)
        assert first is not None
        _until(lambda: engine.held, "the hold")
        gate = threading.Event()
        client.lookup_gate = gate
        out: list[int] = []
        t = threading.Thread(target=lambda: out.append(engine.lookup(TENANT, HASH)))
        t.start()
        assert client.lookup_waiting.wait(10)  # the call has chosen the first handle
        with daemon.client() as c:
            c.unregister_pool(first.pool_id)
        _until(lambda: engine.held and engine.handle not in (None, first), "the new handle")
        fresh = engine.handle
        failures = engine.failures
        gate.set()
        t.join(10)
        assert out == [0] and engine.failures == failures + 1  # the old call failed...
        assert engine.handle is fresh and engine.registrations == 2  # ...and changed nothing
        assert engine.lookup(TENANT, HASH) == 0 and engine.failures == failures + 1
    finally:
        engine.close()
        client.close()
