"""The client's side of the engine contract (README, "Engine contract").

Once an Offload or Restore has returned a failure, the daemon never touches a
page of that request again. The daemon's part: it stops touching the pages at
a *cutoff*, the gRPC deadline less the grace the request declares
(``grace_ms``), and commits nothing after it. This module's part: it gives each
transfer a gRPC deadline of ``timeout + grace`` and decides, from the failure's
*verdict*, when the failure may be returned:

- a failure the daemon reported itself (any status with a ``kvseal-error``
  reason) means the request is over on the daemon: returned at once;
- any other failure (our own deadline, a dropped connection, a closed
  channel) says nothing about what the daemon is still doing: it is *settled*
  first, returned only once the gRPC deadline has passed (the daemon's cutoff
  lies one grace before it) or once the daemon is known to be gone;
- a request that certainly never left this process (``sent`` false) needs no
  settling.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from kvseal.client.errors import KVSealRpcError
from kvseal.client.liveness import daemon_gone
from kvseal.v1 import kvseal_pb2 as pb

T = TypeVar("T")
# How often a settling failure asks whether the daemon is gone.
_POLL_S = 0.01


def run_transfer(
    invoke: Callable[[float], T],
    request: pb.OffloadRequest | pb.RestoreRequest,
    timeout: float,
    grace_s: float,
    target: str,
) -> T:
    """Send ``request`` through ``invoke(grpc_timeout)`` under the engine contract.

    Sets the request's ``grace_ms`` and ``budget_us`` (the daemon's cutoff is
    ``timeout`` from now, as it measures it), calls with a gRPC timeout of
    ``timeout + grace_s`` and returns the reply. A :class:`KVSealRpcError` is
    re-raised at once when it carries the daemon's reason or was never sent,
    otherwise only after :func:`settle`: by then the daemon (at ``target``)
    touches no page of the request."""
    request.grace_ms = round(grace_s * 1000)
    request.budget_us = max(1, int(timeout * 1e6))
    give_up = time.monotonic() + timeout + grace_s
    try:
        return invoke(timeout + grace_s)
    except KVSealRpcError as e:
        if not e.reason and e.sent:
            settle(give_up, target)
        raise


def settle(give_up: float, target: str) -> None:
    """Wait until ``give_up`` (monotonic) or until the daemon at ``target`` is
    known to be gone (its lock on ``<socket>.lock`` released by the kernel: it
    can touch no page any more; never known for TCP targets, which wait out
    the deadline)."""
    while True:
        left = give_up - time.monotonic()
        if left <= 0 or daemon_gone(target):
            return
        time.sleep(min(left, _POLL_S))
