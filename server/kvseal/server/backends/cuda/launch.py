"""Kernel launches of the CUDA backend: the descriptors a request hands the kernels.

Pure arithmetic, tested on the CPU: where each block sits in device staging
(:func:`staging_layout`), which DMA copies move it (:func:`plan_runs`), how a
request is cut into chunks that overlap kernels with copies (:func:`split_chunks`),
the layout of the per-request descriptor arrays (:func:`request_layout`,
:func:`fill_descriptors`), the ``KvsBatch`` of one launch (:func:`chunk_batch`) and
the kernels' own descriptor checks, done on the host so that a bad descriptor never
reaches the GPU (:func:`check_batch`). The ctypes mirrors of the structures live in
:mod:`kvseal.server.backends.cuda.emulated` (shared with the CPU emulator).
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from kvseal.server.backends.cuda.emulated import (
    AAD_BYTES,
    MAX_BLOCK_BYTES,
    NONCE_BYTES,
    TAG_BYTES,
    KvsBatch,
    KvsBlockWs,
    LaunchConfig,
    make_batch,
)

STAGING_ALIGN = 256  # staging slots: 16-byte (uint4) aligned kernels, DMA-friendly
SECTION_ALIGN = 256
DEFAULT_MAX_CHUNKS = 4
DEFAULT_MIN_CHUNK_BYTES = 16 << 20
WS_BYTES = ctypes.sizeof(KvsBlockWs)  # per-block kernel workspace


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def staging_layout(n: int, block_bytes: int) -> tuple[list[int], int]:
    """Offsets of ``n`` blocks in device staging and its total size: slot i at
    ``i * align_up(block_bytes, 256)``. With a 256-multiple block size the slots are
    back to back, so runs of adjacent host extents become single DMA copies."""
    stride = _align(block_bytes, STAGING_ALIGN)
    return [i * stride for i in range(n)], n * stride


def plan_runs(
    host_offsets: Sequence[int],
    staging_offsets: Sequence[int],
    block_bytes: int,
    start: int,
    stop: int,
) -> list[tuple[int, int, int]]:
    """DMA copies ``(host offset, staging offset, bytes)`` for blocks ``[start, stop)``.

    Consecutive blocks whose host extents AND staging slots are both back to back
    are merged into one copy; nothing but the blocks' own bytes is ever copied
    (never alignment padding)."""
    runs: list[tuple[int, int, int]] = []
    for i in range(start, stop):
        h, s = host_offsets[i], staging_offsets[i]
        if runs:
            rh, rs, rn = runs[-1]
            if rh + rn == h and rs + rn == s:
                runs[-1] = (rh, rs, rn + block_bytes)
                continue
        runs.append((h, s, block_bytes))
    return runs


def split_chunks(
    n: int,
    block_bytes: int,
    max_chunks: int = DEFAULT_MAX_CHUNKS,
    min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES,
) -> list[tuple[int, int]]:
    """Split ``n`` blocks into at most ``max_chunks`` balanced ``[start, stop)`` ranges
    of at least ``min_chunk_bytes`` (except when the whole batch is smaller): enough
    to overlap the kernel with the DMA, few enough to keep launches per request a
    small constant."""
    if n <= 0:
        return []
    k = max(1, min(max_chunks, n, (n * block_bytes) // max(1, min_chunk_bytes)))
    bounds = [n * i // k for i in range(k + 1)]
    return list(itertools.pairwise(bounds))


@dataclass(frozen=True, slots=True)
class RequestLayout:
    """Byte offsets of the descriptor arrays in one request's descriptor area (the
    same layout on the host blob and on the device). Inputs first, so one H2D of
    ``[0, upload_seal)`` or ``[0, upload_open)`` uploads everything a stage reads."""

    n: int
    pages: int
    staging_offsets: int
    nonces: int
    aads: int
    tags: int
    ok: int
    ws: int
    total: int

    @property
    def upload_seal(self) -> int:
        return self.tags  # seal writes the tags

    @property
    def upload_open(self) -> int:
        return self.ok  # restore uploads the expected tags too


def request_layout(n: int) -> RequestLayout:
    sizes = (8 * n, 8 * n, NONCE_BYTES * n, AAD_BYTES * n, TAG_BYTES * n, n, WS_BYTES * n)
    offs: list[int] = []
    pos = 0
    for size in sizes:
        offs.append(pos)
        pos = _align(pos + size, SECTION_ALIGN)
    pages, staging_offsets, nonces, aads, tags, ok, ws = offs
    return RequestLayout(n, pages, staging_offsets, nonces, aads, tags, ok, ws, pos)


def fill_descriptors(
    host: int,
    host_size: int,
    lay: RequestLayout,
    *,
    pages: Sequence[int],
    staging_offsets: Sequence[int],
    nonces: Sequence[bytes],
    aads: Sequence[bytes],
    tags: Sequence[bytes] | None = None,
) -> None:
    """Write a request's descriptor arrays at host address ``host`` (``host_size``
    bytes, owned by the caller) in layout ``lay``. Raises ValueError, before writing
    anything, on a length mismatch or a buffer that is too small."""
    n = lay.n
    if not len(pages) == len(staging_offsets) == len(nonces) == len(aads) == n:
        raise ValueError("pages, staging_offsets, nonces and aads must have one entry per block")
    if tags is not None and len(tags) != n:
        raise ValueError("need one tag per block")
    if lay.total > host_size:
        raise ValueError(
            f"descriptor area of {lay.total} bytes exceeds the {host_size}-byte buffer"
        )
    if any(p < 0 for p in pages) or any(o < 0 for o in staging_offsets):
        raise ValueError("page ids and staging offsets must be >= 0")
    for what, items, size in (("nonce", nonces, NONCE_BYTES), ("aad", aads, AAD_BYTES)):
        if any(len(x) != size for x in items):
            raise ValueError(f"every {what} must be {size} bytes")
    if tags is not None and any(len(t) != TAG_BYTES for t in tags):
        raise ValueError(f"every tag must be {TAG_BYTES} bytes")
    arrays: list[tuple[int, bytes]] = [
        (lay.pages, bytes((ctypes.c_int64 * n)(*pages))),
        (lay.staging_offsets, bytes((ctypes.c_uint64 * n)(*staging_offsets))),
        (lay.nonces, b"".join(nonces)),
        (lay.aads, b"".join(aads)),
    ]
    if tags is not None:
        arrays.append((lay.tags, b"".join(tags)))
    for off, data in arrays:
        ctypes.memmove(host + off, data, len(data))


@dataclass(frozen=True, slots=True)
class PoolDescriptors:
    """Device addresses of a mapped pool's buffer table and segment table."""

    buffers: int
    segments: int
    num_segments: int
    block_bytes: int


def chunk_batch(
    *,
    key: int,
    pool: PoolDescriptors,
    desc: int,
    lay: RequestLayout,
    staging: int,
    start: int,
    stop: int,
    config: LaunchConfig,
    all_or_nothing: bool = False,
) -> KvsBatch:
    """The ``KvsBatch`` of blocks ``[start, stop)`` of a request whose descriptor area
    is at (device) address ``desc``: every per-block array pointer is advanced to
    ``start``; staging offsets stay absolute. ``all_or_nothing`` gates on the ok
    flags of exactly these blocks."""
    if not 0 <= start < stop <= lay.n:
        raise ValueError(f"bad block range [{start}, {stop}) of {lay.n}")
    return make_batch(
        key=key,
        buffers=pool.buffers,
        segments=pool.segments,
        pages=desc + lay.pages + 8 * start,
        nonces=desc + lay.nonces + NONCE_BYTES * start,
        aads=desc + lay.aads + AAD_BYTES * start,
        staging=staging,
        staging_offsets=desc + lay.staging_offsets + 8 * start,
        tags=desc + lay.tags + TAG_BYTES * start,
        ok=desc + lay.ok + start,
        ws=desc + lay.ws + WS_BYTES * start,
        block_bytes=pool.block_bytes,
        num_segments=pool.num_segments,
        num_blocks=stop - start,
        config=config,
        all_or_nothing=all_or_nothing,
    )


_CHECK_MESSAGES = {
    -1: "null pointer in descriptor",
    -2: "threads_per_cta must be a power of two in [32, 1024]",
    -3: "slice_blocks must be a positive multiple of threads_per_cta",
    -4: "ctas_per_block does not match block_bytes and slice_blocks",
    -5: "block too large",
    -6: "no segments",
}


def batch_check_code(b: KvsBatch) -> int:
    """The ``KVS_E_*`` code ``kvs_batch_check`` (kernels.cuh) returns for ``b``."""
    ptrs = [b.key, b.buffers, b.segments, b.pages, b.nonces, b.aads, b.staging]
    ptrs += [b.staging_offsets, b.tags, b.ok, b.ws]
    if not all(ptrs):
        return -1
    t = b.threads_per_cta
    if t < 32 or t > 1024 or t & (t - 1):
        return -2
    if b.slice_blocks == 0 or b.slice_blocks % t:
        return -3
    if b.block_bytes >= MAX_BLOCK_BYTES + 1:
        return -5
    if b.num_segments == 0:
        return -6
    m = (b.block_bytes + 15) // 16
    if b.ctas_per_block != max(1, -(-m // b.slice_blocks)):
        return -4
    return 0


def check_batch(b: KvsBatch) -> None:
    """Raise ValueError unless the kernels would accept ``b`` (their ``KVS_E_*``
    checks, done on the host so a bad descriptor never reaches the GPU), and
    the grid fits a 1-D launch."""
    rc = batch_check_code(b)
    if rc:
        raise ValueError(f"bad kernel descriptor: {_CHECK_MESSAGES[rc]}")
    if b.num_blocks == 0 or b.num_blocks * b.ctas_per_block >= 2**31:
        raise ValueError("bad kernel descriptor: grid size out of range")
