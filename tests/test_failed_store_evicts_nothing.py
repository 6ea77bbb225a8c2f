"""A store that fails evicts nothing it did not overwrite, on both backends:
eviction is two-phase (victims are doomed, removed only when the store
succeeds, reinstated when it fails before writing over them), and each backend
reports on a failed ``seal_blocks`` which blocks it may have written
(``backends.base.note_written``).

- Against a real daemon (gRPC over its Unix socket): the CPU backend in its own
  process; the CUDA backend in this process on the emulated device (its engine
  pools are this process's memory exported through the emulated CUDA IPC, which
  no other process can map).
- In process, through ``SealedCache``: a store that fails in the middle of its
  blocks (both backends, both CUDA seal modes), the CUDA backend failing at
  each point before it writes anything, and (with a store tier under
  ``--store-policy spill``) an eviction victim's copy failing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import grpc
import pytest
from kvseal.client import ClientConfig, KVSealClient, KVSealRpcError, tenant_digest
from kvseal.client.shm import KVShape, SharedKVPool
from kvseal.server import convert
from kvseal.server.backends.base import Backend, Region
from kvseal.server.backends.cpu.backend import CpuBackend
from kvseal.server.backends.cuda import emulated as E
from kvseal.server.backends.cuda.backend import CudaBackend
from kvseal.server.backends.cuda.device import CudaError
from kvseal.server.backends.cuda.emulated_device import EmulatedDevice
from kvseal.server.backends.cuda.keys import KEYCTX_BYTES
from kvseal.server.cache import SealedCache
from kvseal.server.config import IntegrityPolicy, ServerConfig, StorePolicy
from kvseal.server.daemon import cli
from kvseal.server.daemon import daemon as daemon_mod
from kvseal.server.deadline import NO_DEADLINE, Deadline
from kvseal.server.errors import DeadlinePassed, EngineNotReady, HandleUnusable
from kvseal.server.hostregion import HostRegion
from kvseal.server.index import State, StoreOutcome
from kvseal.server.sealing import BlockSealer
from kvseal.v1 import kvseal_pb2 as pb

from .conftest import DaemonProc, until
from .store_helpers import chain
from .test_store_drop import TPP, Rig

FP = b"model:evict"
GEOMETRY = {"tokens_per_page": 16, "num_layers": 2, "num_kv_heads": 8, "head_dim": 64}  # 64 KiB


def _shape(num_pages: int) -> KVShape:
    g = GEOMETRY
    return KVShape(
        num_pages, g["tokens_per_page"], g["num_layers"], g["num_kv_heads"], g["head_dim"]
    )


BLOCK = _shape(1).block_bytes  # 16 blocks fill the 1 MiB minimum tier


class EnginePages(Protocol):
    """What these tests do to an engine's pool: the CPU backend's shared-memory
    pool (``SharedKVPool``) and the emulated GPU's (``EmulatedPool``) alike."""

    def geometry(self) -> pb.PoolGeometry: ...

    def read_block(self, page: int) -> bytes: ...

    def write_block(self, page: int, data: bytes | memoryview) -> None: ...

    def fill_page(self, page: int, byte: int) -> None: ...


class EmulatedPool:
    """An engine pool in this process's memory, exported through the emulated
    device's CUDA IPC (``EmulatedDevice.export``): one buffer, one segment of one
    block per page, the geometry of ``GEOMETRY``."""

    def __init__(self, dev: EmulatedDevice, num_pages: int) -> None:
        self.num_pages = num_pages
        self.buf = bytearray(num_pages * BLOCK)  # alive as long as the pool is
        self.handle = dev.export(self.buf)

    def geometry(self) -> pb.PoolGeometry:
        return pb.PoolGeometry(
            num_pages=self.num_pages,
            dtype="bfloat16",
            layout="test",
            buffers=[pb.BufferHandle(cuda_ipc_handle=self.handle, offset=0, size=len(self.buf))],
            segments=[pb.Segment(buffer=0, offset=0, page_stride=BLOCK, bytes=BLOCK)],
            **GEOMETRY,
        )

    def read_block(self, page: int) -> bytes:
        return bytes(self.buf[page * BLOCK : (page + 1) * BLOCK])

    def write_block(self, page: int, data: bytes | memoryview) -> None:
        if len(data) != BLOCK:
            raise ValueError("data must be exactly one block")
        self.buf[page * BLOCK : (page + 1) * BLOCK] = data

    def fill_page(self, page: int, byte: int) -> None:
        self.buf[page * BLOCK : (page + 1) * BLOCK] = bytes([byte]) * BLOCK


def _need_emulator() -> None:
    try:
        E.load_emulator()
    except E.EmulatorUnavailable as exc:
        pytest.skip(f"CPU emulator unavailable: {exc}")


@contextlib.contextmanager
def emulated_cuda_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dev: EmulatedDevice, *args: str
) -> Iterator[str]:
    """A real daemon (``Daemon.create``, gRPC on a Unix socket, the relay) in this
    process, on the CUDA backend over ``dev``; yields its target."""
    monkeypatch.setattr(
        daemon_mod,
        "make_backend",
        lambda cfg, sealer: CudaBackend(
            sealer, cfg.device, dev=dev, cc="off", engine_event_timeout=cfg.engine_event_timeout
        ),
    )
    sock = tmp_path / "run" / "k.sock"
    cfg = cli.config_from_args(
        ["--listen", f"unix://{sock}", "--backend", "cuda", "--host-bytes", "1MiB", *args]
    )
    d = daemon_mod.Daemon.create(cfg)
    d.start()
    try:
        yield f"unix://{sock}"
    finally:
        d.begin_shutdown()
        d.wait()


# How a tenant's offload fails before writing a byte, per backend: (what the test
# does to the engine pool, extra Offload arguments) and the status it gets.
FAILURES = {
    # The engine shrank its shared-memory object: the pool check refuses it.
    "cpu-pool-shrunk": grpc.StatusCode.FAILED_PRECONDITION,
    # The engine's IPC event never completes (its stream is stuck).
    "cuda-event-never-completes": grpc.StatusCode.DEADLINE_EXCEEDED,
    # The engine's IPC event cannot be opened (the engine that exported it exited).
    "cuda-event-handle-dead": grpc.StatusCode.FAILED_PRECONDITION,
}


@pytest.mark.parametrize("how", list(FAILURES))
def test_failed_offload_leaves_other_tenants_blocks_in_place(
    how: str,
    daemon_factory: Callable[..., DaemonProc],
    pool_factory: Callable[..., SharedKVPool],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with contextlib.ExitStack() as stack:
        victim_pool: EnginePages
        engine_pool: EnginePages
        cpu_pool: SharedKVPool | None = None
        event = b""
        if how.startswith("cpu"):
            target = daemon_factory(host_bytes="1MiB").target  # 16 slots of 64 KiB
            backend = pb.BACKEND_CPU
            victim_pool = pool_factory(num_pages=16, geometry=GEOMETRY)
            engine_pool = cpu_pool = pool_factory(num_pages=8, geometry=GEOMETRY)
        else:
            _need_emulator()
            dev = EmulatedDevice()
            target = stack.enter_context(
                emulated_cuda_daemon(tmp_path, monkeypatch, dev, "--engine-event-timeout", "0.2")
            )
            backend = pb.BACKEND_CUDA
            victim_pool, engine_pool = EmulatedPool(dev, 16), EmulatedPool(dev, 8)
            event = os.urandom(64)
            (dev.pending_events if "never-completes" in how else dev.dead_events).add(event)
        a, b = tenant_digest("tenant-a"), tenant_digest("tenant-b")
        content = {p: os.urandom(BLOCK) for p in range(16)}
        for p, data in content.items():
            victim_pool.write_block(p, data)
        a_hashes = [os.urandom(32) for _ in range(16)]
        with KVSealClient(ClientConfig(target=target, timeout_s=10)) as c:
            va = c.register_pool("victims", FP, victim_pool.geometry(), backend).pool_id
            eb = c.register_pool("engine", FP, engine_pool.geometry(), backend).pool_id
            # 16 independent blocks of tenant A fill the tier.
            for h, p in zip(a_hashes, range(16), strict=True):
                c.offload(va, a, [h], [p])
            before = c.stats()
            assert before.blocks_ready == 16
            if cpu_pool is not None:  # cpu-pool-shrunk
                name = cpu_pool.geometry().buffers[0].shm_name
                os.truncate(os.path.join("/dev/shm", name), 4096)
            # Tenant B's offload needs 8 slots (all evictions), then fails before
            # writing a byte.
            with pytest.raises(KVSealRpcError) as ei:
                c.offload(
                    eb,
                    b,
                    [os.urandom(32) for _ in range(8)],
                    list(range(8)),
                    cuda_event_ipc_handle=event,
                )
            assert ei.value.code == FAILURES[how], ei.value
            after = c.stats()
            assert after.blocks_ready == 16
            assert after.evicted_blocks == before.evicted_blocks
            states = c.lookup(va, a, a_hashes).states
            assert all(s == pb.BLOCK_READY for s in states)
            # Every one of them still restores byte for byte.
            for h, p in zip(a_hashes, range(16), strict=True):
                victim_pool.fill_page(p, 0)
                c.restore(va, a, [h], [p])
                assert victim_pool.read_block(p) == content[p]


# --------------------------------------------------------------------------------------
# In process, through SealedCache
# --------------------------------------------------------------------------------------


class _FailsAt(Deadline):
    """A deadline that passes at its ``n``-th check (as if the cutoff fell
    right there): a store that fails in the middle of its blocks."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.calls = 0

    def check(self, what: str = "the next page") -> None:
        self.calls += 1
        if self.calls >= self.n:
            raise DeadlinePassed(f"test cutoff before {what}")


class Tier:
    """A 16-slot tier in this process: ``SealedCache`` over a backend and its
    region, with one registered engine pool of 24 pages (pages 0-15 hold tenant
    A's blocks, 16-23 tenant B's) of random content."""

    def __init__(
        self,
        tmp_path: Path,
        sealer: BlockSealer,
        backend: Backend,
        region: Region,
        pool: EnginePages,
        kind: str,
    ) -> None:
        cfg = ServerConfig(
            listen="unix://" + str(tmp_path / "unused.sock"),
            backend=kind,
            host_bytes=16 * BLOCK,
            integrity_policy=IntegrityPolicy.DROP,
            workers=1,
        )
        self.cache = SealedCache(cfg, backend, region, sealer)
        self.pool = pool
        self.data = {p: os.urandom(BLOCK) for p in range(24)}
        for p, data in self.data.items():
            pool.write_block(p, data)
        req = pb.RegisterPoolRequest(name="engine", model_fingerprint=FP, geometry=pool.geometry())
        reg = self.cache.register_pool(convert.pool_spec(req, kind))
        self.pid, self.ns = reg.pool_id, reg.namespace
        self.a, self.b = tenant_digest("tenant-a"), tenant_digest("tenant-b")
        self.a_hashes = [os.urandom(32) for _ in range(16)]
        self.b_hashes = [os.urandom(32) for _ in range(8)]
        for p, h in enumerate(self.a_hashes):
            self.cache.offload(self.pid, self.a, None, [h], [p])

    def offload_b(self, deadline: Deadline = NO_DEADLINE, event: bytes | None = None) -> None:
        """Tenant B stores 8 blocks: 8 evictions planned."""
        self.cache.offload(
            self.pid,
            self.b,
            None,
            self.b_hashes,
            list(range(16, 24)),
            wait_event=event,
            deadline=deadline,
        )

    def ready_of_a(self) -> list[bytes]:
        _hit, a_states = self.cache.index.lookup(self.ns, self.a, self.a_hashes)
        _hit, b_states = self.cache.index.lookup(self.ns, self.b, self.b_hashes)
        assert all(s is State.ABSENT for s in b_states), "B's failed store is visible"
        return [h for h, s in zip(self.a_hashes, a_states, strict=True) if s is State.READY]

    def restores_byte_exact(self, hashes: list[bytes]) -> None:
        for h in hashes:
            p = self.a_hashes.index(h)
            self.pool.fill_page(p, 0)
            self.cache.restore(self.pid, self.a, [h], [p], release=False)
            assert self.pool.read_block(p) == self.data[p]


@contextlib.contextmanager
def cpu_tier(tmp_path: Path) -> Iterator[Tier]:
    """One sealing thread, so that blocks are sealed in order."""
    sealer = BlockSealer(2**32)
    backend = CpuBackend(sealer, 1)
    region = HostRegion(16 * BLOCK, str(tmp_path / "region.bin"))
    pool = SharedKVPool(_shape(24), "vllm_per_layer", name_prefix="kvseal-evict")
    try:
        tier = Tier(tmp_path, sealer, backend, region, pool, "cpu")
    except BaseException:
        pool.close()
        raise
    try:
        yield tier
    finally:
        tier.cache.close()
        pool.close()


@contextlib.contextmanager
def cuda_tier(tmp_path: Path, dev: EmulatedDevice, **backend_kw: object) -> Iterator[Tier]:
    """The CUDA backend on ``dev``, one block per chunk (so every chunk boundary
    is a block boundary)."""
    _need_emulator()
    sealer = BlockSealer(2**32)
    backend = CudaBackend(
        sealer,
        0,
        dev=dev,
        cc="off",
        min_chunk_bytes=1,
        max_chunks=8,
        **backend_kw,  # type: ignore[arg-type]
    )
    try:
        region = backend.make_region(16 * BLOCK, None)
        tier = Tier(tmp_path, sealer, backend, region, EmulatedPool(dev, 24), "cuda")
    except BaseException:
        backend.close()
        raise
    try:
        yield tier
    finally:
        tier.cache.close()


def _fail_nth(dev: EmulatedDevice, name: str, n: int, error: CudaError) -> None:
    """Make the ``n``-th call (from now) of ``dev.<name>`` raise ``error``."""
    real = getattr(dev, name)
    calls = [0]

    def fails(*args: object, **kw: object) -> object:
        calls[0] += 1
        if calls[0] == n:
            raise error
        return real(*args, **kw)

    setattr(dev, name, fails)


@pytest.mark.parametrize("kind", ["cpu", "cuda-mapped", "cuda-dma"])
def test_store_failing_midway_evicts_only_what_it_overwrote(kind: str, tmp_path: Path) -> None:
    """A 16-slot tier full of tenant A; tenant B stores 8 blocks (8 evictions
    planned) and fails after its first 3 blocks may have reached the region, before
    the 4th: exactly the 3 victims whose slots took B's ciphertext go; the other 5
    are back, byte-exact; nothing of B is visible.

    cpu: the cutoff before block 3 (check 1: before anything is reserved; checks
    2-4: blocks 0-2). cuda-mapped (the kernels write the region): the cutoff before
    chunk 3 (checks 1-2: the cache and the backend before the first page; 3-5:
    chunks 0-2). cuda-dma (kernels write device staging, copies the region): a
    device error queuing chunk 3's copies, after those of chunks 0-2."""
    dev = EmulatedDevice()
    tier_cm = (
        cpu_tier(tmp_path)
        if kind == "cpu"
        else cuda_tier(tmp_path, dev, seal_mode="mapped" if kind == "cuda-mapped" else "dma")
    )
    with tier_cm as tier:
        deadline: Deadline = NO_DEADLINE
        raised: type[BaseException]
        if kind == "cpu":
            deadline, raised = _FailsAt(5), DeadlinePassed
        elif kind == "cuda-mapped":
            deadline, raised = _FailsAt(6), DeadlinePassed
        else:
            # The copy stream waits on each chunk's seal before its copies; the 4th
            # wait is chunk 3's (not a sticky error: the backend keeps serving).
            err = CudaError("cuStreamWaitEvent failed: CUDA_ERROR_INVALID_HANDLE (400)", 400)
            _fail_nth(dev, "wait", 4, err)
            raised = CudaError
        with pytest.raises(raised):
            tier.offload_b(deadline)
        ready = tier.ready_of_a()
        assert len(ready) == 13
        tier.restores_byte_exact(ready)


# Every point at which a CUDA offload can fail before it has queued a single write
# to the host region: (how the test makes it fail, what the offload raises).
BEFORE_ANY_WRITE = [
    "event-never-completes",
    "event-handle-dead",
    "cutoff-while-waiting-for-the-event",
    "context-lost-on-entry",
    "key-context-allocation",
    "key-setup-launch",
    "first-seal-launch",
]


@pytest.mark.parametrize("seal_mode", ["dma", "mapped"])
@pytest.mark.parametrize("how", BEFORE_ANY_WRITE)
def test_cuda_store_failing_before_any_write_evicts_nothing(
    how: str, seal_mode: str, tmp_path: Path
) -> None:
    """Tenant B's 8-block store (8 evictions planned) fails before its first write
    to the region: all 16 of tenant A's blocks stay READY (and restore byte-exact
    while the backend can serve), none counts as evicted, nothing of B is visible."""
    dev = EmulatedDevice()
    timeout = 3600.0 if how == "cutoff-while-waiting-for-the-event" else 0.05
    with cuda_tier(tmp_path, dev, seal_mode=seal_mode, engine_event_timeout=timeout) as tier:
        evicted = tier.cache.counters.evicted_blocks
        event: bytes | None = None
        deadline: Deadline = NO_DEADLINE
        raised: type[BaseException] = CudaError
        if how in ("event-never-completes", "cutoff-while-waiting-for-the-event"):
            event = os.urandom(64)
            dev.pending_events.add(event)
            raised = EngineNotReady
            if how == "cutoff-while-waiting-for-the-event":
                # Check 1: the cache, before reserving; 2: the first poll of the
                # event (not complete); 3: the next poll.
                deadline, raised = _FailsAt(3), DeadlinePassed
        elif how == "event-handle-dead":
            event = os.urandom(64)
            dev.dead_events.add(event)
            raised = HandleUnusable
        elif how == "context-lost-on-entry":
            dev.lose_context()
        elif how == "key-context-allocation":
            # B is a new key scope: its epoch's device key context is allocated now.
            real_alloc = dev.alloc

            def alloc(nbytes: int) -> int:
                if nbytes == KEYCTX_BYTES:
                    raise CudaError("cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY (2)", 2)
                return real_alloc(nbytes)

            dev.alloc = alloc  # type: ignore[method-assign]
        else:
            kernel = "kvseal_key_setup" if how == "key-setup-launch" else "kvseal_seal"
            real_launch = dev.launch

            def launch(kernel_name: str, *args: object) -> None:
                if kernel_name == kernel:
                    raise CudaError(
                        "cuLaunchKernel failed: CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (701)", 701
                    )
                real_launch(kernel_name, *args)  # type: ignore[arg-type]

            dev.launch = launch  # type: ignore[assignment]
        with pytest.raises(raised):
            tier.offload_b(deadline, event)
        assert len(tier.ready_of_a()) == 16
        assert tier.cache.counters.evicted_blocks == evicted
        if how == "context-lost-on-entry":
            assert tier.cache.backend.broken  # type: ignore[attr-defined]
            dev.lost = False  # let close() release what it holds
        else:
            tier.restores_byte_exact(tier.a_hashes)


# ---------------------------------------------------------------- a failed spill snapshot


@pytest.mark.parametrize("error", ["EIO", "MemoryError"])
def test_failed_spill_snapshot_undoes_the_offload(tmp_path: Path, error: str) -> None:
    """Under ``--store-policy spill`` an offload copies each eviction victim's
    ciphertext before reusing its slot. A copy that fails (EIO from the host
    region, MemoryError) fails the offload, and the offload is undone: its new
    blocks are not left PENDING (a retry stores them, never IN_PROGRESS), no
    victim is evicted, nothing of it is queued for the store, and the retry's
    victims reach the store. Real cache, region, sealer and store directory;
    the failure is injected at the second victim's copy."""
    tenant = tenant_digest("user-a")
    rig = Rig(tmp_path, StorePolicy.SPILL, region=4 * 1024)  # 4 blocks of 1 KiB
    try:
        first = chain(4, TPP, b"first")
        rig.offload(tenant, first)
        second = chain(2, TPP, b"second")
        real = rig.region.read_into
        calls = [0]

        def failing(offset: int, out: memoryview) -> int:
            calls[0] += 1
            if calls[0] == 2:
                raise MemoryError() if error == "MemoryError" else OSError(5, "EIO")
            return real(offset, out)

        rig.region.read_into = failing  # type: ignore[method-assign]
        with pytest.raises(MemoryError if error == "MemoryError" else OSError):
            rig.offload(tenant, second, first_page=4)
        rig.region.read_into = real  # type: ignore[method-assign]
        _, states = rig.cache.index.lookup(rig.ns, tenant, second)
        assert states == [State.ABSENT, State.ABSENT], "nothing left PENDING"
        assert rig.cache.lookup(rig.pool_id, tenant, first)[0] == 4, "no victim evicted"
        sample = rig.tier.sample()
        assert sample.queued == 0 and rig.tier._queued_bytes == 0 and not rig.tier._copying
        # Both snapshots released and counted: the one taken, the one that failed.
        assert sample.spills_skipped == 2
        # The retry stores, and its victims are spilled, not lost.
        res = rig.cache.offload(rig.pool_id, tenant, None, second, [4, 5])
        assert res.outcomes == [StoreOutcome.STORED] * 2 and res.evicted_blocks == 2
        until(lambda: rig.tier.sample().spills == 2, "the victims spilled")
        assert rig.cache.lookup(rig.pool_id, tenant, first)[0] == 4, "in the store"
        want = [rig.pool.read_block(p) for p in range(4)]
        for p in range(4):
            rig.pool.fill_page(p, 0)
        rig.cache.restore(rig.pool_id, tenant, first, [0, 1, 2, 3], release=False)
        assert [rig.pool.read_block(p) for p in range(4)] == want
    finally:
        rig.close()
