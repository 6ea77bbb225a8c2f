"""Tying a pool's registration to this process: :class:`PoolHold`, one open
``HoldPool`` stream per registration, owned by a background thread."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from kvseal.client.errors import KVSealRpcError
from kvseal.v1 import kvseal_pb2 as pb

log = logging.getLogger("kvseal.client")


class PoolHold:
    """Keeps a HoldPool stream open: the daemon keeps the pool registered while it
    is open, and unregisters it (releasing its mappings of the engine's memory)
    once it closes, which also happens when this process exits or dies.

    A background thread owns the stream; nothing here blocks the caller. With
    ``retry``, refusals that may pass (RESOURCE_EXHAUSTED: --max-holds reached;
    a daemon too busy to answer) are retried with back-off. The hold is over
    (``ended`` set, ``on_lost(self)`` called unless :meth:`close` ended it) when
    the pool is gone (unregistered, replaced: the stream ends; NOT_FOUND), the
    daemon went away or is stopping (UNAVAILABLE: a restarted daemon has no pool;
    a daemon that saw this connection drop has unregistered it), or the daemon has
    no HoldPool (UNIMPLEMENTED); ``error`` says which. Thread-safe; :meth:`close`
    is idempotent."""

    _FINAL = (
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INVALID_ARGUMENT,
    )

    def __init__(
        self,
        stub: Any,
        pool_id: str,
        *,
        retry: bool = False,
        on_lost: Callable[[PoolHold], None] | None = None,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 10.0,
        start: bool = True,
    ) -> None:
        self.pool_id = pool_id
        self.retry = retry
        self.established = threading.Event()  # the daemon confirmed a hold, once
        self.ended = threading.Event()
        self.error: KVSealRpcError | None = None
        self._stub = stub
        self._on_lost = on_lost
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._call: Any = None
        self._live = False
        self._thread = threading.Thread(
            target=self._run, name=f"kvseal-hold-{pool_id}", daemon=True
        )
        if start:
            self._thread.start()

    def start(self) -> None:
        """Open the stream (when made with ``start=False``, e.g. so that the owner
        can record the hold before ``on_lost`` may fire)."""
        self._thread.start()

    def _run(self) -> None:
        delay, delay_max = self._backoff
        try:
            while not self._stop.is_set():
                with self._lock:
                    if self._stop.is_set():
                        return
                    try:
                        # No deadline: the stream lives as long as the engine does.
                        self._call = call = self._stub.HoldPool(
                            pb.HoldPoolRequest(pool_id=self.pool_id)
                        )
                    except ValueError as e:  # the client's channel was closed
                        self.error = KVSealRpcError(grpc.StatusCode.CANCELLED, "", str(e))
                        return
                try:
                    for _ in call:
                        self._live = True
                        self.established.set()
                        delay = self._backoff[0]
                    self.error = None
                    return  # ended by the daemon: the pool was unregistered or replaced
                except grpc.RpcError as e:
                    if self._stop.is_set():
                        return
                    self.error = KVSealRpcError.from_rpc(e)
                    if not self.retry or self.error.code in self._FINAL:
                        return
                    log.info("kvseal: hold on %s refused, retrying: %s", self.pool_id, self.error)
                finally:
                    self._live = False
                self._stop.wait(delay)
                delay = min(2 * delay, delay_max)
        finally:
            self.ended.set()
            if not self._stop.is_set() and self._on_lost is not None:
                try:
                    self._on_lost(self)
                except Exception:  # the engine's callback must not kill this thread
                    log.exception("kvseal: hold-lost callback failed")

    @property
    def active(self) -> bool:
        """The daemon holds the pool for this process right now."""
        return self._live and not self.ended.is_set()

    def wait_established(self, timeout: float) -> bool:
        """True once the daemon confirmed the hold; False if the hold ended first
        (``error`` says why) or ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        while not self.established.is_set() and not self.ended.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.ended.wait(min(left, 0.01))
        return self.established.is_set() and not (self.ended.is_set() and self.error)

    def close(self, wait: float = 2.0) -> None:
        """Release the hold: the daemon unregisters the pool (unless another hold on
        it is open, or it is gone already). Waits up to ``wait`` seconds for the
        thread (0: not at all)."""
        with self._lock:
            self._stop.set()
            call = self._call
        if call is not None:
            call.cancel()
        if wait > 0 and self._thread.ident is not None:
            self._thread.join(wait)
