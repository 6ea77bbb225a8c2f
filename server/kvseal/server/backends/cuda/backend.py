"""The CUDA backend: seal and verify KV blocks on the GPU (cuda-python driver API).

It keeps the :class:`~kvseal.server.backends.cpu.backend.Backend` contract (see that module):
``seal_blocks`` returns one :class:`SealRecord` per block or raises (then every nonce
it drew is burnt and no extent holds a valid block); ``open_blocks`` authenticates
every block and writes nothing to the engine's pool unless all of them verified.

Data path of one request (every stage is a constant number of launches/copies,
whatever the block count):

offload (seal)
    poll the engine's IPC event until it completes (host side, before the backend
    lock; at most ``engine_event_timeout``) -> ONE H2D of the descriptors (pages, staging
    offsets, nonces, AADs) -> per chunk: ``kvseal_seal`` into device staging ->
    per chunk, on the copy stream: DMA staging -> host extents (runs of adjacent
    extents are merged into one copy) -> ONE D2H of the tags -> synchronise.
    Kernels for all chunks are queued before the first D2H is issued, because in
    CC mode a D2H blocks the issuing thread: chunk i+1 is sealed while chunk i
    crosses PCIe.
restore (verify + open)
    ONE H2D of descriptors (also the expected tags) -> per chunk: DMA host
    extents -> device staging (the snapshot: host memory is read exactly once),
    ``kvseal_verify`` on that chunk -> poll the engine's event (host side; copies
    and verification overlap with the engine's remaining work) ->
    ``kvseal_open`` with ``all_or_nothing=1`` over the whole request -> ONE D2H
    of the verdicts -> synchronise (the RPC replies only once the plaintext is in
    the pages).

Keys: :class:`DeviceKeySource` (``BlockSealer``) owns them. The backend asks for the
32-byte key of an epoch once, into its own pinned buffer, wiped right after a
synchronous upload; ``kvseal_key_setup`` expands it into a ``KvsKeyCtx`` that lives
in device memory only, and the raw key's device copy is zeroed on the same stream.
Contexts of retired epochs are zeroed and freed: at the start of every request, and
at once (``retire_keys``) when a drop destroyed a tenant's key scope.

Concurrency: requests are serialised by one lock (the staging and descriptor
buffers are shared, and copies within one context serialise in CC mode anyway).

Everything that touches the driver sits behind :class:`Device`. :class:`CudaDevice`
is the real one (cuda-python, imported lazily so CPU-only installs never load it);
:class:`EmulatedDevice` runs the same request logic against host memory and the
g++-built kernel emulator, which is how the CPU test-suite checks descriptor
building, chunking, epoch grouping and the all-or-nothing rule without a GPU.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from kvseal.server.backends.base import BlockIO, Region, note_written
from kvseal.server.backends.cuda.emulated import (
    AAD_BYTES,
    MAX_BLOCK_BYTES,
    NONCE_BYTES,
    TAG_BYTES,
    KvsBatch,
    KvsBlockWs,
    KvsKeyCtx,
    LaunchConfig,
    Segment,
    make_batch,
    segment_table,
)
from kvseal.server.backends.cuda.region import CudaHostRegion
from kvseal.server.deadline import NO_DEADLINE, Deadline
from kvseal.server.errors import (
    BadRequest,
    DeadlinePassed,
    EngineNotReady,
    HandleUnusable,
    ShuttingDown,
)
from kvseal.server.pools import BufferMemory, MappedPool, PoolSpec, check_disjoint
from kvseal.server.sealing import KEY_BYTES, SealRecord

log = logging.getLogger("kvseal.cuda")

__all__ = [
    "BackendUnavailable",
    "CudaBackend",
    "CudaDevice",
    "CudaError",
    "CudaMappedPool",
    "Device",
    "DeviceKeySource",
    "EmulatedDevice",
    "RequestLayout",
    "check_batch",
    "chunk_batch",
    "decode_torch_ipc_handle",
    "fill_descriptors",
    "plan_runs",
    "request_layout",
    "split_chunks",
    "staging_layout",
]

IPC_HANDLE_BYTES = 64
STAGING_ALIGN = 256  # staging slots: 16-byte (uint4) aligned kernels, DMA-friendly
SECTION_ALIGN = 256
DEFAULT_MAX_CHUNKS = 4
DEFAULT_MIN_CHUNK_BYTES = 16 << 20
_WS_BYTES = ctypes.sizeof(KvsBlockWs)
_KEYCTX_BYTES = ctypes.sizeof(KvsKeyCtx)
DEFAULT_ENGINE_EVENT_TIMEOUT = 30.0  # seconds an engine's IPC event may stay pending
# CUresult values after which the context is unusable (sticky errors): restart.
# 214 ECC uncorrectable, 700 illegal address, 702 launch timeout, 709 context
# destroyed, 710-719 traps/misaligned/launch failure, 999 unknown (assume the worst).
_STICKY = frozenset({214, 700, 702, 709, 710, 714, 715, 716, 717, 718, 719, 999})
# CUresult values with a specific hint when an IPC memory handle cannot be opened.
_CU_INVALID_DEVICE = 101
_CU_INVALID_CONTEXT = 201
_CU_ALREADY_MAPPED = 208


class CudaError(RuntimeError):
    """A CUDA driver call failed. ``code`` is the CUresult value."""

    def __init__(self, message: str, code: int = -1) -> None:
        super().__init__(message)
        self.code = code


def _request_scope(blocks: Sequence[BlockIO]) -> tuple[bytes, bytes]:
    """The one key scope (namespace, tenant) of a seal batch; ValueError if the
    batch mixes scopes (the cache never does: one request is one pool and tenant)."""
    scope = blocks[0].ad.scope
    if any(b.ad.scope != scope for b in blocks):
        raise ValueError("a seal batch must be of one namespace and one tenant")
    return scope


class BackendUnavailable(RuntimeError):
    """The CUDA backend cannot be built here; the message says why and what to do."""


# ----------------------------------------------------------------------------------------
# The key API this backend needs from BlockSealer
# ----------------------------------------------------------------------------------------


@runtime_checkable
class DeviceKeySource(Protocol):
    """What the CUDA backend needs from :class:`~kvseal.server.sealing.BlockSealer`.

    - ``allocate_for_device(n, scope)``: draw ``n`` fresh nonces, all under ONE epoch
      of the key scope ``(namespace, tenant)`` (its current one, after rotating if
      fewer than ``n`` seals are left before ``rekey_after``); counts them as ``n``
      live blocks of that epoch. A seal batch is single-scope (one request = one
      pool namespace and one tenant). Thread-safe.
    - ``export_key_to(epoch, dst)``: write the epoch's 32-byte key into ``dst``
      (a caller-owned ``ctypes`` ``c_char * 32`` buffer, which the caller wipes).
      Raises ``SealingError`` (``KeyDestroyed``) if the epoch is gone. Never
      returns the key.
    - ``live_epoch_ids()``: ids of epochs whose key still exists (unique across
      scopes); a device key context of any other epoch is wiped and freed.
    - ``require_live(epochs)``: raise ``KeyDestroyed`` if any epoch is gone (a
      drop destroyed its scope); checked right before the open pass writes pages.
    - ``forget(epoch)``: one block of ``epoch`` is gone (also burns an unused nonce).
    """

    def allocate_for_device(
        self, n: int, scope: tuple[bytes, bytes]
    ) -> tuple[int, list[bytes]]: ...

    def export_key_to(self, epoch: int, dst: ctypes.Array[ctypes.c_char]) -> None: ...

    def live_epoch_ids(self) -> frozenset[int]: ...

    def require_live(self, epoch_ids: Iterable[int]) -> None: ...

    def forget(self, epoch_index: int) -> None: ...


# ----------------------------------------------------------------------------------------
# Pure descriptor arithmetic (tested on the CPU)
# ----------------------------------------------------------------------------------------


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
    sizes = (8 * n, 8 * n, NONCE_BYTES * n, AAD_BYTES * n, TAG_BYTES * n, n, _WS_BYTES * n)
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
        ws=desc + lay.ws + _WS_BYTES * start,
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


def decode_torch_ipc_handle(raw: bytes) -> bytes:
    """The 64-byte ``cudaIpcMemHandle_t`` inside what torch's ``_share_cuda_`` returns.

    torch >= 2.2 prefixes a version byte and a type byte (``'c'``: cudaMalloc
    memory, ``'e'``: an expandable segment, which legacy IPC cannot open); older
    torch returns the bare 64 bytes. Raises ValueError naming the fix."""
    if len(raw) == IPC_HANDLE_BYTES:
        return raw
    if len(raw) >= 2 and raw[1] == ord("e"):
        raise ValueError(
            "the tensor lives in a PyTorch expandable segment (cuMemCreate memory), which "
            "legacy CUDA IPC cannot export: start the engine with "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False (or allocate the KV pool "
            "with cudaMalloc)"
        )
    if len(raw) == IPC_HANDLE_BYTES + 2 and raw[1] == ord("c"):
        return raw[2:]
    raise ValueError(f"unrecognised CUDA IPC handle ({len(raw)} bytes)")


def check_no_alias(
    buffers: Sequence[tuple[int, int, int]], segments: Sequence[Any], num_pages: int
) -> None:
    """Raise BadRequest if two (page, segment) pairs of a pool share a byte of
    device memory, across buffers too. ``buffers[i]`` is ``(identity, start,
    end)``: the CUDA allocation base holding buffer i and the buffer's absolute
    device range. The exact check is the backend-independent
    :func:`kvseal.server.pools.check_disjoint`."""
    check_disjoint(
        [BufferMemory(ident, start, end - start) for ident, start, end in buffers],
        segments,
        num_pages,
    )


# ----------------------------------------------------------------------------------------
# Device abstraction
# ----------------------------------------------------------------------------------------


class Device(Protocol):
    """The driver operations the backend uses. Addresses are plain ints; streams and
    events are opaque. ``*_async`` operations are ordered on their stream; ``sync``
    waits for a stream. Every method raises :class:`CudaError` on failure."""

    name: str
    arch: str
    copy_stream: Any
    compute_stream: Any

    def make_current(self) -> None: ...

    def alloc(self, nbytes: int) -> int: ...

    def free(self, ptr: int) -> None: ...

    def host_alloc(self, nbytes: int, *, mapped: bool) -> int: ...

    def host_free(self, ptr: int) -> None: ...

    def host_register(self, ptr: int, nbytes: int, *, mapped: bool) -> None: ...

    def host_unregister(self, ptr: int) -> None: ...

    def host_device_pointer(self, ptr: int) -> int: ...

    def memset_async(self, ptr: int, nbytes: int, stream: Any) -> None: ...

    def h2d_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None: ...

    def d2h_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None: ...

    def launch(
        self, kernel: str, grid: int, threads: int, args: Sequence[Any], stream: Any
    ) -> None: ...

    def new_event(self) -> Any: ...

    def destroy_event(self, event: Any) -> None: ...

    def record(self, event: Any, stream: Any) -> None: ...

    def wait(self, stream: Any, event: Any) -> None: ...

    def sync(self, stream: Any) -> None: ...

    def query_event(self, event: Any) -> bool:
        """True once all work captured by the event's last record has completed."""
        ...

    def open_ipc_event(self, handle: bytes) -> Any: ...

    def open_ipc_mem(self, handle: bytes) -> tuple[int, int]:
        """Map an IPC memory handle: (address, bytes from it to the allocation's end).
        Raises CudaError (code 101) if the memory lives on another GPU; nothing
        stays mapped then."""
        ...

    def close_ipc_mem(self, ptr: int) -> None: ...

    def address_range(self, ptr: int) -> tuple[int, int]:
        """(base, bytes) of the device allocation that contains ``ptr``
        (``cuMemGetAddressRange``): the identity of the memory behind a mapping."""
        ...

    def close(self) -> None: ...


class CudaDevice:
    """:class:`Device` over ``cuda.bindings.driver`` for one GPU's primary context.

    Creates two non-blocking streams (copy, compute) and loads the kernels compiled
    by NVRTC (``compile.compile_kernels``, cached on disk by source hash + arch).
    The context is made current on the calling thread by :meth:`make_current`
    (gRPC calls arrive on any thread). Raises :class:`BackendUnavailable` when the
    driver, the device or the kernels are not usable.
    """

    def __init__(self, ordinal: int) -> None:
        from kvseal.server.backends.cuda import probe  # noqa: PLC0415

        try:
            self._cu: Any = probe.driver_module()
        except ImportError as e:
            raise BackendUnavailable(f"cuda-python (cuda-bindings) is not installed: {e}") from e
        cu = self._cu
        try:
            self._check(cu.cuInit(0), "cuInit")
            self._dev = self._check(cu.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
            self._ctx = self._check(
                cu.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain"
            )
        except (CudaError, RuntimeError) as e:
            raise BackendUnavailable(f"cannot open GPU {ordinal}: {e}") from e
        self.ordinal = ordinal
        self._module: Any = None
        self.copy_stream: Any = None
        self.compute_stream: Any = None
        try:
            self.make_current()
            raw = self._check(cu.cuDeviceGetName(256, self._dev), "cuDeviceGetName")
            self.name = raw.split(b"\0", 1)[0].decode(errors="replace")
            attr = cu.CUdevice_attribute
            major = self._check(
                cu.cuDeviceGetAttribute(
                    attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self._dev
                ),
                "cuDeviceGetAttribute",
            )
            minor = self._check(
                cu.cuDeviceGetAttribute(
                    attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self._dev
                ),
                "cuDeviceGetAttribute",
            )
            self.arch = f"sm_{major}{minor}"
            flags = int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
            self.copy_stream = self._check(cu.cuStreamCreate(flags), "cuStreamCreate")
            self.compute_stream = self._check(cu.cuStreamCreate(flags), "cuStreamCreate")
            self._load_kernels()
        except BaseException:
            self.close()
            raise

    # -- plumbing -----------------------------------------------------------------------

    def _check(self, result: Any, what: str) -> Any:
        """Unpack ``(CUresult, *values)``; raise CudaError naming the call on failure."""
        err, *values = result if isinstance(result, tuple) else (result,)
        code = int(err)
        if code != 0:
            try:
                name = self._cu.CUresult(code).name
            except ValueError:
                name = "CUresult"
            raise CudaError(f"{what} failed: {name} ({code})", code)
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    def _load_kernels(self) -> None:
        from kvseal.server.backends.cuda import compile as kc  # noqa: PLC0415 - optional dependency

        try:
            try:
                compiled = kc.compile_kernels(self.arch)
            except kc.NvrtcError:
                # An architecture this NVRTC cannot target as CUBIN: ship PTX for the
                # newest target it knows and let the driver JIT it.
                compiled = kc.compile_kernels(kc.DEFAULT_ARCH, output="ptx")
        except (kc.NvrtcUnavailable, kc.NvrtcError) as e:
            raise BackendUnavailable(f"cannot compile the kernels with NVRTC: {e}") from e
        image = ctypes.create_string_buffer(compiled.image)  # NUL-terminated (PTX needs it)
        try:
            self._module = self._check(
                self._cu.cuModuleLoadData(ctypes.addressof(image)), "cuModuleLoadData"
            )
        except CudaError as e:
            # Typically a driver older than the NVRTC that built the image (e.g.
            # CUDA_ERROR_UNSUPPORTED_PTX_VERSION): say which versions met.
            err, drv = self._cu.cuDriverGetVersion()
            driver = f"{int(drv) // 1000}.{int(drv) % 1000 // 10}" if int(err) == 0 else "?"
            nv = ".".join(map(str, compiled.nvrtc_version))
            raise BackendUnavailable(
                f"the driver cannot load the {compiled.output} {compiled.arch} image built by "
                f"NVRTC {nv} ({e}); the driver supports CUDA {driver}: use a cuda-python/NVRTC "
                "no newer than the driver (or update the driver)"
            ) from e
        self._functions = {
            name: self._check(
                self._cu.cuModuleGetFunction(self._module, name.encode()),
                f"cuModuleGetFunction({name})",
            )
            for name in kc.KERNEL_NAMES
        }
        self.image_kind = f"{compiled.output} {compiled.arch}" + (
            " (cached)" if compiled.cached else ""
        )

    # -- Device -------------------------------------------------------------------------

    def make_current(self) -> None:
        self._check(self._cu.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def alloc(self, nbytes: int) -> int:
        return int(self._check(self._cu.cuMemAlloc(max(1, nbytes)), f"cuMemAlloc({nbytes})"))

    def free(self, ptr: int) -> None:
        self._check(self._cu.cuMemFree(ptr), "cuMemFree")

    def host_alloc(self, nbytes: int, *, mapped: bool) -> int:
        flags = self._cu.CU_MEMHOSTALLOC_PORTABLE
        if mapped:
            flags |= self._cu.CU_MEMHOSTALLOC_DEVICEMAP
        return int(self._check(self._cu.cuMemHostAlloc(max(1, nbytes), flags), "cuMemHostAlloc"))

    def host_free(self, ptr: int) -> None:
        self._check(self._cu.cuMemFreeHost(ptr), "cuMemFreeHost")

    def host_register(self, ptr: int, nbytes: int, *, mapped: bool) -> None:
        flags = self._cu.CU_MEMHOSTREGISTER_PORTABLE
        if mapped:
            flags |= self._cu.CU_MEMHOSTREGISTER_DEVICEMAP
        self._check(self._cu.cuMemHostRegister(ptr, nbytes, flags), "cuMemHostRegister")

    def host_unregister(self, ptr: int) -> None:
        self._check(self._cu.cuMemHostUnregister(ptr), "cuMemHostUnregister")

    def host_device_pointer(self, ptr: int) -> int:
        return int(
            self._check(self._cu.cuMemHostGetDevicePointer(ptr, 0), "cuMemHostGetDevicePointer")
        )

    def memset_async(self, ptr: int, nbytes: int, stream: Any) -> None:
        if nbytes:
            self._check(self._cu.cuMemsetD8Async(ptr, 0, nbytes, stream), "cuMemsetD8Async")

    def h2d_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self._check(self._cu.cuMemcpyHtoDAsync(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")

    def d2h_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self._check(self._cu.cuMemcpyDtoHAsync(dst, src, nbytes, stream), "cuMemcpyDtoHAsync")

    def launch(
        self, kernel: str, grid: int, threads: int, args: Sequence[Any], stream: Any
    ) -> None:
        # kernelParams: an array of pointers, one per parameter, each pointing at the
        # argument's bytes (KvsBatch travels by value: the driver copies the struct).
        params = (ctypes.c_void_p * len(args))(*(ctypes.addressof(a) for a in args))
        self._check(
            self._cu.cuLaunchKernel(
                self._functions[kernel],
                grid,
                1,
                1,
                threads,
                1,
                1,
                0,
                stream,
                ctypes.addressof(params),
                0,
            ),
            f"cuLaunchKernel({kernel})",
        )

    def new_event(self) -> Any:
        flags = int(self._cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        return self._check(self._cu.cuEventCreate(flags), "cuEventCreate")

    def destroy_event(self, event: Any) -> None:
        self._check(self._cu.cuEventDestroy(event), "cuEventDestroy")

    def record(self, event: Any, stream: Any) -> None:
        self._check(self._cu.cuEventRecord(event, stream), "cuEventRecord")

    def wait(self, stream: Any, event: Any) -> None:
        self._check(self._cu.cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent")

    def sync(self, stream: Any) -> None:
        self._check(self._cu.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def query_event(self, event: Any) -> bool:
        (err,) = self._cu.cuEventQuery(event)
        code = int(err)
        if code == int(self._cu.CUresult.CUDA_ERROR_NOT_READY):
            return False
        self._check((err,), "cuEventQuery")
        return True

    def open_ipc_event(self, handle: bytes) -> Any:
        h = self._cu.CUipcEventHandle()
        h.reserved = handle
        return self._check(self._cu.cuIpcOpenEventHandle(h), "cuIpcOpenEventHandle")

    def open_ipc_mem(self, handle: bytes) -> tuple[int, int]:
        h = self._cu.CUipcMemHandle()
        h.reserved = handle
        flags = int(self._cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        ptr = int(self._check(self._cu.cuIpcOpenMemHandle(h, flags), "cuIpcOpenMemHandle"))
        try:
            # Where the memory really lives, in this process's numbering: the engine's
            # device index may differ (its own CUDA_VISIBLE_DEVICES), and with lazy
            # peer access another GPU's memory would map fine and run over NVLink.
            # A driver that cannot answer for IPC memory only costs the check (it
            # guards performance and clarity, not confidentiality).
            try:
                owner = int(
                    self._check(
                        self._cu.cuPointerGetAttribute(
                            self._cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                            ptr,
                        ),
                        "cuPointerGetAttribute(DEVICE_ORDINAL)",
                    )
                )
            except CudaError as e:
                if e.code in _STICKY:
                    raise
                log.warning("cannot tell which GPU holds an IPC mapping: %s", e)
                owner = self.ordinal
            if owner != self.ordinal:
                raise CudaError(
                    f"the memory is on GPU {owner} of this machine, this daemon drives "
                    f"GPU {self.ordinal}",
                    _CU_INVALID_DEVICE,
                )
            base, size = self._check(self._cu.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
        except CudaError:
            self.close_ipc_mem(ptr)
            raise
        # The handle names the whole allocation, so the mapping starts at its base.
        return ptr, int(size) - (ptr - int(base))

    def close_ipc_mem(self, ptr: int) -> None:
        self._check(self._cu.cuIpcCloseMemHandle(ptr), "cuIpcCloseMemHandle")

    def address_range(self, ptr: int) -> tuple[int, int]:
        base, size = self._check(self._cu.cuMemGetAddressRange(ptr), "cuMemGetAddressRange")
        return int(base), int(size)

    def close(self) -> None:
        """Release streams, module and the primary context; best effort, idempotent."""
        cu = self._cu
        for s in (self.copy_stream, self.compute_stream):
            if s is not None:
                cu.cuStreamDestroy(s)
        self.copy_stream = self.compute_stream = None
        if self._module is not None:
            cu.cuModuleUnload(self._module)
            self._module = None
        if getattr(self, "_ctx", None) is not None:
            cu.cuDevicePrimaryCtxRelease(self._dev)
            self._ctx = None


@dataclass(frozen=True, slots=True)
class _EmulatedIpcEvent:
    handle: bytes


class EmulatedDevice:
    """:class:`Device` in host memory: "device" allocations are ctypes buffers, copies
    are ``memmove``, launches run the g++-built kernel emulator synchronously, events
    are no-ops. For tests and the benchmark's reference runs; it models stream
    *semantics* (everything completes in issue order), not timing.

    ``export(buf)`` stands in for ``cudaIpcGetMemHandle``: it returns a 64-byte handle
    that :meth:`open_ipc_mem` maps back to ``buf``'s address. ``refuse_register``
    makes :meth:`host_register` fail like the CC-mode driver (error 801). An IPC
    event handle listed in ``pending_events`` never completes (an engine whose
    stream is stuck); ``events_opened``/``events_destroyed`` count event handles.

    ``deferred=True`` models asynchrony: copies, memsets and kernels are queued (in
    issue order, a valid serialisation of both streams) and run only by ``sync`` or
    :meth:`flush`; what is still in ``queued`` after a call returned is GPU work that
    call left running. A kernel's descriptor is copied at launch, as the driver does;
    a kernel that fails at run time raises from ``sync`` and the rest of the queue
    is dropped (a context fault aborts all queued work)."""

    name = "emulated (CPU)"
    arch = "emulated"
    copy_stream = "copy"
    compute_stream = "compute"

    def __init__(self, *, refuse_register: bool = False, deferred: bool = False) -> None:
        from kvseal.server.backends.cuda.emulated import load_emulator  # noqa: PLC0415

        self._lib: Any = load_emulator()._lib
        self._mem: dict[int, Any] = {}
        self._exports: dict[bytes, tuple[int, int, int]] = {}  # handle -> ptr, size, gpu
        self._open: dict[int, int] = {}
        self.refuse_register = refuse_register
        self.launches: list[tuple[str, int]] = []  # (kernel, grid) per launch, for tests
        self.pending_events: set[bytes] = set()
        self.events_opened = 0
        self.events_destroyed = 0
        self.syncs = 0
        self.deferred = deferred
        self.queued: list[Callable[[], object]] = []

    def _issue(self, op: Callable[[], object]) -> None:
        if self.deferred:
            self.queued.append(op)
        else:
            op()

    def flush(self) -> None:
        """Run every queued operation, in issue order (deferred mode)."""
        ops, self.queued = self.queued, []
        for op in ops:
            op()

    def make_current(self) -> None:
        pass

    def alloc(self, nbytes: int) -> int:
        buf = ctypes.create_string_buffer(max(1, nbytes))
        ptr = ctypes.addressof(buf)
        self._mem[ptr] = buf
        return ptr

    def free(self, ptr: int) -> None:
        self._mem.pop(ptr)

    def host_alloc(self, nbytes: int, *, mapped: bool) -> int:
        return self.alloc(nbytes)

    def host_free(self, ptr: int) -> None:
        self.free(ptr)

    def host_register(self, ptr: int, nbytes: int, *, mapped: bool) -> None:
        if self.refuse_register:
            raise CudaError("cuMemHostRegister failed: CUDA_ERROR_NOT_SUPPORTED (801)", 801)

    def host_unregister(self, ptr: int) -> None:
        pass

    def host_device_pointer(self, ptr: int) -> int:
        return ptr

    def memset_async(self, ptr: int, nbytes: int, stream: Any) -> None:
        self._issue(lambda: ctypes.memset(ptr, 0, nbytes))

    def h2d_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self._issue(lambda: ctypes.memmove(dst, src, nbytes))

    def d2h_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self._issue(lambda: ctypes.memmove(dst, src, nbytes))

    def launch(
        self, kernel: str, grid: int, threads: int, args: Sequence[Any], stream: Any
    ) -> None:
        self.launches.append((kernel, grid))
        run: Callable[[], int]
        if kernel == "kvseal_key_setup":
            raw, key_ctx = args[0].value, args[1].value
            ctx = ctypes.cast(ctypes.c_void_p(key_ctx), ctypes.POINTER(KvsKeyCtx))
            run = lambda: self._lib.kvseal_emu_key_setup(ctypes.c_void_p(raw), ctx)  # noqa: E731
        else:
            batch = type(args[0]).from_buffer_copy(args[0])  # the driver copies params
            if grid != batch.num_blocks * batch.ctas_per_block or threads != batch.threads_per_cta:
                raise CudaError(f"{kernel}: launch shape does not match the descriptor", 719)
            fn = {
                "kvseal_seal": self._lib.kvseal_emu_seal,
                "kvseal_verify": self._lib.kvseal_emu_verify,
                "kvseal_open": self._lib.kvseal_emu_open,
            }[kernel]
            run = lambda: fn(ctypes.byref(batch), 0)  # noqa: E731

        def op() -> None:
            rc = run()
            if rc < 0:
                raise CudaError(f"{kernel} rejected its descriptor ({rc})", 719)

        self._issue(op)

    def new_event(self) -> Any:
        return object()

    def destroy_event(self, event: Any) -> None:
        if isinstance(event, _EmulatedIpcEvent):
            self.events_destroyed += 1

    def record(self, event: Any, stream: Any) -> None:
        pass

    def wait(self, stream: Any, event: Any) -> None:
        pass

    def sync(self, stream: Any) -> None:
        self.syncs += 1
        ops, self.queued = self.queued, []
        for op in ops:  # everything issued so far: a valid order for either stream
            op()

    def query_event(self, event: Any) -> bool:
        return not (isinstance(event, _EmulatedIpcEvent) and event.handle in self.pending_events)

    def open_ipc_event(self, handle: bytes) -> Any:
        self.events_opened += 1
        return _EmulatedIpcEvent(handle)

    def export(self, buf: Any, *, gpu: int = 0) -> bytes:
        """A fake IPC handle for a writable buffer (kept alive by the caller), as if
        the memory lived on GPU ``gpu``."""
        anchor = (ctypes.c_char * len(buf)).from_buffer(buf)
        handle = secrets.token_bytes(IPC_HANDLE_BYTES)
        self._mem[ctypes.addressof(anchor)] = anchor
        self._exports[handle] = (ctypes.addressof(anchor), len(buf), gpu)
        return handle

    def open_ipc_mem(self, handle: bytes) -> tuple[int, int]:
        if handle not in self._exports:
            raise CudaError("cuIpcOpenMemHandle failed: CUDA_ERROR_INVALID_VALUE (1)", 1)
        ptr, size, gpu = self._exports[handle]
        if gpu != 0:
            raise CudaError(
                f"the memory is on GPU {gpu} of this machine, this daemon drives GPU 0",
                _CU_INVALID_DEVICE,
            )
        if ptr in self._open:
            raise CudaError("cuIpcOpenMemHandle failed: CUDA_ERROR_ALREADY_MAPPED (208)", 208)
        self._open[ptr] = 1
        return ptr, size

    def close_ipc_mem(self, ptr: int) -> None:
        self._open.pop(ptr)

    def address_range(self, ptr: int) -> tuple[int, int]:
        for base, buf in self._mem.items():
            if base <= ptr < base + ctypes.sizeof(buf):
                return base, ctypes.sizeof(buf)
        raise CudaError("cuMemGetAddressRange failed: CUDA_ERROR_INVALID_VALUE (1)", 1)

    @property
    def open_ipc_mappings(self) -> int:
        return len(self._open)

    def close(self) -> None:
        pass


# ----------------------------------------------------------------------------------------
# Pools
# ----------------------------------------------------------------------------------------


class _IpcCache:
    """Backend-wide reference counts of opened IPC memory handles: the driver maps a
    handle once per process, and two registrations (e.g. a pool replaced under
    the same name) may name the same allocation."""

    def __init__(self, dev: Device) -> None:
        self._dev = dev
        self._open: dict[bytes, list[int]] = {}  # handle -> [ptr, size, refs]

    def acquire(self, handle: bytes) -> tuple[int, int]:
        entry = self._open.get(handle)
        if entry is None:
            ptr, size = self._dev.open_ipc_mem(handle)
            entry = self._open[handle] = [ptr, size, 0]
        entry[2] += 1
        return entry[0], entry[1]

    def release(self, handle: bytes) -> None:
        entry = self._open.get(handle)
        if entry is None:
            return
        entry[2] -= 1
        if entry[2] <= 0:
            del self._open[handle]
            try:
                self._dev.close_ipc_mem(entry[0])
            except CudaError as e:
                log.warning("closing a CUDA IPC mapping failed: %s", e)

    def close_all(self) -> None:
        for handle in list(self._open):
            self._open[handle][2] = 0
            self.release(handle)


class CudaMappedPool:
    """One registered pool: device base address per buffer, and the buffer table and
    segment table uploaded once into device memory (the kernels read them).

    Owns its device tables and one reference per distinct IPC handle; ``close``
    releases both (called by the registry when no request uses the pool)."""

    def __init__(
        self,
        spec: PoolSpec,
        dev: Device,
        bases: Sequence[int],
        *,
        release: Any = None,
    ) -> None:
        self.spec = spec
        self._dev = dev
        self._release = release  # callable run by close(), e.g. dropping IPC refs
        self.bases = list(bases)
        g = spec.geometry
        try:
            table, block_bytes = segment_table(
                [Segment(s.buffer, s.offset, s.page_stride, s.bytes) for s in g.segments]
            )
        except ValueError as e:
            raise BadRequest(f"the CUDA backend cannot use this geometry: {e}") from e
        if block_bytes != g.block_bytes:  # pragma: no cover - same sum, by construction
            raise BadRequest("segment table disagrees with the geometry's block size")
        buffers = (ctypes.c_uint64 * len(self.bases))(*self.bases)
        self._tables: list[int] = []
        try:
            bptr = dev.alloc(ctypes.sizeof(buffers))
            self._tables.append(bptr)
            sptr = dev.alloc(ctypes.sizeof(table))
            self._tables.append(sptr)
            # Stream-ordered with the kernels that read the tables; the sync keeps the
            # (pageable) source arrays alive until the copies are done.
            s = dev.compute_stream
            dev.h2d_async(bptr, ctypes.addressof(buffers), ctypes.sizeof(buffers), s)
            dev.h2d_async(sptr, ctypes.addressof(table), ctypes.sizeof(table), s)
            dev.sync(s)
        except BaseException:
            self.close()
            raise
        self.desc = PoolDescriptors(bptr, sptr, len(table), block_bytes)

    @property
    def block_bytes(self) -> int:
        return self.desc.block_bytes

    def close(self) -> None:
        if self._tables:
            try:
                self._dev.make_current()  # the registry closes pools from any thread
            except CudaError as e:
                log.warning("cannot release a pool's device tables: %s", e)
                self._tables = []
        for ptr in self._tables:
            try:
                self._dev.free(ptr)
            except CudaError as e:
                log.warning("freeing a pool table failed: %s", e)
        self._tables = []
        if self._release is not None:
            release, self._release = self._release, None
            release()


# ----------------------------------------------------------------------------------------
# The backend
# ----------------------------------------------------------------------------------------


class _Growable:
    """A device or pinned-host allocation that only grows (freed on close). Callers
    hold the backend lock and have synchronised the streams before it grows."""

    def __init__(self, alloc: Any, free: Any) -> None:
        self._alloc, self._free = alloc, free
        self.ptr = 0
        self.size = 0

    def get(self, nbytes: int) -> int:
        if nbytes > self.size:
            self.release()
            self.ptr = self._alloc(nbytes)
            self.size = nbytes
        return self.ptr

    def release(self) -> None:
        if self.ptr:
            ptr, self.ptr, self.size = self.ptr, 0, 0
            self._free(ptr)


class CudaBackend:
    """See the module docstring. ``device`` is the GPU ordinal; ``dev`` injects a
    :class:`Device` (tests use :class:`EmulatedDevice`). ``seal_mode="mapped"`` makes
    ``kvseal_seal`` write ciphertext straight into mapped pinned host memory (no
    staging, no D2H; off in CC mode, where the region is not mapped), a benchmark
    alternative to the default ``"dma"``. ``engine_event_timeout`` bounds how long a
    request waits for the engine's IPC event (EngineNotReady after it, nothing
    written). An offload waits before taking the backend lock; a restore waits
    after queuing its copies and verification, with the lock held, so a stuck
    engine stream can delay other requests by at most the timeout, and never
    blocks the GPU streams (no GPU-side wait on an engine event is ever queued).

    Failure contract: a request that raises after queuing GPU work first waits for
    all of it (both streams), so no stale copy or kernel can read descriptors or
    staging that the next request rewrites, and no page is touched after the call
    returned (the engine contract; ``deadline`` is checked before each queued chunk).
    A sticky CUDA error, or streams that cannot be drained, mark the backend
    unusable ("restart kvseal-server") and call the :meth:`set_on_broken` callback,
    on which the daemon stops serving and exits 4.

    Device memory it keeps: staging = the largest request's ciphertext (bounded by
    ``--max-batch-bytes``), descriptors, 2,800 B per live key epoch."""

    kind = "cuda"

    def __init__(
        self,
        sealer: DeviceKeySource,
        device: int = 0,
        *,
        dev: Device | None = None,
        config: LaunchConfig | None = None,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES,
        seal_mode: str = "dma",
        cc: str | None = None,
        engine_event_timeout: float = DEFAULT_ENGINE_EVENT_TIMEOUT,
    ) -> None:
        if seal_mode not in ("dma", "mapped"):
            raise ValueError("seal_mode must be 'dma' or 'mapped'")
        from kvseal.server.backends.cuda import probe  # noqa: PLC0415

        self._sealer = sealer
        self.stopping = threading.Event()  # set by the cache when it stops serving
        self._dev: Device = dev if dev is not None else CudaDevice(device)
        self.cc = cc if cc is not None else probe.cc_mode()
        self.config = config or LaunchConfig()
        self.max_chunks = max(1, max_chunks)
        self.min_chunk_bytes = min_chunk_bytes
        self.seal_mode = seal_mode
        self.engine_event_timeout = engine_event_timeout
        self._lock = threading.Lock()
        self._ipc = _IpcCache(self._dev)
        self._keys: dict[int, int] = {}  # epoch -> device KvsKeyCtx
        self._events: list[Any] = []
        self._broken: str | None = None
        self._on_broken: Callable[[str], None] | None = None
        d = self._dev
        self._staging = _Growable(d.alloc, d.free)
        self._desc = _Growable(d.alloc, d.free)
        self._host = _Growable(lambda n: d.host_alloc(n, mapped=False), d.host_free)
        self._key_dev = 0
        self._key_host = 0
        try:
            d.make_current()
            self._key_dev = d.alloc(KEY_BYTES)
            # Pinned and ours: a pageable source would pass through the driver's own
            # staging buffer, which nobody wipes.
            self._key_host = d.host_alloc(KEY_BYTES, mapped=False)
        except BaseException:
            self.close()
            raise
        self.device = device
        self.launches = 0  # kernel launches issued, for the benchmark's per-request count
        image = getattr(self._dev, "image_kind", "")
        self.detail = (
            f"cuda: {d.name} (device {device}, {d.arch}), AES-256-GCM kernels"
            + (f" ({image})" if image else "")
            + f", CC mode {self.cc}, seal {seal_mode}"
        )

    # -- helpers ------------------------------------------------------------------------

    @property
    def broken(self) -> str | None:
        """Why the backend can no longer serve (a sticky CUDA error, or streams that
        could not be drained), or None. Once set it stays set: only a new process
        gets a new context."""
        return self._broken

    def set_on_broken(self, callback: Callable[[str], None]) -> None:
        """Have ``callback(reason)`` run once, when the backend becomes unusable (at
        once if it already is). The daemon stops serving then and exits non-zero so
        that its supervisor starts a fresh process. It runs on the thread that hit
        the error, with the backend lock held: it must only signal, never block."""
        self._on_broken = callback
        if self._broken is not None:
            callback(self._broken)

    def _mark_broken(self, why: str) -> None:
        if self._broken is not None:
            return
        self._broken = why
        log.critical("CUDA backend unusable: %s; kvseal must be restarted", why)
        if self._on_broken is not None:
            try:
                self._on_broken(why)
            except Exception:  # the error being reported matters more than this one
                log.exception("the backend-broken callback failed")

    def _enter(self) -> None:
        if self._broken is not None:
            raise CudaError(
                f"the GPU context is unusable after an earlier error ({self._broken}); "
                "restart kvseal-server"
            )
        try:
            self._dev.make_current()
        except CudaError as e:  # e.g. CONTEXT_IS_DESTROYED: nothing will work again
            self._note(e)
            raise

    def _note(self, e: CudaError) -> None:
        if e.code in _STICKY:
            self._mark_broken(f"CUDA context lost: {e}")

    def _failed(self, e: BaseException) -> None:
        """After a request raised (lock held): note sticky errors, then wait for
        everything it queued. Descriptors and staging are reused by the next request,
        and a stale kernel reading a rewritten descriptor area could seal old pages
        under new nonces."""
        if isinstance(e, CudaError):
            self._note(e)
        for stream in (self._dev.compute_stream, self._dev.copy_stream):
            try:
                self._dev.sync(stream)
            except CudaError as err:
                self._note(err)
                self._mark_broken(f"streams could not be drained after an error: {err}")

    def _event(self, i: int) -> Any:
        while len(self._events) <= i:
            self._events.append(self._dev.new_event())
        return self._events[i]

    def _batch(
        self,
        key: int,
        pool: CudaMappedPool,
        desc: int,
        lay: RequestLayout,
        staging: int,
        start: int,
        stop: int,
        *,
        all_or_nothing: bool = False,
    ) -> KvsBatch:
        """The descriptor of one launch over blocks [start, stop) of the request."""
        return chunk_batch(
            key=key,
            pool=pool.desc,
            desc=desc,
            lay=lay,
            staging=staging,
            start=start,
            stop=stop,
            config=self.config,
            all_or_nothing=all_or_nothing,
        )

    def _launch(self, kernel: str, batch: KvsBatch, stream: Any) -> None:
        check_batch(batch)
        self._dev.launch(
            kernel, batch.num_blocks * batch.ctas_per_block, batch.threads_per_cta, [batch], stream
        )
        self.launches += 1

    def _prune_keys(self) -> None:
        live = self._sealer.live_epoch_ids()
        dead = [e for e in self._keys if e not in live]
        if not dead:
            return
        s = self._dev.compute_stream
        for e in dead:
            self._dev.memset_async(self._keys[e], _KEYCTX_BYTES, s)  # wipe before freeing
        self._dev.sync(s)
        for e in dead:
            self._dev.free(self._keys.pop(e))

    def retire_keys(self) -> None:
        """Wipe and free, now, the device key contexts of epochs the sealer no
        longer lists (a ``Drop(all_of_tenant)`` destroyed their scope). Takes the
        backend lock, so it waits for a request in flight (bounded by that request's
        own deadline); a request that used such a context fails before its open
        pass (``require_live``). Never raises: on a broken backend the contexts go
        with the process (logged)."""
        with self._lock:
            if self._broken is not None or not self._keys:
                return
            try:
                self._enter()
                self._prune_keys()
            except CudaError as e:
                self._note(e)
                log.warning("wiping the device key contexts of a dropped tenant failed: %s", e)

    def _key_ctx(self, epoch: int) -> int:
        """Device address of the epoch's KvsKeyCtx, derived on first use.

        The raw key crosses to the device once: sealer -> ctypes buffer -> stream-
        ordered H2D -> ``kvseal_key_setup`` -> the device copy is zeroed on the same
        stream; after the stream synchronises the host buffer is wiped too."""
        ctx = self._keys.get(epoch)
        if ctx is not None:
            return ctx
        d, s = self._dev, self._dev.compute_stream
        ctx = d.alloc(_KEYCTX_BYTES)
        key = (ctypes.c_char * KEY_BYTES).from_address(self._key_host)
        try:
            try:
                self._sealer.export_key_to(epoch, key)
                d.h2d_async(self._key_dev, ctypes.addressof(key), KEY_BYTES, s)
                d.launch(
                    "kvseal_key_setup",
                    1,
                    32,
                    [ctypes.c_uint64(self._key_dev), ctypes.c_uint64(ctx)],
                    s,
                )
            finally:
                try:
                    d.memset_async(self._key_dev, KEY_BYTES, s)  # ordered after the setup
                    d.sync(s)
                finally:
                    ctypes.memset(key, 0, KEY_BYTES)  # also when the wipe above failed
        except BaseException:
            d.free(ctx)
            raise
        self._keys[epoch] = ctx
        return ctx

    def _open_event(self, handle: bytes | None) -> Any:
        """Open the engine's IPC event (``None`` without a handle); the caller waits
        for it with :meth:`_await_event` and destroys it with :meth:`_close_event`.

        Errors on engine-supplied objects (this open, queries, destroy) are never
        treated as sticky: a garbage handle or a dead engine must not take the
        daemon down for everyone; a real context loss shows again on our own work."""
        if not handle:
            return None
        if len(handle) != IPC_HANDLE_BYTES:
            raise BadRequest(
                f"cuda_event_ipc_handle must be {IPC_HANDLE_BYTES} bytes, got {len(handle)}"
            )
        self._enter()  # raises if the context is unusable; makes it current
        try:
            event = self._dev.open_ipc_event(handle)
        except CudaError as e:
            raise HandleUnusable(
                f"cannot open cuda_event_ipc_handle ({e}): it must come from "
                "torch.cuda.Event(interprocess=True).ipc_handle() of a live engine process "
                f"on GPU {self.device}"
            ) from e
        return event

    def _await_event(self, event: Any, deadline: Deadline = NO_DEADLINE) -> None:
        """Poll the engine's event until it has completed, at most
        ``engine_event_timeout`` seconds (EngineNotReady), and never past the
        request's cutoff (``deadline.check`` raises DeadlinePassed, RequestCancelled
        once the call is over, ShuttingDown once the daemon stops). Host-side only:
        a GPU-side ``cuStreamWaitEvent`` on an event that never completes would block
        the shared streams, and hence every later request, with no way out; and once
        the host has seen the event complete, everything queued afterwards is ordered
        after the engine's work anyway (a GPU-side wait could even catch a *later*
        re-record of the same event)."""
        if event is None:
            return
        give_up = time.monotonic() + self.engine_event_timeout
        delay = 0.0
        while True:
            deadline.check("the engine's pages")  # nothing is queued yet: just raise
            try:
                if self._dev.query_event(event):
                    return
            except CudaError as e:  # the engine's object: its failure is not sticky
                raise HandleUnusable(
                    f"cannot query the engine's CUDA event ({e}); is the engine alive?"
                ) from e
            if self.stopping.is_set():
                raise ShuttingDown("kvseal stopped serving; nothing was read or written")
            now = time.monotonic()
            if now >= give_up:
                raise EngineNotReady(
                    f"the engine's CUDA event did not complete within "
                    f"{self.engine_event_timeout:g} s (is its stream stuck, or was the event "
                    "recorded after a wait on kvseal?); nothing was read or written"
                )
            # 0 first: just yield the GIL; never sleep past the cutoff.
            left = deadline.remaining()
            time.sleep(max(0.0, min(delay, give_up - now, delay if left is None else left)))
            delay = min(max(2 * delay, 20e-6), 1e-3)

    def _close_event(self, event: Any) -> None:
        if event is None:
            return
        try:
            self._dev.make_current()
            self._dev.destroy_event(event)
        except CudaError as e:
            log.warning("destroying an engine's IPC event failed: %s", e)

    @staticmethod
    def _check_blocks(
        pool: CudaMappedPool, blocks: Sequence[BlockIO], region: CudaHostRegion
    ) -> None:
        bb = pool.block_bytes
        for i, b in enumerate(blocks):
            if b.size != bb or not 0 <= b.extent.offset <= region.capacity - bb:
                raise ValueError(f"block {i} does not fit the pool or the host region")

    # -- Backend ------------------------------------------------------------------------

    def make_region(self, capacity: int, path: str | None) -> CudaHostRegion:
        with self._lock:
            self._enter()
            try:
                return CudaHostRegion(self._dev, capacity, path, cc=self.cc)
            except CudaError as e:
                self._note(e)
                raise

    def map_pool(self, spec: PoolSpec) -> CudaMappedPool:
        """Open every buffer's IPC handle (once per distinct handle), check that the
        buffer fits its allocation, and upload the pool's tables. HandleUnusable,
        with what to change, when a handle cannot be used; nothing stays open then."""
        g = spec.geometry
        with self._lock:
            self._enter()
            acquired: list[bytes] = []
            try:
                bases = []
                for i, b in enumerate(g.buffers):
                    # b.device is the engine's own index (its CUDA_VISIBLE_DEVICES may
                    # differ from ours); where the memory lives is checked after the open.
                    handle = b.cuda_ipc_handle or b""
                    try:
                        ptr, size = self._ipc.acquire(handle)
                    except CudaError as e:  # engine-supplied handle: never sticky
                        raise HandleUnusable(self._ipc_hint(i, e)) from e
                    acquired.append(handle)
                    if b.offset + b.size > size:
                        raise HandleUnusable(
                            f"geometry.buffers[{i}] spans bytes [{b.offset}, "
                            f"{b.offset + b.size}) but its CUDA allocation has {size} bytes"
                        )
                    bases.append(ptr + b.offset)
                check_no_alias(self._alias_identity(g, bases), g.segments, g.num_pages)

                def release(handles: list[bytes] = acquired) -> None:
                    with self._lock:
                        self._dev.make_current()
                        for h in handles:
                            self._ipc.release(h)

                pool = CudaMappedPool(spec, self._dev, bases, release=None)
                pool._release = release
                return pool
            except BaseException:
                for h in acquired:
                    self._ipc.release(h)
                raise

    def _alias_identity(self, g: Any, bases: Sequence[int]) -> list[tuple[int, int, int]]:
        """``(identity, start, end)`` of each buffer of geometry ``g`` mapped at
        device address ``bases[i]``: identity is the base of the CUDA allocation
        holding it (``cuMemGetAddressRange``), start/end its absolute device range.
        Two buffers are the same memory exactly when their identities match, whatever
        handles named them (the same allocation reached under two entries, e.g. K
        and V tensors of one cudaMalloc block). Lock held, context current."""
        out = []
        for i, (b, base) in enumerate(zip(g.buffers, bases, strict=True)):
            try:
                alloc, _ = self._dev.address_range(base)
            except CudaError as e:  # our own query on a live mapping
                self._note(e)
                raise HandleUnusable(
                    f"cannot tell which CUDA allocation holds geometry.buffers[{i}]: {e}"
                ) from e
            out.append((alloc, base, base + b.size))
        return out

    def _ipc_hint(self, i: int, e: CudaError) -> str:
        if e.code == _CU_INVALID_DEVICE:
            return (
                f"geometry.buffers[{i}]: {e}. Run one kvseal per GPU (--device N, in this "
                "daemon's device numbering) and register each engine pool with the daemon "
                "of the GPU that holds it"
            )
        hint = (
            f"cannot open the CUDA IPC handle of geometry.buffers[{i}] ({e}). It must be a "
            "legacy cudaIpcMemHandle_t of cudaMalloc memory exported by a live process on "
            f"GPU {self.device} of this machine. Memory from cuMemCreate / PyTorch expandable "
            "segments cannot be exported this way: set "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False in the engine (or allocate "
            "the KV pool with cudaMalloc)"
        )
        if e.code == _CU_ALREADY_MAPPED:
            hint += "; the allocation is already mapped in this daemon under another handle"
        elif e.code == _CU_INVALID_CONTEXT:
            hint += (
                "; CUDA_ERROR_INVALID_CONTEXT usually means the handle was exported by this "
                "daemon's own process (legacy IPC cannot reopen it there), or the GPU is in "
                "a compute mode that allows one process only (nvidia-smi -c DEFAULT)"
            )
        return hint

    def map_local_pool(self, spec: PoolSpec, bases: Sequence[int]) -> CudaMappedPool:
        """A pool whose buffers this process owns (benchmarks, tests): ``bases`` are
        device addresses of ``spec``'s buffers; the caller keeps them alive."""
        with self._lock:
            self._enter()
            return CudaMappedPool(spec, self._dev, bases)

    def seal_blocks(
        self,
        pool: MappedPool,
        blocks: Sequence[BlockIO],
        region: Region,
        wait_event: bytes | None = None,
        deadline: Deadline = NO_DEADLINE,
    ) -> list[SealRecord]:
        """Seal ``blocks`` (see the module docstring). ``deadline`` is checked before
        each chunk's kernels are queued (the kernels are what read the pages) and once
        more after everything completed: a seal that finished past the cutoff, or
        after the call was cancelled, is discarded (its nonces burnt, no record
        returned), since its pages may have been read after the engine gave up. On
        any failure both streams are drained before this raises."""
        assert isinstance(pool, CudaMappedPool) and isinstance(region, CudaHostRegion)
        if not blocks:
            return []
        self._check_blocks(pool, blocks, region)
        engine = self._open_event(wait_event)
        try:
            # Offload reads the pages, so nothing can start before the engine's event:
            # wait for it before taking the lock (a slow engine stream then holds up
            # only its own request, not the backend).
            self._await_event(engine, deadline)
            with self._lock:
                self._enter()
                try:
                    self._prune_keys()
                except BaseException as e:
                    self._failed(e)
                    raise
                try:
                    deadline.check("the first page")  # the lock may have taken a while
                except BaseException as e:
                    note_written(e, set())
                    raise
                epoch, nonces = self._sealer.allocate_for_device(
                    len(blocks), _request_scope(blocks)
                )
                try:
                    return self._seal_locked(pool, blocks, region, epoch, nonces, deadline)
                except BaseException as e:
                    for _ in blocks:  # burn every nonce drawn: none is ever reused
                        self._sealer.forget(epoch)
                    self._failed(e)
                    raise
        finally:
            self._close_event(engine)

    def _seal_locked(
        self,
        pool: CudaMappedPool,
        blocks: Sequence[BlockIO],
        region: CudaHostRegion,
        epoch: int,
        nonces: list[bytes],
        deadline: Deadline,
    ) -> list[SealRecord]:
        d, n, bb = self._dev, len(blocks), pool.block_bytes
        if len(nonces) != n:
            raise RuntimeError("the sealer returned the wrong number of nonces")
        host_offsets = [b.extent.offset for b in blocks]
        mapped = self.seal_mode == "mapped" and region.device_ptr is not None
        if mapped:
            # The kernel computes the tag from ciphertext in registers, never by
            # re-reading it, so writing straight into hostile memory is safe for seal.
            assert region.device_ptr is not None
            staging, staging_offsets = region.device_ptr, host_offsets
        else:
            staging_offsets, total = staging_layout(n, bb)
            staging = self._staging.get(total)
        lay = request_layout(n)
        host = self._host.get(lay.total)
        desc = self._desc.get(lay.total)
        fill_descriptors(
            host,
            self._host.size,
            lay,
            pages=[b.page for b in blocks],
            staging_offsets=staging_offsets,
            nonces=nonces,
            aads=[b.ad.encode() for b in blocks],
        )
        key = self._key_ctx(epoch)
        sk, sc = d.compute_stream, d.copy_stream
        d.h2d_async(desc, host, lay.upload_seal, sk)
        d.memset_async(desc + lay.ws, _WS_BYTES * n, sk)
        chunks = split_chunks(n, bb, self.max_chunks, self.min_chunk_bytes)
        for ci, (a, b) in enumerate(chunks):
            # Each chunk is a bounded unit of page reads; a failed check stops here
            # and the caller drains what is queued (the chunks before this one).
            try:
                deadline.check(f"blocks [{a}, {b})")
            except BaseException as e:
                # No D2H copy is queued yet: the region holds nothing of this
                # request, unless the kernels write it directly (mapped).
                note_written(e, set(range(a)) if mapped else set())
                raise
            self._launch("kvseal_seal", self._batch(key, pool, desc, lay, staging, a, b), sk)
            d.record(self._event(ci), sk)
        # Only now the D2H copies: under CC each one blocks this thread at issue,
        # and every kernel is already queued behind it.
        for ci, (a, b) in enumerate(chunks):
            d.wait(sc, self._event(ci))
            if not mapped:
                for h, s, nbytes in plan_runs(host_offsets, staging_offsets, bb, a, b):
                    d.d2h_async(region.host_ptr + h, staging + s, nbytes, sc)
        d.d2h_async(host + lay.tags, desc + lay.tags, TAG_BYTES * n, sc)
        d.sync(sc)
        d.sync(sk)
        if deadline.expired():
            # The last chunk may have read its pages after the cutoff, i.e. after the
            # engine gave up and reused them: never let those bytes be published.
            raise DeadlinePassed(
                "the request's deadline passed while its blocks were sealed; "
                "the ciphertext was discarded and nothing is published"
            )
        deadline.check("the sealed blocks")  # cancelled or stopping meanwhile: discard
        tags = ctypes.string_at(host + lay.tags, TAG_BYTES * n)
        return [
            SealRecord(epoch, nonces[i], tags[TAG_BYTES * i : TAG_BYTES * (i + 1)])
            for i in range(n)
        ]

    def open_blocks(
        self,
        pool: MappedPool,
        blocks: Sequence[BlockIO],
        records: Sequence[SealRecord],
        region: Region,
        wait_event: bytes | None = None,
        deadline: Deadline = NO_DEADLINE,
    ) -> list[int]:
        """Verify and open ``blocks`` into the pool (see the module docstring).
        ``deadline`` is checked before each chunk's snapshot and verification are
        queued, while the engine's event is awaited, and last right before the open
        pass (the only work that writes pages: one launch per key epoch, queued back
        to back, so it is one bounded unit of kernel time). After a failed check no
        page was written; both streams are drained before this raises.

        A CUDA error raised while or after the open pass was queued (a device fault,
        a failed launch of a later epoch's open) may leave any of the request's
        destination pages partly or wholly overwritten with the plaintext of this
        request's blocks, all of which verified first (``open`` decrypts only the
        verified snapshot in device memory, gated on every block's verdict); no
        unverified byte and no page outside the request is ever written. The
        request fails (INTERNAL) and the engine must treat all its destination
        pages as unwritten garbage, as after any failed restore."""
        assert isinstance(pool, CudaMappedPool) and isinstance(region, CudaHostRegion)
        if len(records) != len(blocks):
            raise ValueError("one record per block is required")
        if not blocks:
            return []
        self._check_blocks(pool, blocks, region)
        engine = self._open_event(wait_event)
        try:
            with self._lock:
                self._enter()
                try:
                    self._prune_keys()
                    return self._open_locked(pool, blocks, records, region, engine, deadline)
                except BaseException as e:
                    self._failed(e)
                    raise
        finally:
            self._close_event(engine)

    def _open_locked(
        self,
        pool: CudaMappedPool,
        blocks: Sequence[BlockIO],
        records: Sequence[SealRecord],
        region: CudaHostRegion,
        engine: Any,
        deadline: Deadline,
    ) -> list[int]:
        d, n, bb = self._dev, len(blocks), pool.block_bytes
        # One key per launch: order the blocks by epoch so each epoch is a contiguous
        # range of the descriptor arrays (almost always a single range).
        perm = sorted(range(n), key=lambda i: records[i].epoch)
        groups: list[tuple[int, int, int]] = []  # (epoch, start, stop) in perm order
        for j, i in enumerate(perm):
            e = records[i].epoch
            if groups and groups[-1][0] == e:
                groups[-1] = (e, groups[-1][1], j + 1)
            else:
                groups.append((e, j, j + 1))
        host_offsets = [blocks[i].extent.offset for i in perm]
        staging_offsets, total = staging_layout(n, bb)
        staging = self._staging.get(total)
        lay = request_layout(n)
        host = self._host.get(lay.total)
        desc = self._desc.get(lay.total)
        fill_descriptors(
            host,
            self._host.size,
            lay,
            pages=[blocks[i].page for i in perm],
            staging_offsets=staging_offsets,
            nonces=[records[i].nonce for i in perm],
            aads=[blocks[i].ad.encode() for i in perm],
            tags=[records[i].tag for i in perm],
        )
        keys = {e: self._key_ctx(e) for e, _, _ in groups}
        sk, sc = d.compute_stream, d.copy_stream
        d.h2d_async(desc, host, lay.upload_open, sk)
        # Verdicts and workspace together: open trusts ok[], which must never carry a
        # previous request's 1 (ok directly precedes ws in the layout).
        d.memset_async(desc + lay.ok, lay.total - lay.ok, sk)
        ci = 0
        for e, g0, g1 in groups:
            for ra, rb in split_chunks(g1 - g0, bb, self.max_chunks, self.min_chunk_bytes):
                a, b = ra + g0, rb + g0
                # Nothing here touches the pages (host region -> staging, verify on
                # staging), but a request already failed need not spend the GPU.
                deadline.check(f"blocks [{a}, {b})")
                # Snapshot this chunk's ciphertext into private device memory: the
                # only read of host memory; verify and open use the snapshot.
                for h, s, nbytes in plan_runs(host_offsets, staging_offsets, bb, a, b):
                    d.h2d_async(staging + s, region.host_ptr + h, nbytes, sc)
                d.record(self._event(ci), sc)
                d.wait(sk, self._event(ci))
                batch = self._batch(keys[e], pool, desc, lay, staging, a, b)
                self._launch("kvseal_verify", batch, sk)
                ci += 1
        # Only open writes the pages: copies and verification above overlap with the
        # engine's remaining work; its event is awaited here, on the host (the
        # backend lock is held, so a stuck engine stream delays other requests by at
        # most the timeout; no GPU-side wait is ever queued on it).
        self._await_event(engine, deadline)
        if len(groups) > 1:
            # Each launch's all-or-nothing gate sees only its own epoch's flags,
            # so the whole-request decision is made here first (rare: rekeys).
            d.d2h_async(host + lay.ok, desc + lay.ok, n, sk)
            d.sync(sk)
            flags = ctypes.string_at(host + lay.ok, n)
            if any(f != 1 for f in flags):
                return sorted(perm[j] for j in range(n) if flags[j] != 1)
        if self.stopping.is_set():  # an integrity abort elsewhere: write no page
            raise ShuttingDown("kvseal stopped serving; nothing was restored")
        # The last check: once the open pass is queued it runs to its end (all
        # epochs' launches back to back), and the reply waits for it.
        deadline.check("the destination pages")
        # Right before the open pass: a drop that destroyed these keys since the
        # request began makes it write no page (KeyDestroyed). Once the pass is
        # queued the restore is committed and counts as done before such a drop.
        self._sealer.require_live(keys)
        for e, g0, g1 in groups:
            batch = self._batch(keys[e], pool, desc, lay, staging, g0, g1, all_or_nothing=True)
            self._launch("kvseal_open", batch, sk)
        d.d2h_async(host + lay.ok, desc + lay.ok, n, sk)
        d.sync(sk)
        d.sync(sc)
        flags = ctypes.string_at(host + lay.ok, n)
        return sorted(perm[j] for j in range(n) if flags[j] != 1)

    def close(self) -> None:
        """Wipe and free key contexts, free buffers, close IPC mappings, release the
        device. Best effort: each step runs even if an earlier one failed (logged).
        Idempotent."""
        with self._lock:
            d = self._dev

            def step(what: str, fn: Any) -> None:
                try:
                    fn()
                except CudaError as e:
                    log.warning("releasing CUDA resources (%s) failed: %s", what, e)

            step("make the context current", d.make_current)

            def wipe_keys() -> None:
                for ctx in self._keys.values():
                    d.memset_async(ctx, _KEYCTX_BYTES, d.compute_stream)
                d.sync(d.compute_stream)

            if self._keys:
                step("wipe key contexts", wipe_keys)
            for ctx in list(self._keys.values()):
                step("free a key context", lambda c=ctx: d.free(c))
            self._keys.clear()
            if self._key_dev:
                step("free the key upload buffer", lambda: d.free(self._key_dev))
                self._key_dev = 0
            if self._key_host:
                ctypes.memset(self._key_host, 0, KEY_BYTES)
                step("free the pinned key buffer", lambda: d.host_free(self._key_host))
                self._key_host = 0
            for buf in (self._staging, self._desc, self._host):
                step("free a staging/descriptor buffer", buf.release)
            for ev in self._events:
                step("destroy an event", lambda e=ev: d.destroy_event(e))
            self._events = []
            step("close IPC mappings", self._ipc.close_all)
            try:
                d.close()
            except CudaError as e:
                log.warning("releasing the CUDA device failed: %s", e)
