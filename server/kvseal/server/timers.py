"""One thread for the daemon's delayed callbacks.

``threading.Timer`` costs a thread per pending callback: the RegisterPool
expiry (``kvseal-hold-within-ms``, 30 s by default) made the daemon's thread
count follow the registration rate (an engine that re-registers every few
seconds kept several timer threads alive at once). :class:`Deferred` runs every
callback on one daemon thread instead, in due order, started with it (so the
daemon's thread count does not depend on whether a registration came yet).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvseal.server.threads import name_os_thread

log = logging.getLogger("kvseal.timers")


class Deferred:
    """Run callbacks after a delay, all on one thread.

    Contract: :meth:`call_later` never blocks on a callback and never starts a
    thread per call; a callback runs once, no earlier than its delay, on the
    ``name`` thread (started by the constructor and named ``name`` for the
    kernel too, ``kvseal.server.threads``; a daemon thread: a pending callback
    never keeps the process alive; it ends at :meth:`close`). Callbacks run one after another, so
    each must be short (the expiry only takes the pool registry's lock). An
    exception in a callback is logged and does not stop the thread. After
    :meth:`close` pending callbacks are dropped and new ones are ignored.
    """

    def __init__(self, name: str = "kvseal-deferred") -> None:
        self._name = name
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()  # ties: first scheduled, first run
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call_later(self, delay_s: float, fn: Callable[..., Any], *args: Any) -> None:
        with self._cv:
            if self._closed:
                return
            due = time.monotonic() + max(0.0, delay_s)
            heapq.heappush(self._heap, (due, next(self._seq), fn, args))
            self._cv.notify()

    def pending(self) -> int:
        with self._cv:
            return len(self._heap)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._heap.clear()
            self._cv.notify()

    def _run(self) -> None:
        name_os_thread(self._name)
        while True:
            with self._cv:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cv.wait(timeout)
                if self._closed:
                    return
                _, _, fn, args = heapq.heappop(self._heap)
            try:
                fn(*args)
            except Exception:
                log.exception("deferred callback %r failed", fn)
