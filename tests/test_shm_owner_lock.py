"""Owner-locked shared-memory pools: no name outlives its engine.

An engine's KV pool object (``kvseal.client.shm.create_owner_locked``, vLLM's
KV cache on the CPU platform) carries a shared ``flock`` held by its creator
for as long as the creator lives. Real processes, a real daemon, real
SIGKILLs: the daemon unlinks the name of a registered owner-locked object
once its engine is gone (the engine can no longer do it); a live engine's name
survives unregistration and a daemon restart (it registers again by name); a
name that was never owner-locked is left alone; and an engine starting sweeps
what dead engines left while no daemon held their pools.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

import pytest
from kvseal.client.shm import (
    SHM_DIR,
    create_owner_locked,
    owner_alive,
    sweep_orphans,
)

from .conftest import DaemonProc, start_daemon
from .conftest import until as _until

# An engine: an owner-locked pool object registered and held by EnginePool
# (argv: socket target, object name prefix, "locked" or "plain" object).
ENGINE = """
import os, secrets, sys, time
from kvseal.client import ClientConfig, EnginePool, KVSealClient
from kvseal.client.shm import BLOCK_ORDER, KVShape, SharedKVPool, create_owner_locked
from kvseal.v1 import kvseal_pb2 as pb
shape = KVShape(num_pages=4, tokens_per_page=4, num_layers=2, num_kv_heads=2, head_dim=16)
if sys.argv[3] == "locked":
    name = f"{sys.argv[2]}-{os.getpid()}-{secrets.token_hex(4)}"
    obj = create_owner_locked(name, shape.num_pages * shape.block_bytes)
    g = pb.PoolGeometry(
        num_pages=shape.num_pages, tokens_per_page=shape.tokens_per_page,
        num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, dtype=shape.dtype, layout=BLOCK_ORDER,
        buffers=[pb.BufferHandle(shm_name=name, offset=0, size=obj.size)],
        segments=[pb.Segment(buffer=0, offset=0, page_stride=shape.block_bytes,
                             bytes=shape.block_bytes)],
    )
else:  # an object without an owner lock
    pool = SharedKVPool(shape, "vllm_cross_layer", name_prefix=sys.argv[2])
    name, g = pool.buffers[0].name, pool.geometry()
engine = EnginePool(KVSealClient(ClientConfig(target=sys.argv[1])), "engine", b"fp", g)
engine.wait_ready(20)
deadline = time.monotonic() + 20
while not engine.held and time.monotonic() < deadline:  # confirmed in the background
    time.sleep(0.01)
print(name, engine.held, flush=True)
for line in sys.stdin:  # "close": release the pool; EOF: exit
    if line.strip() == "close":
        engine.close()
        print("closed", flush=True)
time.sleep(600)
"""


def _exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def _pools(d: DaemonProc) -> int:
    with d.client() as c:
        return int(c.stats().pools)


@pytest.fixture
def prefix() -> Iterator[str]:
    """A name prefix of this test only (other tests may share /dev/shm); what
    a failed test leaves under it is removed."""
    p = f"kvseal-ownertest{os.getpid()}"
    yield p
    for n in os.listdir(SHM_DIR):
        if n.startswith(p + "-"):
            os.unlink(os.path.join(SHM_DIR, n))


@pytest.fixture
def engine_factory() -> Iterator[Callable[..., tuple[subprocess.Popen[str], str]]]:
    procs: list[subprocess.Popen[str]] = []

    def start(
        d: DaemonProc, prefix: str, kind: str = "locked"
    ) -> tuple[subprocess.Popen[str], str]:
        p = subprocess.Popen(
            [sys.executable, "-c", ENGINE, d.target, prefix, kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(p)
        assert p.stdout is not None
        name, held = p.stdout.readline().split()
        assert held == "True"
        return p, name

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_daemon_unlinks_the_name_of_a_killed_engine(
    daemon: DaemonProc,
    prefix: str,
    engine_factory: Callable[..., tuple[subprocess.Popen[str], str]],
) -> None:
    p, name = engine_factory(daemon, prefix)
    assert _exists(name) and _pools(daemon) == 1
    p.send_signal(signal.SIGKILL)  # no exit handler runs: only the daemon can unlink it
    p.wait()
    _until(lambda: _pools(daemon) == 0, "the daemon drops the dead engine's pool")
    _until(lambda: not _exists(name), "the daemon unlinks the dead engine's name")
    assert "the engine that created it is gone" in daemon.log()


def test_live_engine_keeps_its_name_when_its_pool_is_closed(
    daemon: DaemonProc,
    prefix: str,
    engine_factory: Callable[..., tuple[subprocess.Popen[str], str]],
) -> None:
    # Unregistered by its live engine: the daemon closes the pool, the name stays.
    p1, name1 = engine_factory(daemon, prefix)
    assert p1.stdin is not None and p1.stdout is not None
    p1.stdin.write("close\n")
    p1.stdin.flush()
    assert p1.stdout.readline().strip() == "closed"
    assert _pools(daemon) == 0 and _exists(name1)
    # The daemon stops (and closes every pool) while the engine lives: the name stays.
    p2, name2 = engine_factory(daemon, prefix)
    daemon.stop()
    assert _exists(name2) and _exists(name1)
    # Both engines die with no daemon to notice: the next engine's sweep removes them.
    for p in (p1, p2):
        p.kill()
        p.wait()
    assert sorted(sweep_orphans(prefix)) == sorted([name1, name2])
    assert not _exists(name1) and not _exists(name2)


def test_engine_registers_again_after_a_daemon_restart(
    daemon_factory: Callable[..., DaemonProc],
    prefix: str,
    engine_factory: Callable[..., tuple[subprocess.Popen[str], str]],
) -> None:
    d = daemon_factory()
    p, name = engine_factory(d, prefix)
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    assert _exists(name)  # the engine lives: its name is kept for the next daemon
    d2 = start_daemon(d.workdir)  # the same workdir: the socket the engine dials
    try:
        _until(lambda: _pools(d2) == 1, "the engine registers its pool again, by name")
        p.kill()
        p.wait()
        _until(lambda: not _exists(name), "the new daemon unlinks the dead engine's name")
    finally:
        d2.stop()


def test_daemon_leaves_a_name_without_owner_lock(
    daemon: DaemonProc,
    prefix: str,
    engine_factory: Callable[..., tuple[subprocess.Popen[str], str]],
) -> None:
    p, name = engine_factory(daemon, prefix, "plain")
    p.send_signal(signal.SIGKILL)
    p.wait()
    _until(lambda: _pools(daemon) == 0, "the daemon drops the dead engine's pool")
    assert _exists(name)  # not owner-locked: the daemon cannot tell it is orphaned


def test_sweep_removes_only_orphans(prefix: str) -> None:
    mine = create_owner_locked(f"{prefix}-{os.getpid()}-live", 4096)
    try:
        probe = os.open(mine.path, os.O_RDONLY)
        try:
            assert owner_alive(probe)
        finally:
            os.close(probe)
        # A dead engine's object: its creator was SIGKILLed holding the lock.
        child = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys, time; from kvseal.client.shm import create_owner_locked;"
                "create_owner_locked(sys.argv[1], 4096); print('ok', flush=True); time.sleep(600)",
                f"{prefix}-1-dead",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None and child.stdout.readline().strip() == "ok"
        assert _exists(f"{prefix}-1-dead")
        assert sweep_orphans(prefix) == []  # its creator still lives
        child.kill()
        child.wait()
        assert sweep_orphans(prefix) == [f"{prefix}-1-dead"]
        assert not _exists(f"{prefix}-1-dead")
        assert _exists(mine.name)  # a live owner's name is never swept
    finally:
        mine.unlink()
        os.close(mine.fd)


def test_create_owner_locked_refuses_an_existing_name(prefix: str) -> None:
    a = create_owner_locked(f"{prefix}-x", 4096)
    try:
        with pytest.raises(FileExistsError):
            create_owner_locked(f"{prefix}-x", 4096)
        assert os.stat(a.path).st_mode & 0o777 == 0o600
    finally:
        a.unlink()
        os.close(a.fd)
