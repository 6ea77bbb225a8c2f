"""The daemon's owner-lock probe never takes a passing lock for an engine's.

When the CPU backend opens a pool's shared-memory object it asks whether some
other open file description holds a flock on it: an engine's owner lock
(``create_owner_locked``) marks an object whose name the daemon unlinks once
that engine is gone. The probe itself is a momentary exclusive flock, and so
is the orphan test at a pool's close and an engine's ``sweep_orphans``. A
plain object (no owner lock; SGLang's pools, the fuzzer's) probed while such a
momentary lock was held used to be taken for owner-locked, and its live name
was unlinked when that pool closed: every later registration of it failed
with HANDLE_UNUSABLE. ``make fuzz`` met it (four client threads registering
pools over one object at once).

Real objects in /dev/shm, real flocks, real threads and a real second
process; the daemon's ``CpuMappedPool`` as the CPU backend uses it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from kvseal.client.shm import SHM_DIR, KVShape, SharedKVPool
from kvseal.server import convert
from kvseal.server.backends.cpu import shmpool
from kvseal.server.backends.cpu.shmpool import CpuMappedPool
from kvseal.server.pools import PoolSpec
from kvseal.v1 import kvseal_pb2 as pb


@pytest.fixture
def plain() -> Iterator[SharedKVPool]:
    """A pool of plain objects (no owner lock), as the fuzzer and SGLang make."""
    pool = SharedKVPool(
        KVShape(4, tokens_per_page=4, num_layers=2, num_kv_heads=2, head_dim=16),
        "vllm_per_layer",
        name_prefix="kvseal-probe",
    )
    yield pool
    pool.close()


def _spec(pool: SharedKVPool, name: str) -> PoolSpec:
    req = pb.RegisterPoolRequest(name=name, model_fingerprint=b"m", geometry=pool.geometry())
    return convert.pool_spec(req, "cpu")


def _names(pool: SharedKVPool) -> list[str]:
    return [b.name for b in pool.buffers]


def test_pools_opened_and_closed_together_keep_a_plain_objects_name(
    plain: SharedKVPool,
) -> None:
    """Eight threads open and close pools over the same plain objects, as the
    fuzzer's clients register and unregister them: no name is unlinked."""
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def churn(t: int) -> None:
        try:
            start.wait()
            for i in range(400):
                CpuMappedPool(_spec(plain, f"p{t}-{i}")).close()
        except BaseException as e:  # a vanished name fails the open: HandleUnusable
            errors.append(e)

    threads = [threading.Thread(target=churn, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    gone = [n for n in _names(plain) if not os.path.exists(os.path.join(SHM_DIR, n))]
    assert not gone, f"live plain objects unlinked by the daemon's probe: {gone}"
    assert not errors, errors[:3]


# Holds an exclusive flock on an object for a moment, as an engine's
# sweep_orphans does while it looks at an object (argv: path, seconds).
PROBER = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.readline()
time.sleep(float(sys.argv[2]))
fcntl.flock(fd, fcntl.LOCK_UN)
print("released", flush=True)
sys.stdin.readline()
"""


def _locked(name: str, hold_s: str) -> subprocess.Popen[str]:
    """A second process holding an exclusive flock on ``name`` (PROBER):
    returns once it holds it."""
    p = subprocess.Popen(
        [sys.executable, "-c", PROBER, os.path.join(SHM_DIR, name), hold_s],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "locked"
    return p


def test_another_processs_passing_probe_is_not_an_owner_lock(
    plain: SharedKVPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain object opened while another process's momentary probe holds
    it is not owner-locked once that probe has passed, so closing the pool
    leaves its name. (The recheck waits long enough here for a loaded
    machine; the daemon's default is a few milliseconds.)"""
    monkeypatch.setattr(shmpool, "_PROBE_RECHECK_S", 2.0, raising=False)
    name = _names(plain)[0]
    p = _locked(name, "0.05")
    try:
        assert p.stdout is not None and p.stdin is not None
        p.stdin.write("go\n")  # release 50 ms from now, during the daemon's recheck
        p.stdin.flush()
        mapped = CpuMappedPool(_spec(plain, "probed"))
        assert p.stdout.readline().strip() == "released"
        mapped.close()
        assert os.path.exists(os.path.join(SHM_DIR, name)), "a live plain object was unlinked"
    finally:
        p.kill()
        p.wait()


def test_an_owner_lock_held_throughout_still_counts(
    plain: SharedKVPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recheck does not lose a real owner lock: an object locked by a
    process that keeps its lock is owner-locked, and once that process has
    gone the daemon's close unlinks its name (the engine-is-gone rule)."""
    monkeypatch.setattr(shmpool, "_PROBE_RECHECK_S", 0.05, raising=False)
    name = _names(plain)[0]
    p = _locked(name, "0")
    try:
        mapped = CpuMappedPool(_spec(plain, "owned"))
    finally:
        p.kill()
        p.wait()
    mapped.close()  # the lock's holder is gone: its name goes
    assert not os.path.exists(os.path.join(SHM_DIR, name))
