"""The engine side degrades, never hangs or raises: daemon absent, hung,
killed mid-call, restarted (new key, empty cache, pool re-registered)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvseal.client import ClientConfig, EnginePool, KVSealClient, chain_block_hashes, tenant_digest
from kvseal.client.shm import SharedKVPool

from .conftest import DaemonProc, fill_random, is_poisoned, poison, start_daemon

FP = b"model:test"


def _engine(target: str, pool: SharedKVPool, **kw: float) -> tuple[KVSealClient, EnginePool]:
    opts: dict[str, float] = {
        "timeout_s": 1.0,
        "lookup_timeout_s": 1.0,  # the hangs below wait it out; a busy CI machine must not
        "transfer_timeout_s": 1.0,
        "backoff_initial_s": 0.05,
        "backoff_max_s": 0.2,
    }
    cfg = ClientConfig(target=target, **(opts | kw))  # type: ignore[arg-type]
    client = KVSealClient(cfg)
    return client, EnginePool(client, "engine", FP, pool.geometry())


def _wait_stopped(pid: int) -> None:
    """SIGSTOP is delivered asynchronously: wait until every thread stopped."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        states = [
            Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0]
            for t in os.listdir(f"/proc/{pid}/task")
        ]
        if all(s in "Tt" for s in states):
            return
        time.sleep(0.01)
    raise AssertionError("daemon did not stop")


def test_daemon_absent(tmp_path: Path, pool_factory: Callable[..., SharedKVPool]) -> None:
    pool = pool_factory(num_pages=2)
    client, engine = _engine(f"unix://{tmp_path}/missing.sock", pool)
    tenant = tenant_digest(None)
    chain = chain_block_hashes(list(range(8)), 4)
    poison(pool, [0, 1])
    assert engine.lookup(tenant, chain) == 0
    assert engine.offload(tenant, chain, [0, 1]) is False
    assert engine.restore(tenant, chain, [0, 1]) is False
    assert is_poisoned(pool, 0)
    assert engine.failures >= 1
    client.close()


def test_hung_then_killed_mid_call(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    pool = pool_factory(num_pages=4)
    fill_random(pool)
    tenant = tenant_digest(None)
    chain = chain_block_hashes(list(range(16)), 4)
    # The restore below ends when the daemon is killed, not at its deadline: a
    # longer transfer deadline only keeps a loaded machine's first offload in time.
    client, engine = _engine(daemon.target, pool, transfer_timeout_s=10.0)
    assert engine.wait_ready(60) is not None  # registration runs in the background
    assert engine.offload(tenant, chain, [0, 1, 2, 3]) is True
    poison(pool, [0, 1, 2, 3])
    os.kill(daemon.proc.pid, signal.SIGSTOP)  # the daemon hangs
    _wait_stopped(daemon.proc.pid)
    try:
        assert engine.lookup(tenant, chain) == 0  # deadline, then a miss
        results: list[bool] = []
        t = threading.Thread(
            target=lambda: results.append(engine.restore(tenant, chain, [0, 1, 2, 3]))
        )
        engine._down_until = 0.0  # let this call through despite the back-off
        t.start()
        time.sleep(0.1)  # the call is in flight against a stopped daemon
        os.kill(daemon.proc.pid, signal.SIGKILL)
        t.join(30)  # the kill ends the call (no hang): long before this on any machine
        assert not t.is_alive() and results == [False]
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    daemon.proc.wait(30)
    assert all(is_poisoned(pool, p) for p in range(4))
    assert engine.lookup(tenant, chain) == 0
    client.close()


def test_restart_reregisters_and_cache_starts_empty(
    tmp_path: Path, pool_factory: Callable[..., SharedKVPool]
) -> None:
    pool = pool_factory(num_pages=2)
    data = fill_random(pool)
    tenant = tenant_digest("t")
    chain = chain_block_hashes(list(range(8)), 4, cache_salt="t")
    d1 = start_daemon(tmp_path / "a")
    client, engine = _engine(d1.target, pool)
    try:
        assert engine.wait_ready(60) is not None  # registration runs in the background
        assert engine.offload(tenant, chain, [0, 1])
        first = engine.handle
        assert first is not None and engine.lookup(tenant, chain) == 2
        assert d1.stop() == 0
        assert engine.lookup(tenant, chain) == 0  # down: miss, no exception
        # Same socket path, new process: new key, empty cache.
        d2 = start_daemon(tmp_path / "a")
        try:
            deadline = time.monotonic() + 10
            while (
                engine.lookup(tenant, chain) == 0
                and engine.handle is None
                and time.monotonic() < deadline
            ):
                time.sleep(0.05)
            assert (
                engine.handle is not None and engine.handle.server_instance != first.server_instance
            )
            assert engine.lookup(tenant, chain) == 0  # a restart empties the cache
            assert engine.offload(tenant, chain, [0, 1])
            poison(pool, [0, 1])
            assert engine.restore(tenant, chain, [1, 0])
            assert pool.read_block(1) == data[0] and pool.read_block(0) == data[1]
        finally:
            d2.stop()
    finally:
        client.close()


def test_pool_unknown_is_reregistered_transparently(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    pool = pool_factory(num_pages=2)
    fill_random(pool)
    tenant = tenant_digest(None)
    chain = chain_block_hashes(list(range(8)), 4)
    client, engine = _engine(daemon.target, pool)
    assert engine.wait_ready(60) is not None  # registration runs in the background
    assert engine.offload(tenant, chain, [0, 1])
    h = engine.handle
    assert h is not None
    client.unregister_pool(h.pool_id)  # e.g. an operator, or a replaced pool
    # Calls degrade (0) until the pool is registered again, in the background,
    # with no help from the caller; then the blocks are found: they outlive pools.
    deadline = time.monotonic() + 10
    while engine.lookup(tenant, chain) != 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.handle is not None and engine.handle.pool_id != h.pool_id
    assert engine.lookup(tenant, chain) == 2
    client.close()


def test_engine_pool_after_client_close_degrades(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    """An engine shutting down may close its client before its last calls: they
    degrade like any other failure, they do not raise."""
    pool = pool_factory(num_pages=2)
    client, engine = _engine(daemon.target, pool)
    tenant = tenant_digest(None)
    chain = chain_block_hashes(list(range(8)), 4)
    assert engine.lookup(tenant, chain) == 0
    client.close()
    assert engine.lookup(tenant, chain) == 0
    assert engine.offload(tenant, chain, [0, 1]) is False
    assert engine.restore(tenant, chain, [0, 1]) is False
    engine.close()  # never raises either
