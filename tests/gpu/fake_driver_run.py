"""CudaBackend + CudaDevice through the real cuda-python bindings over tests/gpu/fake_libcuda.c.

Run by tests/test_cuda_backend_cpu.py::test_cuda_device_over_fake_driver in a subprocess
whose LD_LIBRARY_PATH puts the fake libcuda.so.1 first (the bindings load libcuda once
per process). Argument conformance is what this checks: every driver call CudaDevice
makes must parse in cuda-python and satisfy the fake driver's strict checks, and the
bytes must equal AESGCM's. Prints "ALL OK" and exits 0 on success.

Usage: fake_driver_run.py SEAL_MODE CC [file] [ptx]
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import tempfile

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


def main(argv: list[str]) -> int:
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
    print("ALL OK")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
