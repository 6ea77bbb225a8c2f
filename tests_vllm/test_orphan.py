"""kvseal.vllm.orphan (issue 28, ``kill -9`` of vLLM's API server alone): a
multiprocessing child whose parent is SIGKILLed stops itself, as vLLM's
engine core then must (vLLM 0.32 leaves it and its worker running, with the
KV object and its registrations); a process that multiprocessing did not
start watches nothing. Real processes, real signals, a real owner-locked
shared-memory object (the daemon's rule: unlinked once its lock is free),
and a real ``vllm serve`` whose API server process alone is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from kvseal.client.shm import sweep_orphans

from tests_vllm.daemon import Daemon
from tests_vllm.test_serve_command import (  # served_model: the fixture, reused
    ROOT,
    Served,
    _gone,
    _offloaded,
    _session_alive,
    marked_blocks,
    prompt,
    served_model,  # noqa: F401
)

# The parent: starts a multiprocessing child (spawn, as vLLM starts its engine
# core), prints the child's pid, then waits to be killed.
_PARENT = textwrap.dedent(
    """
    import multiprocessing, sys, time
    sys.path[:0] = {path!r}
    import orphan_child
    if __name__ == "__main__":
        ctx = multiprocessing.get_context("spawn")
        p = ctx.Process(target=orphan_child.run, args=({prefix!r}, {ignore_term!r}))
        p.start()
        print(p.pid, flush=True)
        time.sleep(600)
    """
)
# The child: arms the watcher, holds an owner-locked shared-memory object (as
# the worker does), reports, then runs until stopped.
_CHILD = textwrap.dedent(
    """
    import os, signal, sys, time

    def run(prefix, ignore_term):
        from kvseal.client.shm import create_owner_locked
        from kvseal.vllm.orphan import stop_when_orphaned
        if ignore_term:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        owned = create_owner_locked(f"{prefix}-{os.getpid()}-x", 1 << 16)
        armed = stop_when_orphaned(grace_s=1.0, poll_s=0.05)
        print("ARMED" if armed else "NOT ARMED", owned.name, flush=True)
        while True:
            time.sleep(1)
    """
)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _wait_gone(pid: int, timeout: float) -> bool:
    """Liveness bound, not a timing assertion."""
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize("ignore_term", [False, True], ids=["sigterm", "sigkill-after-grace"])
def test_a_child_whose_parent_is_killed_stops_itself(tmp_path: Path, ignore_term: bool) -> None:
    """SIGKILL of the parent alone: the child (reparented) stops itself, by
    SIGTERM, or by SIGKILL once the grace ran out when it ignores SIGTERM;
    its shared-memory object's owner lock is then free (what the daemon and
    the next engine's sweep unlink by)."""
    (tmp_path / "orphan_child.py").write_text(_CHILD)
    prefix = f"kvseal-test-orphan-{os.getpid()}-{int(ignore_term)}"
    parent = subprocess.Popen(
        [sys.executable, "-c",
         _PARENT.format(path=[str(tmp_path)], prefix=prefix, ignore_term=ignore_term)],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        report = parent.stdout.readline().split()
        assert report[:1] == ["ARMED"], report
        name = report[1]
        assert (Path("/dev/shm") / name).exists()
        assert sweep_orphans(prefix) == []  # its owner lives: nothing to sweep
        parent.kill()
        parent.wait(30)
        assert _wait_gone(child, 60), "the orphaned child is still running"
        assert sweep_orphans(prefix) == [name]  # the lock came free with it
        assert not (Path("/dev/shm") / name).exists()
    finally:
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        sweep_orphans(prefix)


def test_a_process_multiprocessing_did_not_start_watches_nothing() -> None:
    """The API server, a script, this test: their parent's end is not theirs
    to act on (a shell that exits must never stop the server it started)."""
    r = subprocess.run(
        [sys.executable, "-c",
         "from kvseal.vllm.orphan import stop_when_orphaned; print(stop_when_orphaned())"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stdout + r.stderr


def test_kill_9_of_the_api_server_alone_leaves_no_engine_and_no_object(
    served_model: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The documented ``vllm serve``, one request served through kvseal, then
    SIGKILL of the API server process only (not its process group, as
    ``kill -9 PID`` does): vLLM's engine core and worker stop (kvseal's
    watcher in the engine core; vLLM's own death pipe for the worker), the
    KV object goes and the daemon holds no pool of the engine. vLLM 0.32
    alone leaves both running, with the object and both pools, indefinitely."""
    (cmd,) = [c for k, c in marked_blocks(ROOT / "docs" / "vllm.md") if k == "vllm-serve-cpu"]
    daemon = Daemon(tmp_path / "daemon").start()
    served = Served(cmd, served_model, daemon, tmp_path)
    try:
        assert served.complete(prompt(3)).strip(), served.tail()
        stats = _offloaded(daemon, 3)
        assert stats["pools"] == 2, (stats, served.tail())
        names = served.shm_objects()
        assert len(names) == 1, (names, served.tail())
        served.proc.kill()  # the API server process alone
        served.proc.wait(60)
        deadline = time.monotonic() + 120  # a liveness bound, not a timing assertion
        while _session_alive(served.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _session_alive(served.proc.pid), (
            f"vLLM's engine processes outlived their API server:\n{served.tail()}"
        )
        assert _gone(names) == set(), f"left in /dev/shm:\n{served.tail()}"
        deadline = time.monotonic() + 30
        while daemon.stats()["pools"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert daemon.stats()["pools"] == 0
    finally:
        try:  # every process of the engine's session, whatever happened above
            os.killpg(served.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        served.stop()
        daemon.stop()
