"""A store that fails evicts nothing it did not overwrite, against a real
daemon: eviction is two-phase (victims are doomed, removed only when the store
succeeds, reinstated when it fails before writing over them)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from kvseal.client import KVSealRpcError, tenant_digest
from kvseal.client.shm import KVShape, SharedKVPool
from kvseal.server import convert
from kvseal.server.backends.cpu.backend import CpuBackend
from kvseal.server.cache import SealedCache
from kvseal.server.config import IntegrityPolicy, ServerConfig
from kvseal.server.deadline import Deadline
from kvseal.server.errors import DeadlinePassed
from kvseal.server.hostregion import HostRegion
from kvseal.server.index import State
from kvseal.server.sealing import BlockSealer
from kvseal.v1 import kvseal_pb2 as pb

from .conftest import DaemonProc, fill_random

FP = b"model:evict"
GEOMETRY = {"tokens_per_page": 16, "num_layers": 2, "num_kv_heads": 8, "head_dim": 64}  # 64 KiB


def test_failed_offload_leaves_other_tenants_blocks_in_place(
    daemon_factory: Callable[..., DaemonProc], pool_factory: Callable[..., SharedKVPool]
) -> None:
    d = daemon_factory(host_bytes="1MiB")  # 16 slots of 64 KiB
    victim_pool = pool_factory(num_pages=16, geometry=GEOMETRY)
    engine_pool = pool_factory(num_pages=8, geometry=GEOMETRY)
    a, b = tenant_digest("tenant-a"), tenant_digest("tenant-b")
    content = {p: os.urandom(victim_pool.shape.block_bytes) for p in range(16)}
    for p, data in content.items():
        victim_pool.write_block(p, data)
    a_hashes = [os.urandom(32) for _ in range(16)]
    with d.client() as c:
        va = c.register_pool("victims", FP, victim_pool.geometry()).pool_id
        eb = c.register_pool("engine", FP, engine_pool.geometry()).pool_id
        # 16 independent blocks of tenant A fill the tier.
        for h, p in zip(a_hashes, range(16), strict=True):
            c.offload(va, a, [h], [p])
        before = c.stats()
        assert before.blocks_ready == 16
        # Tenant B's engine shrinks its own pool: its offload needs 8 slots
        # (all evictions), then fails before writing a byte.
        name = engine_pool.geometry().buffers[0].shm_name
        os.truncate(os.path.join("/dev/shm", name), 4096)
        with pytest.raises(KVSealRpcError) as ei:
            c.offload(eb, b, [os.urandom(32) for _ in range(8)], list(range(8)))
        assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION, ei.value
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


def test_store_failing_midway_evicts_only_what_it_overwrote(tmp_path: Path) -> None:
    """In process, one sealing thread: a 16-slot tier full of tenant A; tenant
    B stores 8 blocks (8 evictions planned) and its deadline passes before its
    4th block. Exactly the 3 victims whose slots took B's ciphertext go; the
    other 5 are back, byte-exact; nothing of B is visible."""
    shape = KVShape(24, **GEOMETRY)  # 64 KiB blocks: 16 fill the 1 MiB minimum
    block = shape.block_bytes
    cfg = ServerConfig(
        listen="unix://" + str(tmp_path / "unused.sock"),
        backend="cpu",
        host_bytes=16 * block,
        integrity_policy=IntegrityPolicy.DROP,
        workers=1,
    )
    sealer = BlockSealer(2**32)
    backend = CpuBackend(sealer, 1)
    region = HostRegion(16 * block, str(tmp_path / "region.bin"))
    cache = SealedCache(cfg, backend, region, sealer)
    pool = SharedKVPool(shape, "vllm_per_layer", name_prefix="kvseal-evict")
    try:
        data = fill_random(pool)
        req = pb.RegisterPoolRequest(name="engine", model_fingerprint=FP, geometry=pool.geometry())
        reg = cache.register_pool(convert.pool_spec(req, "cpu"))
        pid, ns = reg.pool_id, reg.namespace
        a, b = tenant_digest("tenant-a"), tenant_digest("tenant-b")
        a_hashes = [os.urandom(32) for _ in range(16)]
        for p, h in enumerate(a_hashes):
            cache.offload(pid, a, None, [h], [p])
        b_hashes = [os.urandom(32) for _ in range(8)]
        with pytest.raises(DeadlinePassed):
            # check 1: before anything is reserved; checks 2-4: blocks 0-2.
            cache.offload(pid, b, None, b_hashes, list(range(16, 24)), deadline=_FailsAt(5))
        _hit, a_states = cache.index.lookup(ns, a, a_hashes)
        _hit, b_states = cache.index.lookup(ns, b, b_hashes)
        assert all(s is State.ABSENT for s in b_states)
        ready = [h for h, s in zip(a_hashes, a_states, strict=True) if s is State.READY]
        assert len(ready) == 13, a_states
        for h in ready:
            p = a_hashes.index(h)
            pool.fill_page(p, 0)
            cache.restore(pid, a, [h], [p], release=False)
            assert pool.read_block(p) == data[p]
    finally:
        cache.close()
        pool.close()
