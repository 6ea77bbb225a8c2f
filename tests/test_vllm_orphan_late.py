"""kvseal.vllm.orphan when vLLM's parent dies *before* the watcher is armed
(``kill -9`` of the API server during a long start-up: vLLM builds the
connector and the spec only after the engine core started, the spec after the
model loaded). The watcher must not take the reaper the kernel handed the
process to for its parent. Real processes (fork, spawn and forkserver
children), real signals and a real owner-locked shared-memory object; the
watcher imports no vLLM, so this runs in the main venv."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kvseal.client.shm import sweep_orphans

# The parent: starts one multiprocessing child with the given start method,
# prints the child's pid, then waits to be killed.
_PARENT = textwrap.dedent(
    """
    import multiprocessing, sys, time
    sys.path[:0] = {path!r}
    import late_child
    if __name__ == "__main__":
        ctx = multiprocessing.get_context({method!r})
        p = ctx.Process(target=late_child.{target}, args=({prefix!r}, {go!r}))
        p.start()
        print(p.pid, flush=True)
        time.sleep(600)
    """
)
# The child: holds an owner-locked shared-memory object (as vLLM's worker
# does) and arms the watcher only once the test created the file ``go``
# (after it killed the parent), as an engine core still loading its model
# would.
_CHILD = textwrap.dedent(
    """
    import os, time

    def run(prefix, go):
        from kvseal.client.shm import create_owner_locked
        from kvseal.vllm.orphan import stop_when_orphaned
        owned = create_owner_locked(f"{prefix}-{os.getpid()}-x", 1 << 16)
        print("READY", owned.name, flush=True)
        while not os.path.exists(go):
            time.sleep(0.05)
        armed = stop_when_orphaned(grace_s=1.0, poll_s=0.05)
        print("ARMED" if armed else "NOT ARMED", flush=True)
        while True:
            time.sleep(1)

    def ask(prefix, go):
        import multiprocessing
        from kvseal.vllm.orphan import orphaned
        print("READY", orphaned(multiprocessing.parent_process().pid), flush=True)
    """
)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def _wait(cond: Callable[[], bool], timeout: float) -> bool:
    """Liveness bound, not a timing assertion."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _sweep(prefix: str, timeout: float) -> list[str]:
    """``sweep_orphans(prefix)`` until it removed something (or ``timeout``)."""
    swept: list[str] = []
    _wait(lambda: bool(swept.extend(sweep_orphans(prefix)) or swept), timeout)
    return swept


class _Parent:
    """The parent script with its child; stdout read on a thread so that no
    read blocks the test past a liveness bound."""

    def __init__(self, tmp_path: Path, method: str, target: str, prefix: str) -> None:
        (tmp_path / "late_child.py").write_text(_CHILD)
        self.go = tmp_path / "go"
        code = _PARENT.format(
            path=[str(tmp_path)], method=method, target=target, prefix=prefix, go=str(self.go)
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.child = int(self.line())

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def line(self) -> str:
        return self._lines.get(timeout=60)

    def close(self) -> None:
        if self.child and _alive(self.child):
            os.kill(self.child, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def parents() -> Iterator[list[_Parent]]:
    made: list[_Parent] = []
    yield made
    for p in made:
        p.close()


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_a_parent_killed_before_the_watcher_is_armed_still_stops_the_child(
    tmp_path: Path, method: str, parents: list[_Parent]
) -> None:
    """The parent is SIGKILLed and reaped, the child reparented, and only then
    is the watcher armed: the child stops itself and its object's owner lock
    comes free. The old watcher took the reaper for the parent and waited
    for the reaper's death: the child ran on for good."""
    prefix = f"kvseal-test-orphan-late-{os.getpid()}-{method}"
    try:
        p = _Parent(tmp_path, method, "run", prefix)
        parents.append(p)
        ready = p.line().split()
        assert ready[:1] == ["READY"], ready
        name = ready[1]
        assert (Path("/dev/shm") / name).exists()
        assert sweep_orphans(prefix) == []  # its owner lives: nothing to sweep
        p.proc.kill()
        p.proc.wait(30)
        # For fork and spawn: the kernel handed the child to a reaper (a fork
        # server's child: the server exits once its parent is gone).
        assert _wait(lambda: _ppid(p.child) != p.proc.pid, 30)
        p.go.touch()  # only now is the watcher armed
        assert p.line().strip() == "ARMED"
        assert _wait(lambda: not _alive(p.child), 60), "the orphaned child is still running"
        # The lock comes free with it (its last thread gone: a leader exits
        # before its other threads, so /proc shows it dead a little earlier).
        assert _sweep(prefix, 30) == [name]
        assert not (Path("/dev/shm") / name).exists()
    finally:
        for q in parents:
            q.close()
        _sweep(prefix, 10)


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_a_child_of_a_live_parent_is_not_orphaned(
    tmp_path: Path, method: str, parents: list[_Parent]
) -> None:
    """Whatever the start method (a forkserver child's kernel parent is the
    fork server, not the process that started it), a live parent's child is
    not taken as orphaned."""
    p = _Parent(tmp_path, method, "ask", "unused")
    parents.append(p)
    assert p.line().split() == ["READY", "False"]
