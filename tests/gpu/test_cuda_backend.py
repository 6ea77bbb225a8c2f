"""The CUDA backend on a real GPU (``make device-check``; skipped without a GPU).

Two halves:

- in-process: ``CudaBackend`` + ``CudaDevice`` over torch-allocated device memory,
  with the test sealer from tests/test_cuda_backend_cpu.py (known keys), so GPU bytes
  are compared with AESGCM / the BlockSealer format both ways, and tampering is
  checked against the pages;
- daemon: ``kvseal-server --backend cuda`` in its own process, this test process as
  the engine (torch CUDA tensors exported over CUDA IPC, interprocess events): round
  trip, host tampering -> DATA_LOSS, and the stream-sync race.

Budget: well under 3 minutes on an H200 once the kernels are in the NVRTC cache. The
device check runs the two halves as two pytest runs (``-k "not daemon"``, then
``-k daemon``) so that a kernel trap in one cannot poison the other's CUDA context;
a failing daemon test shows the tail of the daemon's log.
"""

from __future__ import annotations

import ctypes
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The engine side exports pool tensors over legacy CUDA IPC, which refuses
# expandable-segment memory: pin the allocator before torch allocates anything. Set,
# not setdefault: the image may set expandable segments itself. torch >= 2.9 reads
# PYTORCH_ALLOC_CONF first, older torch only the CUDA name.
for _var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
    os.environ[_var] = "expandable_segments:False"
torch = pytest.importorskip("torch")


def _pin_allocator() -> None:
    """If torch's CUDA allocator was initialised before this module (the variable is
    read then), set it there too: it applies to the segments allocated from now on.
    Private torch API, so only where it exists (newest name first)."""
    cuda: Any = getattr(torch, "cuda", None)
    if cuda is None or not getattr(cuda, "is_initialized", lambda: False)():
        return
    setter: Any = getattr(getattr(torch, "_C", None), "_accelerator_setAllocatorSettings", None)
    setter = setter or getattr(getattr(cuda, "memory", None), "_set_allocator_settings", None)
    if setter is not None:
        setter("expandable_segments:False")


_pin_allocator()

from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: E402
from kvseal.client import KVSealRpcError, tenant_digest  # noqa: E402
from kvseal.client.shm import BLOCK_ORDER  # noqa: E402
from kvseal.client.torch_pool import geometry_from_tensors, ipc_event_handle  # noqa: E402
from kvseal.server.backends.base import BlockIO  # noqa: E402
from kvseal.server.backends.cuda import compile as kc  # noqa: E402
from kvseal.server.backends.cuda import probe  # noqa: E402
from kvseal.server.backends.cuda.backend import CudaBackend  # noqa: E402
from kvseal.server.hostregion import Extent, align_up  # noqa: E402
from kvseal.server.pools import BufferSpec, Geometry, PoolSpec, SegmentSpec  # noqa: E402
from kvseal.server.sealing import BlockAD, SealRecord  # noqa: E402
from kvseal.v1 import kvseal_pb2 as pb  # noqa: E402

from ..conftest import DaemonProc, start_daemon  # noqa: E402
from ..test_cuda_backend_cpu import (  # noqa: E402
    CountdownDeadline,
    DeviceSealer,
    check_raised,
    known_key,
)
from .bytes_check import assert_same_bytes  # noqa: E402

_ok, _why = probe.cuda_available(0)
if not _ok:
    pytest.skip(f"no usable GPU: {_why}", allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip(f"torch {torch.__version__} has no usable CUDA ({_why})", allow_module_level=True)

pytestmark = pytest.mark.gpu
NS, TENANT = b"N" * 32, b"T" * 32
LAYERS, TOKENS, HEADS, DIM = 64, 16, 8, 128  # Qwen3-32B: 4 MiB blocks
DEV = torch.device("cuda", 0)
REGION_BYTES = 96 << 20  # the daemons' host tier: 24 blocks of 4 MiB (LRU evicts beyond)


@pytest.fixture(scope="module", autouse=True)
def warm_kernels() -> None:
    """Compile (or load from the NVRTC cache) before any daemon starts: its health
    wait would otherwise include the compile."""
    major, minor = torch.cuda.get_device_capability(0)
    try:
        kc.compile_kernels(f"sm_{major}{minor}")
    except kc.NvrtcError:
        kc.compile_kernels(kc.DEFAULT_ARCH, output="ptx")


# --------------------------------------------------------------------------------------
# In-process: the backend over torch device memory
# --------------------------------------------------------------------------------------


class DevicePool:
    """Pool buffers in device memory (torch uint8), with an odd segment layout."""

    def __init__(self, pages: int, segs: list[SegmentSpec], sizes: list[int]) -> None:
        self.pages, self.segs = pages, segs
        self.bufs = [torch.randint(0, 256, (n,), dtype=torch.uint8, device=DEV) for n in sizes]
        self.block_bytes = sum(s.bytes for s in segs)
        buffers = tuple(BufferSpec(None, b"\0" * 64, 0, n, 0) for n in sizes)
        g = Geometry(pages, 1, 1, 1, 1, "uint8", "gpu-test", buffers, tuple(segs))
        self.spec = PoolSpec("gpu-test", b"m", g, "cuda")
        self.spec.validate()
        torch.cuda.synchronize()  # the backend's streams do not order with torch's

    def read(self, page: int) -> bytes:
        parts = [
            self.bufs[s.buffer][s.offset + page * s.page_stride :][: s.bytes] for s in self.segs
        ]
        return _host_bytes(torch.cat(parts))

    def poison(self, page: int) -> None:
        for s in self.segs:
            self.bufs[s.buffer][s.offset + page * s.page_stride :][: s.bytes].fill_(0xA5)
        torch.cuda.synchronize()


def _host_bytes(t: torch.Tensor) -> bytes:
    """A device tensor's bytes (no numpy needed)."""
    cpu = t.contiguous().cpu()
    return ctypes.string_at(cpu.data_ptr(), cpu.numel() * cpu.element_size())


def _qwen_pool(pages: int) -> DevicePool:
    kv = TOKENS * HEADS * DIM * 2
    segs = []
    for layer in range(LAYERS):
        for half in (0, 1):
            segs.append(SegmentSpec(layer, half * pages * kv, kv, kv))
    return DevicePool(pages, segs, [2 * pages * kv] * LAYERS)


def _odd_pool(pages: int) -> DevicePool:
    segs = [
        SegmentSpec(0, 40, 300, 200),
        SegmentSpec(1, 8, 1024, 1000),
        SegmentSpec(0, 40 + 300 * pages, 120, 57),
    ]
    return DevicePool(pages, segs, [40 + 420 * pages + 64, 8 + 1024 * pages])


def _blocks(pool: DevicePool, pages: list[int]) -> list[BlockIO]:
    size = align_up(pool.block_bytes)
    return [
        BlockIO(
            p, Extent(i * size, size), BlockAD(NS, TENANT, bytes([i]) * 32, 7), pool.block_bytes
        )
        for i, p in enumerate(pages)
    ]


@pytest.fixture(scope="module")
def sealer() -> DeviceSealer:
    """The module backend's sealer: a test that seals outside the backend draws its
    epoch and nonces here (a key epoch exists only once something drew from it)."""
    return DeviceSealer()


@pytest.fixture(scope="module")
def backend(sealer: DeviceSealer) -> Iterator[CudaBackend]:
    b = CudaBackend(sealer, 0)
    yield b
    b.close()


@pytest.mark.parametrize("make", [_odd_pool, _qwen_pool], ids=["odd-segments", "qwen3-4MiB"])
def test_gpu_seal_equals_aesgcm_and_round_trips(backend: CudaBackend, make: object) -> None:
    pool = make(6)  # type: ignore[operator]
    region = backend.make_region(64 << 20, None)
    mapped = backend.map_local_pool(pool.spec, [b.data_ptr() for b in pool.bufs])
    try:
        pages = [4, 0, 5, 2]
        blocks = _blocks(pool, pages)
        plain = {p: pool.read(p) for p in pages}
        before = backend.launches
        records = backend.seal_blocks(mapped, blocks, region)
        assert backend.launches - before <= 4  # one launch per chunk, whatever the block count
        for b, rec in zip(blocks, records, strict=True):
            want = AESGCM(known_key(rec.epoch)).encrypt(rec.nonce, plain[b.page], b.ad.encode())
            ct = bytearray(b.size)
            region.read_into(b.extent.offset, memoryview(ct))
            assert_same_bytes(ct, want[:-16], f"ciphertext of page {b.page} vs AESGCM")
            assert_same_bytes(rec.tag, want[-16:], f"tag of page {b.page} vs AESGCM")
        for p in pages:
            pool.poison(p)
        assert backend.open_blocks(mapped, blocks, records, region) == []
        for p in pages:
            assert_same_bytes(pool.read(p), plain[p], f"page {p} opened")
    finally:
        mapped.close()
        region.close()


def test_gpu_opens_what_the_cpu_format_sealed(backend: CudaBackend, sealer: DeviceSealer) -> None:
    pool = _odd_pool(4)
    region = backend.make_region(1 << 20, None)
    mapped = backend.map_local_pool(pool.spec, [b.data_ptr() for b in pool.bufs])
    try:
        blocks = _blocks(pool, [1, 3])
        # The blocks' key epoch and nonces, drawn as a seal would (this test runs
        # alone too: no earlier test need have created the epoch).
        epoch, nonces = sealer.allocate_for_device(len(blocks), (NS, TENANT))
        records = []
        want = {}
        for b, nonce in zip(blocks, nonces, strict=True):
            data = os.urandom(b.size)
            sealed = AESGCM(known_key(epoch)).encrypt(nonce, data, b.ad.encode())
            region.write(b.extent.offset, memoryview(sealed[:-16]))
            records.append(SealRecord(epoch, nonce, sealed[-16:]))
            want[b.page] = data
        assert backend.open_blocks(mapped, blocks, records, region) == []
        for b in blocks:
            assert_same_bytes(pool.read(b.page), want[b.page], f"page {b.page} opened")
    finally:
        mapped.close()
        region.close()


def test_gpu_tamper_writes_nothing(backend: CudaBackend) -> None:
    pool = _qwen_pool(4)
    region = backend.make_region(64 << 20, None)
    mapped = backend.map_local_pool(pool.spec, [b.data_ptr() for b in pool.bufs])
    try:
        blocks = _blocks(pool, [0, 1, 2, 3])
        records = backend.seal_blocks(mapped, blocks, region)
        for p in range(4):
            pool.poison(p)
        poisoned = pool.read(0)
        one = bytearray(1)
        off = blocks[2].extent.offset + 3_000_000
        region.read_into(off, memoryview(one))
        region.write(off, memoryview(bytes([one[0] ^ 0x10])))
        assert backend.open_blocks(mapped, blocks, records, region) == [2]
        for p in range(4):
            assert_same_bytes(pool.read(p), poisoned, f"page {p} after a failed open")
    finally:
        mapped.close()
        region.close()


@pytest.mark.parametrize("how", ["cutoff", "cancel"])
def test_gpu_deadline_at_every_boundary_touches_no_page_after(
    backend: CudaBackend, how: str
) -> None:
    """The engine contract on real streams: a deadline failing at each check of a
    restore raises with no page written: pages rewritten by torch after the raise
    still hold torch's bytes once both kvseal streams are synchronised (anything left
    queued would have landed then); a seal failing at each check returns nothing."""
    pool = _qwen_pool(8)
    min_chunk_bytes = backend.min_chunk_bytes
    backend.min_chunk_bytes = 1  # 4 chunks for 8 blocks: every boundary is reachable
    region = backend.make_region(64 << 20, None)
    mapped = backend.map_local_pool(pool.spec, [b.data_ptr() for b in pool.bufs])
    try:
        blocks = _blocks(pool, list(range(8)))
        plain = {b.page: pool.read(b.page) for b in blocks}
        counting = CountdownDeadline()
        records = backend.seal_blocks(mapped, blocks, region, deadline=counting)
        for at in range(1, counting.calls + 1):
            with check_raised(how):
                backend.seal_blocks(mapped, blocks, region, deadline=CountdownDeadline(at, how))
        counting = CountdownDeadline()
        for p in plain:
            pool.poison(p)
        assert backend.open_blocks(mapped, blocks, records, region, deadline=counting) == []
        for p, data in plain.items():
            assert_same_bytes(pool.read(p), data, f"page {p} opened")
        for at in range(1, counting.calls + 1):
            for p in plain:
                pool.poison(p)
            with check_raised(how):
                backend.open_blocks(
                    mapped, blocks, records, region, deadline=CountdownDeadline(at, how)
                )
            for b in pool.bufs:  # the engine reuses the pages at once
                b.fill_(0x3C)
            torch.cuda.synchronize()
            backend._dev.sync(backend._dev.compute_stream)  # anything left would land now
            backend._dev.sync(backend._dev.copy_stream)
            for p in plain:
                assert_same_bytes(pool.read(p), b"\x3c" * pool.block_bytes, f"page {p}, at {at}")
    finally:
        backend.min_chunk_bytes = min_chunk_bytes  # as the other tests expect it
        mapped.close()
        region.close()


def test_gpu_mapped_seal_mode_gives_the_same_bytes() -> None:
    if probe.cc_mode() == "on":
        pytest.skip("CC on: the host region is not mapped into the device")
    b = CudaBackend(DeviceSealer(), 0, seal_mode="mapped")
    try:
        pool = _odd_pool(3)
        region = b.make_region(1 << 20, None)
        mapped = b.map_local_pool(pool.spec, [x.data_ptr() for x in pool.bufs])
        blocks = _blocks(pool, [2, 0])
        recs = b.seal_blocks(mapped, blocks, region)
        for blk, rec in zip(blocks, recs, strict=True):
            want = AESGCM(known_key(rec.epoch)).encrypt(
                rec.nonce, pool.read(blk.page), blk.ad.encode()
            )
            ct = bytearray(blk.size)
            region.read_into(blk.extent.offset, memoryview(ct))
            assert_same_bytes(bytes(ct) + rec.tag, want, f"mapped seal of page {blk.page}")
        mapped.close()
        region.close()
    finally:
        b.close()


def test_gpu_periodic_device_check_passes_on_a_healthy_context() -> None:
    """The daemon's periodic check (``cuCtxSynchronize`` on the real driver) on a
    healthy idle context: the backend stays usable and its callback never runs.
    A backend of its own: a failing check would mark it broken for good."""
    b = CudaBackend(DeviceSealer(), 0)
    try:
        reports: list[str] = []
        b.set_on_broken(reports.append)
        for _ in range(3):
            b.check_device()
        assert b.broken is None and reports == []
    finally:
        b.close()


# --------------------------------------------------------------------------------------
# Daemon in its own process; this process is the engine
# --------------------------------------------------------------------------------------


class Engine:
    """vLLM-style per-layer KV tensors [2, pages, tokens, heads, dim] bf16 on GPU 0."""

    def __init__(self, pages: int) -> None:
        self.pages = pages
        self.layers = [
            torch.zeros((2, pages, TOKENS, HEADS, DIM), dtype=torch.bfloat16, device=DEV)
            for _ in range(LAYERS)
        ]
        self.stream = torch.cuda.Stream()

    def geometry(self) -> pb.PoolGeometry:
        return geometry_from_tensors(
            self.layers,
            1,
            layout_name=BLOCK_ORDER,
            tokens_per_page=TOKENS,
            num_layers=LAYERS,
            num_kv_heads=HEADS,
            head_dim=DIM,
        )

    def bytes_of(self, page: int) -> bytes:
        return b"".join(_host_bytes(t[:, page]) for t in self.layers)

    def fill(self, page: int, value: int) -> None:
        for t in self.layers:
            t[:, page].view(torch.uint8).fill_(value)

    def randomize(self, page: int) -> None:
        for t in self.layers:
            t[:, page].view(torch.uint8).random_(0, 256)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[DaemonProc, Path]]:
    # The tamper test rewrites the region file, so it must be registrable: shmem is
    # (Linux refuses long-term pins of writable disk-file mappings), and the pages must
    # exist (a full /dev/shm would fault while pinning): only with room to spare.
    region = Path("/dev/shm") / f"kvseal-gpu-test-{secrets.token_hex(4)}"
    st = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    room = st is not None and st.f_bavail * st.f_frsize > 4 * REGION_BYTES
    extra = ["--host-region", str(region)] if room else []
    d = start_daemon(
        tmp_path / "d",
        "--backend",
        "cuda",
        "--device",
        "0",
        *extra,
        "--on-integrity-failure",
        "drop",
        host_bytes=str(REGION_BYTES),
    )
    try:
        yield d, region
    finally:
        d.stop()
        region.unlink(missing_ok=True)
        # Shown by pytest under "Captured stdout teardown" when the test failed: the
        # daemon's side of the story (CUDA errors, refused handles) without its file.
        try:
            tail = d.log()[-4000:]
        except OSError as e:
            tail = f"(no daemon log: {e})"
        print(f"---- daemon log {d.log_path} (last 4000 chars) ----\n{tail}")


def _register(d: DaemonProc, eng: Engine) -> str:
    with d.client() as c:
        return c.register_pool("engine", b"model:gpu-test", eng.geometry(), pb.BACKEND_CUDA).pool_id


def _offload(
    d: DaemonProc, pool_id: str, hashes: list[bytes], pages: list[int], ev: bytes = b""
) -> None:
    with d.client() as c:
        r = c.offload(pool_id, tenant_digest(None), hashes, pages, cuda_event_ipc_handle=ev)
        assert r.stored_blocks == len(hashes)


def _restore(
    d: DaemonProc, pool_id: str, hashes: list[bytes], pages: list[int], ev: bytes = b""
) -> None:
    with d.client() as c:
        c.restore(pool_id, tenant_digest(None), hashes, pages, cuda_event_ipc_handle=ev)


def test_daemon_round_trip_over_cuda_ipc(daemon: tuple[DaemonProc, Path]) -> None:
    d, _ = daemon
    eng = Engine(8)
    for p in range(4):
        eng.randomize(p)
    torch.cuda.synchronize()
    want = {p: eng.bytes_of(p) for p in range(4)}
    pool_id = _register(d, eng)
    with d.client() as c:
        st = c.stats()
        assert st.backend == pb.BACKEND_CUDA and "cuda:" in st.backend_detail
    hashes = [secrets.token_bytes(32) for _ in range(4)]
    _offload(d, pool_id, hashes, [0, 1, 2, 3])
    for p in range(4, 8):
        eng.fill(p, 0xA5)
    torch.cuda.synchronize()
    _restore(d, pool_id, hashes, [4, 5, 6, 7])
    for i in range(4):
        assert_same_bytes(eng.bytes_of(4 + i), want[i], f"page {4 + i} restored")


def _head(path: Path, n: int = 8 << 20) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def test_daemon_host_tamper_is_data_loss(daemon: tuple[DaemonProc, Path]) -> None:
    d, region = daemon
    with d.client() as c:
        desc = c.stats().host_region
    if "registered" not in desc:
        pytest.skip(f"host region is not the file ({desc}): cannot play the hypervisor")
    eng = Engine(4)
    eng.randomize(0)
    torch.cuda.synchronize()
    pool_id = _register(d, eng)
    before = _head(region)
    h = secrets.token_bytes(32)
    _offload(d, pool_id, [h], [0])
    after = _head(region)
    changed = next(
        i for i in range(0, len(after), 4096) if after[i : i + 4096] != before[i : i + 4096]
    )
    with open(region, "r+b") as f:
        f.seek(changed + 100)
        b = f.read(1)
        f.seek(changed + 100)
        f.write(bytes([b[0] ^ 1]))
    eng.fill(1, 0xA5)
    torch.cuda.synchronize()
    poisoned = eng.bytes_of(1)
    with pytest.raises(KVSealRpcError) as ei:
        _restore(d, pool_id, [h], [1])
    assert ei.value.code.name == "DATA_LOSS"
    assert_same_bytes(eng.bytes_of(1), poisoned, "page 1 after DATA_LOSS")


def test_daemon_waits_for_the_engine_stream(daemon: tuple[DaemonProc, Path]) -> None:
    """The engine writes pages on its own stream behind a long kernel, records an
    interprocess event and offloads at once, without synchronising; the daemon must
    read the new bytes. Same on restore: the engine's late write to the destination
    page must land before the daemon's open, so the page ends up restored."""
    d, _ = daemon
    eng = Engine(4)
    pool_id = _register(d, eng)
    ev = torch.cuda.Event(interprocess=True)
    handle = ipc_event_handle(ev)
    for i in range(12):
        value = 1 + i
        with torch.cuda.stream(eng.stream):
            torch.cuda._sleep(20_000_000)  # ~10 ms: a race would read stale bytes
            eng.fill(0, value)
            ev.record(eng.stream)
        h = secrets.token_bytes(32)
        _offload(d, pool_id, [h], [0], handle)
        with torch.cuda.stream(eng.stream):
            torch.cuda._sleep(20_000_000)
            eng.fill(1, 0xEE)  # the engine's last use of the destination page
            ev.record(eng.stream)
        _restore(d, pool_id, [h], [1], handle)
        eng.stream.synchronize()
        page = bytes([value]) * (LAYERS * 2 * TOKENS * HEADS * DIM * 2)
        assert_same_bytes(eng.bytes_of(1), page, f"page 1 restored, round {i}")


def test_operator_selftest_against_cuda_daemon(daemon: tuple[DaemonProc, Path]) -> None:
    """`kvseal selftest` on a GPU node: torch CUDA tensors over CUDA IPC, real geometry."""
    import subprocess
    import sys

    d, _ = daemon
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvseal.client.cli",
            "--socket",
            d.socket,
            "selftest",
            "--blocks",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every byte identical" in r.stdout and r.stdout.strip().endswith("PASS")


_GPU_ENGINE = """
import sys, time, torch
from kvseal.client import ClientConfig, EnginePool, KVSealClient
from kvseal.client.shm import BLOCK_ORDER
from kvseal.client.torch_pool import geometry_from_tensors
layers = [torch.zeros((2, 256, 16, 8, 128), dtype=torch.bfloat16, device="cuda:0")
          for _ in range(64)]  # 1 GiB of KV pool
torch.cuda.synchronize()
geometry = geometry_from_tensors(layers, 1, layout_name=BLOCK_ORDER, tokens_per_page=16,
                                 num_layers=64, num_kv_heads=8, head_dim=128)
engine = EnginePool(KVSealClient(ClientConfig(target=sys.argv[1])), "doomed", b"fp", geometry)
handle = engine.wait_ready(20)
deadline = time.monotonic() + 20
while not engine.held and time.monotonic() < deadline:  # confirmed in the background
    time.sleep(0.01)
print(handle.pool_id if handle else "-", engine.held, flush=True)
time.sleep(600)
"""


def test_daemon_frees_a_killed_engines_gpu_memory(daemon: tuple[DaemonProc, Path]) -> None:
    """An engine that dies (SIGKILL: no clean-up) must get its KV memory back on
    restart: its HoldPool stream drops, the daemon unregisters the pool and closes
    the CUDA IPC mappings, and the driver frees the allocation (device-wide free
    memory comes back). Without that, a restarted engine would run out of memory."""
    import signal
    import subprocess
    import sys
    import time

    d, _ = daemon
    torch.cuda.synchronize()
    free_before, _total = torch.cuda.mem_get_info(0)
    child = subprocess.Popen(
        [sys.executable, "-c", _GPU_ENGINE, d.target],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert child.stdout is not None
        pool_id, held = child.stdout.readline().split()
        assert pool_id != "-" and held == "True", "the engine could not register and hold"
        free_with_engine = torch.cuda.mem_get_info(0)[0]
        assert free_before - free_with_engine >= 1 << 30
        child.send_signal(signal.SIGKILL)
        child.wait(30)
        deadline = time.monotonic() + 30  # bounds a broken build; not a timing check
        while time.monotonic() < deadline:
            with d.client() as c:
                if c.stats().pools == 0 and torch.cuda.mem_get_info(0)[0] > free_with_engine + (
                    768 << 20
                ):
                    break
            time.sleep(0.1)
        with d.client() as c:
            assert c.stats().pools == 0, "the dead engine's pool is still registered"
        assert torch.cuda.mem_get_info(0)[0] > free_with_engine + (768 << 20), (
            "the dead engine's GPU memory was not freed (still mapped by the daemon?)"
        )
        assert "its holder (the engine) went away" in d.log()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
