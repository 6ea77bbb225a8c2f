"""Pool geometries an engine adapter derives from its own: the observer pool's."""

from __future__ import annotations

from kvseal.v1 import kvseal_pb2 as pb


def observer_geometry(geometry: pb.PoolGeometry) -> pb.PoolGeometry:
    """The observer-pool geometry of a pool geometry (buffers, if any, ignored):
    the same block geometry (tokens_per_page, layers, heads, head_dim, dtype,
    layout) and ``block_bytes`` (the segments' sum, or ``geometry.block_bytes``
    when it has no segments), no pages, buffers or segments. The daemon derives
    the namespace from exactly these fields and the fingerprint, so the observer
    shares the namespace of every pool with this block geometry."""
    block_bytes = sum(s.bytes for s in geometry.segments) or geometry.block_bytes
    return pb.PoolGeometry(
        num_pages=0,
        tokens_per_page=geometry.tokens_per_page,
        num_layers=geometry.num_layers,
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        dtype=geometry.dtype,
        layout=geometry.layout,
        block_bytes=block_bytes,
    )
