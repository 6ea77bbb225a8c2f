"""Device and stream management of the CUDA backend.

Everything that touches the driver sits behind :class:`Device`: allocations,
pinned host memory, stream-ordered copies and memsets, kernel launches, events,
and the IPC handles of engine memory and events. :class:`CudaDevice` is the
real one (``cuda.bindings.driver``, imported lazily so CPU-only installs never
load it); :class:`~kvseal.server.backends.cuda.emulated_device.EmulatedDevice`
runs the same calls against host memory and the g++-built kernel emulator.

:class:`ContextGuard` keeps the context's health: a sticky CUDA error (or
streams that cannot be drained after a failed request) marks the backend
unusable for good, and the daemon restarts (exit 4).
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

log = logging.getLogger("kvseal.cuda")

IPC_HANDLE_BYTES = 64
# CUresult values after which the context is unusable (sticky errors): restart.
# 214 ECC uncorrectable, 700 illegal address, 702 launch timeout, 709 context
# destroyed, 710-719 traps/misaligned/launch failure, 999 unknown (assume the worst).
STICKY_ERRORS = frozenset({214, 700, 702, 709, 710, 714, 715, 716, 717, 718, 719, 999})
# CUresult values with a specific hint when an IPC memory handle cannot be opened.
CU_INVALID_DEVICE = 101
CU_INVALID_CONTEXT = 201
CU_ALREADY_MAPPED = 208


# Both handle types are 64 opaque bytes (CU_IPC_HANDLE_SIZE in cuda.h).
IPC_HANDLE_BYTES = 64


def ipc_handle(handle_type: Callable[[], Any], handle: bytes) -> Any:
    """A new ``CUipcMemHandle`` / ``CUipcEventHandle`` holding ``handle``.

    Filled through ``getPtr()`` (the address of the struct's 64 bytes), the one API
    every supported cuda-bindings version has: 13.4 made both types opaque and
    removed the ``reserved`` attribute that older releases let callers assign.
    Raises ValueError for a handle of the wrong length (the bytes come from the
    engine, over gRPC): a short copy would open whatever the rest of the struct
    held, a long one would write past it."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
    h = handle_type()
    ctypes.memmove(int(h.getPtr()), handle, IPC_HANDLE_BYTES)
    return h


class CudaError(RuntimeError):
    """A CUDA driver call failed. ``code`` is the CUresult value."""

    def __init__(self, message: str, code: int = -1) -> None:
        super().__init__(message)
        self.code = code


class BackendUnavailable(RuntimeError):
    """The CUDA backend cannot be built here; the message says why and what to do."""


class Device(Protocol):
    """The driver operations the backend uses. Addresses are plain ints; streams and
    events are opaque. ``*_async`` operations are ordered on their stream; ``sync``
    waits for a stream. Every method raises :class:`CudaError` on failure."""

    name: str
    arch: str
    copy_stream: Any
    compute_stream: Any

    def make_current(self) -> None: ...

    def check_context(self) -> None:
        """Raise CudaError unless the current context can still run work: it waits
        for all of the context's work (``cuCtxSynchronize``), so callers make sure
        none is queued (cheap then) and hold the backend lock."""
        ...

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

    def check_context(self) -> None:
        # A lost context (an Xid, a sticky fault, a reset) fails this with the
        # context's error; on a healthy idle context it returns at once.
        self._check(self._cu.cuCtxSynchronize(), "cuCtxSynchronize")

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
        h = ipc_handle(self._cu.CUipcEventHandle, handle)
        return self._check(self._cu.cuIpcOpenEventHandle(h), "cuIpcOpenEventHandle")

    def open_ipc_mem(self, handle: bytes) -> tuple[int, int]:
        h = ipc_handle(self._cu.CUipcMemHandle, handle)
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
                if e.code in STICKY_ERRORS:
                    raise
                log.warning("cannot tell which GPU holds an IPC mapping: %s", e)
                owner = self.ordinal
            if owner != self.ordinal:
                raise CudaError(
                    f"the memory is on GPU {owner} of this machine, this daemon drives "
                    f"GPU {self.ordinal}",
                    CU_INVALID_DEVICE,
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


class ContextGuard:
    """Whether the device's context can still serve, and what to do when it cannot.

    Callers hold the backend lock. Once :attr:`broken` is set it stays set: only a
    new process gets a new context."""

    def __init__(self, dev: Device) -> None:
        self._dev = dev
        self.broken: str | None = None
        self._on_broken: Callable[[str], None] | None = None

    def set_on_broken(self, callback: Callable[[str], None]) -> None:
        """Have ``callback(reason)`` run once, when the context becomes unusable (at
        once if it already is). It runs on the thread that hit the error, with the
        backend lock held: it must only signal, never block."""
        self._on_broken = callback
        if self.broken is not None:
            callback(self.broken)

    def mark_broken(self, why: str) -> None:
        if self.broken is not None:
            return
        self.broken = why
        log.critical("CUDA backend unusable: %s; kvseal must be restarted", why)
        if self._on_broken is not None:
            try:
                self._on_broken(why)
            except Exception:  # the error being reported matters more than this one
                log.exception("the backend-broken callback failed")

    def enter(self) -> None:
        """Make the context current on this thread; CudaError if it is unusable."""
        if self.broken is not None:
            raise CudaError(
                f"the GPU context is unusable after an earlier error ({self.broken}); "
                "restart kvseal-server"
            )
        try:
            self._dev.make_current()
        except CudaError as e:  # e.g. CONTEXT_IS_DESTROYED: nothing will work again
            self.note(e)
            raise

    def note(self, e: CudaError) -> None:
        """Mark the context broken if ``e`` is a sticky error."""
        if e.code in STICKY_ERRORS:
            self.mark_broken(f"CUDA context lost: {e}")

    def failed(self, e: BaseException) -> None:
        """After a request raised (lock held): note sticky errors, then wait for
        everything it queued. Descriptors and staging are reused by the next request,
        and a stale kernel reading a rewritten descriptor area could seal old pages
        under new nonces."""
        if isinstance(e, CudaError):
            self.note(e)
        for stream in (self._dev.compute_stream, self._dev.copy_stream):
            try:
                self._dev.sync(stream)
            except CudaError as err:
                self.note(err)
                self.mark_broken(f"streams could not be drained after an error: {err}")
