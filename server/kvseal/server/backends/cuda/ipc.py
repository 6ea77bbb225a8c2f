"""IPC of the CUDA backend: engine memory and engine events, opened by handle.

- Pools: an engine exports each KV buffer with a legacy ``cudaIpcMemHandle_t``;
  :class:`IpcPools` opens each handle once per process (reference-counted: two
  registrations may name the same allocation), checks that the buffers fit their
  allocations and never alias (:func:`check_no_alias`), and uploads the pool's
  buffer and segment tables (:class:`CudaMappedPool`).
- Events: a request may carry the engine's interprocess CUDA event; the backend
  opens it (:func:`open_engine_event`), waits for it on the host
  (:func:`await_engine_event`) and destroys it (:func:`close_engine_event`).

Errors on engine-supplied objects (handles, events) are never sticky: a garbage
handle or a dead engine must not take the daemon down for everyone.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvseal.server.backends.cuda.device import (
    CU_ALREADY_MAPPED,
    CU_INVALID_CONTEXT,
    CU_INVALID_DEVICE,
    IPC_HANDLE_BYTES,
    ContextGuard,
    CudaError,
    Device,
)
from kvseal.server.backends.cuda.emulated import Segment, segment_table
from kvseal.server.backends.cuda.launch import PoolDescriptors
from kvseal.server.deadline import NO_DEADLINE, Deadline
from kvseal.server.errors import BadRequest, EngineNotReady, HandleUnusable, ShuttingDown
from kvseal.server.pools import BufferMemory, Geometry, PoolSpec, check_disjoint

log = logging.getLogger("kvseal.cuda")

DEFAULT_ENGINE_EVENT_TIMEOUT = 30.0  # seconds an engine's IPC event may stay pending


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


class IpcPools:
    """Engine pools mapped over CUDA IPC. ``lock`` is the backend lock (pools are
    released from any thread, under it); ``ordinal`` is this daemon's GPU."""

    def __init__(
        self, dev: Device, guard: ContextGuard, lock: threading.Lock, ordinal: int
    ) -> None:
        self._dev = dev
        self._guard = guard
        self._lock = lock
        self._ordinal = ordinal
        self._ipc = _IpcCache(dev)

    def map(self, spec: PoolSpec) -> CudaMappedPool:
        """Open every buffer's IPC handle (once per distinct handle), check that the
        buffer fits its allocation, and upload the pool's tables. HandleUnusable,
        with what to change, when a handle cannot be used; nothing stays open then.
        The caller holds the backend lock, with the context current."""
        g = spec.geometry
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
                    raise HandleUnusable(self._hint(i, e)) from e
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

    def _alias_identity(self, g: Geometry, bases: Sequence[int]) -> list[tuple[int, int, int]]:
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
                self._guard.note(e)
                raise HandleUnusable(
                    f"cannot tell which CUDA allocation holds geometry.buffers[{i}]: {e}"
                ) from e
            out.append((alloc, base, base + b.size))
        return out

    def _hint(self, i: int, e: CudaError) -> str:
        if e.code == CU_INVALID_DEVICE:
            return (
                f"geometry.buffers[{i}]: {e}. Run one kvseal per GPU (--device N, in this "
                "daemon's device numbering) and register each engine pool with the daemon "
                "of the GPU that holds it"
            )
        hint = (
            f"cannot open the CUDA IPC handle of geometry.buffers[{i}] ({e}). It must be a "
            "legacy cudaIpcMemHandle_t of cudaMalloc memory exported by a live process on "
            f"GPU {self._ordinal} of this machine. Memory from cuMemCreate / PyTorch "
            "expandable segments cannot be exported this way: set "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False in the engine (or allocate "
            "the KV pool with cudaMalloc)"
        )
        if e.code == CU_ALREADY_MAPPED:
            hint += "; the allocation is already mapped in this daemon under another handle"
        elif e.code == CU_INVALID_CONTEXT:
            hint += (
                "; CUDA_ERROR_INVALID_CONTEXT usually means the handle was exported by this "
                "daemon's own process (legacy IPC cannot reopen it there), or the GPU is in "
                "a compute mode that allows one process only (nvidia-smi -c DEFAULT)"
            )
        return hint

    def close_all(self) -> None:
        """Close every IPC mapping (backend close; lock held)."""
        self._ipc.close_all()


# ----------------------------------------------------------------------------------------
# Engine events
# ----------------------------------------------------------------------------------------


def open_engine_event(dev: Device, guard: ContextGuard, handle: bytes | None, ordinal: int) -> Any:
    """Open the engine's IPC event (``None`` without a handle); the caller waits
    for it with :func:`await_engine_event` and destroys it with
    :func:`close_engine_event`.

    Errors on engine-supplied objects (this open, queries, destroy) are never
    treated as sticky: a garbage handle or a dead engine must not take the
    daemon down for everyone; a real context loss shows again on our own work."""
    if not handle:
        return None
    if len(handle) != IPC_HANDLE_BYTES:
        raise BadRequest(
            f"cuda_event_ipc_handle must be {IPC_HANDLE_BYTES} bytes, got {len(handle)}"
        )
    guard.enter()  # raises if the context is unusable; makes it current
    try:
        event = dev.open_ipc_event(handle)
    except CudaError as e:
        raise HandleUnusable(
            f"cannot open cuda_event_ipc_handle ({e}): it must come from "
            "torch.cuda.Event(interprocess=True).ipc_handle() of a live engine process "
            f"on GPU {ordinal}"
        ) from e
    return event


def await_engine_event(
    dev: Device,
    event: Any,
    timeout: float,
    stopping: threading.Event,
    deadline: Deadline = NO_DEADLINE,
) -> None:
    """Poll the engine's event until it has completed, at most ``timeout``
    seconds (EngineNotReady), and never past the request's cutoff
    (``deadline.check`` raises DeadlinePassed, RequestCancelled once the call is
    over, ShuttingDown once the daemon stops). Host-side only:
    a GPU-side ``cuStreamWaitEvent`` on an event that never completes would block
    the shared streams, and hence every later request, with no way out; and once
    the host has seen the event complete, everything queued afterwards is ordered
    after the engine's work anyway (a GPU-side wait could even catch a *later*
    re-record of the same event)."""
    if event is None:
        return
    give_up = time.monotonic() + timeout
    delay = 0.0
    while True:
        deadline.check("the engine's pages")  # nothing is queued yet: just raise
        try:
            if dev.query_event(event):
                return
        except CudaError as e:  # the engine's object: its failure is not sticky
            raise HandleUnusable(
                f"cannot query the engine's CUDA event ({e}); is the engine alive?"
            ) from e
        if stopping.is_set():
            raise ShuttingDown("kvseal stopped serving; nothing was read or written")
        now = time.monotonic()
        if now >= give_up:
            raise EngineNotReady(
                f"the engine's CUDA event did not complete within "
                f"{timeout:g} s (is its stream stuck, or was the event "
                "recorded after a wait on kvseal?); nothing was read or written"
            )
        # 0 first: just yield the GIL; never sleep past the cutoff.
        left = deadline.remaining()
        time.sleep(max(0.0, min(delay, give_up - now, delay if left is None else left)))
        delay = min(max(2 * delay, 20e-6), 1e-3)


def close_engine_event(dev: Device, event: Any) -> None:
    """Destroy an event :func:`open_engine_event` opened (None: nothing); logs failures."""
    if event is None:
        return
    try:
        dev.make_current()
        dev.destroy_event(event)
    except CudaError as e:
        log.warning("destroying an engine's IPC event failed: %s", e)
