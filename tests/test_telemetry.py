"""Traces to a real OTLP/gRPC receiver, Prometheus metrics scraped over HTTP,
JSON logs, and the redaction rule: no key material, plaintext or cache salt
in any span, metric or log line."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from kvseal.client import KVSealRpcError, chain_block_hashes, tenant_digest
from kvseal.client.shm import SharedKVPool
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from .conftest import DaemonProc, fill_random, start_daemon
from .test_tamper import HostView

SALT = "tenant-secret-salt-7f3a9c"


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A real OTLP/gRPC trace receiver (the collector's service definition)."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> trace_service_pb2.ExportTraceServiceResponse:
        with self.lock:
            self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[tuple[dict[str, Any], trace_pb2.Span]]:
        out = []
        with self.lock:
            for req in self.requests:
                for rs in req.resource_spans:
                    res = {a.key: a.value.string_value for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        out.extend((res, s) for s in ss.spans)
        return out

    def raw(self) -> bytes:
        with self.lock:
            return b"".join(r.SerializeToString() for r in self.requests)


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    rec = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield rec, port
    server.stop(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _attrs(span: trace_pb2.Span) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None
    return out


def _scrape(port: int) -> dict[str, float]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvseal_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    out["__text__"] = text  # type: ignore[assignment]
    return out


def test_traces_metrics_logs_and_redaction(
    tmp_path: Path, receiver: tuple[Receiver, int], pool_factory: Callable[..., SharedKVPool]
) -> None:
    rec, otlp_port = receiver
    metrics_port = _free_port()
    d: DaemonProc = start_daemon(
        tmp_path / "d",
        "--on-integrity-failure", "drop", "--log-format", "json",
        "--metrics-address", f"127.0.0.1:{metrics_port}",
        region=True, host_bytes="4MiB",
        env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp_port}",
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": "50",
            "OTEL_SERVICE_NAME": "kvseal-test",
            "OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=vllm-0",
        },
    )  # fmt: skip
    try:
        pool = pool_factory(num_pages=6)
        data = fill_random(pool)
        tenant = tenant_digest(SALT)
        chain = chain_block_hashes(list(range(12)), 4, cache_salt=SALT)
        # The engine's own tracer, exporting to the same receiver.
        provider = TracerProvider(resource=Resource.create({"service.name": "engine"}))
        provider.add_span_processor(
            SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"127.0.0.1:{otlp_port}", insecure=True))
        )
        tracer = provider.get_tracer("engine")
        before = _scrape(metrics_port)
        host = HostView(d.region)  # type: ignore[arg-type]
        with d.client() as c:
            h = c.register_pool("engine", b"model:test", pool.geometry())
            with tracer.start_as_current_span("engine.step") as step:
                c.offload(h.pool_id, tenant, chain, [0, 1, 2])
                assert c.lookup(h.pool_id, tenant, chain).hit_blocks == 3
                c.restore(h.pool_id, tenant, chain, [3, 4, 5])
            engine_ctx = step.get_span_context()
            # Tamper with the last block (a leaf) and restore it: DATA_LOSS.
            off, _ = host.changed_extent()
            slot = off + 2 * 1024  # blocks are 1 KiB slots laid out in order
            host.write(slot + 100, bytes([host.read(slot + 100, 1)[0] ^ 1]))
            with pytest.raises(KVSealRpcError) as e:
                c.restore(h.pool_id, tenant, chain[2:], [5])
            assert e.value.code == grpc.StatusCode.DATA_LOSS
        provider.shutdown()
        after = _scrape(metrics_port)
    finally:
        d.stop()

    # ------------------------------------------------------------ metrics
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    block = pool.shape.block_bytes
    assert delta("kvseal_offloaded_blocks_total") == 3
    assert delta("kvseal_offloaded_bytes_total") == 3 * block
    assert delta("kvseal_restored_blocks_total") == 3
    assert delta("kvseal_restored_bytes_total") == 3 * block
    assert delta("kvseal_lookups_total") == 1
    assert delta("kvseal_lookup_blocks_total") == 3
    assert delta("kvseal_lookup_hit_blocks_total") == 3
    assert delta("kvseal_integrity_failures_total") == 1
    assert delta('kvseal_requests_total{code="OK",method="Offload"}') == 1
    assert delta('kvseal_requests_total{code="OK",method="Restore"}') == 1
    assert delta('kvseal_requests_total{code="DATA_LOSS",method="Restore"}') == 1
    assert delta('kvseal_transfer_duration_seconds_count{direction="offload"}') == 1
    assert delta('kvseal_transfer_duration_seconds_count{direction="restore"}') == 1
    assert after["kvseal_host_blocks"] == 2  # the tampered block was evicted
    assert after["kvseal_registered_pools"] == 1
    assert after["kvseal_host_bytes_capacity"] == 4 * 1024 * 1024

    # ------------------------------------------------------------ traces
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        names = {s.name for _, s in rec.spans()}
        if {"kvseal.v1.KVSeal/Offload", "kvseal.scatter", "engine.step"} <= names and sum(
            s.name == "kvseal.v1.KVSeal/Restore" for _, s in rec.spans()
        ) == 2:
            break
        time.sleep(0.1)
    spans = rec.spans()
    by_id = {s.span_id: (res, s) for res, s in spans}
    rpc = {s.name.rsplit("/", 1)[1]: s for _, s in spans if s.name.startswith("kvseal.v1.KVSeal/")}
    restores = [s for _, s in spans if s.name == "kvseal.v1.KVSeal/Restore"]
    offload = rpc["Offload"]
    res, _ = by_id[offload.span_id]
    assert res["service.name"] == "kvseal-test" and res["k8s.pod.name"] == "vllm-0"
    assert offload.kind == trace_pb2.Span.SPAN_KIND_SERVER
    # Client -> daemon hop: the daemon's span is a child of the engine's.
    assert offload.trace_id == engine_ctx.trace_id.to_bytes(16, "big")
    assert offload.parent_span_id == engine_ctx.span_id.to_bytes(8, "big")
    a = _attrs(offload)
    assert (
        a["rpc.method"] == "Offload" and a["kvseal.blocks"] == 3 and a["kvseal.stored_blocks"] == 3
    )
    assert a["kvseal.bytes"] == 3 * block and a["kvseal.pool"] == h.pool_id
    assert re.fullmatch(r"[0-9a-f]{16}", a["kvseal.tenant"])

    def children(parent: trace_pb2.Span) -> list[str]:
        return sorted(s.name for _, s in spans if s.parent_span_id == parent.span_id)

    assert children(offload) == ["kvseal.commit", "kvseal.reserve", "kvseal.seal"]
    good, bad = sorted(restores, key=lambda s: s.start_time_unix_nano)
    assert good.parent_span_id == engine_ctx.span_id.to_bytes(8, "big")
    assert children(good) == ["kvseal.open", "kvseal.pin"]
    opened = next(
        s for _, s in spans if s.name == "kvseal.open" and s.parent_span_id == good.span_id
    )
    assert children(opened) == ["kvseal.copy_verify", "kvseal.scatter"]
    assert _attrs(good)["kvseal.restored_blocks"] == 3
    assert [ev.name for ev in bad.events] == ["kvseal.integrity_failure"], [
        _attrs(ev) for ev in bad.events
    ]  # type: ignore[arg-type]
    assert {ev.name: _attrs(ev) for ev in bad.events}["kvseal.integrity_failure"][
        "kvseal.blocks"
    ] == 1  # type: ignore[arg-type]
    assert bad.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    assert _attrs(bad)["kvseal.error"] == "INTEGRITY_FAILURE"
    assert "kvseal.scatter" not in [s.name for _, s in spans if s.parent_span_id in
                                    {x.span_id for _, x in spans if x.parent_span_id == bad.span_id}]  # fmt: skip

    # ------------------------------------------------------------ logs
    log_lines = [ln for ln in d.log().splitlines() if ln.strip()]
    docs = [json.loads(ln) for ln in log_lines]
    assert all({"ts", "level", "logger", "msg"} <= doc.keys() for doc in docs)
    assert any(doc["level"] == "error" and "INTEGRITY FAILURE" in doc["msg"] for doc in docs)

    # ------------------------------------------------------------ redaction
    exported = rec.raw()
    text_blobs = [d.log(), str(after["__text__"])]
    secrets_ = [SALT.encode(), tenant, tenant.hex().encode()]
    secrets_ += [data[p][:32] for p in range(3)] + [data[p][:32].hex().encode() for p in range(3)]
    for secret in secrets_:
        assert secret not in exported
        for blob in text_blobs:
            assert secret.decode("latin-1") not in blob
    # Nothing that looks like a raw 32-byte secret in any attribute value.
    for _, s in spans:
        for key, value in _attrs(s).items():
            assert not (isinstance(value, bytes) and len(value) >= 16), key
            assert not (isinstance(value, str) and re.fullmatch(r"[0-9a-f]{32,}", value)), key
    assert os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") is None  # the test did not leak config
