"""SIGUSR2 makes the daemon log every thread's stack and keep serving (the soak
sends it when an engine's call has been in flight for long: where is it?)."""

from __future__ import annotations

import signal

from kvseal.client import ClientConfig, KVSealClient

from .conftest import DaemonProc
from .conftest import until as _until


def test_sigusr2_logs_thread_stacks_and_the_daemon_keeps_serving(daemon: DaemonProc) -> None:
    daemon.proc.send_signal(signal.SIGUSR2)
    # The main thread (dumped last, being the current one) waits in Daemon.wait.
    _until(lambda: " in main\n" in daemon.log(), "the stack dump in the daemon log")
    log = daemon.log()
    # Every thread, not only the current one: gRPC's polling thread too.
    assert "most recent call first" in log and " in _serve\n" in log and " in wait\n" in log
    with KVSealClient(ClientConfig(target=daemon.target)) as c:
        assert c.health() == "SERVING"
    assert daemon.proc.poll() is None
