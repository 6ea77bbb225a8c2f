"""The daemon's own threads: named where the kernel shows them, and started
up front, so that how many there are follows from the configuration alone.

Why: a thread pool that starts threads on demand and never ends them (as
``concurrent.futures.ThreadPoolExecutor`` does) grows to the highest
concurrency it has ever seen, so the daemon's thread count said nothing
about leaks (the soak saw it wander between 20 and 28). :class:`FixedPool`
starts every worker when it is made; :func:`name_os_thread` gives each of
kvseal's threads its name in ``/proc/<pid>/task/<tid>/comm`` (the kernel's
15-byte name, which ``top -H``, ``ps -L`` and the soak read), so every thread
of a running daemon is accounted for (docs/testing.md, "soak").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("kvseal.threads")
_PR_SET_NAME = 15
OS_NAME_MAX = 15  # bytes of a thread name the kernel keeps (TASK_COMM_LEN - 1)
_libc: ctypes.CDLL | None = None


def name_os_thread(name: str) -> None:
    """Name the calling thread ``name`` (cut to 15 bytes) for the kernel.
    Best effort: a platform without ``prctl`` keeps the inherited name."""
    global _libc  # noqa: PLW0603 - one handle for the process
    try:
        if _libc is None:
            _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.prctl(_PR_SET_NAME, name.encode("ascii", "replace")[:OS_NAME_MAX], 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        log.debug("cannot name thread %s", name)


class FixedPool(ThreadPoolExecutor):
    """A :class:`ThreadPoolExecutor` whose ``size`` workers all exist once the
    constructor returns, each named ``name`` for the kernel; none ever ends
    before :meth:`shutdown`. So the pool holds exactly ``size`` threads for
    its whole life, whatever the load (a queued task still waits for a free
    worker, as in any executor of this size).

    How the workers are started uses only the executor's public behaviour: it
    starts a new worker for a submitted task while no worker is idle, so
    ``size`` tasks that each wait until all ``size`` are running need ``size``
    workers."""

    def __init__(self, size: int, name: str) -> None:
        if size < 1:
            raise ValueError("a pool needs at least one thread")
        super().__init__(
            size, thread_name_prefix=name, initializer=name_os_thread, initargs=(name,)
        )
        self.size = size
        self.name = name
        started = threading.Barrier(size)
        for f in [self.submit(started.wait, 60.0) for _ in range(size)]:
            f.result()  # BrokenBarrierError if a worker could not start in time
