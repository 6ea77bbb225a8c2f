"""A registration whose engine dies before it can hold it (found by ``make chaos``).

``EnginePool`` registers, then opens its HoldPool; an engine SIGKILLed between the
two left the pool registered, with the daemon holding the dead engine's memory
(an fd per shm object here, the CUDA IPC mapping on a GPU) until the name was
registered again. Now the client announces the hold (``hold_within_s``) and the
daemon drops a registration that no hold ever reached within that time.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from kvseal.client.shm import SharedKVPool

from .conftest import DaemonProc
from .test_pool_hold import _holds, _pools, _until

FP = b"model:unheld"

ENGINE = """
import os, signal, sys
from kvseal.client import ClientConfig, KVSealClient
from kvseal.client.shm import KVShape, SharedKVPool
shape = KVShape(num_pages=4, dtype="bfloat16", tokens_per_page=4, num_layers=2,
                num_kv_heads=2, head_dim=16)
pool = SharedKVPool(shape, "vllm_per_layer", name_prefix="kvseal-test")
c = KVSealClient(ClientConfig(target=sys.argv[1]))
h = c.register_pool("engine", b"model:unheld", pool.geometry(), hold_within_s=1.0)
print(h.pool_id, *[b.name for b in pool.buffers], flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # dies before its HoldPool, leaving its shm behind
"""


def test_engine_killed_before_its_hold_is_unregistered(daemon: DaemonProc) -> None:
    engine = subprocess.run(
        [sys.executable, "-c", ENGINE, daemon.target], capture_output=True, text=True, timeout=60
    )
    pool_id, *names = engine.stdout.split()
    try:
        assert engine.returncode == -9 and names, engine.stderr
        _until(lambda: _pools(daemon) == 0, "the unheld registration to expire")
        _until(
            lambda: not any(f"/dev/shm/{n}" in _holds(daemon.proc.pid) for n in names),
            "the daemon to release the dead engine's memory",
        )
        assert f"unregistered pool {pool_id}: not held within 1.0 s" in daemon.log()
    finally:
        for n in names:
            Path(f"/dev/shm/{n}").unlink(missing_ok=True)


def test_a_held_registration_does_not_expire(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    pool = pool_factory(num_pages=2)
    with daemon.client() as c:
        h = c.register_pool("a", FP, pool.geometry(), hold_within_s=0.2)
        hold = c.hold_pool(h.pool_id)
        plain = c.register_pool("b", FP, pool.geometry())  # no hold announced: no expiry
        time.sleep(1.0)  # well past the announced 0.2 s: an expiry would have run
        assert hold.active and c.stats().pools == 2
        assert c.lookup(h.pool_id, b"\0" * 32, [b"\1" * 32]).hit_blocks == 0
        assert c.lookup(plain.pool_id, b"\0" * 32, [b"\1" * 32]).hit_blocks == 0
        hold.close()
    assert "not held within" not in daemon.log()


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_pending_expiries_share_one_thread(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    """Each registration that announced a hold used to start a ``threading.Timer``
    (a thread for its whole ``hold_within``): the daemon's thread count followed
    the registration rate (the soak's "thread count flat" check). Now every
    pending expiry waits on one thread."""
    from kvseal.client import ClientConfig, KVSealClient

    n = 12
    pools = [pool_factory(num_pages=2) for _ in range(n)]
    with KVSealClient(ClientConfig(target=daemon.target)) as c:
        c.stats()  # the connection and a handler thread exist before the baseline
        before = _threads(daemon.proc.pid)
        ids = [
            c.register_pool(f"unheld-{i}", FP, p.geometry(), hold_within_s=600).pool_id
            for i, p in enumerate(pools)
        ]
        after = _threads(daemon.proc.pid)
        # One expiry thread, plus gRPC's executor growing by a thread or two.
        assert after - before <= 3, (before, after)
        assert _pools(daemon) == n  # none expired: 600 s to go
        for pid in ids:
            c.unregister_pool(pid)
