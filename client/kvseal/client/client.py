"""gRPC client for the kvseal daemon.

Two layers:

- :class:`KVSealClient` is the typed API. Every call has a deadline; calls
  that are safe to repeat (lookup, touch, stats, health) are retried by gRPC's
  own retry policy on UNAVAILABLE, bounded by attempts and by the deadline.
  Offload and restore are not retried (they move data; the engine decides).
  Failures raise :class:`KVSealRpcError` with the status code and the
  daemon's machine-readable reason.
- :class:`EnginePool` is what an engine calls in its hot path. It never
  raises and never waits past its deadline: errors become a miss (lookup),
  a dropped offload, or a failed restore (the engine recomputes). After a
  failure it stops calling for a short, growing back-off, so a dead daemon
  costs the engine nothing. Registration (and re-registration when the pool
  is lost: daemon restart, new key, empty cache) runs on a background thread,
  never on the hot path.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from kvseal.client.hashing import load_tenant_key, tenant_digest
from kvseal.client.liveness import daemon_gone
from kvseal.v1 import kvseal_pb2 as pb
from kvseal.v1 import kvseal_pb2_grpc as pb_grpc

log = logging.getLogger("kvseal.client")
ERROR_METADATA_KEY = "kvseal-error"
# RegisterPool: "a HoldPool follows within this many ms" (the daemon drops a
# registration that is never held: its engine died before it could hold it).
HOLD_WITHIN_METADATA_KEY = "kvseal-hold-within-ms"
T = TypeVar("T")
_IDEMPOTENT = ("Lookup", "Touch", "Stats")


def default_target() -> str:
    """KVSEAL_SOCKET, else the daemon's default socket path."""
    sock = os.environ.get("KVSEAL_SOCKET")
    if sock:
        return sock if "://" in sock else "unix://" + sock
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(runtime, "kvseal") if runtime else f"/tmp/kvseal-{os.getuid()}"  # noqa: S108
    return "unix://" + os.path.join(base, "kvseal.sock")


class KVSealRpcError(Exception):
    """A failed call: ``code`` (grpc.StatusCode), ``reason`` (the daemon's
    ErrorReason name, or "" when the daemon was not reached) and ``details``."""

    def __init__(self, code: grpc.StatusCode, reason: str, details: str) -> None:
        super().__init__(f"{code.name}{f' ({reason})' if reason else ''}: {details}")
        self.code = code
        self.reason = reason
        self.details = details
        # False only when the request certainly never left this process
        # (e.g. the client was closed): then the daemon cannot be touching
        # its pages.
        self.sent = True

    @classmethod
    def from_rpc(cls, err: grpc.RpcError) -> KVSealRpcError:
        reason = ""
        call: Any = err
        try:
            for key, value in call.trailing_metadata() or ():
                if key == ERROR_METADATA_KEY:
                    reason = str(value)
        except Exception:  # noqa: S110 - no metadata when the daemon was not reached
            pass
        return cls(call.code(), reason, call.details() or "")


@dataclass(frozen=True)
class ClientConfig:
    target: str = field(default_factory=default_target)
    timeout_s: float = 2.0  # control calls (register, stats, drop)
    lookup_timeout_s: float = 0.2  # hot-path lookups
    transfer_timeout_s: float = 30.0  # offload/restore: large batches move GBs
    # Engine contract (README "Engine contract"): the daemon stops touching a
    # transfer's pages this long before the call's gRPC deadline, and a failure
    # the daemon did not report itself is returned no earlier than that
    # deadline. Must cover the request's transit plus one block's copy.
    transfer_grace_s: float = 1.0
    retries: int = 3  # attempts for idempotent calls, first one included
    backoff_initial_s: float = 0.2  # EnginePool: pause after a failure...
    backoff_max_s: float = 10.0  # ...doubling up to this
    tls_root_ca: bytes | None = None  # tcp:// targets: mutual TLS material
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    tls_server_name: str | None = None
    # Key of the tenant digests (hashing.tenant_digest): $KVSEAL_TENANT_KEY_FILE by
    # default, None (unkeyed) when unset. Never sent to the daemon.
    tenant_key: bytes | None = field(default_factory=load_tenant_key, repr=False)

    def __post_init__(self) -> None:
        if min(self.timeout_s, self.lookup_timeout_s, self.transfer_timeout_s) <= 0:
            raise ValueError("timeouts must be positive")
        if not 0.05 <= self.transfer_grace_s <= 60:
            raise ValueError("transfer_grace_s must be in 0.05..60 seconds")
        if not 1 <= self.retries <= 5:
            raise ValueError("retries must be in 1..5 (gRPC caps attempts at 5)")


@dataclass(frozen=True)
class PoolHandle:
    pool_id: str
    namespace: bytes
    block_bytes: int
    server_instance: str
    # Proves this registration's ownership of its name (RegisterPool's owner_token);
    # not secret from the engine, but no business of logs.
    owner_token: bytes = field(default=b"", repr=False)


@dataclass(frozen=True)
class LookupResult:
    hit_blocks: int
    states: list[int]  # kvseal.v1.BlockState values


@dataclass(frozen=True)
class OffloadResult:
    outcomes: list[int]  # kvseal.v1.OffloadOutcome values
    stored_blocks: int
    stored_bytes: int
    evicted_blocks: int


@dataclass(frozen=True)
class RestoreResult:
    restored_blocks: int
    restored_bytes: int


# grpc.health.v1 without a dependency on grpcio-health-checking (the client
# installs with grpcio and protobuf only): HealthCheckRequest is
# {string service = 1}, HealthCheckResponse is {ServingStatus status = 1}.
_HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _encode_health_request(service: str) -> bytes:
    raw = service.encode()
    return b"\x0a" + _varint(len(raw)) + raw if raw else b""


def _decode_health_status(data: bytes) -> int:
    i, status = 0, 0
    while i < len(data):
        key = data[i]
        i += 1
        value, shift = 0, 0
        while True:  # every field of this message is a varint or length-delimited
            b = data[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        if key == 0x08:
            status = value
        elif key & 7 == 2:
            i += value
    return status


def _trace_metadata() -> tuple[tuple[str, str], ...] | None:
    """W3C trace context of the caller's current span, when the engine uses
    OpenTelemetry (an optional import: the client does not depend on it)."""
    try:
        from opentelemetry import propagate  # noqa: PLC0415
    except ImportError:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items()) or None


def _service_config(retries: int) -> str:
    return json.dumps(
        {
            "methodConfig": [
                {
                    "name": [{"service": "kvseal.v1.KVSeal", "method": m} for m in _IDEMPOTENT]
                    + [{"service": "grpc.health.v1.Health"}],
                    "retryPolicy": {
                        "maxAttempts": max(2, retries),
                        "initialBackoff": "0.01s",
                        "maxBackoff": "0.2s",
                        "backoffMultiplier": 2,
                        "retryableStatusCodes": ["UNAVAILABLE"],
                    },
                }
            ]
        }
    )


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


def _connect_timeout_ms(cfg: ClientConfig) -> int:
    """How long one connection attempt may take: at least every configured deadline."""
    longest = max(20.0, cfg.timeout_s, cfg.lookup_timeout_s, cfg.transfer_timeout_s)
    return int(longest * 1000)


class KVSealClient:
    """One channel to one daemon. Thread-safe (gRPC channels are).

    Connecting: a call waits, up to its own deadline, for a connection that is
    being established (a slow accept or handshake ends in success or in
    DEADLINE_EXCEEDED at the deadline, never in an early UNAVAILABLE). A
    connection that is refused (no daemon on the socket) fails the call with
    UNAVAILABLE at once, so an engine degrades without waiting.
    """

    def __init__(self, config: ClientConfig | None = None) -> None:
        self.config = config or ClientConfig()
        cfg = self.config
        options: list[tuple[str, Any]] = [
            ("grpc.enable_retries", 1 if cfg.retries > 1 else 0),
            ("grpc.service_config", _service_config(cfg.retries)),
            # Reconnect quickly after a daemon restart instead of gRPC's
            # default back-off of up to 2 minutes.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            # Despite its name, gRPC uses this as the *minimum connect timeout*: a
            # connection attempt (socket connect plus the HTTP/2 handshake) is
            # abandoned after it, and queued calls then fail UNAVAILABLE early. So it
            # must cover the longest deadline a call is given (and never be below
            # gRPC's own 20 s default): every call then waits up to its own deadline
            # for a connection that is being made. A refused connection (no daemon)
            # still fails at once, and the back-off above still applies.
            ("grpc.min_reconnect_backoff_ms", _connect_timeout_ms(cfg)),
        ]
        if cfg.target.startswith("unix:"):
            self._channel = grpc.insecure_channel(cfg.target, options=options)
        else:
            if cfg.tls_server_name:
                options.append(("grpc.ssl_target_name_override", cfg.tls_server_name))
            creds = grpc.ssl_channel_credentials(cfg.tls_root_ca, cfg.tls_key, cfg.tls_cert)
            target = cfg.target.removeprefix("tcp://")
            self._channel = grpc.secure_channel(target, creds, options=options)
        self._stub = pb_grpc.KVSealStub(self._channel)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> KVSealClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _transfer(self, method: str, request: Any, timeout: float) -> Any:
        """Run an Offload/Restore under the engine contract.

        The daemon stops touching the request's pages at the cutoff (``timeout``
        from now, as the daemon measures it) and answers then; the gRPC deadline
        is ``timeout + transfer_grace_s``. A failure the daemon reported itself
        (any status with a ``kvseal-error`` reason) means the request is over:
        it is raised at once. Any other failure (our own deadline, a dropped
        connection, a closed channel) says nothing about what the daemon is
        still doing, so it is raised only once the gRPC deadline has passed or
        the daemon is known to be gone; by then the daemon has stopped.
        """
        grace = self.config.transfer_grace_s
        request.grace_ms = round(grace * 1000)
        request.budget_us = max(1, int(timeout * 1e6))
        give_up = time.monotonic() + timeout + grace
        try:
            return self._call(method, request, timeout + grace)
        except KVSealRpcError as e:
            if not e.reason and e.sent:
                self._settle(give_up)
            raise

    def _settle(self, give_up: float) -> None:
        """Wait until ``give_up`` (monotonic) or until the daemon is gone."""
        while True:
            left = give_up - time.monotonic()
            if left <= 0 or self._daemon_gone():
                return
            time.sleep(min(left, 0.01))

    def _daemon_gone(self) -> bool:
        """True only when the daemon process is known to be gone (its lock
        on ``<socket>.lock`` released by the kernel): it can touch no page
        any more. Always False for TCP targets (no way to tell)."""
        return daemon_gone(self.config.target)

    def _call(
        self,
        method: str,
        request: Any,
        timeout: float | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Any:
        fn = getattr(self._stub, method)
        md = (_trace_metadata() or ()) + metadata
        try:
            return fn(request, timeout=timeout or self.config.timeout_s, metadata=md or None)
        except grpc.RpcError as e:
            raise KVSealRpcError.from_rpc(e) from None
        except ValueError as e:  # grpc: "Cannot invoke RPC on closed channel!"
            err = KVSealRpcError(grpc.StatusCode.CANCELLED, "", f"client closed: {e}")
            err.sent = False
            raise err from None

    # ------------------------------------------------------------ API

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """The daemon's grpc.health.v1 status name, e.g. "SERVING"."""
        check = self._channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=_encode_health_request,
            response_deserializer=_decode_health_status,
        )
        try:
            status: int = check(service, timeout=timeout or self.config.timeout_s)
        except grpc.RpcError as e:
            raise KVSealRpcError.from_rpc(e) from None
        return _HEALTH_STATUS.get(status, f"STATUS_{status}")

    def register_pool(
        self,
        name: str,
        model_fingerprint: bytes,
        geometry: pb.PoolGeometry,
        backend: pb.Backend = pb.BACKEND_UNSPECIFIED,
        *,
        owner_token: bytes = b"",
        timeout: float | None = None,
        hold_within_s: float | None = None,
        observer: bool = False,
    ) -> PoolHandle:
        """Register (or replace) the pool named ``name``. ``owner_token``: the
        ``owner_token`` of an earlier handle for this name, which lets this engine
        replace its own registration while it is held; without it a held name is
        refused with ALREADY_EXISTS (POOL_NAME_TAKEN). A refused registration left
        nothing mapped on the daemon. ``hold_within_s``: this client will open a
        HoldPool on the new pool within that many seconds; if none is ever opened
        (the engine died right after registering), the daemon unregisters the pool
        then (the ``kvseal-hold-within-ms`` request metadata). ``observer``: register
        an observer pool (no memory; ``geometry`` has no pages, buffers or segments
        and states ``block_bytes``): lookups, events and holds only, in the namespace
        of the pools with that block geometry (see ``RegisterPoolRequest.observer``)."""
        md: tuple[tuple[str, str], ...] = ()
        if hold_within_s is not None:
            md = ((HOLD_WITHIN_METADATA_KEY, str(max(1, round(hold_within_s * 1000)))),)
        r = self._call(
            "RegisterPool",
            pb.RegisterPoolRequest(
                name=name,
                model_fingerprint=model_fingerprint,
                geometry=geometry,
                backend=backend,
                owner_token=owner_token,
                observer=observer,
            ),
            timeout,
            md,
        )
        return PoolHandle(
            r.pool_id, r.namespace, r.block_bytes, r.server_instance, bytes(r.owner_token)
        )

    def unregister_pool(self, pool_id: str) -> None:
        self._call("UnregisterPool", pb.UnregisterPoolRequest(pool_id=pool_id))

    def hold_pool(self, pool_id: str, timeout: float | None = None) -> PoolHold:
        """Tie the pool's registration to this process (see :class:`PoolHold`).
        Returns once the daemon confirmed the hold; raises KVSealRpcError if it
        refused (NOT_FOUND, RESOURCE_EXHAUSTED, ...) or did not answer in time."""
        hold = PoolHold(self._stub, pool_id)  # one attempt: the caller decides
        if hold.wait_established(timeout or self.config.timeout_s):
            return hold
        hold.close()
        raise hold.error or KVSealRpcError(
            grpc.StatusCode.DEADLINE_EXCEEDED, "", "HoldPool was not confirmed in time"
        )

    def lookup(self, pool_id: str, tenant: bytes, block_hashes: Sequence[bytes]) -> LookupResult:
        r = self._call(
            "Lookup",
            pb.LookupRequest(pool_id=pool_id, tenant=tenant, block_hashes=block_hashes),
            self.config.lookup_timeout_s,
        )
        return LookupResult(r.hit_blocks, list(r.states))

    def touch(self, pool_id: str, tenant: bytes, block_hashes: Sequence[bytes]) -> int:
        r = self._call(
            "Touch", pb.TouchRequest(pool_id=pool_id, tenant=tenant, block_hashes=block_hashes)
        )
        return int(r.touched)

    def offload(
        self,
        pool_id: str,
        tenant: bytes,
        block_hashes: Sequence[bytes],
        page_ids: Sequence[int],
        parent_hash: bytes | None = None,
        timeout: float | None = None,
        cuda_event_ipc_handle: bytes = b"",
    ) -> OffloadResult:
        """Seal and store pages. ``cuda_event_ipc_handle`` (CUDA backend): an
        interprocess event recorded after the engine wrote the pages; without
        it the engine must have synchronised its stream first.

        The pages belong to kvseal until this returns. On success every block
        was read. On any KVSealRpcError the daemon reads none of the pages any
        more and publishes nothing it read after the failure: the engine may
        overwrite the pages at once. (A failed offload may still have stored
        blocks whose bytes it read before, while they still held this
        request's KV: a later hit on them is correct.)"""
        r = self._transfer(
            "Offload",
            pb.OffloadRequest(
                pool_id=pool_id,
                tenant=tenant,
                parent_hash=parent_hash or b"",
                block_hashes=block_hashes,
                page_ids=page_ids,
                cuda_event_ipc_handle=cuda_event_ipc_handle,
            ),
            timeout or self.config.transfer_timeout_s,
        )
        return OffloadResult(list(r.outcomes), r.stored_blocks, r.stored_bytes, r.evicted_blocks)

    def restore(
        self,
        pool_id: str,
        tenant: bytes,
        block_hashes: Sequence[bytes],
        page_ids: Sequence[int],
        release: bool = False,
        timeout: float | None = None,
        cuda_event_ipc_handle: bytes = b"",
    ) -> RestoreResult:
        """Verify and write blocks into pages; returns once the bytes are in
        place. ``cuda_event_ipc_handle``: an interprocess event recorded after
        the engine's last use of the destination pages.

        The pages belong to kvseal until this returns. On success every page
        holds its verified block. On any KVSealRpcError the daemon writes none
        of the pages any more, so the engine may reuse them at once; what they
        hold then is unspecified but never unverified bytes (nothing is written
        unless every block of the request verified; only a restore stopped in
        the middle of its writes, which takes a daemon starved for half the
        grace, leaves some pages holding their verified blocks)."""
        r = self._transfer(
            "Restore",
            pb.RestoreRequest(
                pool_id=pool_id,
                tenant=tenant,
                block_hashes=block_hashes,
                page_ids=page_ids,
                release=release,
                cuda_event_ipc_handle=cuda_event_ipc_handle,
            ),
            timeout or self.config.transfer_timeout_s,
        )
        return RestoreResult(r.restored_blocks, r.restored_bytes)

    def drop(
        self,
        pool_id: str,
        tenant: bytes,
        block_hashes: Sequence[bytes] = (),
        all_of_tenant: bool = False,
    ) -> int:
        r = self._call(
            "Drop",
            pb.DropRequest(
                pool_id=pool_id,
                tenant=tenant,
                block_hashes=block_hashes,
                all_of_tenant=all_of_tenant,
            ),
        )
        return int(r.dropped_blocks)

    def stats(self) -> pb.StatsReply:
        reply: pb.StatsReply = self._call("Stats", pb.StatsRequest())
        return reply

    def tenant_digest(self, cache_salt: str | bytes | None) -> bytes:
        """The tenant digest of ``cache_salt`` under this client's ``tenant_key``."""
        return tenant_digest(cache_salt, key=self.config.tenant_key)

    def watch_events(
        self, pool_id: str, tenant: bytes = b"", timeout: float | None = None
    ) -> Iterator[pb.BlockEvent]:
        """Stream of the block events of ``pool_id``'s namespace, for the tenants
        requests on that pool have named (only ``tenant``'s when given); ends with
        KVSealRpcError: RESOURCE_EXHAUSTED if this watcher fell behind (resubscribe
        and resync), NOT_FOUND / UNKNOWN_POOL once the pool is gone."""
        call = self._stub.WatchEvents(
            pb.WatchEventsRequest(pool_id=pool_id, tenant=tenant), timeout=timeout
        )
        try:
            yield from call
        except grpc.RpcError as e:
            raise KVSealRpcError.from_rpc(e) from None
        finally:
            call.cancel()


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


def _state(err: KVSealRpcError) -> str:
    return f"{err.code.name}/{err.reason}" if err.reason else err.code.name


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
        state = _state(err)
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
        state = _state(err)
        if state != self._call_state:  # once per state, not per call
            self._call_state = state
            log.warning("kvseal call degraded: %s", err)

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
    ) -> bool:
        """True: every destination page now holds its verified block. False
        (integrity failure, miss, daemon down, no handle): the pages are yours
        again — the daemon will not touch them after this returns; recompute them.
        ``cuda_event_ipc_handle`` (CUDA backend): as in :meth:`KVSealClient.restore`."""
        if not block_hashes:
            return False

        def call(h: PoolHandle) -> bool:
            self.client.restore(
                h.pool_id,
                tenant,
                block_hashes,
                page_ids,
                release,
                cuda_event_ipc_handle=cuda_event_ipc_handle,
            )
            return True

        return self._guarded(call, False)
