"""Can this machine do what the daemon tests need, with kvseal out of the picture?

Run by scripts/device_check.sh before the GPU tests (``python scripts/ipc_preflight.py``),
so that a failure of the daemon tests can be told apart from a kvseal bug: the
sandbox (gVisor, Firecracker) may not pass legacy CUDA IPC between processes, or may
refuse to pin host memory.

The parent plays the engine, the way kvseal's client does it: a torch CUDA tensor
(cudaMalloc memory: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False) exported with
``untyped_storage()._share_cuda_()`` and an interprocess event
(``torch.cuda.Event(interprocess=True).ipc_handle()``). A child process started with
subprocess (never fork after CUDA init) plays the daemon with cuda-python's driver
API only, making every call the daemon makes on a mapping (kvseal's
backends/cuda/device.py ``open_ipc_mem`` and ipc.py's alias check):
``cuIpcOpenMemHandle`` with lazy peer access, ``cuPointerGetAttribute(DEVICE_ORDINAL)``
(which GPU holds it: the daemon refuses another GPU's memory, and only warns when the
driver cannot say), ``cuMemGetAddressRange`` (the allocation's base and size: the
mapping must cover the tensor), a read back of the bytes and ``cuIpcCloseMemHandle``;
``cuIpcOpenEventHandle``, ``cuEventQuery`` and ``cuStreamWaitEvent``; then
``cuMemHostRegister`` of a 2 MiB mmap'd /dev/shm file (how a ``--host-region`` file is
pinned) and ``cuMemHostAlloc``. A pass means the daemon half can map.

One line per step: ``preflight: <step>: OK ...``; ``FAILED: <call>: <CUresult name>
(<code>)`` when the driver returned an error (a finding about this machine: the sandbox,
the driver, the GPU's compute mode); or ``DEFECT (kvseal/cuda-bindings): <exception>``
when a step raised a Python exception instead (an AttributeError or TypeError from a
binding whose API changed, as cuda-bindings 13.4 did to the IPC handle types): that
is a bug on our side or the bindings', not a limitation of the platform, and a daemon
run would only repeat it. The last line sums up.

Exit status: 0 IPC works (the memory and event steps); 1 it does not (CUDA errors: the
platform); 2 no torch CUDA here (nothing tried); 3 a DEFECT (kvseal/cuda-bindings or
the engine side's torch API), whatever else failed. Host-pinning failures are reported
but do not fail the preflight: kvseal falls back to cuMemHostAlloc (and in CC mode
cuMemHostRegister is refused by design); a DEFECT there does.

Deliberately imports nothing from kvseal.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

HANDLE_BYTES = 64
# How a step that raised a Python exception is reported (see the module docstring).
DEFECT = "DEFECT (kvseal/cuda-bindings)"
EXIT_OK, EXIT_IPC_FAILED, EXIT_NO_TORCH_CUDA, EXIT_DEFECT = 0, 1, 2, 3
SIZE = 2 << 20  # bytes exported over IPC, and pinned by each host-memory step
IPC_STEPS = ("ipc-mem-open", "ipc-mem-ordinal", "ipc-mem-range", "ipc-mem-read",
             "ipc-event-open", "event-query", "stream-wait-event")  # fmt: skip


def say(step: str, result: str) -> None:
    print(f"preflight: {step}: {result}", flush=True)


def defect(e: BaseException) -> str:
    """The report of a Python exception raised where a CUresult was expected."""
    return f"{DEFECT}: {type(e).__name__}: {e}"


# --------------------------------------------------------------------------------------
# child: the daemon's side, cuda-python only
# --------------------------------------------------------------------------------------


def driver() -> Any:
    """cuda-python's driver module: ``cuda.bindings.driver`` (>= 12.6) or ``cuda.cuda``."""
    first: ImportError | None = None
    for name in ("cuda.bindings.driver", "cuda.cuda"):
        try:
            return importlib.import_module(name)
        except ImportError as e:
            first = first or e
    raise ImportError(f"no cuda-python driver bindings: {first}")


def fill_handle(h: Any, raw: bytes) -> Any:
    """``h`` (a new CUipcMemHandle / CUipcEventHandle) holding the 64 bytes ``raw``.

    Through ``getPtr()``, which every cuda-bindings release has: 13.4 made both types
    opaque (no ``reserved`` attribute), so assigning ``h.reserved`` fails there with an
    AttributeError (a defect of the caller, not of the machine)."""
    if len(raw) != 64:
        raise ValueError(f"an IPC handle is 64 bytes, got {len(raw)}")
    ctypes.memmove(int(h.getPtr()), raw, 64)
    return h


class Failed(Exception):
    """A driver call returned an error; the message names the call and the CUresult."""


def make_check(cu: Any) -> Callable[[Any, str], Any]:
    def check(result: Any, what: str) -> Any:
        err, *values = result if isinstance(result, tuple) else (result,)
        code = int(err)
        if code != 0:
            try:
                name = cu.CUresult(code).name
            except ValueError:
                name = "CUresult"
            raise Failed(f"{what}: {name} ({code})")
        return values[0] if len(values) == 1 else (tuple(values) or None)

    return check


def child(spec: dict[str, Any]) -> int:
    """Open what the parent exported, then try host pinning. Returns the number of
    failed IPC steps."""
    cu = driver()
    check = make_check(cu)
    failed: list[str] = []

    def step(name: str, fn: Callable[[], str]) -> bool:
        try:
            say(name, f"OK {fn()}".rstrip())
            return True
        except Failed as e:
            say(name, f"FAILED: {e}")
        except Exception as e:  # a binding that does not parse its arguments, say
            say(name, defect(e))
        failed.append(name)
        return False

    try:
        check(cu.cuInit(0), "cuInit")
        dev = check(cu.cuDeviceGet(int(spec["device"])), "cuDeviceGet")
        ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        flags = int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)
        stream = check(cu.cuStreamCreate(flags), "cuStreamCreate")
    except (Failed, RuntimeError) as e:  # RuntimeError: the bindings cannot load libcuda
        say("child-context", f"FAILED: {e}")
        return len(IPC_STEPS)
    except Exception as e:
        say("child-context", defect(e))
        return len(IPC_STEPS)
    say("child-context", "OK")
    box: dict[str, Any] = {}
    size, offset = int(spec["size"]), int(spec["offset"])

    def mem_open() -> str:
        h = fill_handle(cu.CUipcMemHandle(), bytes.fromhex(spec["mem"]))
        lazy = int(cu.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
        box["ptr"] = int(check(cu.cuIpcOpenMemHandle(h, lazy), "cuIpcOpenMemHandle"))
        return f"(mapped at {box['ptr']:#x})"

    def mem_ordinal() -> str:
        # Which GPU holds the mapping, in this process's numbering (the daemon refuses
        # memory of another GPU than the one it drives, and maps anyway, with a
        # warning, when the driver cannot answer for IPC memory).
        attr = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
        try:
            owner = int(check(cu.cuPointerGetAttribute(attr, box["ptr"]), "cuPointerGetAttribute"))
        except Failed as e:
            return f"(not answered: {e}; the daemon warns and maps anyway)"
        if owner != int(spec["device"]):
            raise Failed(f"the mapping is on GPU {owner}, not GPU {spec['device']}")
        return f"(GPU {owner})"

    def mem_range() -> str:
        # The daemon sizes the mapping from its allocation: ptr .. base + size.
        base, whole = check(cu.cuMemGetAddressRange(box["ptr"]), "cuMemGetAddressRange")
        base, whole = int(base), int(whole)
        usable = whole - (box["ptr"] - base)
        if not base <= box["ptr"] or usable < offset + size:
            raise Failed(
                f"cuMemGetAddressRange: allocation {base:#x}+{whole} does not cover the "
                f"tensor at {box['ptr']:#x}+{offset + size}"
            )
        return f"(allocation of {whole} bytes, mapping at its base + {box['ptr'] - base})"

    def mem_read() -> str:
        buf = (ctypes.c_char * size)()
        src = box["ptr"] + offset
        check(cu.cuMemcpyDtoHAsync(ctypes.addressof(buf), src, size, stream), "cuMemcpyDtoH")
        check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
        got = hashlib.sha256(bytes(buf)).hexdigest()
        if got != spec["sha256"]:
            raise Failed(f"the {size} bytes read differ from the parent's tensor")
        return f"({size} bytes identical)"

    def event_open() -> str:
        h = fill_handle(cu.CUipcEventHandle(), bytes.fromhex(spec["event"]))
        box["event"] = check(cu.cuIpcOpenEventHandle(h), "cuIpcOpenEventHandle")
        return ""

    def event_query() -> str:
        # What the daemon polls before it queues anything behind the engine's event.
        (err,) = cu.cuEventQuery(box["event"])
        if int(err) == int(cu.CUresult.CUDA_ERROR_NOT_READY):
            return "(not ready yet: the parent's stream is still busy)"
        check((err,), "cuEventQuery")
        return "(complete)"

    def stream_wait() -> str:
        check(cu.cuStreamWaitEvent(stream, box["event"], 0), "cuStreamWaitEvent")
        check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
        return ""

    if step("ipc-mem-open", mem_open):
        step("ipc-mem-ordinal", mem_ordinal)
        step("ipc-mem-range", mem_range)
        step("ipc-mem-read", mem_read)
        step("ipc-mem-close", lambda: check(cu.cuIpcCloseMemHandle(box["ptr"]), "close") or "")
    else:
        failed += ["ipc-mem-ordinal", "ipc-mem-range", "ipc-mem-read"]
    if step("ipc-event-open", event_open):
        step("event-query", event_query)
        step("stream-wait-event", stream_wait)
        step("event-destroy", lambda: check(cu.cuEventDestroy(box["event"]), "destroy") or "")
    else:
        failed += ["event-query", "stream-wait-event"]

    # Host pinning: reported, not counted (see the module docstring).
    scratch = (ctypes.c_char * SIZE)()  # DMA source for the pinned-memory checks
    try:
        reg_flags = cu.CU_MEMHOSTREGISTER_PORTABLE | cu.CU_MEMHOSTREGISTER_DEVICEMAP
        alloc_flags = cu.CU_MEMHOSTALLOC_PORTABLE | cu.CU_MEMHOSTALLOC_DEVICEMAP
        dev_buf = check(cu.cuMemAlloc(SIZE), "cuMemAlloc")
    except Failed as e:
        say("host-setup", f"FAILED: {e}")
        return sum(1 for f in failed if f in IPC_STEPS)
    except Exception as e:
        say("host-setup", defect(e))
        return sum(1 for f in failed if f in IPC_STEPS)

    def dma_into(host: int) -> None:
        check(cu.cuMemcpyHtoDAsync(dev_buf, ctypes.addressof(scratch), SIZE, stream), "H2D")
        check(cu.cuMemcpyDtoHAsync(host, dev_buf, SIZE, stream), "D2H into pinned memory")
        check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")

    def host_register() -> str:
        # Where kvseal's --host-region files live in the tests (shmem: Linux refuses
        # long-term pins of writable disk-file mappings); mkstemp makes it private.
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # noqa: S108
        fd, path = tempfile.mkstemp(prefix="kvseal-preflight-", dir=shm)
        try:
            os.ftruncate(fd, SIZE)
            m = mmap.mmap(fd, SIZE)
            m.write(b"\x5a" * SIZE)  # the pages must exist before they can be pinned
            anchor = ctypes.c_char.from_buffer(m)
            addr = ctypes.addressof(anchor)
            try:
                try:
                    check(cu.cuMemHostRegister(addr, SIZE, reg_flags), "cuMemHostRegister")
                    how = "PORTABLE|DEVICEMAP"
                except Failed as e:  # kvseal retries without DEVICEMAP too
                    check(
                        cu.cuMemHostRegister(addr, SIZE, cu.CU_MEMHOSTREGISTER_PORTABLE),
                        f"{e}; without DEVICEMAP",
                    )
                    how = f"PORTABLE only (DEVICEMAP refused: {e})"
                try:
                    ctypes.memset(scratch, 0x3C, SIZE)
                    dma_into(addr)
                    if m[:16] != b"\x3c" * 16:
                        raise Failed("the DMA into the registered file did not land")
                finally:
                    check(cu.cuMemHostUnregister(addr), "cuMemHostUnregister")
            finally:
                del anchor
                m.close()
            return f"({SIZE >> 20} MiB file in {shm or tempfile.gettempdir()}, {how}, DMA ok)"
        finally:
            os.close(fd)
            os.unlink(path)

    def host_alloc() -> str:
        ptr = int(check(cu.cuMemHostAlloc(SIZE, alloc_flags), "cuMemHostAlloc"))
        try:
            try:
                check(cu.cuMemHostGetDevicePointer(ptr, 0), "cuMemHostGetDevicePointer")
                mapped = "mapped"
            except Failed as e:
                mapped = f"not mapped ({e})"
            ctypes.memset(scratch, 0xC3, SIZE)
            dma_into(ptr)
            if ctypes.string_at(ptr, 16) != b"\xc3" * 16:
                raise Failed("the DMA into cuMemHostAlloc memory did not land")
        finally:
            check(cu.cuMemFreeHost(ptr), "cuMemFreeHost")
        return f"({SIZE >> 20} MiB, {mapped}, DMA ok)"

    step("host-register", host_register)
    step("host-alloc", host_alloc)

    def cleanup() -> str:
        check(cu.cuMemFree(dev_buf), "cuMemFree")
        check(cu.cuStreamDestroy(stream), "cuStreamDestroy")
        check(cu.cuDevicePrimaryCtxRelease(dev), "cuDevicePrimaryCtxRelease")
        return ""

    # Best effort: a failing release is reported, and the verdict stays the steps'.
    step("cleanup", cleanup)
    return sum(1 for f in failed if f in IPC_STEPS)


# --------------------------------------------------------------------------------------
# parent: the engine's side, torch only
# --------------------------------------------------------------------------------------


def legacy_handle(raw: bytes) -> bytes:
    """The 64-byte cudaIpcMemHandle_t in what ``_share_cuda_`` returns (as
    kvseal.client.torch_pool decodes it): torch >= 2.2 prefixes a version byte and a
    type byte ('c' cudaMalloc, 'e' expandable segment, which legacy IPC cannot open)."""
    if len(raw) == HANDLE_BYTES:
        return raw
    if len(raw) == HANDLE_BYTES + 2 and raw[1] == ord("c"):
        return raw[2:]
    kind = chr(raw[1]) if len(raw) >= 2 else "?"
    raise ValueError(f"not a legacy cudaMalloc handle ({len(raw)} bytes, type {kind!r})")


def parent(device: int, budget: float) -> int:
    t0 = time.monotonic()
    # Before torch allocates anything: legacy IPC cannot export expandable segments
    # (torch >= 2.9 reads PYTORCH_ALLOC_CONF first, older torch the CUDA name).
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        os.environ[var] = "expandable_segments:False"
    try:
        import torch  # noqa: PLC0415 - only after the allocator setting above
    except ImportError as e:
        say("summary", f"SKIPPED: no torch ({e})")
        return EXIT_NO_TORCH_CUDA
    if not torch.cuda.is_available():
        say("summary", f"SKIPPED: torch {torch.__version__} has no usable CUDA")
        return EXIT_NO_TORCH_CUDA
    dev = torch.device("cuda", device)
    try:
        # A storage offset inside the allocation, as kvseal's pools have: the child
        # must add it to the mapped base, like the daemon does.
        whole = torch.randint(0, 256, (SIZE + 4096,), dtype=torch.uint8, device=dev)
        t = whole[4096:]
        stream = torch.cuda.Stream(device=dev)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(dev))  # randint ran there
        event = torch.cuda.Event(interprocess=True)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            t.add_(1)  # the engine's last write, ordered before the event
            event.record(stream)
        storage: Any = t.untyped_storage()
        _dev, raw, _size, storage_offset, *_ = storage._share_cuda_()
        mem = legacy_handle(bytes(raw))
        ev: Any = event
        ev_handle = bytes(ev.ipc_handle())
        if len(ev_handle) != HANDLE_BYTES:
            raise ValueError(f"event IPC handle of {len(ev_handle)} bytes")
        stream.synchronize()
        cpu = t.cpu()
        want = hashlib.sha256(ctypes.string_at(cpu.data_ptr(), SIZE)).hexdigest()
    except (AttributeError, TypeError) as e:  # torch's API changed, not the GPU
        say("engine-export", f"DEFECT (preflight/torch API): {type(e).__name__}: {e}")
        say("summary", f"{DEFECT}: the engine side could not export (torch {torch.__version__})")
        return EXIT_DEFECT
    except Exception as e:  # torch raises CUDA errors as RuntimeError subclasses
        say("engine-export", f"FAILED: {type(e).__name__}: {e}")
        say("summary", "FAILED: the engine side could not export (torch)")
        return EXIT_IPC_FAILED
    offset = int(storage_offset) + t.storage_offset() * t.element_size()
    say("engine-export", f"OK (torch {torch.__version__}, handle type 'c', offset {offset})")
    spec = {
        "device": device,
        "mem": mem.hex(),
        "offset": offset,
        "size": SIZE,
        "sha256": want,
        "event": ev_handle.hex(),
    }
    # The tensor and the event stay alive (locals) until the child is done with them.
    timeout = max(5.0, budget - (time.monotonic() - t0))
    try:
        r = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout
        print(out or "", end="")
        say("summary", f"FAILED: the child did not finish within {timeout:g} s")
        return EXIT_IPC_FAILED
    print(r.stdout, end="")
    if r.stderr.strip():
        print(r.stderr.strip()[-2000:], file=sys.stderr)
    verdict, rc = summarize(r.stdout, r.returncode)
    say("summary", verdict)
    return rc


def summarize(child_out: str, child_rc: int) -> tuple[str, int]:
    """The summary line and exit status from the child's step lines: a DEFECT line
    anywhere wins (the platform findings next to it may be its consequences)."""
    lines = [ln for ln in child_out.splitlines() if ln.startswith("preflight: ")]
    defects = [ln.removeprefix("preflight: ") for ln in lines if f": {DEFECT}: " in ln]
    if defects:
        step, _, what = defects[0].partition(f": {DEFECT}: ")
        more = f" (+{len(defects) - 1} more)" if len(defects) > 1 else ""
        return (
            f"{DEFECT}: {what} in step {step}{more}: a bug in kvseal or cuda-bindings, "
            "not a platform limitation",
            EXIT_DEFECT,
        )
    bad = [ln.split(": ")[1] for ln in lines if ": FAILED" in ln]
    ipc_bad = [s for s in bad if s in IPC_STEPS or s == "child-context"]
    ran = {ln.split(": ")[1] for ln in lines}
    missing = [f"{s} not reached" for s in IPC_STEPS if s not in ran]
    if child_rc != 0 or ipc_bad or missing:
        why = ", ".join(ipc_bad + missing) or f"child exit {child_rc}"
        return f"FAILED: CUDA IPC between processes ({why})", EXIT_IPC_FAILED
    pin = [s for s in bad if s.startswith("host-")]
    note = f"; {', '.join(pin)} FAILED (kvseal falls back)" if pin else "; host pinning OK"
    return f"OK: CUDA IPC memory + event across processes{note}", EXIT_OK


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument(
        "--budget", type=float, default=25.0, help="seconds for all of it (the child gets the rest)"
    )
    ap.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        try:
            return EXIT_IPC_FAILED if child(json.loads(args.child)) else EXIT_OK
        except Exception as e:  # raised outside any step: still ours, not the platform's
            say("child", defect(e))
            return EXIT_DEFECT
    return parent(args.device, args.budget)


if __name__ == "__main__":
    sys.exit(main())
