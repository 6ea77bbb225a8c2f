"""Registered engine KV pools: geometry, validation, and the registry.

A *block* is one page index across the whole pool: its plaintext is the
concatenation, in segment order, of each segment's bytes for that page (see
``Segment`` in the proto). Every check that protects the engine's memory
(page ranges, segment extents inside buffers, buffers inside the mapped
object) happens before a single byte is copied.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from kvseal.server.errors import BadRequest, UnknownPool, echo

MAX_BUFFERS = 4096
MAX_SEGMENTS = 65536
MAX_PAGES = 2**31 - 1
MAX_BLOCK_BYTES = 1 << 30
MAX_FINGERPRINT = 256
# Always used with fullmatch: ``$`` would also accept a trailing newline.
_SHM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,250}")
_POOL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:-]{0,127}")
# dtype and layout end up in logs: printable ASCII only (no newline, NUL, escapes).
_DTYPE = re.compile(r"[ -~]{1,64}")
_LAYOUT = re.compile(r"[ -~]{0,64}")


@dataclass(frozen=True, slots=True)
class BufferSpec:
    shm_name: str | None
    cuda_ipc_handle: bytes | None
    offset: int
    size: int
    device: int = 0


@dataclass(frozen=True, slots=True)
class SegmentSpec:
    buffer: int
    offset: int
    page_stride: int
    bytes: int


@dataclass(frozen=True, slots=True)
class Geometry:
    num_pages: int
    tokens_per_page: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    layout: str
    buffers: tuple[BufferSpec, ...]
    segments: tuple[SegmentSpec, ...]

    @property
    def block_bytes(self) -> int:
        return sum(s.bytes for s in self.segments)

    def validate(self, backend: str) -> None:
        """Raise BadRequest naming the first problem; ``backend`` is "cpu" or
        "cuda" (which kind of buffer handle is required)."""
        if not 1 <= self.num_pages <= MAX_PAGES:
            raise BadRequest(
                f"geometry.num_pages must be in [1, {MAX_PAGES}], got {self.num_pages}"
            )
        if not self.buffers or len(self.buffers) > MAX_BUFFERS:
            raise BadRequest(f"geometry.buffers must have 1..{MAX_BUFFERS} entries")
        if not self.segments or len(self.segments) > MAX_SEGMENTS:
            raise BadRequest(f"geometry.segments must have 1..{MAX_SEGMENTS} entries")
        if not _DTYPE.fullmatch(self.dtype) or not _LAYOUT.fullmatch(self.layout):
            raise BadRequest(
                "geometry.dtype is required; dtype and layout are at most 64 "
                "printable ASCII characters"
            )
        for i, b in enumerate(self.buffers):
            if backend == "cpu":
                if b.shm_name is None or not _SHM_NAME.fullmatch(b.shm_name):
                    raise BadRequest(
                        f"geometry.buffers[{i}] needs a shm_name of letters, digits, '.', '_', '-' "
                        "(no '/') on the CPU backend"
                    )
            elif b.cuda_ipc_handle is None or len(b.cuda_ipc_handle) != 64:
                raise BadRequest(
                    f"geometry.buffers[{i}] needs a 64-byte cuda_ipc_handle on the CUDA backend"
                )
            if b.size <= 0:
                raise BadRequest(f"geometry.buffers[{i}].size must be positive")
        for i, s in enumerate(self.segments):
            where = f"geometry.segments[{i}]"
            if s.buffer >= len(self.buffers):
                raise BadRequest(
                    f"{where}.buffer={s.buffer} but there are {len(self.buffers)} buffers"
                )
            if s.bytes <= 0:
                raise BadRequest(f"{where}.bytes must be positive")
            if self.num_pages > 1 and s.page_stride < s.bytes:
                raise BadRequest(
                    f"{where}: page_stride {s.page_stride} < bytes {s.bytes} (pages would overlap)"
                )
            end = s.offset + (self.num_pages - 1) * s.page_stride + s.bytes
            size = self.buffers[s.buffer].size
            if end > size:
                raise BadRequest(
                    f"{where} reaches byte {end} of buffer {s.buffer}, which has {size} bytes: "
                    "the geometry does not fit the buffer"
                )
        self._check_disjoint()
        if self.block_bytes > MAX_BLOCK_BYTES:
            raise BadRequest(f"a block would be {self.block_bytes} bytes (limit {MAX_BLOCK_BYTES})")

    def _check_disjoint(self) -> None:
        """No byte of the pool may belong to two (segment, page) pairs, or a
        restore into one page would also rewrite another.

        Per buffer: segments whose whole extents (all pages) do not overlap
        are fine. Segments whose extents do overlap (pages interleaved, e.g.
        a [pages, K/V, ...] tensor) must share one stride, and their page-0
        spans must be disjoint and fit inside one stride: then every page's
        spans tile a separate stride-sized window. Anything else is refused
        (kvseal cannot cheaply prove it safe).
        """
        by_buffer: dict[int, list[SegmentSpec]] = {}
        for s in self.segments:
            by_buffer.setdefault(s.buffer, []).append(s)
        last = self.num_pages - 1
        for buf, segs in by_buffer.items():
            segs.sort(key=lambda s: s.offset)
            group: list[SegmentSpec] = []
            group_end = -1
            for seg in [*segs, None]:
                if seg is not None and seg.offset < group_end:
                    group.append(seg)
                    group_end = max(group_end, seg.offset + last * seg.page_stride + seg.bytes)
                    continue
                if len(group) > 1:
                    self._check_interleaved(buf, group)
                if seg is not None:
                    group = [seg]
                    group_end = seg.offset + last * seg.page_stride + seg.bytes

    def _check_interleaved(self, buf: int, group: list[SegmentSpec]) -> None:
        stride = group[0].page_stride
        window_end = group[0].offset + stride
        prev_end = group[0].offset
        for s in group:
            if s.page_stride != stride or s.offset < prev_end or s.offset + s.bytes > window_end:
                raise BadRequest(
                    f"segments of buffer {buf} overlap: some page's bytes would belong to two "
                    "pages or two segments (overlapping pages)"
                )
            prev_end = s.offset + s.bytes


@dataclass(frozen=True, slots=True)
class PoolSpec:
    name: str
    model_fingerprint: bytes
    geometry: Geometry
    backend: str  # "cpu" | "cuda"

    def validate(self) -> None:
        if not _POOL_NAME.fullmatch(self.name):
            raise BadRequest("name must be 1-128 chars of letters, digits, '.', '_', ':', '-'")
        if not 1 <= len(self.model_fingerprint) <= MAX_FINGERPRINT:
            raise BadRequest(f"model_fingerprint must be 1..{MAX_FINGERPRINT} bytes")
        self.geometry.validate(self.backend)

    def namespace(self) -> bytes:
        """Cache namespace: blocks are shared between pools with the same
        model fingerprint and the same block byte layout, and nowhere else."""
        g = self.geometry
        h = hashlib.sha256(b"kvseal/namespace/v1\x00")
        for part in (self.model_fingerprint, g.dtype.encode(), g.layout.encode()):
            h.update(struct.pack(">I", len(part)) + part)
        h.update(
            struct.pack(
                ">IIIIQ", g.tokens_per_page, g.num_layers, g.num_kv_heads, g.head_dim, g.block_bytes
            )
        )
        return h.digest()


class MappedPool(Protocol):
    """A backend's view of one registered pool's memory."""

    spec: PoolSpec

    def close(self) -> None:
        """Release the mapping. Called once, when no request uses the pool."""


@dataclass(eq=False)
class Pool:
    pool_id: str
    spec: PoolSpec
    namespace: bytes
    mapped: MappedPool
    in_use: int = 0
    closed: bool = False
    # Tenants this pool's requests named, oldest first (SealedCache.note_tenant):
    # the tenants whose events its WatchEvents stream may carry.
    tenants: dict[bytes, None] = field(default_factory=dict)

    @property
    def block_bytes(self) -> int:
        return self.spec.geometry.block_bytes

    @property
    def num_pages(self) -> int:
        return self.spec.geometry.num_pages


class PoolRegistry:
    """pool id -> Pool. A pool being used by requests is closed only when the
    last one finishes (``use`` is a lease), so unregistering or replacing a
    pool never pulls a mapping from under a copy."""

    def __init__(self, max_pools: int) -> None:
        self._lock = threading.Lock()
        self._by_id: dict[str, Pool] = {}
        self._max = max_pools

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)

    def __contains__(self, pool_id: object) -> bool:
        with self._lock:
            return pool_id in self._by_id

    def add(self, spec: PoolSpec, namespace: bytes, mapped: MappedPool) -> tuple[Pool, Pool | None]:
        """Register; a pool with the same name is replaced (and returned)."""
        pool_id = f"{spec.name}#{secrets.token_hex(6)}"
        with self._lock:
            old = next((p for p in self._by_id.values() if p.spec.name == spec.name), None)
            if old is None and len(self._by_id) >= self._max:
                raise BadRequest(f"too many pools registered (limit {self._max})")
            if old is not None:
                del self._by_id[old.pool_id]
            pool = Pool(pool_id, spec, namespace, mapped)
            self._by_id[pool_id] = pool
        if old is not None:
            self._retire(old)
        return pool, old

    def remove(self, pool_id: str) -> Pool:
        with self._lock:
            pool = self._by_id.pop(pool_id, None)
        if pool is None:
            raise UnknownPool(f"pool {echo(pool_id)} is not registered")
        self._retire(pool)
        return pool

    def _retire(self, pool: Pool) -> None:
        with self._lock:
            pool.closed = True
            close_now = pool.in_use == 0
        if close_now:
            pool.mapped.close()

    @contextmanager
    def use(self, pool_id: str) -> Iterator[Pool]:
        with self._lock:
            pool = self._by_id.get(pool_id)
            if pool is None:
                raise UnknownPool(
                    f"pool {echo(pool_id)} is not registered (unregistered, replaced, or the "
                    "daemon restarted): register it again"
                )
            pool.in_use += 1
        try:
            yield pool
        finally:
            with self._lock:
                pool.in_use -= 1
                close_now = pool.closed and pool.in_use == 0
            if close_now:
                pool.mapped.close()

    def all(self) -> list[Pool]:
        with self._lock:
            return list(self._by_id.values())
