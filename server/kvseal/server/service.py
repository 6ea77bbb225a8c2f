"""The gRPC edge: ``kvseal.v1.KVSeal`` handlers over a :class:`SealedCache`.

Handlers are thin: convert, call the cache, convert back. Every domain error
becomes its status code (table in ``errors``) plus the machine-readable
reason in trailing metadata; anything unexpected becomes INTERNAL with a
generic message (details go to the log, never to the client). A request body
that does not parse (a string field that is not UTF-8, a truncated message, a
wrong wire type) is INVALID_ARGUMENT / BAD_REQUEST like any other bad input:
:func:`add_to_server` installs deserializers that never raise. Status messages
are bounded (``errors.bound_message``), so no input decides the status a
client sees.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message
from kvseal.server import convert, telemetry
from kvseal.server.agreement import Agreement
from kvseal.server.cache import SealedCache
from kvseal.server.deadline import MAX_GRACE_MS, Deadline
from kvseal.server.errors import (
    ERROR_METADATA_KEY,
    BadRequest,
    EventsOverflow,
    KVSealError,
    ShuttingDown,
    UnknownPool,
    echo,
)
from kvseal.server.timers import Deferred
from kvseal.v1 import kvseal_pb2 as pb
from kvseal.v1 import kvseal_pb2_grpc as pb_grpc
from opentelemetry import trace

log = logging.getLogger("kvseal.service")
R = TypeVar("R")
Hook = Callable[[str, grpc.StatusCode], None]
SERVICE = pb.DESCRIPTOR.services_by_name["KVSeal"]
# Block RPCs: their (pool_id, tenant) is noted before they run, for WatchEvents.
# (Lookup notes it itself, under the pool lease it takes anyway.)
_TENANT_RPCS = frozenset({"Touch", "Offload", "Restore", "Drop", "Release"})


HOLD_WITHIN_METADATA_KEY = "kvseal-hold-within-ms"


def _hold_within_s(context: grpc.ServicerContext) -> float | None:
    """RegisterPool's ``kvseal-hold-within-ms`` metadata (1..600000), in seconds:
    the client promises a HoldPool within that time, else the registration is
    dropped. None when absent or not a number in range (no expiry)."""
    for key, value in context.invocation_metadata() or ():
        if key == HOLD_WITHIN_METADATA_KEY:
            try:
                ms = int(value)
            except (TypeError, ValueError):
                return None
            return ms / 1000 if 1 <= ms <= 600_000 else None
    return None


class Undecodable:
    """Stands for a request body that did not parse as ``type_name``."""

    __slots__ = ("type_name",)

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def error(self) -> BadRequest:
        return BadRequest(
            f"the request is not a valid {self.type_name} (e.g. a string field that is "
            "not UTF-8, a truncated message or a field of the wrong wire type)"
        )


def _deserializer(cls: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    def parse(data: bytes) -> Message | Undecodable:
        try:
            return cls.FromString(data)
        except DecodeError:
            return Undecodable(cls.DESCRIPTOR.full_name)

    return parse


def add_to_server(servicer: KVSealServicer, server: grpc.Server) -> None:
    """Register ``servicer`` like the generated ``add_KVSealServicer_to_server``,
    except that a request that does not parse reaches kvseal (and becomes
    INVALID_ARGUMENT / BAD_REQUEST) instead of gRPC's own INTERNAL
    "Exception deserializing request!"."""
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for m in SERVICE.methods:
        req_cls = getattr(pb, m.input_type.name)
        rep_cls = getattr(pb, m.output_type.name)
        behaviour = _refuse_undecodable(m.name, getattr(servicer, m.name), servicer)
        make = (
            grpc.unary_stream_rpc_method_handler
            if m.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[m.name] = make(
            behaviour,
            request_deserializer=_deserializer(req_cls),
            response_serializer=rep_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
    server.add_registered_method_handlers(SERVICE.full_name, handlers)  # type: ignore[attr-defined]


def _refuse_undecodable(
    name: str, method: Callable[[Any, grpc.ServicerContext], Any], servicer: KVSealServicer
) -> Callable[[Any, grpc.ServicerContext], Any]:
    def call(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            if servicer.on_done is not None:
                servicer.on_done(name, grpc.StatusCode.INVALID_ARGUMENT)
            return _abort(context, request.error())
        return method(request, context)

    return call


def _abort(context: grpc.ServicerContext, err: KVSealError) -> Any:
    """End the call with ``err``'s status and reason. ``err.message`` is bounded
    and printable ASCII (``KVSealError``), so the trailers stay far below gRPC's
    metadata limit whatever the request held."""
    context.set_trailing_metadata(((ERROR_METADATA_KEY, err.reason),))
    context.abort(err.code, err.message)


def _aborted(context: grpc.ServicerContext) -> bool:
    """Whether grpc (or our own ``_abort``) already set a final status."""
    return getattr(context, "code", lambda: None)() is not None


def handler(fn: Callable[..., R]) -> Callable[..., R]:
    """Map exceptions to statuses; report (method, code) to ``self.on_done``."""

    name = fn.__name__
    names_tenant = name in _TENANT_RPCS

    @functools.wraps(fn)
    def wrapper(self: KVSealServicer, request: Any, context: grpc.ServicerContext) -> R:
        code = grpc.StatusCode.OK
        try:
            # The metadata is read only for the caller's trace context.
            metadata = context.invocation_metadata() if telemetry.enabled() else None
            with telemetry.rpc_span(name, metadata) as span:
                try:
                    if names_tenant:
                        self.cache.note_tenant(request.pool_id, bytes(request.tenant))
                    return fn(self, request, context)
                except KVSealError as e:
                    code = e.code
                    if span is not None:
                        span.set_attribute("rpc.grpc.status_code", e.code.value[0])
                        span.set_attribute("kvseal.error", e.reason)
                        span.set_status(trace.StatusCode.ERROR, e.reason)
                    raise
                except Exception:
                    if span is not None:
                        span.set_status(trace.StatusCode.ERROR, "INTERNAL")
                    raise
        except KVSealError as e:
            return _abort(context, e)  # type: ignore[no-any-return]
        except Exception:
            code = grpc.StatusCode.INTERNAL
            if _aborted(context):
                raise
            log.exception("internal error in %s", name)
            # A reason in the trailers tells the client this is the daemon's
            # verdict: the request is over and touches no page any more.
            context.set_trailing_metadata(((ERROR_METADATA_KEY, "INTERNAL_ERROR"),))
            context.abort(grpc.StatusCode.INTERNAL, "internal error in kvseal (see daemon log)")
            raise
        finally:
            if self.on_done is not None:
                self.on_done(name, code)

    return wrapper


def _transfer_deadline(
    context: grpc.ServicerContext, grace_ms: int, budget_us: int, stopping: threading.Event
) -> Deadline:
    """The engine-contract deadline of an Offload/Restore (``kvseal.server.deadline``):
    its gRPC deadline less the client's grace, cancelled when the RPC ends early."""
    if grace_ms > MAX_GRACE_MS:
        raise BadRequest(f"grace_ms={grace_ms} is over the limit of {MAX_GRACE_MS}")
    cancelled = threading.Event()
    # Fires when the RPC terminates (cancelled, disconnected, deadline); False
    # means it is over already.
    if not context.add_callback(cancelled.set):
        cancelled.set()
    return Deadline.for_rpc(
        context.time_remaining(), grace_ms / 1000, cancelled, stopping, budget_us / 1e6
    )


# The request counts of a Stats reply (a pool's own requests, or the daemon's).
_POOL_COUNTS = (
    "lookups",
    "lookup_hit_blocks",
    "offloaded_blocks",
    "offloaded_bytes",
    "restored_blocks",
    "restored_bytes",
    "evicted_blocks",
    "dropped_blocks",
    "integrity_failures",
)


# How often idle tenants are forgotten (SealedCache.sweep_tenants), on the
# expiry timer's thread.
TENANT_SWEEP_S = 60.0


class KVSealServicer(pb_grpc.KVSealServicer):
    def __init__(
        self,
        cache: SealedCache,
        instance: str,
        on_done: Hook | None = None,
        *,
        is_operator: Callable[[grpc.ServicerContext], bool],
    ) -> None:
        self.cache = cache
        self.instance = instance
        self.on_done = on_done
        # Replicas' registrations compared through the store (kvseal.server.agreement).
        self.agreement = Agreement(cache.store.store if cache.store is not None else None)
        # Whether a call may see the daemon-wide Stats (--operator-uid; see
        # kvseal.server.daemon.daemon.operator_check).
        self.is_operator = is_operator
        self.expiries = Deferred("kvseal-expiry")  # 15 bytes: the kernel's whole name
        self.expiries.call_later(TENANT_SWEEP_S, self._sweep_tenants)

    def _sweep_tenants(self) -> None:
        """Forget idle tenants, then run again in TENANT_SWEEP_S (until the timer
        closes with the daemon)."""
        try:
            n = self.cache.sweep_tenants()
            if n:
                log.info("forgot %d idle tenants of the pools' event scopes", n)
        finally:
            self.expiries.call_later(TENANT_SWEEP_S, self._sweep_tenants)

    @handler
    def RegisterPool(
        self, request: pb.RegisterPoolRequest, context: grpc.ServicerContext
    ) -> pb.RegisterPoolReply:
        spec = convert.pool_spec(request, self.cache.backend.kind)
        hold_within = _hold_within_s(context)
        reg = self.cache.register_pool(spec, bytes(request.owner_token))
        if hold_within is not None:
            # The client will hold this registration (HoldPool) at once; if no hold
            # ever comes, its engine died in between: do not map its memory forever.
            # One shared thread, not a Timer thread per registration (kvseal.server.timers).
            self.expiries.call_later(
                hold_within, self.cache.expire_unheld, reg.pool_id, hold_within
            )
        return pb.RegisterPoolReply(
            pool_id=reg.pool_id,
            namespace=reg.namespace,
            block_bytes=reg.block_bytes,
            backend=convert.BACKEND_ENUMS[self.cache.backend.kind],
            server_instance=self.instance,
            owner_token=reg.owner_token,
            warnings=self.agreement.check(request.identity, reg.namespace)
            if request.HasField("identity")
            else (),
        )

    @handler
    def UnregisterPool(
        self, request: pb.UnregisterPoolRequest, context: grpc.ServicerContext
    ) -> pb.UnregisterPoolReply:
        self.cache.unregister_pool(request.pool_id)
        return pb.UnregisterPoolReply()

    @handler
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupReply:
        hit, states = self.cache.lookup(request.pool_id, request.tenant, list(request.block_hashes))
        return pb.LookupReply(hit_blocks=hit, states=[convert.STATE_ENUMS[s] for s in states])

    @handler
    def Touch(self, request: pb.TouchRequest, context: grpc.ServicerContext) -> pb.TouchReply:
        n = self.cache.touch(request.pool_id, request.tenant, list(request.block_hashes))
        return pb.TouchReply(touched=n)

    @handler
    def Offload(self, request: pb.OffloadRequest, context: grpc.ServicerContext) -> pb.OffloadReply:
        res = self.cache.offload(
            request.pool_id,
            request.tenant,
            request.parent_hash or None,
            list(request.block_hashes),
            list(request.page_ids),
            wait_event=request.cuda_event_ipc_handle or None,
            deadline=_transfer_deadline(
                context, request.grace_ms, request.budget_us, self.cache.backend.stopping
            ),
        )
        return pb.OffloadReply(
            outcomes=[convert.OUTCOME_ENUMS[o] for o in res.outcomes],
            stored_blocks=res.stored_blocks,
            stored_bytes=res.stored_bytes,
            evicted_blocks=res.evicted_blocks,
        )

    @handler
    def Restore(self, request: pb.RestoreRequest, context: grpc.ServicerContext) -> pb.RestoreReply:
        res = self.cache.restore(
            request.pool_id,
            request.tenant,
            list(request.block_hashes),
            list(request.page_ids),
            release=request.release,
            wait_event=request.cuda_event_ipc_handle or None,
            deadline=_transfer_deadline(
                context, request.grace_ms, request.budget_us, self.cache.backend.stopping
            ),
        )
        return pb.RestoreReply(
            restored_blocks=res.restored_blocks, restored_bytes=res.restored_bytes
        )

    @handler
    def Drop(self, request: pb.DropRequest, context: grpc.ServicerContext) -> pb.DropReply:
        n = self.cache.drop(
            request.pool_id,
            request.tenant,
            list(request.block_hashes),
            all_of_tenant=request.all_of_tenant,
        )
        return pb.DropReply(dropped_blocks=n)

    @handler
    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseReply:
        n = self.cache.release(request.pool_id, request.tenant, list(request.block_hashes))
        return pb.ReleaseReply(released_blocks=n)

    @handler
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsReply:
        """See the proto: the counts of the caller's own pool (``pool_id``), the
        daemon's (an operator), or none (the daemon's configuration only), so
        that a peer learns nothing of other tenants' activity from them."""
        ix = self.cache.index.stats()  # O(1): capacity is a fact
        sealer = self.cache.sealer
        facts = pb.StatsReply(
            server_instance=self.instance,
            backend=convert.BACKEND_ENUMS[self.cache.backend.kind],
            backend_detail=self.cache.backend.detail,
            host_bytes_capacity=ix.capacity_bytes,
            integrity_policy=self.cache.config.integrity_policy.value,
            rekey_after=sealer.rekey_after,
            host_region=self.cache.region.description,
            scope=pb.STATS_SCOPE_FACTS,
        )
        tier = self.cache.store
        if tier is not None:
            facts.store_policy = tier.policy.value
            facts.store_locality = tier.events.locality
            facts.store_bytes_capacity = tier.store.config.capacity_bytes
        if request.pool_id:
            counts, blocks, nbytes = self.cache.pool_stats(request.pool_id)
            facts.scope = pb.STATS_SCOPE_POOL
            facts.host_bytes_used = nbytes
            facts.blocks_ready = blocks
            facts.pools = 1
            for k in _POOL_COUNTS:
                setattr(facts, k, counts.get(k, 0))
            return facts
        if not self.is_operator(context):
            return facts
        c = self.cache.counters
        for k in _POOL_COUNTS:  # the same request counts, daemon-wide
            setattr(facts, k, getattr(c, k))
        facts.MergeFrom(
            pb.StatsReply(
                scope=pb.STATS_SCOPE_DAEMON,
                host_bytes_used=ix.used_bytes,
                blocks_ready=ix.ready,
                blocks_pending=ix.pending,
                blocks_pinned=ix.pinned,
                pools=len(self.cache.pools),
                pool_holds=self.cache.open_holds,
                key_epoch=sealer.current_epoch,
                seals_under_current_key=sealer.seals_under_current_key,
            )
        )
        if tier is not None:
            st = tier.sample()
            facts.store_bytes_used, facts.store_objects = st.bytes_used, st.objects
            facts.store_lookup_hit_blocks = st.lookup_hits
            facts.store_restored_blocks = st.promoted
            facts.store_spilled_blocks = st.spills
            facts.store_evicted_blocks = st.evictions
            facts.store_integrity_failures = st.integrity_failures
        return facts

    def HoldPool(
        self, request: pb.HoldPoolRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.HoldPoolReply]:
        """See the proto. The stream's end tells who ended it: the caller (cancel,
        or its connection dropped: the callback fires), the pool (unregistered or
        replaced), or the daemon (stopping). Only the first unregisters the pool."""
        try:
            self.cache.hold_pool(request.pool_id)
        except KVSealError as e:
            _abort(context, e)
        gone = threading.Event()
        # Set when the RPC is over: cancelled, disconnected or finished. False means
        # it is over already (the caller left before we got here).
        if not context.add_callback(gone.set):
            gone.set()
        holder_left = True
        try:
            yield pb.HoldPoolReply(pool_id=request.pool_id)
            while not gone.wait(0.25) and context.is_active():
                if self.cache.draining.is_set():
                    holder_left = False
                    _abort(context, ShuttingDown("kvseal is shutting down"))
                if request.pool_id not in self.cache.pools:
                    holder_left = False  # unregistered or replaced: the hold is over
                    return
        except Exception:
            if _aborted(context):
                raise
            holder_left = False  # our failure, not the engine's departure
            log.exception("internal error in HoldPool")
            context.abort(grpc.StatusCode.INTERNAL, "internal error in kvseal (see daemon log)")
        finally:
            self.cache.release_hold(request.pool_id, holder_left=holder_left)

    def WatchEvents(
        self, request: pb.WatchEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.BlockEvent]:
        """See the proto: events of ``pool_id``'s namespace, for tenants that pool's
        requests named (optionally only ``tenant``). Ends with NOT_FOUND /
        UNKNOWN_POOL when the pool is unregistered or replaced (register again,
        resubscribe, resync)."""
        try:
            pool, sub = self.cache.subscribe_events(request.pool_id, bytes(request.tenant))
        except KVSealError as e:
            _abort(context, e)
            return
        try:
            # Tell the client the subscription is live before any event: lets
            # it order "subscribe, then resync" without a race.
            context.send_initial_metadata((("kvseal-watch", "subscribed"),))
            while context.is_active():
                if self.cache.draining.is_set():
                    _abort(context, ShuttingDown("kvseal is shutting down"))
                if sub.overflowed and sub.queue.empty():
                    _abort(
                        context, EventsOverflow("event watcher fell behind; resubscribe and resync")
                    )
                if pool.closed and sub.queue.empty():
                    _abort(
                        context,
                        UnknownPool(
                            f"pool {echo(pool.pool_id)} was unregistered or replaced: "
                            "register it again and resubscribe"
                        ),
                    )
                try:
                    ev = sub.queue.get(timeout=0.25)
                except queue.Empty:
                    continue
                yield convert.event(ev)
        finally:
            sub.close()
