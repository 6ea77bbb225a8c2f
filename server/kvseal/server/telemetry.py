"""Traces (OpenTelemetry) and metrics (Prometheus) for the daemon.

Tracing is off unless the standard OTel environment asks for it
(``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
``OTEL_TRACES_EXPORTER=otlp``); the SDK then reads the rest of the standard
variables itself (service name, resource attributes, sampler, batch delays).
Every RPC gets a SERVER span whose parent comes from the W3C ``traceparent``
the client sent in gRPC metadata, so an engine's trace contains the
sidecar's work; each stage of the data path is a child span (``stage``).

Redaction rules, for spans, metrics and logs alike: never key material,
plaintext, or raw cache salts. The tenant appears only as a short digest of
the tenant namespace (itself already a digest of the salt); block hashes
only as counts.

Metrics are read from the cache's own counters at scrape time (one source
of truth), except the request and latency families, which are recorded as
they happen. Telemetry does not know the cache: it collects a
:class:`TierSample` through a :class:`MetricsSource` (the cache is one), so
the dependency points one way (cache -> telemetry).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

log = logging.getLogger("kvseal.telemetry")
_tracer: trace.Tracer | None = None
_provider: Any = None


def tracing_requested(env: Mapping[str, str] = os.environ) -> bool:
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(
        exporter == "otlp"
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def setup_tracing() -> bool:
    """Install an OTLP/gRPC exporting tracer if the environment asks for one."""
    global _tracer, _provider  # noqa: PLW0603 - one process-wide tracer, set once at start-up
    if not tracing_requested():
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter  # noqa: PLC0415
    from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415

    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "kvseal")})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    _provider = provider
    _tracer = provider.get_tracer("kvseal.server")
    log.info("tracing: exporting OTLP/gRPC spans")
    return True


def shutdown_tracing() -> None:
    """Flush and stop the exporter (at daemon shutdown)."""
    if _provider is not None:
        _provider.shutdown()


def tenant_label(tenant: bytes) -> str:
    """A short, non-reversible label for a tenant namespace."""
    return hashlib.sha256(b"kvseal/tenant-label\x00" + tenant).hexdigest()[:16]


# What the span helpers return while tracing is off: one shared no-op context
# (no generator per call; every request takes this path by default).
_NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()


def enabled() -> bool:
    """Whether spans are recorded; callers skip building span inputs otherwise."""
    return _tracer is not None


def rpc_span(
    method: str, metadata: Iterable[tuple[str, Any]] | None
) -> contextlib.AbstractContextManager[trace.Span | None]:
    """A SERVER span for one RPC, parented by the caller's traceparent."""
    return _NO_SPAN if _tracer is None else _rpc_span(_tracer, method, metadata)


@contextlib.contextmanager
def _rpc_span(
    tracer: trace.Tracer, method: str, metadata: Iterable[tuple[str, Any]] | None
) -> Iterator[trace.Span]:
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    parent = propagate.extract(carrier)
    token = otel_context.attach(parent)
    try:
        with tracer.start_as_current_span(
            f"kvseal.v1.KVSeal/{method}",
            kind=trace.SpanKind.SERVER,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": "kvseal.v1.KVSeal",
                "rpc.method": method,
            },
            # Exception messages are written for operators' logs, not for a
            # trace backend; the handler sets the status and reason itself.
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            yield span
    finally:
        otel_context.detach(token)


def stage(name: str, **attributes: Any) -> contextlib.AbstractContextManager[None]:
    """A child span of the current RPC for one stage (no-op without tracing)."""
    return _NO_SPAN if _tracer is None else _stage(_tracer, name, attributes)


@contextlib.contextmanager
def _stage(tracer: trace.Tracer, name: str, attributes: Mapping[str, Any]) -> Iterator[None]:
    with tracer.start_as_current_span(
        f"kvseal.{name}", attributes=_clean(attributes), record_exception=False
    ):
        yield


def annotate(**attributes: Any) -> None:
    """Set attributes on the current span (no-op without tracing)."""
    if _tracer is not None:
        trace.get_current_span().set_attributes(_clean(attributes))


def event(name: str, **attributes: Any) -> None:
    if _tracer is not None:
        trace.get_current_span().add_event(name, _clean(attributes))


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in attributes.items():
        if isinstance(v, (bytes, bytearray, memoryview)):  # never ship raw bytes
            raise TypeError(f"span attribute {k!r} is raw bytes; pass a digest or a count")
        if v is not None:
            out[f"kvseal.{k}" if "." not in k else k] = v
    return out


# ------------------------------------------------------------------ metrics


@dataclass(frozen=True, slots=True)
class TierSample:
    """The sealed tier's counters (totals since start) and gauges at one scrape."""

    lookups: int
    lookup_blocks: int
    lookup_hit_blocks: int
    offloaded_blocks: int
    offloaded_bytes: int
    restored_blocks: int
    restored_bytes: int
    evicted_blocks: int
    dropped_blocks: int
    integrity_failures: int
    key_scopes_destroyed: int
    restores_of_dropped: int
    host_bytes_used: int
    host_bytes_capacity: int
    host_blocks: int
    registered_pools: int
    pool_holds: int
    store: StoreSample | None = None  # the store tier's, when --store-dir is set


@dataclass(frozen=True, slots=True)
class StoreSample:
    """The store tier's counters (this process's, since start) and gauges
    (``bytes_used``, ``objects``: the last directory scan, every replica's)."""

    bytes_used: int
    objects: int
    capacity_bytes: int
    queued: int
    lookup_hits: int
    hits: int
    misses: int
    promoted: int
    spills: int
    spills_present: int
    spills_skipped: int
    evictions: int
    evicted_bytes: int
    integrity_failures: int
    replays: int
    scope_rollbacks: int
    tenant_drops: int
    errors: int
    host_auth_failures: int


class MetricsSource(Protocol):
    """Where the scrape-time families come from (the cache, ``SealedCache``).
    Called on the metrics server's thread at each scrape; must not block long."""

    def metrics_sample(self) -> TierSample: ...


class Metrics:
    """Prometheus families for one daemon, in their own registry."""

    def __init__(self, source: MetricsSource) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram  # noqa: PLC0415

        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvseal_requests", "RPCs handled, by method and gRPC status code",
            ["method", "code"], registry=self.registry,
        )  # fmt: skip
        self.transfer = Histogram(
            "kvseal_transfer_duration_seconds",
            "Time to move a batch between the engine pool and the sealed host tier",
            ["direction"],
            buckets=(
                0.0005,
                0.001,
                0.0025,
                0.005,
                0.01,
                0.025,
                0.05,
                0.1,
                0.25,
                0.5,
                1,
                2.5,
                5,
                10,
            ),
            registry=self.registry,
        )
        self.registry.register(_SourceCollector(source))

    def on_request(self, method: str, code: Any) -> None:
        self.requests.labels(method, code.name).inc()

    def on_transfer(self, direction: str, blocks: int, nbytes: int, seconds: float) -> None:
        self.transfer.labels(direction).observe(seconds)

    def serve(self, address: str) -> Callable[[], None]:
        """Serve /metrics on HOST:PORT; returns a function that stops it."""
        from prometheus_client import start_http_server  # noqa: PLC0415

        host, _, port = address.rpartition(":")
        # Binding to all interfaces is the operator's explicit choice
        # (--metrics-address :9464 in a pod); metrics are off by default.
        bind = host or "0.0.0.0"  # noqa: S104
        server, thread = start_http_server(int(port), addr=bind, registry=self.registry)

        def stop() -> None:
            server.shutdown()
            thread.join(5)

        return stop


class _SourceCollector:
    """Reads the tier's counters and gauges at scrape time."""

    def __init__(self, source: MetricsSource) -> None:
        self.source = source

    def describe(self) -> list[Any]:
        return list(self.collect())

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: PLC0415

        c = self.source.metrics_sample()
        counters = (
            ("kvseal_lookups", "Lookup RPCs served", c.lookups),
            ("kvseal_lookup_blocks", "Block hashes asked for in lookups", c.lookup_blocks),
            ("kvseal_lookup_hit_blocks", "Blocks in the cached prefix found by lookups",
             c.lookup_hit_blocks),
            ("kvseal_offloaded_blocks", "Blocks sealed into the host tier", c.offloaded_blocks),
            ("kvseal_offloaded_bytes", "Plaintext bytes sealed into the host tier",
             c.offloaded_bytes),
            ("kvseal_restored_blocks", "Blocks verified and restored into engine pools",
             c.restored_blocks),
            ("kvseal_restored_bytes", "Bytes verified and restored into engine pools",
             c.restored_bytes),
            ("kvseal_evicted_blocks", "Blocks evicted to make room (LRU, leaves first)",
             c.evicted_blocks),
            ("kvseal_dropped_blocks", "Blocks dropped on request (with descendants)",
             c.dropped_blocks),
            ("kvseal_integrity_failures", "Blocks that failed authentication: the host "
             "altered, swapped, replayed or removed ciphertext", c.integrity_failures),
            ("kvseal_key_scopes_destroyed", "Tenant key scopes crypto-erased by "
             "Drop(all_of_tenant)", c.key_scopes_destroyed),
            ("kvseal_restores_of_dropped", "Restores refused because a drop destroyed "
             "their tenant's keys meanwhile (never served)", c.restores_of_dropped),
        )  # fmt: skip
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        gauges = (
            (
                "kvseal_host_bytes_used",
                "Bytes of the host tier holding sealed blocks",
                c.host_bytes_used,
            ),
            (
                "kvseal_host_bytes_capacity",
                "Capacity of the host tier in bytes",
                c.host_bytes_capacity,
            ),
            ("kvseal_host_blocks", "Sealed blocks ready in the host tier", c.host_blocks),
            ("kvseal_registered_pools", "Engine KV pools registered", c.registered_pools),
            (
                "kvseal_pool_holds",
                "Open HoldPool streams (pools tied to a live engine process)",
                c.pool_holds,
            ),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        if c.store is not None:
            yield from _store_families(c.store)


def _store_families(s: StoreSample) -> Iterator[Any]:
    """The store tier's families (only when the daemon has a store)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # noqa: PLC0415

    counters = (
        ("kvseal_store_lookup_hit_blocks", "Blocks lookups found in the store only",
         s.lookup_hits),
        ("kvseal_store_hits", "Store objects read and verified", s.hits),
        ("kvseal_store_misses", "Store reads that found nothing usable (a miss)", s.misses),
        ("kvseal_store_promoted_blocks", "Blocks restored from the store into the host tier",
         s.promoted),
        ("kvseal_store_spills", "Blocks sealed into the store", s.spills),
        ("kvseal_store_spills_present", "Spills of blocks the store already held (touched)",
         s.spills_present),
        ("kvseal_store_spills_skipped", "Spills not done (queue full, block gone or dropped, "
         "filesystem error)", s.spills_skipped),
        ("kvseal_store_evictions", "Store objects this daemon removed to make room",
         s.evictions),
        ("kvseal_store_evicted_bytes", "Bytes of those objects", s.evicted_bytes),
        ("kvseal_store_integrity_failures", "Store objects or scope markers that failed their "
         "checks (tampered, swapped, truncated, foreign)", s.integrity_failures),
        ("kvseal_store_replays", "Older copies of a block this daemon recognised (a miss)",
         s.replays),
        ("kvseal_store_scope_rollbacks", "Replaced scope markers seen again (rotated again)",
         s.scope_rollbacks),
        ("kvseal_store_tenant_drops", "Tenant store epochs rotated by Drop(all_of_tenant)",
         s.tenant_drops),
        ("kvseal_store_errors", "Filesystem errors (not tampering), each a miss or a skipped "
         "spill", s.errors),
        ("kvseal_store_spill_open_failures", "Host-tier blocks that failed authentication "
         "when opened for a spill (left to the restore path's policy)", s.host_auth_failures),
    )  # fmt: skip
    for name, doc, value in counters:
        yield CounterMetricFamily(name, doc, value=value)
    gauges = (
        ("kvseal_store_bytes_used", "Bytes in the store directory (last scan, all writers)",
         s.bytes_used),
        ("kvseal_store_objects", "Block objects in the store directory (last scan)", s.objects),
        ("kvseal_store_bytes_capacity", "Capacity of the store in bytes", s.capacity_bytes),
        ("kvseal_store_spill_queue", "Blocks waiting to be spilled", s.queued),
    )  # fmt: skip
    for name, doc, value in gauges:
        yield GaugeMetricFamily(name, doc, value=value)
