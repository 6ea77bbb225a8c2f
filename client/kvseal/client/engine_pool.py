"""What an engine calls in its hot path: :class:`EnginePool`.

It never raises and never waits past its deadline: errors become a miss
(lookup), a dropped offload, or a failed restore (the engine recomputes).
After a failure it stops calling for a short, growing back-off, so a dead
daemon costs the engine nothing. Registration (and re-registration when the
pool is lost: daemon restart, new key, empty cache) runs on a background
thread, never on the hot path.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc
from kvseal.client.client import KVSealClient
from kvseal.client.errors import KVSealRpcError, failure_state
from kvseal.client.hold import PoolHold
from kvseal.client.results import PoolHandle
from kvseal.v1 import kvseal_pb2 as pb

log = logging.getLogger("kvseal.client")
T = TypeVar("T")


class _Backoff:
    """Exponential back-off: ``initial``, doubling up to ``maximum``; ``reset``
    on success. Unlocked: concurrent callers can at worst skew one delay."""

    def __init__(self, initial: float, maximum: float) -> None:
        self.initial = initial
        self.maximum = max(initial, maximum)
        self.current = initial

    def next(self) -> float:
        """The pause to take now; the following one is twice as long (bounded)."""
        delay = self.current
        self.current = min(self.current * 2, self.maximum)
        return delay

    def reset(self) -> None:
        self.current = self.initial


class EnginePool:
    """A registered pool as the engine's hot path sees it: degrade, never fail.

    ``register`` describes the pool. A background thread (started by the first
    call, or by :meth:`wait_ready`) registers it and ties it to this process with a
    :class:`PoolHold`, and registers again whenever the handle is lost (daemon
    restart, pool unregistered, hold lost), so the engine can start before the
    daemon and survive its restarts. Hot-path calls never register and never wait
    for a registration: without a handle they degrade at once. Every method is
    thread-safe, never raises, and returns within its own deadline (lookups
    ``lookup_timeout_s``, transfers ``transfer_timeout_s``).

    What each result means for the engine's pages:

    - :meth:`lookup` ``0``: a miss (daemon down, no handle yet, any error). A
      lookup never reads or writes a page.
    - :meth:`offload` ``True``: the daemon has finished reading the pages. ``False``:
      the pages are yours again — the daemon will not touch them after this returns;
      treat the blocks as not stored (nothing to undo).
    - :meth:`restore` ``True``: every destination page holds its verified block.
      ``False``: the pages are yours again — the daemon will not touch them after
      this returns; do not use what they hold, recompute them.

    (When a call degrades without an RPC, e.g. no handle yet or a back-off, the
    daemon never saw the pages at all.) :attr:`failures` counts degraded calls.

    Registration failures are retried with exponential back-off
    (``backoff_initial_s`` doubling to ``backoff_max_s``, reset by a successful
    registration) and logged once per change of state, not per call; the last one
    is :attr:`registration_error` (None while registered). A name that another
    engine holds is refused by the daemon (ALREADY_EXISTS, ``POOL_NAME_TAKEN``):
    this pool logs that once, stays degraded and keeps retrying with back-off,
    and gets the name once the other engine's hold ends. Each registration's owner
    token lets this pool replace its own registration (still held or not) without
    being mistaken for another engine.

    With ``hold`` (the default) every registration is held: if the engine dies,
    the daemon unregisters the pool and stops mapping its KV memory (a restarted
    engine gets that memory back). A daemon without HoldPool is used without a
    hold; without holds a name is not protected from another engine. :meth:`close`
    releases the pool; afterwards every call degrades. A failure of a call made
    with an older handle never discards a newer one.
    """

    def __init__(
        self,
        client: KVSealClient,
        name: str,
        model_fingerprint: bytes,
        geometry: pb.PoolGeometry,
        *,
        hold: bool = True,
        backend: pb.Backend = pb.BACKEND_UNSPECIFIED,
    ) -> None:
        cfg = client.config
        self.client = client
        self.name = name
        self.model_fingerprint = model_fingerprint
        self.geometry = geometry
        self.hold = hold
        # The backend the geometry's buffer handles are for (unspecified: the daemon's).
        self.backend = backend
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # handle installed or closed
        self._handle: PoolHandle | None = None
        self._hold: PoolHold | None = None
        self._owner_token = b""
        self._closed = False
        self._wake = threading.Event()  # the handle is gone: register (again)
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        # Hot-path back-off: after a failure that suggests the daemon is down or
        # hung, calls degrade without an RPC until ``_down_until``.
        self._down_until = 0.0
        self._call_backoff = _Backoff(cfg.backoff_initial_s, cfg.backoff_max_s)
        self._reg_backoff = _Backoff(cfg.backoff_initial_s, cfg.backoff_max_s)
        self._call_state = ""  # last hot-path failure logged ("" while calls succeed)
        self._reg_state = ""  # last registration failure logged
        self.failures = 0  # calls that degraded (visible to engine metrics)
        self.registrations = 0  # RegisterPool attempts (all made by the background thread)
        self.registration_error: KVSealRpcError | None = None

    @property
    def handle(self) -> PoolHandle | None:
        return self._handle

    # ------------------------------------------------------------ registration

    def _want_handle(self) -> None:
        """Ask the background thread for a (new) registration; never blocks on it."""
        if self._worker is None:
            with self._lock:
                if self._worker is None and not self._closed:
                    # The thread holds only a weak reference between attempts, so an
                    # engine that drops its EnginePool without close() does not keep
                    # a thread registering forever.
                    ref = weakref.ref(self)
                    t = threading.Thread(
                        target=EnginePool._run,
                        args=(ref, self._wake, self._stop),
                        name=f"kvseal-register-{self.name}",
                        daemon=True,
                    )
                    self._worker = t
                    # ...and ends once the EnginePool is garbage (it may be waiting).
                    weakref.finalize(self, EnginePool._end_worker, self._wake, self._stop)
                    t.start()
        self._wake.set()

    @staticmethod
    def _end_worker(wake: threading.Event, stop: threading.Event) -> None:
        stop.set()
        wake.set()

    @staticmethod
    def _run(
        ref: weakref.ReferenceType[EnginePool], wake: threading.Event, stop: threading.Event
    ) -> None:
        pause = 0.0
        while not stop.is_set():
            if pause and stop.wait(pause):
                return
            # Clear before looking: a handle dropped after this line sets it again.
            wake.clear()
            pool = ref()
            if pool is None:
                return
            with pool._lock:
                if pool._closed:
                    return
                need = pool._handle is None
            if not need:
                del pool
                pause = 0.0
                wake.wait()
                continue
            outcome = pool._register_once()
            if outcome is None:  # the client was closed: nothing will ever work again
                return
            pause = 0.0 if outcome else pool._reg_backoff.next()
            del pool

    def _register_once(self) -> bool | None:
        """One registration (and hold). True: settled (registered; held, or the hold
        is being retried, or no hold is used). False: failed, or the new
        registration was lost before it was held: back off, then try again. None:
        the client is closed."""
        cfg = self.client.config
        self.registrations += 1
        try:
            h = self.client.register_pool(
                self.name,
                self.model_fingerprint,
                self.geometry,
                self.backend,
                owner_token=self._owner_token,
                timeout=cfg.timeout_s,
                # A kill between this registration and its hold must not leave the
                # pool mapped by the daemon: it expires unless held by then.
                hold_within_s=max(10.0, 3 * cfg.timeout_s) if self.hold else None,
            )
        except KVSealRpcError as e:
            self.registration_error = e
            if e.code is grpc.StatusCode.CANCELLED and not e.reason:
                log.info("kvseal: pool %s: the client was closed; not registering", self.name)
                return None
            self._registration_failed(e)
            return False
        if h.owner_token:
            self._owner_token = h.owner_token
        hold = (
            PoolHold(
                self.client._stub,
                h.pool_id,
                retry=True,
                on_lost=self._hold_lost,
                backoff_initial_s=cfg.backoff_initial_s,
                backoff_max_s=cfg.backoff_max_s,
                start=False,
            )
            if self.hold
            else None
        )
        with self._lock:
            installed = not self._closed
            old = self._hold
            if installed:
                self._handle, self._hold = h, hold
                self._changed.notify_all()
        if not installed:  # close() ran meanwhile: this registration must not outlive it
            self._release(h, None)
            return True
        self.registration_error = None
        self._reg_backoff.reset()
        if self._reg_state:
            log.info("kvseal: pool %s registered again as %s", self.name, h.pool_id)
            self._reg_state = ""
        if old is not None:
            old.close(wait=0)  # the previous registration's (replaced or gone already)
        if hold is None:
            return True
        hold.start()
        # This thread may wait (the hot path does not): a registration replaced
        # before its hold landed (two engines racing for a name) backs off.
        hold.wait_established(cfg.timeout_s)
        return not (hold.ended.is_set() and not hold.established.is_set())

    def _registration_failed(self, err: KVSealRpcError) -> None:
        state = failure_state(err)
        if state == self._reg_state:
            return  # logged once per state, not per attempt
        self._reg_state = state
        if err.reason == "POOL_NAME_TAKEN":
            log.error(
                "kvseal: pool name %r is held by another engine; this engine runs without "
                "the kvseal tier (lookups miss, offloads are dropped) and retries with "
                "back-off until that engine's hold ends. The daemon says: %s",
                self.name,
                err.details,
            )
        else:
            log.warning(
                "kvseal: registering pool %s failed, retrying with back-off: %s", self.name, err
            )

    def wait_ready(self, timeout: float) -> PoolHandle | None:
        """Start registering (if not yet) and wait up to ``timeout`` seconds for a
        handle: for an engine's start-up, never for its hot path. The hold is
        confirmed in the background (see :attr:`held`). None if there is none yet
        (:attr:`registration_error` says why) or the pool was closed."""
        self._want_handle()
        with self._changed:
            self._changed.wait_for(lambda: self._handle is not None or self._closed, timeout)
            return self._handle

    def _hold_lost(self, hold: PoolHold) -> None:
        """The daemon no longer holds the current registration for us: the pool is
        gone (daemon restart, replaced) or, after a dropped connection, was
        unregistered. Register again in the background; without HoldPool on the
        daemon (UNIMPLEMENTED), carry on without holds."""
        err = hold.error
        with self._lock:
            if self._hold is not hold:
                return
            self._hold = None
            if err is not None and err.code is grpc.StatusCode.UNIMPLEMENTED:
                self.hold = False
                log.warning(
                    "kvseal: the daemon has no HoldPool; pools are not tied to this process"
                )
                return
            if self._handle is not None and self._handle.pool_id == hold.pool_id:
                self._handle = None
        self._wake.set()
        log.info(
            "kvseal: hold on pool %s ended (%s); registering again",
            hold.pool_id,
            err or "pool gone",
        )

    @property
    def held(self) -> bool:
        """Whether the daemon holds the current registration for this process."""
        hold = self._hold
        return hold is not None and hold.active

    def close(self) -> None:
        """Release the pool: the daemon unregisters it and unmaps the engine's
        memory before this returns (best effort: never raises; a registration under
        way is waited for, up to ``timeout_s``, and released too); later calls
        degrade."""
        with self._lock:
            self._closed = True
            h, hold = self._handle, self._hold
            self._handle = self._hold = None
            worker = self._worker
            self._changed.notify_all()
        self._stop.set()
        self._wake.set()
        self._release(h, hold)
        if worker is not None and worker is not threading.current_thread():
            worker.join(self.client.config.timeout_s + 1.0)

    def _release(self, h: PoolHandle | None, hold: PoolHold | None) -> None:
        if h is not None:
            try:  # synchronous: the pool is gone when this returns
                self.client.unregister_pool(h.pool_id)
            except KVSealRpcError as e:
                log.info("kvseal: unregister on close: %s", e)
        if hold is not None:
            hold.close()  # the pool is gone already: ending the stream releases nothing more

    # ------------------------------------------------------------ hot path

    def _ready(self) -> PoolHandle | None:
        if self._closed:
            return None
        h = self._handle
        if h is None:
            self._want_handle()
            return None
        if time.monotonic() < self._down_until:
            return None
        return h

    def _failed(self, err: KVSealRpcError, used: PoolHandle) -> None:
        """A call made with ``used`` failed. Only that handle may be dropped: a call
        that started before a re-registration must not discard the new handle."""
        self.failures += 1
        lost = False
        with self._lock:
            current = self._handle is used
            if err.reason == "UNKNOWN_POOL":
                lost = current  # daemon restarted or pool replaced: register again
            elif err.code in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.INTERNAL,
            ):
                self._down_until = time.monotonic() + self._call_backoff.next()
                lost = current and err.code is not grpc.StatusCode.DEADLINE_EXCEEDED
            if lost:
                self._handle = None
        if lost:
            self._wake.set()
        state = failure_state(err)
        if state != self._call_state:  # once per state, not per call
            self._call_state = state
            log.warning("kvseal call degraded on pool %s: %s", self.name, err)

    def _ok(self) -> None:
        self._call_backoff.reset()
        if self._call_state:
            self._call_state = ""
            log.info("kvseal calls on pool %s succeed again", self.name)

    def _guarded(self, call: Callable[[PoolHandle], T], default: T) -> T:
        """Run ``call`` with the pool handle; any RPC failure degrades to
        ``default`` (and feeds the back-off / re-registration logic)."""
        h = self._ready()
        if h is None:
            self.failures += 1
            return default
        try:
            result = call(h)
        except KVSealRpcError as e:
            self._failed(e, h)
            return default
        self._ok()
        return result

    def lookup(self, tenant: bytes, block_hashes: Sequence[bytes]) -> int:
        """Number of leading blocks cached (0 on any failure; no page is touched)."""
        if not block_hashes:
            return 0
        return self._guarded(
            lambda h: self.client.lookup(h.pool_id, tenant, block_hashes).hit_blocks, 0
        )

    def offload(
        self,
        tenant: bytes,
        block_hashes: Sequence[bytes],
        page_ids: Sequence[int],
        parent_hash: bytes | None = None,
        cuda_event_ipc_handle: bytes = b"",
    ) -> bool:
        """Seal and store the pages. True: the daemon is done reading them.
        False: the pages are yours again — the daemon will not touch them after this
        returns; the offload was dropped (nothing to undo). ``cuda_event_ipc_handle``
        (CUDA backend): as in :meth:`KVSealClient.offload`."""
        if not block_hashes:
            return False

        def call(h: PoolHandle) -> bool:
            self.client.offload(
                h.pool_id,
                tenant,
                block_hashes,
                page_ids,
                parent_hash,
                cuda_event_ipc_handle=cuda_event_ipc_handle,
            )
            return True

        return self._guarded(call, False)

    def restore(
        self,
        tenant: bytes,
        block_hashes: Sequence[bytes],
        page_ids: Sequence[int],
        release: bool = False,
        cuda_event_ipc_handle: bytes = b"",
        timeout: float | None = None,
    ) -> bool:
        """True: every destination page now holds its verified block. False
        (integrity failure, miss, daemon down, no handle): the pages are yours
        again — the daemon will not touch them after this returns; recompute them.
        ``cuda_event_ipc_handle`` (CUDA backend): as in :meth:`KVSealClient.restore`.
        ``timeout``: this call's deadline instead of the client's transfer timeout
        (a caller that waits on a latency-critical thread bounds it tighter)."""
        if not block_hashes:
            return False

        def call(h: PoolHandle) -> bool:
            self.client.restore(
                h.pool_id,
                tenant,
                block_hashes,
                page_ids,
                release,
                timeout=timeout,
                cuda_event_ipc_handle=cuda_event_ipc_handle,
            )
            return True

        return self._guarded(call, False)

    def release(
        self, tenant: bytes, block_hashes: Sequence[bytes], timeout: float | None = None
    ) -> bool:
        """Write-back: release the host copies of blocks this pool restored
        with ``release=False`` (call it once the whole load verified). True:
        the daemon answered (the blocks it still held left its tier). False
        (daemon down, no handle): nothing is known to have been released; the
        copies may stay cached, which costs host memory, never data."""
        if not block_hashes:
            return True

        def call(h: PoolHandle) -> bool:
            self.client.release(h.pool_id, tenant, block_hashes, timeout=timeout)
            return True

        return self._guarded(call, False)
