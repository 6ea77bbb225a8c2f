"""Stopping a vLLM process whose parent was killed (issue 28: ``kill -9`` of
the API server process alone).

vLLM 0.32 starts its engine core as a multiprocessing child of the API server
(or of the script that made an ``LLM``) and its workers as multiprocessing
children of the engine core. A worker exits when the engine core dies (vLLM's
death pipe), but nothing in vLLM notices the API server's death: after
``kill -9`` of the API server alone, the engine core (reparented) and its
worker run on indefinitely (watched for 90 s here), with the KV cache's
shared-memory object (tens of GiB in production) and both pools registered
with the daemon. Such an engine never serves again: its only client is gone.

:func:`stop_when_orphaned`, called once in each of those processes: a thread
waits for the parent's end (the sentinel Python's multiprocessing gives
every child: ready once the parent's end of it closes) and for the kernel to
have reparented this process (so a parent that only closed its handle is not
taken for dead), then stops this process the way vLLM stops it: SIGTERM to
itself (vLLM's engine core shuts down and its workers exit), and SIGKILL if
it still lives ``grace_s`` later. Once the worker is gone its owner lock is
free, and the daemon, whose ``HoldPool`` streams ended, unlinks the object
(docs/vllm.md, "The shared-memory KV object").

A process that Python's multiprocessing did not start (the API server, a
script, a test) watches nothing. A multiprocessing child outlives its parent
only when the parent was killed or ended without its exit handlers (a parent
that exits normally joins or terminates its children first), so a process
stopped here had been abandoned.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time

log = logging.getLogger("kvseal.vllm")

GRACE_S = 30.0  # SIGTERM, then this long before SIGKILL
POLL_S = 1.0  # how often the parent pid is re-read once the sentinel fired

_lock = threading.Lock()
_armed = threading.Event()  # set once this process's watcher runs


def stop_when_orphaned(grace_s: float = GRACE_S, poll_s: float = POLL_S) -> bool:
    """Arm the watcher (module doc) in this process, once: True if it watches
    (this process is a multiprocessing child), False if there is nothing to
    watch. Never blocks; safe to call from any thread, any number of times."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return False
    with _lock:
        if _armed.is_set():
            return True
        _armed.set()
    ppid = os.getppid()  # the kernel's parent now (a fork server's child: the server)
    threading.Thread(
        target=_watch, args=(parent, ppid, grace_s, poll_s), name="kvseal-orphan", daemon=True
    ).start()
    return True


def _watch(
    parent: multiprocessing.process.BaseProcess, ppid: int, grace: float, poll: float
) -> None:
    try:
        parent.join()  # returns once the parent's end of the sentinel closed
    except Exception:  # an unusable sentinel: the parent pid alone decides
        log.debug("kvseal: the multiprocessing parent's sentinel cannot be waited on")
    while os.getppid() == ppid:  # not reparented: the parent lives (or only closed it)
        time.sleep(poll)
    log.warning(
        "kvseal: this process's parent (pid %d, vLLM's API server or engine core) is gone; "
        "stopping this orphaned process (SIGTERM), which frees the KV cache's "
        "shared-memory object and its registration with the daemon",
        parent.pid or ppid,
    )
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace)
    log.warning("kvseal: still running %.0f s after SIGTERM; SIGKILL", grace)
    os.kill(os.getpid(), signal.SIGKILL)
