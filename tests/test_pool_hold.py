"""HoldPool: a pool's registration lives as long as its engine process.

A real daemon and, where it matters, a real engine process that is SIGKILLed: the
daemon must notice the dropped connection, unregister the pool and release the
engine's memory (for the CUDA backend that memory would otherwise stay allocated
on the GPU and a restarted engine could not get it back).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from kvseal.client import ClientConfig, EnginePool, KVSealClient, KVSealRpcError, tenant_digest
from kvseal.client.shm import SharedKVPool

from .conftest import DaemonProc, start_daemon
from .conftest import until as _until

FP = b"model:test"

ENGINE = """
import sys, time
from kvseal.client import ClientConfig, EnginePool, KVSealClient, tenant_digest
from kvseal.client.shm import KVShape, SharedKVPool
shape = KVShape(num_pages=4, dtype="bfloat16", tokens_per_page=4, num_layers=2,
                num_kv_heads=2, head_dim=16)
pool = SharedKVPool(shape, "vllm_per_layer", name_prefix="kvseal-test")
engine = EnginePool(KVSealClient(ClientConfig(target=sys.argv[1])), "engine", b"fp",
                    pool.geometry())
handle = engine.wait_ready(20)
deadline = time.monotonic() + 20
while not engine.held and time.monotonic() < deadline:  # confirmed in the background
    time.sleep(0.01)
assert engine.offload(tenant_digest(None), [bytes([17]) * 32], [0])
print(handle.pool_id, engine.held, *[b.name for b in pool.buffers], flush=True)
time.sleep(600)
"""


def _holds(pid: int) -> str:
    """Every file the process maps or has open (the CPU backend keeps an fd
    per pool object and maps none; the CUDA backend maps), one per line."""
    links = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            links.append(os.readlink(fd))
        except FileNotFoundError:  # closed meanwhile
            pass
    return Path(f"/proc/{pid}/maps").read_text() + "\n".join(links)


def _pools(d: DaemonProc) -> int:
    with d.client() as c:
        return c.stats().pools


def test_killed_engine_releases_its_pool(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, daemon.target],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    names: list[str] = []
    try:
        assert engine.stdout is not None
        pool_id, held, *names = engine.stdout.readline().split()
        assert held == "True" and names
        assert _pools(daemon) == 1
        holds = _holds(daemon.proc.pid)
        assert all(f"/dev/shm/{n}" in holds for n in names)  # the daemon holds the pool

        engine.send_signal(signal.SIGKILL)  # no clean-up of any kind on the engine side
        engine.wait(10)

        _until(lambda: _pools(daemon) == 0, "the pool to be unregistered")
        _until(
            lambda: not any(f"/dev/shm/{n}" in _holds(daemon.proc.pid) for n in names),
            "the daemon to release the engine's memory",
        )
        assert f"unregistered pool {pool_id}: its holder (the engine) went away" in daemon.log()
        with daemon.client() as c:  # the daemon serves on
            assert c.health() == "SERVING"
            # The sealed blocks belong to the model namespace, not to the pool: a
            # restarted engine (same model, same layout) still finds them.
            again = c.register_pool("engine", b"fp", pool_factory(num_pages=4).geometry())
            assert c.lookup(again.pool_id, tenant_digest(None), [bytes([17]) * 32]).hit_blocks == 1
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()
        for n in names:  # SIGKILL left the engine's shm objects behind
            Path(f"/dev/shm/{n}").unlink(missing_ok=True)


def test_hold_lifecycle(daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]) -> None:
    pool = pool_factory(num_pages=2)
    with daemon.client() as c:
        with pytest.raises(KVSealRpcError) as ei:
            c.hold_pool("nope#000000")
        assert ei.value.code is grpc.StatusCode.NOT_FOUND and ei.value.reason == "UNKNOWN_POOL"

        # Two holds: the pool stays until the last one is released.
        h = c.register_pool("a", FP, pool.geometry())
        one, two = c.hold_pool(h.pool_id), c.hold_pool(h.pool_id)
        assert one.active and two.active and c.stats().pool_holds == 2
        one.close()
        assert one.ended.is_set() and one.error is None
        _until(lambda: c.stats().pool_holds == 1, "the daemon to count the release")
        assert c.stats().pools == 1
        assert c.lookup(h.pool_id, tenant_digest(None), [b"\0" * 32]).hit_blocks == 0
        two.close()
        _until(lambda: c.stats().pools == 0, "the pool to be unregistered")
        assert c.stats().pool_holds == 0

        # A held name is not taken over by another engine (no owner token)...
        old = c.register_pool("b", FP, pool.geometry())
        hold = c.hold_pool(old.pool_id)
        with pytest.raises(KVSealRpcError) as ei:
            c.register_pool("b", FP, pool.geometry())
        assert ei.value.code is grpc.StatusCode.ALREADY_EXISTS
        assert ei.value.reason == "POOL_NAME_TAKEN"
        assert hold.active and c.stats().pools == 1
        # ...but its owner replaces it: the old hold ends (OK), the new pool stays.
        new = c.register_pool("b", FP, pool.geometry(), owner_token=old.owner_token)
        assert new.pool_id != old.pool_id and new.owner_token == old.owner_token
        assert hold.ended.wait(10) and hold.error is None
        assert c.stats().pools == 1
        c.lookup(new.pool_id, tenant_digest(None), [b"\0" * 32])  # still registered

        # Unregistered while held: the hold just ends.
        hold = c.hold_pool(new.pool_id)
        c.unregister_pool(new.pool_id)
        assert hold.ended.wait(10) and hold.error is None
        assert c.stats().pools == 0


def test_engine_pool_holds_and_close_releases(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    pool = pool_factory(num_pages=2)
    client = KVSealClient(ClientConfig(target=daemon.target))
    engine = EnginePool(client, "engine", FP, pool.geometry())
    try:
        assert engine.lookup(tenant_digest(None), [b"\0" * 32]) == 0
        _until(lambda: engine.held, "the hold to be confirmed (in the background)")
        assert _pools(daemon) == 1
        engine.close()
        assert _pools(daemon) == 0  # close() unregisters before it returns
        assert engine.lookup(tenant_digest(None), [b"\0" * 32]) == 0  # degrades, no re-register
        assert _pools(daemon) == 0
        # Without a hold (e.g. an older daemon), close unregisters directly.
        bare = EnginePool(client, "bare", FP, pool.geometry(), hold=False)
        assert bare.wait_ready(10) is not None
        assert not bare.held and _pools(daemon) == 1
        bare.close()
        assert _pools(daemon) == 0
    finally:
        client.close()


def test_hold_limit(
    daemon_factory: Callable[..., DaemonProc], pool_factory: Callable[..., SharedKVPool]
) -> None:
    d = daemon_factory("--max-holds", "1")
    pool = pool_factory(num_pages=2)
    with d.client() as c:
        h = c.register_pool("a", FP, pool.geometry())
        first = c.hold_pool(h.pool_id)
        with pytest.raises(KVSealRpcError) as ei:
            c.hold_pool(h.pool_id)
        assert ei.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ei.value.reason == "CAPACITY_EXHAUSTED" and "--max-holds" in ei.value.details
        assert first.active and c.stats().pools == 1  # the refused hold changed nothing
        first.close()
        _until(lambda: c.stats().pools == 0, "the pool to be unregistered")
        h = c.register_pool("a", FP, pool.geometry())
        c.hold_pool(h.pool_id).close()  # room again


def test_daemon_shutdown_ends_holds_without_calling_the_engine_gone(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    pool = pool_factory(num_pages=2)
    with daemon.client() as c:
        h = c.register_pool("a", FP, pool.geometry())
        hold = c.hold_pool(h.pool_id)
        assert daemon.stop() == 0
        assert hold.ended.wait(10)
        # Ended by the drain (kvseal's own reason), not cut by gRPC after the grace.
        assert hold.error is not None and hold.error.code is grpc.StatusCode.UNAVAILABLE
        assert hold.error.reason == "SHUTTING_DOWN"
    assert "went away" not in daemon.log()


def test_engine_pool_holds_again_after_a_daemon_restart(
    tmp_path: Path, pool_factory: Callable[..., SharedKVPool]
) -> None:
    pool = pool_factory(num_pages=2)
    d = start_daemon(tmp_path / "d")
    client = KVSealClient(ClientConfig(target=d.target, backoff_initial_s=0.05))
    engine = EnginePool(client, "engine", FP, pool.geometry())
    try:
        engine.lookup(tenant_digest(None), [b"\0" * 32])
        _until(lambda: engine.held, "the first hold")
        d.stop()
        d = start_daemon(tmp_path / "d")  # same socket: a restart
        _until(
            lambda: engine.lookup(tenant_digest(None), [b"\0" * 32]) == 0 and engine.held,
            "the engine to register and hold again",
        )
        assert _pools(d) == 1
    finally:
        engine.close()
        client.close()
        d.stop()


def test_engine_pool_retries_a_refused_hold(
    daemon_factory: Callable[..., DaemonProc], pool_factory: Callable[..., SharedKVPool]
) -> None:
    """--max-holds reached: the engine's pool works unheld, and is held as soon as
    there is room (a refusal must not leave a pool unheld for the engine's life)."""
    d = daemon_factory("--max-holds", "1")
    pool = pool_factory(num_pages=2)
    client = KVSealClient(ClientConfig(target=d.target, backoff_initial_s=0.05))
    a = EnginePool(client, "a", FP, pool.geometry())
    b = EnginePool(client, "b", FP, pool.geometry())
    try:
        a.lookup(tenant_digest(None), [b"\0" * 32])
        _until(lambda: a.held, "a's hold")
        assert b.wait_ready(10) is not None
        assert b.lookup(tenant_digest(None), [b"\0" * 32]) == 0  # works, unheld
        assert not b.held and _pools(d) == 2
        a.close()
        _until(lambda: b.held, "b's hold, once a released its slot")
        with d.client() as c:
            assert c.stats().pool_holds == 1 and c.stats().pools == 1
    finally:
        b.close()
        client.close()


def test_engine_pool_registers_again_when_its_pool_is_taken_away(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    """An operator (or a dropped connection) unregisters the pool: the hold ends,
    and the engine registers and holds again instead of degrading every call."""
    pool = pool_factory(num_pages=2)
    client = KVSealClient(ClientConfig(target=daemon.target))
    engine = EnginePool(client, "engine", FP, pool.geometry())
    try:
        engine.lookup(tenant_digest(None), [b"\0" * 32])
        _until(lambda: engine.held, "the hold")
        first = engine.handle
        assert first is not None
        with daemon.client() as c:
            c.unregister_pool(first.pool_id)
        # Registered again in the background (no engine call needed).
        _until(lambda: engine.held and engine.handle not in (None, first), "the new registration")
        assert engine.handle is not None and engine.handle.pool_id != first.pool_id
        assert _pools(daemon) == 1
    finally:
        engine.close()
        client.close()
