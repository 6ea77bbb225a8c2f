"""End to end: a real daemon process, real gRPC over a Unix socket, real
shared memory, real AES-GCM. Offload -> overwrite -> restore -> identical."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

import grpc
import pytest
from kvseal.client import KVSealRpcError, chain_block_hashes, tenant_digest
from kvseal.client.shm import SharedKVPool
from kvseal.v1 import kvseal_pb2 as pb

from .conftest import QWEN3_32B, DaemonProc, fill_random, is_poisoned, poison

FP = b"model:qwen3-32b@rev1/tp0"


def _hashes(n: int, tokens_per_page: int, salt: bytes | None = None) -> list[bytes]:
    tokens = list(os.urandom(n * tokens_per_page))
    return chain_block_hashes(tokens, tokens_per_page, cache_salt=salt)


@pytest.mark.parametrize("layout", ["vllm_per_layer", "vllm_cross_layer", "sglang_per_layer"])
def test_round_trip_realistic_geometry(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool], layout: str
) -> None:
    pool = pool_factory(num_pages=6, layout=layout, geometry=QWEN3_32B)
    assert pool.shape.block_bytes == 4 * 1024 * 1024  # 64 layers x K,V x 16 x 8 x 128 x bf16
    data = fill_random(pool)
    tenant = tenant_digest("user-a")
    hashes = _hashes(4, 16, b"user-a")
    with daemon.client() as c:
        h = c.register_pool("engine0", FP, pool.geometry())
        assert h.block_bytes == pool.shape.block_bytes
        off = c.offload(h.pool_id, tenant, hashes, [0, 1, 2, 3])
        assert off.stored_blocks == 4 and off.outcomes == [pb.OFFLOAD_STORED] * 4
        poison(pool, [0, 1, 2, 3, 4, 5])
        # Restore into different pages than they came from.
        res = c.restore(h.pool_id, tenant, hashes, [5, 4, 3, 2])
        assert res.restored_blocks == 4 and res.restored_bytes == 4 * pool.shape.block_bytes
        for src, dst in zip([0, 1, 2, 3], [5, 4, 3, 2], strict=True):
            assert pool.read_block(dst) == data[src]
        assert is_poisoned(pool, 0) and is_poisoned(pool, 1)


def test_lookup_prefix_and_states(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    pool = pool_factory(num_pages=8)
    fill_random(pool)
    tenant = tenant_digest(None)
    chain = _hashes(6, pool.shape.tokens_per_page)
    with daemon.client() as c:
        h = c.register_pool("e", FP, pool.geometry())
        assert c.lookup(h.pool_id, tenant, chain).hit_blocks == 0
        c.offload(h.pool_id, tenant, chain[:3], [0, 1, 2])
        r = c.lookup(h.pool_id, tenant, chain)
        assert r.hit_blocks == 3
        assert r.states == [pb.BLOCK_READY] * 3 + [pb.BLOCK_ABSENT] * 3
        # A hole stops the prefix even if later blocks are cached.
        c.offload(h.pool_id, tenant, chain[4:5], [4], parent_hash=chain[3])
        r = c.lookup(h.pool_id, tenant, chain)
        assert r.hit_blocks == 3 and r.states[4] == pb.BLOCK_READY
        # Offloading a present block is a touch, not a re-encryption.
        before = c.stats().offloaded_blocks
        again = c.offload(h.pool_id, tenant, chain[:3], [0, 1, 2])
        assert again.outcomes == [pb.OFFLOAD_ALREADY_PRESENT] * 3 and again.stored_blocks == 0
        assert c.stats().offloaded_blocks == before


def test_write_through_keeps_and_write_back_releases(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    pool = pool_factory(num_pages=4)
    data = fill_random(pool)
    tenant = tenant_digest(None)
    chain = _hashes(4, pool.shape.tokens_per_page)
    with daemon.client() as c:
        h = c.register_pool("e", FP, pool.geometry())
        c.offload(h.pool_id, tenant, chain, [0, 1, 2, 3])
        poison(pool, [0, 1])
        c.restore(h.pool_id, tenant, chain[:2], [0, 1], release=False)  # write-through
        assert pool.read_block(0) == data[0] and pool.read_block(1) == data[1]
        assert c.lookup(h.pool_id, tenant, chain).hit_blocks == 4
        used = c.stats().host_bytes_used
        poison(pool, [0, 1])
        c.restore(h.pool_id, tenant, chain[:2], [0, 1], release=True)  # write-back
        assert pool.read_block(0) == data[0] and pool.read_block(1) == data[1]
        r = c.lookup(h.pool_id, tenant, chain)
        assert r.states[:2] == [pb.BLOCK_ABSENT] * 2 and r.states[2:] == [pb.BLOCK_READY] * 2
        assert c.stats().host_bytes_used < used
        with pytest.raises(KVSealRpcError) as e:
            c.restore(h.pool_id, tenant, chain[:1], [0])
        assert e.value.code == grpc.StatusCode.NOT_FOUND and e.value.reason == "BLOCK_NOT_PRESENT"


def test_layouts_share_blocks_and_tenants_do_not(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    """vLLM per-layer and cross-layer pools of one model produce the same
    block bytes, so one can restore what the other offloaded; another tenant
    or another model sees nothing."""
    a = pool_factory(num_pages=2, layout="vllm_per_layer")
    b = pool_factory(num_pages=2, layout="vllm_cross_layer")
    data = fill_random(a)
    t1, t2 = tenant_digest("tenant-1"), tenant_digest("tenant-2")
    chain = _hashes(2, a.shape.tokens_per_page, b"tenant-1")
    with daemon.client() as c:
        ha = c.register_pool("a", FP, a.geometry())
        hb = c.register_pool("b", FP, b.geometry())
        hm = c.register_pool("other-model", b"model:other", b.geometry())
        assert ha.namespace == hb.namespace != hm.namespace
        c.offload(ha.pool_id, t1, chain, [0, 1])
        c.restore(hb.pool_id, t1, chain, [1, 0])
        assert b.read_block(1) == data[0] and b.read_block(0) == data[1]
        assert c.lookup(hb.pool_id, t2, chain).hit_blocks == 0
        assert c.lookup(hm.pool_id, t1, chain).hit_blocks == 0
        for pid, tenant in ((hb.pool_id, t2), (hm.pool_id, t1)):
            with pytest.raises(KVSealRpcError) as e:
                c.restore(pid, tenant, chain, [0, 1])
            assert e.value.reason == "BLOCK_NOT_PRESENT"


def test_eviction_is_lru_leaf_first(
    daemon_factory: Callable[..., DaemonProc], pool_factory: Callable[..., SharedKVPool]
) -> None:
    pool = pool_factory(num_pages=8)
    block = pool.shape.block_bytes  # 2*2*4*2*16*2 = 1 KiB: slots are 1 KiB (256-aligned)
    capacity_blocks = 1024 * 1024 // block
    d = daemon_factory(host_bytes="1MiB")
    fill_random(pool)
    tenant = tenant_digest(None)
    old = _hashes(capacity_blocks, pool.shape.tokens_per_page)
    with d.client() as c:
        h = c.register_pool("e", FP, pool.geometry())
        for i in range(0, capacity_blocks, 8):
            parent = old[i - 1] if i else None
            c.offload(h.pool_id, tenant, old[i : i + 8], list(range(8)), parent_hash=parent)
        assert c.stats().blocks_ready == capacity_blocks
        new = _hashes(2, pool.shape.tokens_per_page)
        r = c.offload(h.pool_id, tenant, new, [0, 1])
        assert r.evicted_blocks == 2
        # The whole old chain was one chain: its two deepest blocks went, the prefix stays.
        lk = c.lookup(h.pool_id, tenant, old)
        assert lk.hit_blocks == capacity_blocks - 2
        assert lk.states[-2:] == [pb.BLOCK_ABSENT] * 2


def test_events_stream(daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]) -> None:
    pool = pool_factory(num_pages=2)
    fill_random(pool)
    tenant = tenant_digest("ev")
    chain = _hashes(2, pool.shape.tokens_per_page, b"ev")
    with daemon.client() as c:
        h = c.register_pool("e", FP, pool.geometry())
        events: list[pb.BlockEvent] = []
        done = threading.Event()
        c.lookup(h.pool_id, tenant, chain)  # names the tenant on the pool: its events flow
        # watch_events returns once the daemon has subscribed the stream: the
        # offload below cannot be missed.
        stream = c.watch_events(h.pool_id, tenant=tenant, timeout=20)

        def watch() -> None:
            try:
                for ev in stream:
                    events.append(ev)
                    if len(events) == 2:
                        break
            finally:
                done.set()

        t = threading.Thread(target=watch)
        t.start()
        c.offload(h.pool_id, tenant, chain, [0, 1])
        for _ in range(200):  # until the STORED event arrived (a liveness bound)
            if events or done.wait(0.05):
                break
        c.drop(h.pool_id, tenant, chain[:1])
        done.wait(20)
        t.join(10)
    assert [e.kind for e in events] == [pb.BLOCK_STORED, pb.BLOCK_REMOVED]
    assert list(events[0].block_hashes) == chain
    assert (
        events[1].reason == pb.REMOVED_DROPPED and list(events[1].block_hashes) == chain
    )  # cascade
    assert events[1].sequence == events[0].sequence + 1
    assert events[0].medium == "cpu" and events[0].tenant == tenant


def test_pool_replaced_by_name_and_unregister(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    pool = pool_factory(num_pages=2)
    with daemon.client() as c:
        h1 = c.register_pool("engine", FP, pool.geometry())
        h2 = c.register_pool("engine", FP, pool.geometry())
        assert c.stats().pools == 1
        with pytest.raises(KVSealRpcError) as e:
            c.lookup(h1.pool_id, tenant_digest(None), _hashes(1, 4))
        assert e.value.code == grpc.StatusCode.NOT_FOUND and e.value.reason == "UNKNOWN_POOL"
        c.unregister_pool(h2.pool_id)
        assert c.stats().pools == 0


def test_sigterm_drains_and_exits_zero(daemon: DaemonProc) -> None:
    with daemon.client() as c:
        assert c.health() == "SERVING"
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.wait_exit() == 0
    assert not os.path.exists(daemon.socket)
    assert "stopped (exit status 0)" in daemon.log()


def test_rekey_keeps_old_blocks_openable(
    daemon_factory: Callable[..., DaemonProc], pool_factory: Callable[..., SharedKVPool]
) -> None:
    d = daemon_factory("--rekey-after", "2")
    pool = pool_factory(num_pages=5)
    data = fill_random(pool)
    tenant = tenant_digest(None)
    chain = _hashes(5, pool.shape.tokens_per_page)
    with d.client() as c:
        h = c.register_pool("e", FP, pool.geometry())
        for i in range(5):
            c.offload(h.pool_id, tenant, chain[i : i + 1], [i])
        assert c.stats().key_epoch == 2
        poison(pool, list(range(5)))
        c.restore(h.pool_id, tenant, chain, list(range(5)))
        assert all(pool.read_block(i) == data[i] for i in range(5))
