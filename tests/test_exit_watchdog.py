"""A stopped daemon exits even when a non-daemon thread lingers at interpreter
exit (e.g. a gRPC handler worker that concurrent.futures joins): the exit
watchdog of ``kvseal.server.main`` logs every thread's stack and leaves with the
daemon's own exit status."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging, threading, sys
from kvseal.server import main as m
logging.basicConfig(level=logging.INFO)
threading.Thread(target=threading.Event().wait, name="lingering-worker").start()
m._exit_watchdog(3, 0.2)
sys.exit(3)
"""


def test_lingering_thread_does_not_keep_a_stopped_daemon_alive() -> None:
    # Without the watchdog this process never exits (the non-daemon thread is
    # joined forever); the timeout is a hang guard, not a latency claim.
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr
    assert "still running" in r.stderr and "thread stacks follow" in r.stderr
    assert "lingering" in r.stderr or "Thread 0x" in r.stderr, r.stderr
