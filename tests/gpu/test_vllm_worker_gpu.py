"""The vLLM adapter's GPU path on a real GPU (``make device-check``; skipped without one).

A tiny fake "vLLM KV cache": per-layer int8 CUDA allocations viewed as vLLM's
canonical ``(num_blocks, page_bytes)`` tensors (the ``set_`` call of vLLM's
``register_kv_caches``), handed to :class:`kvseal.core.kv_pool.KVPool` exactly as
``KVSealOffloadingWorker`` does (vLLM itself is not installed on the device
machine; the worker's only GPU-specific code is that class and the event it
records per job). Against ``kvseal-server --backend cuda`` in its own process:

- the pool registers over CUDA IPC on the CUDA backend;
- a store whose pages the engine writes on its stream behind a long kernel, with
  the job's event recorded right after (no synchronisation), seals the new bytes;
  a restore into pages the engine still uses on its stream lands after that use;
  the restored bytes equal the stored ones;
- the scheduler's mirror (an observer pool) registers on the same CUDA daemon,
  gets the worker pool's namespace and hears of the stored blocks.

Test names with "daemon" run in the device check's daemon half (``-k daemon``).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Legacy CUDA IPC refuses expandable-segment memory: pin the allocator before torch
# allocates anything (see tests/gpu/test_cuda_backend.py).
for _var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
    os.environ[_var] = "expandable_segments:False"
torch = pytest.importorskip("torch")
_cuda: Any = getattr(torch, "cuda", None)
if _cuda is not None and getattr(_cuda, "is_initialized", lambda: False)():
    # Initialised before this module (the variable is read then): set it there too.
    _set: Any = getattr(getattr(torch, "_C", None), "_accelerator_setAllocatorSettings", None)
    _set = _set or getattr(getattr(_cuda, "memory", None), "_set_allocator_settings", None)
    if _set is not None:
        _set("expandable_segments:False")

from kvseal.client import ClientConfig, KVSealClient, tenant_digest  # noqa: E402
from kvseal.core.kv_pool import KVPool, layer_page_views, pool_geometry  # noqa: E402
from kvseal.core.mirror import DaemonMirror, observer_geometry  # noqa: E402
from kvseal.server.backends.cuda import compile as kc  # noqa: E402
from kvseal.server.backends.cuda import probe  # noqa: E402
from kvseal.v1 import kvseal_pb2 as pb  # noqa: E402

from ..conftest import DaemonProc, start_daemon  # noqa: E402
from .bytes_check import assert_same_bytes  # noqa: E402

_ok, _why = probe.cuda_available(0)
if not _ok:
    pytest.skip(f"no usable GPU: {_why}", allow_module_level=True)
if not torch.cuda.is_available():
    pytest.skip(f"torch {torch.__version__} has no usable CUDA ({_why})", allow_module_level=True)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda", 0)
LAYERS, BLOCKS, TOKENS, HEADS, DIM = 4, 16, 16, 2, 64
PAGE = 2 * TOKENS * HEADS * DIM * 2  # K and V of one block of one layer, bf16: 8 KiB
FP = b"vllm-gpu-test-model"
TENANT = tenant_digest("gpu-tenant")


@dataclass
class CanonicalTensor:  # vLLM's CanonicalKVCacheTensor (the fields the worker reads)
    tensor: Any
    page_size_bytes: int


@dataclass
class CanonicalRef:  # vLLM's CanonicalKVCacheRef
    tensor_idx: int
    page_size_bytes: int


class FakeVllmKV:
    """Per-layer KV allocations as vLLM's GPU model runner makes them (int8 zeros of
    ``BLOCKS * PAGE`` bytes each), viewed the way its offloading connector canonicalises
    them before it calls ``spec.get_worker``."""

    def __init__(self) -> None:
        self.raw = [torch.zeros(BLOCKS * PAGE, dtype=torch.int8, device=DEV) for _ in range(LAYERS)]
        self.tensors = [
            CanonicalTensor(
                torch.tensor([], dtype=torch.int8, device=DEV).set_(
                    r.untyped_storage(), 0, (BLOCKS, PAGE), (PAGE, 1)
                ),
                PAGE,
            )
            for r in self.raw
        ]
        self.refs = [CanonicalRef(i, PAGE) for i in range(LAYERS)]
        self.stream = torch.cuda.Stream(DEV)  # the engine's compute stream
        torch.cuda.synchronize()

    def block(self, page: int) -> bytes:
        """The block's plaintext as the daemon sees it: each layer's page, in order."""
        parts = torch.cat([t.tensor[page] for t in self.tensors]).cpu()
        return ctypes.string_at(parts.data_ptr(), parts.numel())


def template() -> pb.PoolGeometry:
    """What KVSealOffloadingSpec.geometry_template gives for this cache."""
    return pb.PoolGeometry(
        num_pages=1,
        tokens_per_page=TOKENS,
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=DIM,
        dtype="bfloat16",
        layout="vllm-page:default",
        segments=[pb.Segment(buffer=0, offset=0, page_stride=LAYERS * PAGE, bytes=LAYERS * PAGE)],
    )


@pytest.fixture(scope="module", autouse=True)
def warm_kernels() -> None:
    major, minor = torch.cuda.get_device_capability(0)
    try:
        kc.compile_kernels(f"sm_{major}{minor}")
    except kc.NvrtcError:
        kc.compile_kernels(kc.DEFAULT_ARCH, output="ptx")


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProc]:
    d = start_daemon(tmp_path / "d", "--backend", "cuda", "--device", "0", host_bytes="64MiB")
    try:
        yield d
    finally:
        d.stop()
        print(f"---- daemon log (last 4000 chars) ----\n{d.log()[-4000:]}")


def test_vllm_layer_views_export_over_cuda_ipc() -> None:
    """In-process: the worker's layout of a CUDA KV cache is one segment per layer
    (page stride and bytes from vLLM's strides), one buffer per allocation, for the
    CUDA backend; the namespace fields are the template's."""
    kv = FakeVllmKV()
    views = layer_page_views(kv.tensors, kv.refs)
    g, backend = pool_geometry(views, template())
    assert backend == pb.BACKEND_CUDA
    assert g.num_pages == BLOCKS
    assert [(s.page_stride, s.bytes) for s in g.segments] == [(PAGE, PAGE)] * LAYERS
    assert sum(s.bytes for s in g.segments) == template().segments[0].bytes
    assert all(len(b.cuda_ipc_handle) == 64 for b in g.buffers)
    assert (g.dtype, g.layout, g.tokens_per_page) == ("bfloat16", "vllm-page:default", TOKENS)


def _engine_writes(kv: FakeVllmKV, pages: list[int], data: list[Any]) -> None:
    """On the engine's stream, behind a ~10 ms kernel: a daemon that did not wait for
    the job's event would read the pages' old bytes."""
    with torch.cuda.stream(kv.stream):
        torch.cuda._sleep(20_000_000)
        for p, d in zip(pages, data, strict=True):
            for layer, t in enumerate(kv.tensors):
                t.tensor[p].copy_(d[layer])


def test_daemon_vllm_worker_store_and_restore_over_cuda(daemon: DaemonProc) -> None:
    kv = FakeVllmKV()
    client = KVSealClient(ClientConfig(target=daemon.target, transfer_timeout_s=30))
    pool = KVPool(client, "vllm.gpu-test.r0.kv", FP, template(), kv.tensors, kv.refs)
    try:
        assert pool.cuda and pool.block_bytes == LAYERS * PAGE
        assert pool.pool.wait_ready(30), pool.pool.registration_error
        with daemon.client() as c:
            assert c.stats().backend == pb.BACKEND_CUDA
        for rnd in range(3):
            src, dst = [0, 1, 2], [8 + rnd, 11 + rnd, 14]
            data = [
                [torch.randint(-128, 127, (PAGE,), dtype=torch.int8, device=DEV) for _ in kv.refs]
                for _ in src
            ]
            torch.cuda.synchronize()
            want = [b"".join(ctypes.string_at(x.cpu().data_ptr(), PAGE) for x in d) for d in data]
            hashes = [secrets.token_bytes(32) for _ in src]
            # submit_store: vLLM's thread, its current stream is the one that wrote.
            _engine_writes(kv, src, data)
            with torch.cuda.stream(kv.stream):
                ev = pool.engine_event()
            assert ev is not None and len(ev.handle) == 64
            # The transfer runs on the worker's own thread, as in the worker.
            out: list[bool] = []
            t = threading.Thread(
                target=lambda o, h, s, e: o.append(pool.offload(TENANT, h, s, None, event=e)),
                args=(out, hashes, src, ev),
            )
            t.start()
            t.join(60)
            assert out == [True], pool.pool.registration_error
            # submit_load into pages the engine still uses on its stream (last write).
            with torch.cuda.stream(kv.stream):
                torch.cuda._sleep(20_000_000)
                for p in dst:
                    for tt in kv.tensors:
                        tt.tensor[p].fill_(0x5A)
                ev2 = pool.engine_event()
            assert pool.restore(TENANT, hashes, dst, event=ev2)
            kv.stream.synchronize()
            for i, p in enumerate(dst):
                assert_same_bytes(kv.block(p), want[i], f"round {rnd}, block {i} restored")
            # The stored bytes were the engine's new ones, not the old page contents.
            assert want[0] != bytes(LAYERS * PAGE)
    finally:
        pool.close()
        client.close()


def test_daemon_scheduler_mirror_observes_the_gpu_pool(daemon: DaemonProc) -> None:
    """The scheduler side on a CUDA daemon: its observer pool (no shared memory)
    has the worker pool's namespace and its stream carries the worker's stores."""
    kv = FakeVllmKV()
    client = KVSealClient(ClientConfig(target=daemon.target, transfer_timeout_s=30))
    pool = KVPool(client, "vllm.gpu-test.r0.kv", FP, template(), kv.tensors, kv.refs)
    seen = threading.Event()
    stored: list[bytes] = []

    def changed(rank: int, tenant: bytes, h: bytes, present: bool) -> None:
        if present and tenant == TENANT:
            stored.append(h)
            seen.set()

    mirror = DaemonMirror(0, daemon.target, "vllm.gpu-test.r0.probe", FP, template(), changed)
    try:
        assert pool.pool.wait_ready(30)
        assert mirror.synced.wait(30)
        handle = pool.pool.handle
        assert handle is not None and mirror.namespace == handle.namespace
        with daemon.client() as c:
            obs = c.register_pool("obs", FP, observer_geometry(template()), observer=True)
            assert obs.namespace == handle.namespace
        mirror.introduce(TENANT)
        with daemon.client() as c:  # names TENANT on the mirror's pool now (as introduce does)
            assert mirror.pool_id is not None
            c.lookup(mirror.pool_id, TENANT, [bytes(32)])
        h = secrets.token_bytes(32)
        with torch.cuda.stream(kv.stream):
            kv.tensors[0].tensor[3].fill_(7)
            ev = pool.engine_event()
        assert pool.offload(TENANT, [h], [3], event=ev)
        assert seen.wait(30)
        assert h in stored and mirror.contains(TENANT, h)
    finally:
        mirror.close()
        pool.close()
        client.close()
