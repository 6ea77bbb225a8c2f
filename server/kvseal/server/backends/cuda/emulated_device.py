"""A :class:`~kvseal.server.backends.cuda.device.Device` in host memory, for the CPU
test-suite and the benchmark's reference runs: the CUDA backend's request logic
(descriptors, chunking, epoch grouping, the all-or-nothing rule, failure
draining) runs against it without a GPU."""

from __future__ import annotations

import ctypes
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvseal.server.backends.cuda.device import CU_INVALID_DEVICE, IPC_HANDLE_BYTES, CudaError
from kvseal.server.backends.cuda.emulated import KvsKeyCtx, load_emulator


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
    stream is stuck); one listed in ``dead_events`` cannot be opened (its engine
    exited); ``events_opened``/``events_destroyed`` count event handles.
    :meth:`lose_context` stands in for an Xid or a GPU reset: from then on
    :meth:`make_current`, :meth:`check_context` and :meth:`sync` fail with
    CONTEXT_IS_DESTROYED (709), as the driver's calls do on a lost context.

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

        self._lib: Any = load_emulator()._lib
        self._mem: dict[int, Any] = {}
        self._exports: dict[bytes, tuple[int, int, int]] = {}  # handle -> ptr, size, gpu
        self._open: dict[int, int] = {}
        self.refuse_register = refuse_register
        self.launches: list[tuple[str, int]] = []  # (kernel, grid) per launch, for tests
        self.pending_events: set[bytes] = set()
        self.dead_events: set[bytes] = set()
        self.lost = False
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

    def lose_context(self) -> None:
        """Lose the context for good (see the class docstring); callable from any
        thread, e.g. a signal handler."""
        self.lost = True

    def _alive(self, call: str) -> None:
        if self.lost:
            raise CudaError(f"{call} failed: CUDA_ERROR_CONTEXT_IS_DESTROYED (709)", 709)

    def make_current(self) -> None:
        self._alive("cuCtxSetCurrent")

    def check_context(self) -> None:
        self._alive("cuCtxSynchronize")
        self.flush()  # as cuCtxSynchronize: everything queued runs (and may fail) first

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
        self._alive("cuStreamSynchronize")
        self.syncs += 1
        ops, self.queued = self.queued, []
        for op in ops:  # everything issued so far: a valid order for either stream
            op()

    def query_event(self, event: Any) -> bool:
        return not (isinstance(event, _EmulatedIpcEvent) and event.handle in self.pending_events)

    def open_ipc_event(self, handle: bytes) -> Any:
        if handle in self.dead_events:
            raise CudaError("cuIpcOpenEventHandle failed: CUDA_ERROR_INVALID_VALUE (1)", 1)
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
                CU_INVALID_DEVICE,
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
