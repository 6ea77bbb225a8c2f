"""``kvseal-server``: the daemon's entry point. Its pieces live in ``daemon/``
(command line, process hardening, socket access, serving and shutdown).

Lifecycle: harden the process (no core dumps, not ptrace-able) -> cipher
self-test -> pick the backend -> create the host region -> bind -> health
SERVING -> systemd READY=1 -> ... SIGTERM -> health NOT_SERVING -> drain
in-flight RPCs for ``grace`` seconds -> exit 0. After an integrity failure
under ``--on-integrity-failure abort`` the same shutdown runs and the exit
status is 3 (EXIT_INTEGRITY). When the backend becomes unusable (the CUDA
context was lost: every later transfer would fail) the same shutdown runs and
the exit status is 4 (EXIT_BACKEND), so that the supervisor restarts it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

from kvseal.server.daemon.cli import config_from_args
from kvseal.server.daemon.daemon import Daemon
from kvseal.server.daemon.process import harden_process, setup_logging

log = logging.getLogger("kvseal")
EXIT_CONFIG = 2
EXIT_WATCHDOG_S = 3.0


def _exit_watchdog(code: int, after_s: float) -> None:
    """Everything is released once the daemon logged that it stopped; what is
    left is the interpreter's exit, which joins every non-daemon thread (gRPC's
    handler executor among them: concurrent.futures joins its workers at exit).
    A thread that lingers there must not keep a stopped daemon alive (its
    supervisor would SIGKILL it, and the exit status would be lost): if the
    process still runs ``after_s`` seconds later, log every thread's stack (to
    say which) and leave with ``code``."""

    def expire() -> None:
        time.sleep(after_s)
        log.error("still running %.1f s after it stopped; thread stacks follow", after_s)
        for h in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                h.flush()
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        logging.shutdown()
        os._exit(code)

    threading.Thread(target=expire, name="kvseal-exit-watchdog", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = config_from_args(argv)
    except ValueError as e:
        print(f"kvseal-server: {e}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(cfg)
    harden_process()
    try:
        daemon = Daemon.create(cfg)
    except SystemExit as e:  # start-up refusals carry their one-line message
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return EXIT_CONFIG
        raise
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.begin_shutdown())
    # On demand, every thread's stack to the log (stderr): where a slow request
    # sits, without stopping the daemon (`kill -USR2 <pid>`; the soak sends it
    # when an engine's call has been in flight for long). Stacks carry no data.
    faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True)
    daemon.start()
    code = daemon.wait()
    _exit_watchdog(code, EXIT_WATCHDOG_S)  # the process's own entry point: exit it
    return code


if __name__ == "__main__":
    sys.exit(main())
