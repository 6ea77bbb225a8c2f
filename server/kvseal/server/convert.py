"""The one place that converts between proto messages and domain types."""

from __future__ import annotations

from kvseal.server.errors import BadRequest
from kvseal.server.events import BlockEvent, EventKind
from kvseal.server.index import State, StoreOutcome
from kvseal.server.pools import BufferSpec, Geometry, PoolSpec, SegmentSpec
from kvseal.v1 import kvseal_pb2 as pb

BACKEND_NAMES = {pb.BACKEND_CPU: "cpu", pb.BACKEND_CUDA: "cuda"}
BACKEND_ENUMS = {v: k for k, v in BACKEND_NAMES.items()}
STATE_ENUMS = {
    State.ABSENT: pb.BLOCK_ABSENT,
    State.PENDING: pb.BLOCK_PENDING,
    State.READY: pb.BLOCK_READY,
}
OUTCOME_ENUMS = {
    StoreOutcome.STORED: pb.OFFLOAD_STORED,
    StoreOutcome.ALREADY_PRESENT: pb.OFFLOAD_ALREADY_PRESENT,
    StoreOutcome.IN_PROGRESS: pb.OFFLOAD_IN_PROGRESS,
}
REMOVAL_ENUMS = {
    "EVICTED": pb.REMOVED_EVICTED,
    "DROPPED": pb.REMOVED_DROPPED,
    "RELEASED": pb.REMOVED_RELEASED,
    "INTEGRITY": pb.REMOVED_INTEGRITY,
}


def pool_spec(req: pb.RegisterPoolRequest, default_backend: str) -> PoolSpec:
    if req.backend == pb.BACKEND_UNSPECIFIED:
        backend = default_backend
    elif req.backend in BACKEND_NAMES:
        backend = BACKEND_NAMES[req.backend]
    else:
        raise BadRequest(f"unknown backend enum value {req.backend}")
    g = req.geometry
    buffers = tuple(
        BufferSpec(
            shm_name=b.shm_name if b.WhichOneof("kind") == "shm_name" else None,
            cuda_ipc_handle=b.cuda_ipc_handle
            if b.WhichOneof("kind") == "cuda_ipc_handle"
            else None,
            offset=b.offset,
            size=b.size,
            device=b.device,
        )
        for b in g.buffers
    )
    segments = tuple(SegmentSpec(s.buffer, s.offset, s.page_stride, s.bytes) for s in g.segments)
    geometry = Geometry(
        num_pages=g.num_pages,
        tokens_per_page=g.tokens_per_page,
        num_layers=g.num_layers,
        num_kv_heads=g.num_kv_heads,
        head_dim=g.head_dim,
        dtype=g.dtype,
        layout=g.layout,
        buffers=buffers,
        segments=segments,
        declared_block_bytes=g.block_bytes,
    )
    return PoolSpec(
        req.name, bytes(req.model_fingerprint), geometry, backend, observer=req.observer
    )


def event(ev: BlockEvent) -> pb.BlockEvent:
    return pb.BlockEvent(
        sequence=ev.sequence,
        kind=pb.BLOCK_STORED if ev.kind is EventKind.STORED else pb.BLOCK_REMOVED,
        reason=REMOVAL_ENUMS.get(ev.reason, pb.REMOVAL_REASON_UNSPECIFIED),
        namespace=ev.namespace,
        tenant=ev.tenant,
        block_hashes=list(ev.block_hashes),
        medium=ev.medium,
        locality=ev.locality,
        restorable=ev.restorable,
    )
