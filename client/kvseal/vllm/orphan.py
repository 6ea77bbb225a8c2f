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

:func:`stop_when_orphaned`, called in each of those processes (at the import
of :mod:`kvseal.vllm.connector`, the first kvseal code vLLM runs there, and by
the spec; vLLM 0.32 gets to either only after the model loaded): a thread
stops this process, the way vLLM stops it, once :func:`orphaned` says its
parent is gone: SIGTERM to itself (vLLM's engine core shuts down and its
workers exit), and SIGKILL if it still lives ``grace_s`` later. Once the
worker is gone its owner lock is free, and the daemon, whose ``HoldPool``
streams ended, unlinks the object (docs/vllm.md, "The shared-memory KV
object").

**What "orphaned" means, and why nothing seen at arm time is trusted.** The
parent is the pid multiprocessing recorded *in the parent* when it made the
``Process`` (``multiprocessing.parent_process().pid``): it names the real
parent however late the watcher is armed. The parent seen by the kernel
(``os.getppid()``) at arm time is not: a parent killed during a long start-up
(model load) has already been replaced by the reaper (pid 1 or a subreaper),
and a watcher that took that reaper for the parent waited for its death
forever. The process is orphaned when the kernel's parent now is neither the
recorded parent nor a process whose parent it is (a ``forkserver`` child's
kernel parent is the fork server, which exits once its own parent is gone).
For ``fork`` and ``spawn`` (what vLLM uses) this is exact: the kernel
reparents a child only when its parent ended. The multiprocessing sentinel
(ready once the parent's end of a pipe closed) only wakes the thread early: it
decides nothing, because a live parent may close its end (a finalized
``Process`` object) and a sibling forked later may keep it open after the
parent's death; the kernel's parent is read every ``poll_s`` as well.
``prctl(PR_SET_PDEATHSIG)`` is not used: it fires when the parent *thread*
that started the child ends (a live server whose starting thread exited would
lose its engine), and, set after the parent's death, it never fires.

A process that Python's multiprocessing did not start (the API server, a
script, a test) watches nothing. A multiprocessing child outlives its parent
only when the parent was killed or ended without its exit handlers (a parent
that exits normally joins or terminates its children first), so a process
stopped here had been abandoned.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time

log = logging.getLogger("kvseal.vllm")

GRACE_S = 30.0  # SIGTERM, then this long before SIGKILL
POLL_S = 1.0  # how often the kernel's parent is re-read

_lock = threading.Lock()
_armed = threading.Event()  # set once this process's watcher runs


def stop_when_orphaned(grace_s: float = GRACE_S, poll_s: float = POLL_S) -> bool:
    """Arm the watcher (module doc) in this process, once: True if it watches
    (this process is a multiprocessing child), False if there is nothing to
    watch. Never blocks; safe to call from any thread, any number of times,
    and at any time: a parent that died before the call is found at once."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        return False
    with _lock:
        if _armed.is_set():
            return True
        _armed.set()
    threading.Thread(
        target=_watch, args=(parent, parent.pid, grace_s, poll_s), name="kvseal-orphan", daemon=True
    ).start()
    return True


def orphaned(parent_pid: int) -> bool:
    """Whether the process that started this one, ``parent_pid`` (as
    multiprocessing recorded it in the parent), is gone: the kernel's parent
    now is neither it nor one of its children (a fork server). Reads only the
    kernel's state now, so it is right whenever it is asked."""
    ppid = os.getppid()
    if ppid == parent_pid:
        return False
    if ppid == 1:  # init took this process over
        return True
    # A fork server's child, or a subreaper's: the fork server's own parent is
    # the recorded one while that lives. Unknown (the server just exited, no
    # /proc) is not orphaned: the next poll reads the new parent.
    grandparent = _parent_of(ppid)
    return grandparent is not None and grandparent != parent_pid


def _parent_of(pid: int) -> int | None:
    """``pid``'s parent from /proc (field 4 of its stat), None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2 :].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _watch(
    parent: multiprocessing.process.BaseProcess, parent_pid: int, grace: float, poll: float
) -> None:
    sentinel: int | None = parent.sentinel
    while not orphaned(parent_pid):
        if sentinel is None:
            time.sleep(poll)
            continue
        try:  # wakes at once when the parent's end closes; decides nothing
            if multiprocessing.connection.wait([sentinel], timeout=poll):
                sentinel = None  # ready for good: poll from now on
        except (OSError, ValueError):  # an unusable sentinel: poll alone
            log.debug("kvseal: the multiprocessing parent's sentinel cannot be waited on")
            sentinel = None
    log.warning(
        "kvseal: this process's parent (pid %d, vLLM's API server or engine core) is gone; "
        "stopping this orphaned process (SIGTERM), which frees the KV cache's "
        "shared-memory object and its registration with the daemon",
        parent_pid,
    )
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace)
    log.warning("kvseal: still running %.0f s after SIGTERM; SIGKILL", grace)
    os.kill(os.getpid(), signal.SIGKILL)
