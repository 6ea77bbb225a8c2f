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
  costs the engine nothing; it re-registers its pool when the daemon reports
  the pool unknown (daemon restart: new key, empty cache).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from kvseal.client.hashing import load_tenant_key, tenant_digest
from kvseal.v1 import kvseal_pb2 as pb
from kvseal.v1 import kvseal_pb2_grpc as pb_grpc

log = logging.getLogger("kvseal.client")
ERROR_METADATA_KEY = "kvseal-error"
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
        if not 1 <= self.retries <= 5:
            raise ValueError("retries must be in 1..5 (gRPC caps attempts at 5)")


@dataclass(frozen=True)
class PoolHandle:
    pool_id: str
    namespace: bytes
    block_bytes: int
    server_instance: str


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


class KVSealClient:
    """One channel to one daemon. Thread-safe (gRPC channels are)."""

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
            ("grpc.min_reconnect_backoff_ms", 100),
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

    def _call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        fn = getattr(self._stub, method)
        try:
            return fn(request, timeout=timeout or self.config.timeout_s, metadata=_trace_metadata())
        except grpc.RpcError as e:
            raise KVSealRpcError.from_rpc(e) from None
        except ValueError as e:  # grpc: "Cannot invoke RPC on closed channel!"
            raise KVSealRpcError(grpc.StatusCode.CANCELLED, "", f"client closed: {e}") from None

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
    ) -> PoolHandle:
        r = self._call(
            "RegisterPool",
            pb.RegisterPoolRequest(
                name=name, model_fingerprint=model_fingerprint, geometry=geometry, backend=backend
            ),
        )
        return PoolHandle(r.pool_id, r.namespace, r.block_bytes, r.server_instance)

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
        it the engine must have synchronised its stream first."""
        r = self._call(
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
        place. All-or-nothing: on any error no page was written.
        ``cuda_event_ipc_handle``: an interprocess event recorded after the
        engine's last use of the destination pages."""
        r = self._call(
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


class EnginePool:
    """A registered pool as the engine's hot path sees it: degrade, never fail.

    ``register`` describes the pool; the handle is (re)obtained lazily, so
    the engine can start before the daemon and survive its restarts. All
    methods are thread-safe and return within their deadline.

    With ``hold`` (the default) every registration is tied to this process with a
    :class:`PoolHold`: if the engine dies, the daemon unregisters the pool and
    stops mapping its KV memory (a restarted engine gets that memory back). A
    daemon without HoldPool is used without a hold. :meth:`close` releases the
    pool; afterwards every call degrades.
    """

    def __init__(
        self,
        client: KVSealClient,
        name: str,
        model_fingerprint: bytes,
        geometry: pb.PoolGeometry,
        *,
        hold: bool = True,
    ) -> None:
        self.client = client
        self.name = name
        self.model_fingerprint = model_fingerprint
        self.geometry = geometry
        self.hold = hold
        self._lock = threading.Lock()
        self._handle: PoolHandle | None = None
        self._hold: PoolHold | None = None
        self._register_lock = threading.Lock()
        self._closed = False
        self._down_until = 0.0
        self._backoff = client.config.backoff_initial_s
        self.failures = 0  # calls that degraded (visible to engine metrics)

    @property
    def handle(self) -> PoolHandle | None:
        return self._handle

    def _available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, err: KVSealRpcError) -> None:
        self.failures += 1
        with self._lock:
            if err.reason == "UNKNOWN_POOL":
                self._handle = None  # daemon restarted or pool replaced: register again
                return
            if err.code in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.INTERNAL,
            ):
                self._down_until = time.monotonic() + self._backoff
                self._backoff = min(self._backoff * 2, self.client.config.backoff_max_s)
                self._handle = (
                    None if err.code is not grpc.StatusCode.DEADLINE_EXCEEDED else self._handle
                )
        log.warning("kvseal call degraded: %s", err)

    def _ok(self) -> None:
        self._backoff = self.client.config.backoff_initial_s

    def _ensure(self) -> PoolHandle | None:
        if self._closed or not self._available():
            return None
        h = self._handle
        if h is not None:
            return h
        # One registration at a time; a caller that finds one under way degrades
        # rather than wait (and rather than replace the pool the other one makes).
        if not self._register_lock.acquire(blocking=False):
            return None
        try:
            if self._handle is not None:
                return self._handle
            try:
                h = self.client.register_pool(self.name, self.model_fingerprint, self.geometry)
            except KVSealRpcError as e:
                self._failed(e)
                return None
            hold = (
                PoolHold(
                    self.client._stub,
                    h.pool_id,
                    retry=True,
                    on_lost=self._hold_lost,
                    backoff_initial_s=self.client.config.backoff_initial_s,
                    backoff_max_s=self.client.config.backoff_max_s,
                    start=False,
                )
                if self.hold
                else None
            )
            old: PoolHold | None = None
            with self._lock:
                installed = not self._is_closed()
                if installed:
                    self._handle, old = h, self._hold
                    self._hold = hold
        finally:
            self._register_lock.release()
        if not installed:  # close() ran meanwhile: this registration must not outlive it
            self._release(h, None)
            return None
        if hold is not None:
            hold.start()  # confirmed in the background: the hot path does not wait
        if old is not None:
            old.close(wait=0)  # the previous registration's (already replaced or gone)
        return h

    def _is_closed(self) -> bool:
        return self._closed

    def _hold_lost(self, hold: PoolHold) -> None:
        """The daemon no longer holds the current registration for us: the pool is
        gone (daemon restart, replaced) or, after a dropped connection, was
        unregistered. Register again at the next call; without HoldPool on the
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
            self._handle = None
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
        memory before this returns (best effort: never raises); later calls
        degrade."""
        with self._lock:
            self._closed = True
            h, hold = self._handle, self._hold
            self._handle = self._hold = None
        self._release(h, hold)

    def _release(self, h: PoolHandle | None, hold: PoolHold | None) -> None:
        if h is not None:
            try:  # synchronous: the pool is gone when this returns
                self.client.unregister_pool(h.pool_id)
            except KVSealRpcError as e:
                log.info("kvseal: unregister on close: %s", e)
        if hold is not None:
            hold.close()  # the pool is gone already: ending the stream releases nothing more

    def _guarded(self, call: Callable[[PoolHandle], T], default: T) -> T:
        """Run ``call`` with the pool handle; any RPC failure degrades to
        ``default`` (and feeds the back-off / re-registration logic)."""
        h = self._ensure()
        if h is None:
            return default
        try:
            result = call(h)
        except KVSealRpcError as e:
            self._failed(e)
            return default
        self._ok()
        return result

    def lookup(self, tenant: bytes, block_hashes: Sequence[bytes]) -> int:
        """Number of leading blocks cached (0 on any failure)."""
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
    ) -> bool:
        """Seal and store the pages; False means dropped (nothing to undo)."""
        if not block_hashes:
            return False

        def call(h: PoolHandle) -> bool:
            self.client.offload(h.pool_id, tenant, block_hashes, page_ids, parent_hash)
            return True

        return self._guarded(call, False)

    def restore(
        self,
        tenant: bytes,
        block_hashes: Sequence[bytes],
        page_ids: Sequence[int],
        release: bool = False,
    ) -> bool:
        """True: every destination page now holds its block. False: none was
        written (integrity failure, miss, daemon down): recompute them."""
        if not block_hashes:
            return False

        def call(h: PoolHandle) -> bool:
            self.client.restore(h.pool_id, tenant, block_hashes, page_ids, release)
            return True

        return self._guarded(call, False)
