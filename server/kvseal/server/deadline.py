"""When a request must stop touching the engine's pages.

The engine contract (``kvseal.proto``, README "Engine contract"): once a call
has returned any failure to the engine, the daemon never reads or writes a
page of that request again and never publishes anything it read for it. An
engine frees a failed transfer's pages at once, so a late write would corrupt
another request's KV and a late read could seal another request's bytes under
this request's hashes (cache poisoning).

The daemon's half of that contract lives here. A request's *cutoff* is its
gRPC deadline minus the ``grace_ms`` the client declared (or, if earlier, the
client's own timeout ``budget_us`` after the request started): the client does not
report a failure of its own (local deadline, lost connection) before the gRPC
deadline, so every page touch that starts before the cutoff ends before the
client can give up, as long as one touch (one block) and the request's transit
take less than the grace. Backends call :meth:`Deadline.check` before every
block they read from or write to a pool, and before a store is published, and
keep each touch bounded (one block).

Some steps must not be cut in half: a restore writes either all of its verified
blocks or none, and an offload publishes all its sealed blocks or none. Those
*commit* steps start only before the cutoff and then run on until ``commit_by``
(the cutoff plus half the grace): a commit that began in time finishes before
the client gives up, and one that overran it (the daemon was starved for half
a second) stops at the next block, so nothing is written after the client saw
its failure.

A deadline is also cancelled when the RPC ends early (the client cancelled or
its connection dropped): the daemon then stops at the next check instead of
running to the cutoff; the client still waits for the cutoff or for the daemon
to be gone, so the contract does not depend on how fast cancellation travels.
"""

from __future__ import annotations

import threading
import time

from kvseal.server.errors import DeadlinePassed, RequestCancelled, ShuttingDown

# Upper bound the daemon accepts for a client's grace: a larger one would
# let a client make the daemon give up long before the deadline it was sent.
MAX_GRACE_MS = 60_000


class Deadline:
    """A request's cutoff on ``time.monotonic()`` (``None``: no cutoff), an
    event set when the RPC ends early, and the backend's stop flag.

    Thread-safe: backends check it from their worker threads.
    """

    __slots__ = ("cancelled", "commit_by", "cutoff", "stopping")

    def __init__(
        self,
        cutoff: float | None = None,
        cancelled: threading.Event | None = None,
        stopping: threading.Event | None = None,
        commit_by: float | None = None,
    ) -> None:
        self.cutoff = cutoff
        self.commit_by = cutoff if commit_by is None else commit_by
        self.cancelled = cancelled
        self.stopping = stopping

    @classmethod
    def after(cls, seconds: float, grace: float = 0.0) -> Deadline:
        """A cutoff ``seconds`` from now (tests and in-process callers)."""
        cutoff = time.monotonic() + seconds
        return cls(cutoff, commit_by=cutoff + grace / 2)

    @classmethod
    def for_rpc(
        cls,
        time_remaining: float | None,
        grace_s: float,
        cancelled: threading.Event | None,
        stopping: threading.Event | None,
        budget_s: float = 0.0,
    ) -> Deadline:
        """The deadline of an RPC with ``time_remaining`` seconds left on its
        gRPC deadline (None or huge: none) whose client declared ``grace_s``
        and, optionally, its own timeout ``budget_s`` (0: none).

        Each bound errs late, in a different way: gRPC rounds the deadline it
        transmits up (~0.1 s at 30 s), and the budget counts from when the
        handler started, not from when the request arrived. The earlier wins.
        """
        now = time.monotonic()
        ends: list[float] = []
        if time_remaining is not None and time_remaining < 1e7:
            ends.append(now + time_remaining - grace_s)
        if budget_s > 0:
            ends.append(now + budget_s)
        if not ends:
            return cls(None, cancelled, stopping)
        cutoff = min(ends)
        return cls(cutoff, cancelled, stopping, commit_by=cutoff + grace_s / 2)

    def remaining(self) -> float | None:
        """Seconds left before the cutoff (negative once passed), or None."""
        return None if self.cutoff is None else self.cutoff - time.monotonic()

    def expired(self) -> bool:
        return self.cutoff is not None and time.monotonic() >= self.cutoff

    def check(self, what: str = "the next page") -> None:
        """Raise unless the request may still touch ``what`` now.

        DeadlinePassed after the cutoff, RequestCancelled once the RPC is
        over, ShuttingDown once the daemon stops serving. The caller must not
        touch a page after this raises, and must treat the request as failed.
        """
        if self.cutoff is not None and time.monotonic() >= self.cutoff:
            raise DeadlinePassed(
                f"the request's deadline passed before {what} was touched; "
                "no page was read or written after it"
            )
        self._check_live()

    def check_commit(self, what: str) -> None:
        """Like :meth:`check`, against ``commit_by``: called inside a commit
        step (see the module docstring) that began before the cutoff."""
        if self.commit_by is not None and time.monotonic() >= self.commit_by:
            raise DeadlinePassed(
                f"the request's deadline passed while {what}; it was stopped before the "
                "client could see the failure, and nothing was touched after it"
            )
        self._check_live()

    def _check_live(self) -> None:
        if self.cancelled is not None and self.cancelled.is_set():
            raise RequestCancelled("the call was cancelled; no page was read or written after it")
        if self.stopping is not None and self.stopping.is_set():
            raise ShuttingDown("kvseal stopped serving; no page was touched after that")


NO_DEADLINE = Deadline()
