"""One daemon per socket and per host region (kvseal.server.locks), and the
client's liveness probe of the socket lock (kvseal.client.liveness).

Real daemon processes throughout: a second daemon on the same socket or the
same region must exit 2 with one line naming the holder, and leave the first
one serving with its ciphertext intact; a kill -9 leaves no lock behind."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from kvseal.client import chain_block_hashes, tenant_digest
from kvseal.client.liveness import daemon_gone
from kvseal.client.shm import SharedKVPool

from .conftest import DaemonProc, fill_random, poison, start_daemon

FP = b"model:single-instance"


def _second(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvseal.server", "--backend", "cpu", "--host-bytes", "64MiB", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _store(d: DaemonProc, pool: SharedKVPool) -> tuple[str, list[bytes], dict[int, bytes]]:
    data = fill_random(pool, [0, 1])
    hashes = chain_block_hashes(list(os.urandom(2 * pool.shape.tokens_per_page)), 4)
    with d.client() as c:
        h = c.register_pool("e", FP, pool.geometry())
        assert c.offload(h.pool_id, tenant_digest(None), hashes, [0, 1]).stored_blocks == 2
    return h.pool_id, hashes, data


def _restores(d: DaemonProc, pool: SharedKVPool, pool_id: str, hashes: list[bytes]) -> list[bytes]:
    poison(pool, [2, 3])
    with d.client() as c:
        assert c.restore(pool_id, tenant_digest(None), hashes, [2, 3]).restored_blocks == 2
    return [pool.read_block(2), pool.read_block(3)]


def test_second_daemon_on_the_same_socket_is_refused(
    daemon_factory: Callable[..., DaemonProc], pool_factory: Callable[..., SharedKVPool]
) -> None:
    d = daemon_factory()
    pool = pool_factory(num_pages=4)
    pool_id, hashes, data = _store(d, pool)
    before = os.stat(d.socket)
    dir_mode = os.stat(os.path.dirname(d.socket)).st_mode
    # Another allow list would open the directory: refused first, it changes nothing.
    r = _second("--listen", d.target, "--allow-uid", "4242")
    assert r.returncode == 2, r.stderr
    assert os.stat(os.path.dirname(d.socket)).st_mode == dir_mode
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert f"pid={d.proc.pid}" in lines[0] and d.socket in lines[0]
    # The live socket was neither unlinked nor replaced, and the first daemon serves on.
    after = os.stat(d.socket)
    assert (after.st_dev, after.st_ino) == (before.st_dev, before.st_ino)
    assert d.proc.poll() is None
    assert _restores(d, pool, pool_id, hashes) == [data[0], data[1]]


def test_second_daemon_on_the_same_region_is_refused(
    daemon_factory: Callable[..., DaemonProc],
    pool_factory: Callable[..., SharedKVPool],
    tmp_path: Path,
) -> None:
    d = daemon_factory(region=True)
    assert d.region is not None
    pool = pool_factory(num_pages=4)
    pool_id, hashes, data = _store(d, pool)
    size = d.region.stat().st_size
    other = tmp_path / "other" / "kvseal.sock"
    r = _second("--listen", f"unix://{other}", "--host-region", str(d.region))
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and str(d.region) in lines[0], r.stderr
    if os.geteuid() == 0:  # /proc/<pid>/fd of a non-dumpable daemon: root only
        assert f"pid {d.proc.pid}" in lines[0], lines[0]
    # Not truncated: the first daemon's ciphertext still restores (no DATA_LOSS).
    assert d.region.stat().st_size == size
    assert not other.exists()
    assert _restores(d, pool, pool_id, hashes) == [data[0], data[1]]


def test_lock_file_convention_and_liveness_probe(daemon_factory: Callable[..., DaemonProc]) -> None:
    d = daemon_factory()
    lock = Path(d.socket + ".lock")
    st = lock.stat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644
    assert lock.read_text().startswith(f"pid={d.proc.pid} started=")
    assert daemon_gone(d.socket) is False  # held by a live daemon
    assert daemon_gone(d.target) is False
    # Probing never takes the lock: the daemon still holds it, and a second one is refused.
    assert _second("--listen", d.target).returncode == 2
    os.kill(d.proc.pid, signal.SIGKILL)
    d.proc.wait(timeout=15)
    assert daemon_gone(d.socket) is True  # the kernel dropped the lock with the process
    assert daemon_gone(d.target) is True


def test_liveness_probe_cannot_tell(tmp_path: Path) -> None:
    assert daemon_gone(str(tmp_path / "missing.sock")) is False  # no lock file
    assert daemon_gone("tcp://127.0.0.1:1") is False
    assert daemon_gone("") is False
    (tmp_path / "dir.sock.lock").mkdir()
    assert daemon_gone(str(tmp_path / "dir.sock")) is False  # not a lock file at all


def test_restart_after_kill_9_is_not_blocked(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "d", region=True)
    try:
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait(timeout=15)
        assert os.path.exists(d.socket)  # a stale socket and lock file stay behind
        assert daemon_gone(d.socket)
        again = start_daemon(tmp_path / "d", region=True)  # same socket, same region
        try:
            with again.client() as c:
                assert c.health() == "SERVING"
            assert not daemon_gone(again.socket)
            assert Path(again.socket + ".lock").read_text().startswith(f"pid={again.proc.pid} ")
        finally:
            assert again.stop() == 0
    finally:
        d.stop()
