"""Registered engine KV pools: geometry, validation, and the registry.

A *block* is one page index across the whole pool: its plaintext is the
concatenation, in segment order, of each segment's bytes for that page (see
``Segment`` in the proto). Every check that protects the engine's memory
(page ranges, segment extents inside buffers, buffers inside the mapped
object) happens before a single byte is copied.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import heapq
import re
import secrets
import struct
import threading
from collections.abc import Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from kvseal.server.errors import BadRequest, CapacityExhausted, PoolNameTaken, UnknownPool, echo

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
    # PoolGeometry.block_bytes: required for an observer pool (no segments),
    # optional elsewhere (then a cross-check of the segments' sum).
    declared_block_bytes: int = 0

    @property
    def block_bytes(self) -> int:
        """Bytes per block: the segments' sum, or for an observer pool (which has
        none) the declared block bytes. Part of the namespace."""
        if not self.segments:
            return self.declared_block_bytes
        return sum(s.bytes for s in self.segments)

    def validate_observer(self) -> None:
        """Raise BadRequest unless this is an observer pool's geometry: no pages,
        buffers or segments, a dtype, and the observed pool's block bytes."""
        if self.num_pages or self.buffers or self.segments:
            raise BadRequest(
                "an observer pool has no memory: geometry.num_pages must be 0 and "
                "geometry.buffers and geometry.segments empty (state the observed pool's "
                "block size in geometry.block_bytes)"
            )
        if not 1 <= self.declared_block_bytes <= MAX_BLOCK_BYTES:
            raise BadRequest(
                f"an observer pool needs geometry.block_bytes in [1, {MAX_BLOCK_BYTES}] (the "
                f"observed pool's block bytes), got {self.declared_block_bytes}"
            )
        if not _DTYPE.fullmatch(self.dtype) or not _LAYOUT.fullmatch(self.layout):
            raise BadRequest(
                "geometry.dtype is required; dtype and layout are at most 64 "
                "printable ASCII characters"
            )

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
        # Within each buffer; the backend repeats this across buffers once it
        # knows which memory each one really is (names can alias).
        check_disjoint(
            [BufferMemory(i, 0, b.size) for i, b in enumerate(self.buffers)],
            self.segments,
            self.num_pages,
        )
        if self.block_bytes > MAX_BLOCK_BYTES:
            raise BadRequest(f"a block would be {self.block_bytes} bytes (limit {MAX_BLOCK_BYTES})")
        if self.declared_block_bytes and self.declared_block_bytes != self.block_bytes:
            raise BadRequest(
                f"geometry.block_bytes is {self.declared_block_bytes} but the segments add up "
                f"to {self.block_bytes} bytes per block"
            )


# ------------------------------------------------------------------ aliasing

# How many (segment pair, page) checks ``check_disjoint`` spends on segments of
# *different* page strides whose extents overlap (no engine layout has them;
# equal strides cost nothing like this) before it refuses the geometry.
ALIAS_CHECK_BUDGET = 1 << 18


@dataclass(frozen=True, slots=True)
class BufferMemory:
    """Where one pool buffer really lives, as the backend resolved it.

    ``identity`` names the underlying memory object (any hashable: the CPU
    backend uses the shm object's ``(st_dev, st_ino)``, the CUDA backend the
    allocation base from ``cuMemGetAddressRange``); two buffers with the same
    identity are the same memory whatever their names. ``start`` is the
    absolute byte offset of the buffer's byte 0 in that memory and ``size``
    its length (the segments were already checked to fit ``size``).
    """

    identity: Hashable
    start: int
    size: int


def check_disjoint(
    memory: Sequence[BufferMemory], segments: Sequence[SegmentSpec], num_pages: int
) -> None:
    """Raise BadRequest if any byte of memory belongs to two (segment, page)
    pairs: a restore into one page would then also rewrite another page (or
    another segment of the same page), which the request never named.

    ``memory[i]`` resolves ``geometry.buffers[i]``; segment ``s`` page ``p``
    covers ``[start + s.offset + p * s.page_stride, + s.bytes)`` of
    ``memory[s.buffer].identity``. Exact (legal layouts such as K/V segments
    interleaved within one page stride, or vLLM's ``[2, pages, ...]`` halves,
    pass), and cheap: segments of equal stride are compared in (page-stride
    lap, offset within the stride) coordinates with one sweep, never page by
    page; only segments of different strides with overlapping extents are
    checked page by page, within ``ALIAS_CHECK_BUDGET`` (beyond it the
    geometry is refused as too complex to prove safe). Validation of the
    geometry itself (``page_stride >= bytes`` when ``num_pages > 1``,
    segments inside buffers) is assumed done.
    """
    if num_pages < 1:
        raise BadRequest("geometry.num_pages must be positive")
    # With one page the stride never matters: give every segment the same one
    # (at least each one's length), so the equal-stride sweep handles them all.
    one_stride = max((s.bytes for s in segments), default=1) if num_pages == 1 else 0
    by_memory: dict[Hashable, list[_Run]] = {}
    for i, s in enumerate(segments):
        m = memory[s.buffer]
        if s.offset < 0 or s.offset + (num_pages - 1) * s.page_stride + s.bytes > m.size:
            raise BadRequest(f"geometry.segments[{i}] does not fit its buffer")
        stride = one_stride or s.page_stride
        run = _Run(i, s.buffer, m.start + s.offset, stride, s.bytes)
        by_memory.setdefault(m.identity, []).append(run)
    budget = [ALIAS_CHECK_BUDGET]
    for runs in by_memory.values():
        by_stride: dict[int, list[_Run]] = {}
        for r in runs:
            by_stride.setdefault(r.stride, []).append(r)
        for stride, group in by_stride.items():
            _sweep_equal_stride(group, stride, num_pages)
        if len(by_stride) > 1:
            _check_mixed_strides(runs, num_pages, budget)


@dataclass(frozen=True, slots=True)
class _Run:
    """One segment in absolute coordinates of its memory."""

    index: int  # in geometry.segments
    buffer: int
    start: int  # page 0's first byte
    stride: int
    bytes: int

    def end(self, num_pages: int) -> int:
        return self.start + (num_pages - 1) * self.stride + self.bytes


def _alias_error(a: _Run, b: _Run, byte: int) -> BadRequest:
    pa, pb_ = (byte - a.start) // a.stride, (byte - b.start) // b.stride
    same = (
        f"buffers {a.buffer} and {b.buffer} are the same memory"
        if a.buffer != b.buffer
        else f"both in buffer {a.buffer}"
    )
    return BadRequest(
        f"geometry segments overlap: page {pa} of segments[{a.index}] and page {pb_} of "
        f"segments[{b.index}] share memory ({same}): a restore into one page would rewrite "
        "another"
    )


def _sweep_equal_stride(group: list[_Run], stride: int, num_pages: int) -> None:
    """Exact check for segments sharing one stride T. Byte x is the point
    (x // T, x % T): segment a covers laps [a // T, + pages) at offsets
    [a % T, + bytes), wrapping into the next lap when it runs past T (bytes <=
    T, so at most two rectangles). Two segments share a byte iff two of their
    rectangles intersect: a sweep over laps keeps the active offset intervals,
    which must stay disjoint, in a sorted list."""
    if len(group) < 2:
        return
    # (lap_lo, lap_hi inclusive, off_lo, off_hi exclusive, run)
    rects: list[tuple[int, int, int, int, _Run]] = []
    for r in group:
        lap, off = divmod(r.start, stride)
        rects.append((lap, lap + num_pages - 1, off, min(off + r.bytes, stride), r))
        if off + r.bytes > stride:
            rects.append((lap + 1, lap + num_pages, 0, off + r.bytes - stride, r))
    # Events: removals (kind 0) at lap_hi + 1 sort before insertions (kind 1).
    events = sorted(
        [(lo, 1, k) for k, (lo, _, _, _, _) in enumerate(rects)]
        + [(hi + 1, 0, k) for k, (_, hi, _, _, _) in enumerate(rects)]
    )
    active: list[tuple[int, int, int]] = []  # (off_lo, off_hi, rect index), disjoint, sorted
    for lap, kind, k in events:
        lo, hi, run = rects[k][2], rects[k][3], rects[k][4]
        if kind == 0:
            active.remove((lo, hi, k))
            continue
        at = bisect.bisect_left(active, (lo, hi, k))
        for j in (at - 1, at):
            if 0 <= j < len(active):
                olo, ohi, ok = active[j]
                if olo < hi and lo < ohi:
                    raise _alias_error(rects[ok][4], run, lap * stride + max(lo, olo))
        active.insert(at, (lo, hi, k))


def _check_mixed_strides(runs: list[_Run], num_pages: int, budget: list[int]) -> None:
    """Exact check for pairs of segments with different strides whose extents
    overlap, page by page over the one with the larger stride (the fewer
    pages), at a bounded cost."""
    order = sorted(runs, key=lambda r: r.start)
    expiry: list[tuple[int, int]] = []  # heap of (extent end, position in order)
    active: dict[int, dict[int, _Run]] = {}  # stride -> {position: run}, extents live
    for pos, r in enumerate(order):
        while expiry and expiry[0][0] <= r.start:
            _, old = heapq.heappop(expiry)
            live = active[order[old].stride]
            del live[old]
            if not live:
                del active[order[old].stride]
        for stride, live in active.items():
            if stride == r.stride:
                continue  # the equal-stride sweep covered these
            for other in live.values():
                _check_pair(other, r, num_pages, budget)
        heapq.heappush(expiry, (r.end(num_pages), pos))
        active.setdefault(r.stride, {})[pos] = r


def _check_pair(a: _Run, b: _Run, num_pages: int, budget: list[int]) -> None:
    if a.stride < b.stride:
        a, b = b, a  # walk the pages of a, the larger stride
    lo, hi = max(a.start, b.start), min(a.end(num_pages), b.end(num_pages))
    if lo >= hi:
        return
    # a's pages that can reach [lo, hi): start < hi and start + bytes > lo.
    first = max(0, (lo - a.bytes - a.start) // a.stride + 1)
    last = min(num_pages - 1, (hi - 1 - a.start) // a.stride)
    budget[0] -= 1 + max(0, last - first + 1)  # a pair costs something even if empty
    if budget[0] < 0:
        raise BadRequest(
            f"geometry.segments[{a.index}] and segments[{b.index}] have different page strides "
            "and overlapping extents: too many pages to prove that no byte belongs to two "
            "pages; lay such segments out apart or give them one stride"
        )
    for p in range(first, last + 1):
        x = a.start + p * a.stride
        # b's first page that ends after x; it shares a byte iff it starts before x + bytes.
        q = max(0, (x - b.bytes - b.start) // b.stride + 1)
        if q < num_pages:
            y = b.start + q * b.stride
            if y < x + a.bytes:
                raise _alias_error(a, b, max(x, y))


@dataclass(frozen=True, slots=True)
class PoolSpec:
    name: str
    model_fingerprint: bytes
    geometry: Geometry
    backend: str  # "cpu" | "cuda"
    # An observer pool (RegisterPoolRequest.observer): a namespace without memory.
    observer: bool = False

    def validate(self) -> None:
        if not _POOL_NAME.fullmatch(self.name):
            raise BadRequest("name must be 1-128 chars of letters, digits, '.', '_', ':', '-'")
        if not 1 <= len(self.model_fingerprint) <= MAX_FINGERPRINT:
            raise BadRequest(f"model_fingerprint must be 1..{MAX_FINGERPRINT} bytes")
        if self.observer:
            self.geometry.validate_observer()
        else:
            self.geometry.validate(self.backend)

    def namespace(self) -> bytes:
        """Cache namespace: blocks are shared between pools with the same
        model fingerprint and the same block byte layout, and nowhere else.

        SHA-256 of ``"kvseal/namespace/v1\\0"``, then the model fingerprint, dtype
        and layout (each as a 4-byte big-endian length and its bytes), then
        tokens_per_page, num_layers, num_kv_heads, head_dim (4 bytes each) and
        block_bytes (8 bytes), big-endian. Pages, buffers and segment placement
        are not part of it, so an observer pool that states the same fields has
        the namespace of the pool it observes."""
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
class NoMemory:
    """The "mapping" of an observer pool: there is none (no backend was asked
    to map anything), so closing it releases nothing."""

    spec: PoolSpec

    def close(self) -> None:
        return


@dataclass(eq=False)
class Pool:
    pool_id: str
    spec: PoolSpec
    namespace: bytes
    mapped: MappedPool
    in_use: int = 0
    closed: bool = False
    owner_token: bytes = b""  # proves ownership of the name (see PoolRegistry.add)
    holds: int = 0  # open HoldPool streams: a held name is not taken over
    held_ever: bool = False  # a HoldPool was opened on it (see remove_if_never_held)
    # Tenants this pool's requests named, first-named first, each with when a
    # request last named it (time.monotonic; SealedCache.note_tenant): the
    # tenants whose events its WatchEvents stream may carry.
    tenants: dict[bytes, float] = field(default_factory=dict)
    # This pool's own requests, by ``Counters`` field name (SealedCache._count,
    # under its counter lock): what a Stats call scoped to the pool reports.
    counters: dict[str, int] = field(default_factory=dict)

    @functools.cached_property
    def block_bytes(self) -> int:
        # Once: the geometry sums its segments on every read, and each transfer
        # reads it a few times (the spec never changes for a registered pool).
        return self.spec.geometry.block_bytes

    @property
    def num_pages(self) -> int:
        return self.spec.geometry.num_pages

    @property
    def observer(self) -> bool:
        return self.spec.observer


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

    def add(
        self, spec: PoolSpec, namespace: bytes, mapped: MappedPool, owner_token: bytes = b""
    ) -> tuple[Pool, Pool | None]:
        """Register; a pool with the same name is replaced (and returned), unless
        it is held (an open HoldPool) and ``owner_token`` is not its owner's:
        then PoolNameTaken. CapacityExhausted when ``max_pools`` are registered.

        The check and the replacement are one step under the registry lock, as is
        :meth:`hold`, so a hold and a takeover cannot both succeed. On any error
        nothing changed and ``mapped`` still belongs to the caller (who must close
        it). The new pool keeps the old owner token when the owner replaced its own
        registration, so a reply it never saw does not lock it out of its name;
        anyone else gets a fresh random token."""
        pool_id = f"{spec.name}#{secrets.token_hex(6)}"
        with self._lock:
            old = next((p for p in self._by_id.values() if p.spec.name == spec.name), None)
            owner = (
                old is not None
                and bool(owner_token)
                and secrets.compare_digest(owner_token, old.owner_token)
            )
            if old is not None and old.holds > 0 and not owner:
                raise PoolNameTaken(
                    f"pool name {spec.name!r} is taken: pool {old.pool_id!r} is held by the "
                    "engine that registered it (an open HoldPool); give each engine its own "
                    "name, or register again once that engine has exited"
                )
            if old is None and len(self._by_id) >= self._max:
                raise CapacityExhausted(f"too many pools registered (limit {self._max})")
            if old is not None:
                del self._by_id[old.pool_id]
            token = old.owner_token if owner and old is not None else secrets.token_bytes(16)
            pool = Pool(pool_id, spec, namespace, mapped, owner_token=token)
            self._by_id[pool_id] = pool
        if old is not None:
            self._retire(old)
        return pool, old

    def hold(self, pool_id: str) -> None:
        """Count one more open hold on a registered pool (UnknownPool if it is
        not registered); pair with :meth:`release`."""
        with self._lock:
            pool = self._by_id.get(pool_id)
            if pool is None:
                raise UnknownPool(f"pool {echo(pool_id)} is not registered")
            pool.holds += 1
            pool.held_ever = True

    def release(self, pool_id: str) -> None:
        """End one hold counted by :meth:`hold` (nothing to do if the pool is gone:
        its count went with it)."""
        with self._lock:
            pool = self._by_id.get(pool_id)
            if pool is not None and pool.holds > 0:
                pool.holds -= 1

    def remove_if_never_held(self, pool_id: str) -> Pool | None:
        """Unregister the pool if it is registered and no hold was ever opened on
        it (one step under the registry lock, as :meth:`hold`: a hold and this
        removal cannot both succeed); the removed pool, or None."""
        with self._lock:
            pool = self._by_id.get(pool_id)
            if pool is None or pool.held_ever:
                return None
            del self._by_id[pool_id]
        self._retire(pool)
        return pool

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
