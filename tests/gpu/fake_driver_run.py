"""CudaBackend + CudaDevice through the real cuda-python bindings over tests/gpu/fake_libcuda.c.

Run by tests/test_cuda_backend_cpu.py::test_cuda_device_over_fake_driver in a subprocess
whose LD_LIBRARY_PATH puts the fake libcuda.so.1 first (the bindings load libcuda once
per process). Argument conformance is what this checks: every driver call CudaDevice
makes must parse in cuda-python and satisfy the fake driver's strict checks, and the
bytes must equal AESGCM's. Prints "ALL OK" and exits 0 on success.

Every AttributeError or TypeError raised by a driver call, by constructing a driver
struct or by reading or writing one of its attributes is recorded (see
:class:`RecordingDriver`) and fails the run, even when kvseal's code catches it: the
daemon turns such an exception into INTERNAL, and the host region's fallbacks swallow
any exception, so a binding that changed its API (cuda-bindings 13.4 made the IPC
handle types opaque) could otherwise pass here and fail for every user. The first line
printed names the cuda-bindings version and where it was loaded from.

``fake_driver_run.py preflight [defect]`` runs the child half of
scripts/ipc_preflight.py (the daemon's side, cuda-python only) in this process, over
memory and an event this process made: every step must pass, and with ``defect`` a
handle the bindings refuse (the bytes themselves, not a CUipcMemHandle) must be
reported as ``DEFECT (kvseal/cuda-bindings): TypeError`` with exit status 3.

Usage: fake_driver_run.py SEAL_MODE CC [file] [ptx] | fake_driver_run.py preflight [defect]
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib
import importlib.util
import io
import os
import struct
import sys
import tempfile
import types
from collections.abc import Callable
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from kvseal.server.backends.base import BlockIO
from kvseal.server.backends.cuda import compile as kc
from kvseal.server.backends.cuda import probe
from kvseal.server.backends.cuda.backend import CudaBackend
from kvseal.server.backends.cuda.device import CudaDevice
from kvseal.server.errors import BadRequest, HandleUnusable
from kvseal.server.hostregion import Extent, align_up
from kvseal.server.pools import BufferSpec, Geometry, PoolSpec, SegmentSpec
from kvseal.server.sealing import BlockAD

from tests.test_cuda_backend_cpu import DeviceSealer, known_key

# What a binding raises when kvseal calls it with the wrong API: a removed attribute
# (AttributeError), an argument of a type it no longer accepts (TypeError).
API_DEFECTS = (AttributeError, TypeError)


class RecordingDriver(types.ModuleType):
    """``cuda.bindings.driver`` with every API defect recorded in :attr:`defects`.

    Functions are wrapped; classes that are not enums (``CUipcMemHandle``, ...) build a
    :class:`_Struct` around the real object, so that ``h.reserved = ...`` on an opaque
    handle is seen too. Enums, constants and the objects the driver returns pass
    through untouched (they are compared, converted with ``int`` and handed back)."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__(real.__name__, real.__doc__)
        self._real = real
        self.defects: list[str] = []

    def note(self, what: str, e: BaseException) -> None:
        self.defects.append(f"{what}: {type(e).__name__}: {e}")

    def __getattr__(self, name: str) -> Any:
        try:
            value = getattr(self._real, name)
        except AttributeError as e:  # a name this release does not have
            self.note(f"cuda.bindings.driver.{name}", e)
            raise
        if isinstance(value, type) and not issubclass(value, int):  # IntEnum, FastEnum
            return self.wrap(name, functools.partial(_Struct, self, name, value))
        if callable(value) and not isinstance(value, type):
            return self.wrap(name, value)
        return value

    def wrap(self, what: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*map(_unwrap, args), **{k: _unwrap(v) for k, v in kwargs.items()})
            except API_DEFECTS as e:
                self.note(f"{what}(...)", e)
                raise

        return call


class _Struct:
    """A driver struct kvseal built; attribute reads and writes go to the real one,
    and raise (after recording) what they raise there. :func:`_unwrap` hands the real
    object to the driver calls."""

    __slots__ = ("_drv", "_name", "_real")

    def __init__(self, drv: RecordingDriver, name: str, cls: type, *args: Any) -> None:
        object.__setattr__(self, "_drv", drv)
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_real", cls(*map(_unwrap, args)))

    def __getattr__(self, attr: str) -> Any:
        try:
            value = getattr(self._real, attr)
        except API_DEFECTS as e:
            self._drv.note(f"{self._name}.{attr}", e)
            raise
        return self._drv.wrap(f"{self._name}.{attr}", value) if callable(value) else value

    def __setattr__(self, attr: str, value: Any) -> None:
        try:
            setattr(self._real, attr, _unwrap(value))
        except API_DEFECTS as e:
            self._drv.note(f"{self._name}.{attr} = ...", e)
            raise


def _unwrap(value: Any) -> Any:
    return object.__getattribute__(value, "_real") if isinstance(value, _Struct) else value


def install_recording_driver() -> RecordingDriver:
    """Put a :class:`RecordingDriver` where every import of the driver module finds it
    (``importlib``, ``import cuda.bindings.driver``, ``from cuda.bindings import driver``);
    print the bindings' version and location first."""
    import cuda.bindings

    real = importlib.import_module("cuda.bindings.driver")
    # Compiled siblings import the driver's types from sys.modules when they load,
    # and a wrapped class is no type: load them (NVRTC is what kvseal uses) first.
    for sibling in ("cuda.bindings.nvrtc", "cuda.bindings.runtime"):
        importlib.import_module(sibling)
    version = getattr(cuda.bindings, "__version__", "unknown")
    print(f"cuda-bindings {version} from {os.path.dirname(cuda.bindings.__file__ or '?')}")
    drv = RecordingDriver(real)
    sys.modules["cuda.bindings.driver"] = drv
    cuda.bindings.driver = drv  # type: ignore[attr-defined]
    return drv


def main(argv: list[str]) -> int:
    drv = install_recording_driver()
    if argv[0] == "preflight":
        return preflight(drv, "defect" in argv[1:])
    try:
        run(argv)
    finally:
        # Printed whatever happened: a defect that kvseal caught and turned into
        # another error (HandleUnusable, a region fallback) is the cause to report.
        for d in drv.defects:
            print(f"DRIVER API DEFECT: {d}")
    if drv.defects:
        print(f"FAILED: {len(drv.defects)} AttributeError/TypeError in driver calls")
        return 1
    print("ALL OK")
    return 0


def preflight(drv: RecordingDriver, defect: bool) -> int:
    """The preflight's child over this process's own fake device memory and event."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "ipc_preflight.py")
    spec_ = importlib.util.spec_from_file_location("ipc_preflight", path)
    assert spec_ is not None and spec_.loader is not None
    pf = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(pf)
    fake = ctypes.CDLL("libcuda.so.1")
    cu: Any = drv
    assert int(cu.cuInit(0)[0]) == 0
    _, dev = cu.cuDeviceGet(0)
    _, ctx = cu.cuDevicePrimaryCtxRetain(dev)
    cu.cuCtxSetCurrent(ctx)
    offset, size = 4096, int(pf.SIZE)
    err, base = cu.cuMemAlloc(offset + size)  # the "engine's" tensor
    assert int(err) == 0
    payload = os.urandom(size)
    ctypes.memmove(int(base) + offset, payload, size)  # fake device memory is host memory
    mem = b"FAKEIPC!" + struct.pack("<Q", int(base)) + bytes(0x80 + i for i in range(16, 64))
    spec = {
        "device": 0,
        "mem": mem.hex(),
        "offset": offset,
        "size": size,
        "sha256": hashlib.sha256(payload).hexdigest(),
        "event": (b"FAKEEVT!" + bytes(range(8, 64))).hex(),
    }
    if defect:  # the handle's bytes where the bindings want a CUipcMemHandle
        pf.fill_handle = lambda h, raw: raw
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        failed = pf.child(spec)
    print(out.getvalue(), end="")
    verdict, rc = pf.summarize(out.getvalue(), 1 if failed else 0)
    print(f"preflight: summary: {verdict} (exit {rc})")
    cu.cuMemFree(base)
    cu.cuDevicePrimaryCtxRelease(dev)
    assert fake.fake_cuda_live() == 0, f"{fake.fake_cuda_live()} driver objects leaked"
    assert fake.fake_cuda_ctx_refs() == 0, "primary context not released"
    if defect:
        assert rc == pf.EXIT_DEFECT, verdict
        assert verdict.startswith("DEFECT (kvseal/cuda-bindings): TypeError"), verdict
        assert "ipc-mem-open" in verdict, verdict
        # The recorder saw the same exception: it was expected here.
        assert any("cuIpcOpenMemHandle" in d and "TypeError" in d for d in drv.defects)
        drv.defects.clear()
    else:
        assert rc == pf.EXIT_OK and verdict.startswith("OK: "), verdict
        assert "host pinning OK" in verdict, verdict
    for d in drv.defects:
        print(f"DRIVER API DEFECT: {d}")
    if drv.defects:
        return 1
    print("ALL OK")
    return 0


def run(argv: list[str]) -> None:
    mode, cc = argv[0], argv[1]
    use_file, ptx = "file" in argv[2:], "ptx" in argv[2:]
    fake = ctypes.CDLL("libcuda.so.1")
    assert probe.cuda_available(0) == (True, "Fake H200 (device 0, sm_90)")
    assert probe.cuda_available(3)[0] is False
    if ptx:  # NVRTC cannot target the arch as CUBIN: the PTX fallback must load
        real = kc.compile_kernels

        def no_cubin(arch: str = kc.DEFAULT_ARCH, **kw: object) -> kc.CompiledKernels:
            if kw.get("output", "cubin") == "cubin":
                raise kc.NvrtcError("no CUBIN for this arch (test)")
            return real(arch, **kw)  # type: ignore[arg-type]

        kc.compile_kernels = no_cubin  # type: ignore[assignment]
    be = CudaBackend(DeviceSealer(), 0, seal_mode=mode, cc=cc)
    d = be._dev
    assert isinstance(d, CudaDevice)
    assert ("ptx" in d.image_kind) == ptx, d.image_kind

    pages = 6
    segs = [
        SegmentSpec(0, 40, 300, 200),
        SegmentSpec(1, 8, 1024, 1000),
        SegmentSpec(0, 40 + 300 * pages, 120, 57),
    ]
    sizes = [40 + 420 * pages + 64, 8 + 1024 * pages]
    bufs = [d.alloc(n) for n in sizes]
    contents = [os.urandom(n) for n in sizes]

    def reset() -> None:
        for b, c in zip(bufs, contents, strict=True):
            ctypes.memmove(b, c, len(c))  # fake device memory is host memory

    def read_page(p: int) -> bytes:
        return b"".join(
            ctypes.string_at(bufs[s.buffer] + s.offset + p * s.page_stride, s.bytes) for s in segs
        )

    def fill_page(p: int, v: int) -> None:
        for s in segs:
            ctypes.memset(bufs[s.buffer] + s.offset + p * s.page_stride, v, s.bytes)

    def ipc_handle(base: int) -> bytes:  # what fake_libcuda.c's cuIpcOpenMemHandle decodes
        return b"FAKEIPC!" + struct.pack("<Q", base) + bytes(0x80 + i for i in range(16, 64))

    reset()
    bb = sum(s.bytes for s in segs)
    buffers = tuple(
        BufferSpec(None, ipc_handle(b), 0, n, 0) for b, n in zip(bufs, sizes, strict=True)
    )
    spec = PoolSpec(
        "t", b"m", Geometry(pages, 1, 1, 1, 1, "uint8", "t", buffers, tuple(segs)), "cuda"
    )
    spec.validate()
    ipc_pool = be.map_pool(spec)  # cuIpcOpenMemHandle + cuMemGetAddressRange
    local_pool = be.map_local_pool(spec, bufs)
    path = os.path.join(tempfile.mkdtemp(), "region") if use_file else None
    region = be.make_region(1 << 20, path)
    print("region:", region.description)
    assert (region.device_ptr is not None) == (cc != "on")
    size = align_up(bb)
    blocks = [
        BlockIO(p, Extent(i * size, size), BlockAD(b"N" * 32, b"T" * 32, bytes([i]) * 32, 7), bb)
        for i, p in enumerate([4, 0, 5, 2])
    ]
    plain = {b.page: read_page(b.page) for b in blocks}
    event = b"FAKEEVT!" + bytes(range(8, 64))  # what cuIpcOpenEventHandle accepts
    for pool in (ipc_pool, local_pool):
        recs = be.seal_blocks(pool, blocks, region, wait_event=event)
        for b, r in zip(blocks, recs, strict=True):
            want = AESGCM(known_key(r.epoch)).encrypt(r.nonce, plain[b.page], b.ad.encode())
            ct = bytearray(b.size)
            region.read_into(b.extent.offset, memoryview(ct))
            assert bytes(ct) == want[:-16] and r.tag == want[-16:], "not AESGCM's bytes"
        for b in blocks:
            fill_page(b.page, 0xA5)
        assert be.open_blocks(pool, blocks, recs, region, wait_event=event) == []
        assert all(read_page(p) == plain[p] for p in plain)
        one = bytearray(1)
        region.read_into(blocks[2].extent.offset + 5, memoryview(one))
        region.write(blocks[2].extent.offset + 5, memoryview(bytes([one[0] ^ 1])))
        for b in blocks:
            fill_page(b.page, 0x11)
        assert be.open_blocks(pool, blocks, recs, region) == [2]
        assert all(read_page(b.page) == b"\x11" * bb for b in blocks), "tamper wrote pages"
        reset()
    assert fake.fake_cuda_launches() == be.launches + 1, "launches not counted"  # + key setup
    try:
        be._open_event(b"x" * 64)
        raise AssertionError("a bad event handle was accepted")
    except HandleUnusable:
        pass
    bad = Geometry(
        pages,
        1,
        1,
        1,
        1,
        "uint8",
        "t",
        (BufferSpec(None, b"y" * 64, 0, 8, 0),),
        (SegmentSpec(0, 0, 8, 8),),
    )
    try:
        be.map_pool(PoolSpec("u", b"m", bad, "cuda"))
        raise AssertionError("a bad IPC handle was accepted")
    except HandleUnusable:
        pass
    # Two entries over one allocation (the same handle, overlapping ranges): resolved
    # through cuMemGetAddressRange to the same identity, refused, nothing left mapped.
    h0 = ipc_handle(bufs[0])
    alias = Geometry(
        2,
        1,
        1,
        1,
        1,
        "uint8",
        "t",
        (BufferSpec(None, h0, 0, 512, 0), BufferSpec(None, h0, 256, 512, 0)),
        (SegmentSpec(0, 0, 256, 256), SegmentSpec(1, 0, 256, 256)),
    )
    live = fake.fake_cuda_live()
    try:
        be.map_pool(PoolSpec("a", b"m", alias, "cuda"))
        raise AssertionError("aliasing buffers were accepted")
    except BadRequest:
        pass
    assert fake.fake_cuda_live() == live, "the refused pool left a mapping open"
    # The daemon's periodic device check, through the real bindings: a healthy
    # context passes it (a wrong call would mark the backend broken).
    be.check_device()
    assert be.broken is None, f"the device check broke a healthy backend: {be.broken}"
    ipc_pool.close()
    local_pool.close()
    region.close()
    for b in bufs:
        d.free(b)
    be.close()
    assert fake.fake_cuda_live() == 0, f"{fake.fake_cuda_live()} driver objects leaked"
    assert fake.fake_cuda_ctx_refs() == 0, "primary context not released"
    space = b" "
    assert space[0] == 32, "the one-byte b' ' object was overwritten"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
