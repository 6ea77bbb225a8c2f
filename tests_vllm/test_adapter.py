"""kvseal's vLLM spec, manager and worker against real daemons, without an
engine: tensor parallelism across two daemons, tenants, the scheduler mirror
following evictions/drops/restarts, restores and failed restores."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from kvseal.client import ClientConfig, KVSealClient, KVSealRpcError, tenant_digest
from kvseal.vllm import keys
from kvseal.vllm.spec import (
    KVSealLoadStoreSpec,
    KVSealOffloadingManager,
    KVSealOffloadingSpec,
    KVSealOffloadingWorker,
    note_request_salt,
)
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, OffloadKey, ReqContext

from tests_vllm.daemon import Daemon
from tests_vllm.helpers import block_bytes, offloading_config, shm_kv_caches, wait_for

NUM_BLOCKS = 8


def _key(i: int) -> OffloadKey:
    return OffloadKey(keys.make_offload_key(bytes([i]) * 32, 0))


def test_hash_mapping_is_injective_and_groups_and_ranks_are_apart() -> None:
    h32 = os.urandom(32)
    assert keys.kvseal_hash(h32) == h32
    short = [b"\x01" * n for n in range(1, 32)]
    mapped = {keys.kvseal_hash(h) for h in short}
    assert len(mapped) == len(short) and all(len(m) == 32 for m in mapped)
    assert len(keys.kvseal_hash(b"\x01" * 40)) == 32
    base = dict(
        model="m", revision=None, kv_dtype="bfloat16", tokens_per_block=32,
        layer_names=["a", "b"], bytes_per_block=4096, kv_cache_layout=None,
        hash_algo="sha256", tp_size=2,
    )  # fmt: skip
    fps = {
        keys.model_fingerprint(**base, group=g, tp_rank=r)  # type: ignore[arg-type]
        for g in (0, 1)
        for r in (0, 1)
    }
    assert len(fps) == 4
    assert keys.model_fingerprint(**{**base, "model": "other"}, group=0, tp_rank=0) not in fps  # type: ignore[arg-type]
    assert keys.pool_name("e", 0, 0, "kv") != keys.pool_name("e", 0, 1, "kv")


@pytest.fixture
def two_daemons(tmp_path: Path) -> Iterator[list[Daemon]]:
    ds = [Daemon(tmp_path / f"gpu{r}", extra=("--on-integrity-failure", "drop")) for r in (0, 1)]
    for d in ds:
        d.start()
    yield ds
    for d in ds:
        d.stop()


class Rank:
    def __init__(self, sockets: list[str], rank: int) -> None:
        self.spec = KVSealOffloadingSpec(offloading_config(sockets, rank))
        self.buf, kv = shm_kv_caches(NUM_BLOCKS)
        w = self.spec.get_worker(kv)
        assert isinstance(w, KVSealOffloadingWorker)
        self.worker = w
        self.jobs = 0

    def fill(self, block: int, seed: int) -> bytes:
        g = torch.Generator().manual_seed(seed)
        data = torch.randint(-128, 127, (self.worker.block_bytes,), dtype=torch.int8, generator=g)
        half = self.worker.block_bytes // 2
        n = NUM_BLOCKS * half
        self.buf[block * half : (block + 1) * half] = data[:half]
        self.buf[n + block * half : n + (block + 1) * half] = data[half:]
        return block_bytes(self.buf, NUM_BLOCKS, block)

    def run(self, store: bool, tenant: bytes, hashes: list[bytes], blocks: list[int]) -> None:
        self.jobs += 1
        gpu = GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0])
        spec = KVSealLoadStoreSpec(tenant, hashes)
        if store:
            self.worker.submit_store(self.jobs, gpu, spec)
        else:
            self.worker.submit_load(self.jobs, spec, gpu)
        self.worker.wait({self.jobs})
        done = self.worker.get_finished()
        assert [r.job_id for r in done] == [self.jobs] and done[0].success


def _named(mgr: KVSealOffloadingManager, *tenants: bytes) -> bool:
    """Wait until every mirror's daemon has the tenants named on its observer
    pool (``on_new_request`` names them in the background): only then do the
    stores of those tenants reach the mirrors as events."""
    return wait_for(lambda: all(set(tenants) <= m.named for m in mgr.mirrors))


@contextmanager
def _one_rank(
    tmp_path: Path, **daemon: str
) -> Iterator[tuple[Daemon, KVSealOffloadingManager, Rank]]:
    """A daemon, a scheduler-side manager and one rank's worker, the mirror
    synced and the pool registered; all stopped afterwards."""
    d = Daemon(tmp_path / "d", **daemon)
    d.start()
    sock = [d.target]
    mgr = KVSealOffloadingSpec(offloading_config(sock, 0)).get_manager()
    assert isinstance(mgr, KVSealOffloadingManager)
    rank = Rank(sock, 0)
    try:
        assert wait_for(lambda: mgr.mirrors[0].synced.is_set() and rank.worker.kv is not None)
        yield d, mgr, rank
    finally:
        mgr.shutdown()
        rank.worker.shutdown()
        d.stop()


def test_tp2_hit_only_when_every_rank_holds_the_block(two_daemons: list[Daemon]) -> None:
    socks = [d.target for d in two_daemons]
    sched = KVSealOffloadingSpec(offloading_config(socks, 0))
    mgr = sched.get_manager()
    assert isinstance(mgr, KVSealOffloadingManager)
    ranks = [Rank(socks, r) for r in (0, 1)]
    try:
        note_request_salt("req-a", "alice")
        note_request_salt("req-b", "bob")
        ctx_a, ctx_b = ReqContext(req_id="req-a"), ReqContext(req_id="req-b")
        mgr.on_new_request(ctx_a)
        mgr.on_new_request(ctx_b)
        alice = tenant_digest("alice")
        k = [_key(i) for i in (1, 2)]
        spec = mgr.prepare_store(k, ctx_a)
        assert spec is not None and spec.keys_to_store == k
        st = spec.store_spec
        # the worker gets the tenant digest, never the salt
        assert isinstance(st, KVSealLoadStoreSpec) and st.tenant == alice
        data = {r: [ranks[r].fill(b, 10 * r + b) for b in (1, 2)] for r in (0, 1)}
        # The mirrors learn of blocks from the event stream: they must be subscribed
        # before the stores (an engine's are, long before its first request).
        assert wait_for(lambda: all(m.synced.is_set() for m in mgr.mirrors))
        assert _named(mgr, alice, tenant_digest("bob"))

        ranks[0].run(True, alice, st.hashes, [1, 2])
        assert wait_for(lambda: mgr.mirrors[0].blocks() == 2)
        # Not a hit: rank 1 does not have it yet. Its store is in flight, though, so
        # vLLM is told to wait a step rather than recompute (a pending hit).
        assert mgr.lookup(k[0], ctx_a) is LookupResult.HIT_PENDING
        ranks[1].run(True, alice, st.hashes, [1, 2])
        assert wait_for(lambda: mgr.lookup(k[1], ctx_a) is LookupResult.HIT)
        mgr.complete_store(k, ctx_a)  # the connector reports the job done
        assert mgr.lookup(k[0], ctx_a) is LookupResult.HIT
        assert mgr.lookup(k[0], ctx_b) is LookupResult.MISS  # another tenant, same hash
        stored = [e for e in mgr.take_events() if not e.removed]
        assert sorted(kk for e in stored for kk in e.keys) == sorted(k)
        assert all(e.medium.value == "CPU" for e in stored)

        # restore on both ranks into other blocks: the same bytes come back
        for r in (0, 1):
            ranks[r].run(False, alice, st.hashes, [5, 6])
            assert block_bytes(ranks[r].buf, NUM_BLOCKS, 5) == data[r][0]
            assert block_bytes(ranks[r].buf, NUM_BLOCKS, 6) == data[r][1]
            assert ranks[r].worker.take_failed_block_ids() == set()

        # the daemon of rank 1 drops one block: no longer a hit, and vLLM is told
        with KVSealClient(ClientConfig(target=socks[1])) as c:
            pool_id = mgr.mirrors[1].pool_id
            assert pool_id is not None
            assert c.drop(pool_id, alice, [st.hashes[1]]) == 1
        assert wait_for(lambda: mgr.lookup(k[1], ctx_a) is LookupResult.MISS)
        removed = [e for e in mgr.take_events() if e.removed]
        assert [kk for e in removed for kk in e.keys] == [k[1]]
        # a restore of it now fails safely from the missing block on: the block
        # before it is restored (vLLM recomputes from the first failed block, so
        # it keeps that one), the missing one is reported failed, its page untouched
        for b in (5, 6):
            ranks[1].buf[b * 2048 : (b + 1) * 2048] = 7
        before = block_bytes(ranks[1].buf, NUM_BLOCKS, 6)
        ranks[1].run(False, alice, st.hashes, [5, 6])
        assert ranks[1].worker.take_failed_block_ids() == {6}
        assert block_bytes(ranks[1].buf, NUM_BLOCKS, 5) == data[1][0]
        assert block_bytes(ranks[1].buf, NUM_BLOCKS, 6) == before
        assert ranks[1].worker.stats["partial_loads"] == 1
        # the first block missing: nothing to keep, every page reported and untouched
        ranks[1].buf[5 * 2048 : 6 * 2048] = 7
        before5 = block_bytes(ranks[1].buf, NUM_BLOCKS, 5)
        ranks[1].run(False, alice, [st.hashes[1], st.hashes[0]], [5, 6])
        assert ranks[1].worker.take_failed_block_ids() == {5, 6}
        assert block_bytes(ranks[1].buf, NUM_BLOCKS, 5) == before5
        assert block_bytes(ranks[1].buf, NUM_BLOCKS, 6) == before

        # rank 0's daemon dies: nothing is a hit any more (its blocks are gone)
        two_daemons[0].kill()
        assert wait_for(lambda: mgr.lookup(k[0], ctx_a) is LookupResult.MISS)
        # ...and after its restart the mirror follows the new daemon again
        two_daemons[0].start()
        assert wait_for(
            lambda: mgr.mirrors[0].pool_id is not None and mgr.mirrors[0].synced.is_set()
        )
        assert mgr.mirrors[0].blocks() == 0
    finally:
        mgr.shutdown()
        for r in ranks:
            r.worker.shutdown()


def test_other_model_never_sees_the_blocks(two_daemons: list[Daemon]) -> None:
    sock = [two_daemons[0].target]
    a = KVSealOffloadingSpec(offloading_config(sock, 0, model="model-a")).get_manager()
    b = KVSealOffloadingSpec(offloading_config(sock, 0, model="model-b")).get_manager()
    assert isinstance(a, KVSealOffloadingManager) and isinstance(b, KVSealOffloadingManager)
    worker = Rank(sock, 0)  # model "tiny": a third namespace
    try:
        assert wait_for(
            lambda: a.mirrors[0].namespace is not None and b.mirrors[0].namespace is not None
        )
        assert a.mirrors[0].namespace != b.mirrors[0].namespace
        ctx = ReqContext(req_id="r")
        a.on_new_request(ctx)
        b.on_new_request(ctx)
        worker.fill(1, 1)
        worker.run(True, tenant_digest(None), [bytes([1]) * 32], [1])
        assert wait_for(lambda: two_daemons[0].stats()["blocks_ready"] == 1)
        assert a.lookup(_key(1), ctx) is LookupResult.MISS
        assert b.lookup(_key(1), ctx) is LookupResult.MISS
    finally:
        a.shutdown()
        b.shutdown()
        worker.worker.shutdown()


def test_mirror_resync_keeps_only_what_the_daemon_holds(two_daemons: list[Daemon]) -> None:
    """After a gap in the event stream (a watcher that fell behind is cut off),
    the mirror re-checks every block it believes READY against the daemon."""
    sock = [two_daemons[0].target]
    mgr = KVSealOffloadingSpec(offloading_config(sock, 0)).get_manager()
    assert isinstance(mgr, KVSealOffloadingManager)
    worker = Rank(sock, 0)
    try:
        ctx = ReqContext(req_id="r")
        mgr.on_new_request(ctx)
        shared = tenant_digest(None)
        m = mgr.mirrors[0]
        assert wait_for(m.synced.is_set) and _named(mgr, shared)
        worker.fill(1, 1)
        worker.run(True, shared, [bytes([1]) * 32], [1])
        assert wait_for(lambda: m.blocks() == 1)
        # a block the mirror wrongly believes present (a missed removal)
        m._set(shared, [bytes([2]) * 32], True)
        assert mgr.lookup(_key(2), ctx) is LookupResult.HIT
        m._resync()
        assert mgr.lookup(_key(2), ctx) is LookupResult.MISS
        assert mgr.lookup(_key(1), ctx) is LookupResult.HIT
        removed = [kk for e in mgr.take_events() if e.removed for kk in e.keys]
        assert removed == [_key(2)]
    finally:
        mgr.shutdown()
        worker.worker.shutdown()


def test_discovery_finds_blocks_stored_before_the_engine_subscribed(
    two_daemons: list[Daemon],
) -> None:
    """An engine restarted next to a warm daemon: with kvseal_lookup_discovery the
    first lookup of an unknown block says RETRY (vLLM looks again next step), a
    background Lookup learns the answer, then it is a HIT (or a MISS if absent)."""
    sock = [two_daemons[0].target]
    worker = Rank(sock, 0)
    shared = tenant_digest(None)
    worker.fill(1, 1)
    worker.run(True, shared, [bytes([1]) * 32], [1])  # before any manager exists
    assert wait_for(lambda: two_daemons[0].stats()["blocks_ready"] == 1)
    cfg = offloading_config(sock, 0)
    cfg = type(cfg)(
        **{**cfg.__dict__, "extra_config": {**cfg.extra_config, "kvseal_lookup_discovery": True}}
    )
    mgr = KVSealOffloadingSpec(cfg).get_manager()
    plain = KVSealOffloadingSpec(offloading_config(sock, 0)).get_manager()
    assert isinstance(mgr, KVSealOffloadingManager) and isinstance(plain, KVSealOffloadingManager)
    try:
        ctx = ReqContext(req_id="r")
        mgr.on_new_request(ctx)
        plain.on_new_request(ctx)
        assert wait_for(mgr.mirrors[0].synced.is_set) and wait_for(plain.mirrors[0].synced.is_set)
        assert plain.lookup(_key(1), ctx) is LookupResult.MISS  # the mirror alone never heard of it
        assert mgr.lookup(_key(1), ctx) is LookupResult.RETRY
        assert mgr.lookup(_key(3), ctx) is LookupResult.RETRY  # never stored
        assert wait_for(lambda: mgr.lookup(_key(1), ctx) is LookupResult.HIT)
        assert wait_for(lambda: mgr.lookup(_key(3), ctx) is LookupResult.MISS)
    finally:
        mgr.shutdown()
        plain.shutdown()
        worker.worker.shutdown()


def test_the_mirror_is_an_observer_of_the_workers_namespace(two_daemons: list[Daemon]) -> None:
    """The scheduler's mirror registers an observer pool (no memory: nothing in
    /dev/shm, usable on a CUDA daemon): the worker pool's namespace, transfers
    refused, the worker's blocks visible to it."""
    sock = [two_daemons[0].target]
    shm_before = {n for n in os.listdir("/dev/shm") if n.startswith("kvseal-vllm-probe")}
    mgr = KVSealOffloadingSpec(offloading_config(sock, 0)).get_manager()
    assert isinstance(mgr, KVSealOffloadingManager)
    rank = Rank(sock, 0)
    try:
        m = mgr.mirrors[0]
        assert wait_for(lambda: m.synced.is_set() and rank.worker.kv is not None)
        assert rank.worker.kv is not None
        worker_handle = rank.worker.kv.pool.handle
        assert worker_handle is not None
        assert m.namespace == worker_handle.namespace
        assert {n for n in os.listdir("/dev/shm") if n.startswith("kvseal-vllm-probe")} == (
            shm_before
        )
        tenant = tenant_digest(None)
        h = [bytes([3]) * 32]
        with KVSealClient(ClientConfig(target=sock[0])) as c:
            assert m.pool_id is not None
            with pytest.raises(KVSealRpcError) as err:
                c.offload(m.pool_id, tenant, h, [0])
            assert err.value.reason == "OBSERVER_POOL"
        mgr.on_new_request(ReqContext(req_id="r"))  # names the shared tenant on the mirror
        assert _named(mgr, tenant)
        rank.fill(2, 2)
        rank.run(True, tenant, h, [2])
        assert wait_for(lambda: m.contains(tenant, h[0]))
    finally:
        mgr.shutdown()
        rank.worker.shutdown()


def test_blocks_offered_again_stay_recent_in_the_daemon(tmp_path: Path) -> None:
    """vLLM offers a request's blocks for store also when the tier already holds
    them (a prefix the engine served from its own cache). The manager skips the
    copy but has the daemon touch them, in the background: the daemon's LRU
    then evicts a block nobody used, not the prefix in use (without the touch,
    exactly that prefix would go first)."""
    # The smallest tier: ~250 test blocks.
    with _one_rank(tmp_path, host_bytes="1MiB") as (d, mgr, rank):
        m = mgr.mirrors[0]
        ctx = ReqContext(req_id="r")
        mgr.on_new_request(ctx)  # names the shared tenant on the mirror
        tenant = tenant_digest(None)
        assert _named(mgr, tenant)
        k = [OffloadKey(keys.make_offload_key(i.to_bytes(2, "big") * 16, 0)) for i in range(600)]
        h = [bytes(kk[: -keys.OFFLOAD_GROUP_BYTES]) for kk in k]
        # Fill the tier one single-block chain at a time, until it evicts.
        n = 0
        while d.stats()["evicted_blocks"] == 0:
            assert n < len(k), "the tier never filled"
            rank.fill(n % NUM_BLOCKS, n)
            rank.run(True, tenant, [h[n]], [n % NUM_BLOCKS])
            n += 1
        assert n >= 4, n  # room for a few blocks: the test means something
        assert wait_for(lambda: not m.contains(tenant, h[0]))  # plain LRU: the oldest went
        oldest = 1  # h[1] is now the least recently used
        assert m.contains(tenant, h[oldest]) and m.contains(tenant, h[oldest + 1])

        # The engine uses h[1] again (served from its own cache) and vLLM offers
        # it for store: nothing to copy, but it becomes the most recent.
        before = m.touched
        out = mgr.prepare_store([k[oldest]], ctx)
        assert out is not None and out.keys_to_store == []
        assert wait_for(lambda: m.touched > before)

        rank.fill(0, 999)
        rank.run(True, tenant, [h[n]], [0])  # one more block: one eviction
        # The daemon announces the eviction before the store that caused it, so
        # wait for both announcements before asserting on the mirror.
        assert wait_for(lambda: m.contains(tenant, h[n]))
        assert wait_for(lambda: not m.contains(tenant, h[oldest + 1]))
        assert m.contains(tenant, h[oldest]), "the block in use was evicted"


def test_a_block_being_stored_is_a_pending_hit_then_a_verified_hit(tmp_path: Path) -> None:
    """While a block's store is in flight, ``lookup`` says HIT_PENDING (vLLM
    defers the request a step instead of recomputing the block, as with its
    own CPU manager); once the daemon announces it, HIT. A job reported done is
    a hit at once, and the mirror's background Lookup drops a block the daemon
    does not hold (the worker reports a dropped store as done: vLLM 0.32 takes
    no failed job); a failed job is a miss at once."""
    with _one_rank(tmp_path) as (_, mgr, rank):
        note_request_salt("r-pending", "alice")  # a tenant of its own, not the shared one
        ctx = ReqContext(req_id="r-pending")
        mgr.on_new_request(ctx)
        tenant = tenant_digest("alice")
        assert _named(mgr, tenant)
        k = [_key(i) for i in (1, 2, 3)]
        assert mgr.lookup(k[0], ctx) is LookupResult.MISS
        out = mgr.prepare_store(k, ctx)
        assert out is not None and out.keys_to_store == k
        st = out.store_spec
        assert isinstance(st, KVSealLoadStoreSpec)
        assert all(mgr.lookup(kk, ctx) is LookupResult.HIT_PENDING for kk in k)

        # The worker stores the first block; the daemon's announcement makes it a hit.
        rank.fill(1, 1)
        rank.run(True, tenant, st.hashes[:1], [1])
        assert wait_for(lambda: mgr.lookup(k[0], ctx) is LookupResult.HIT)
        # The job ends, but the daemon never got the second block (the worker
        # dropped it): claimed, then dropped once the mirror's Lookup answered.
        # vLLM may report the job after the request finished (its tenant forgotten).
        m = mgr.mirrors[0]
        verified = m.verified
        mgr.on_request_finished(ctx)
        mgr.complete_store(k[:2], ctx)
        note_request_salt("r-next", "alice")  # the next request of the same tenant
        nxt = ReqContext(req_id="r-next")
        mgr.on_new_request(nxt)
        assert mgr.lookup(k[0], nxt) is LookupResult.HIT
        assert wait_for(lambda: mgr.lookup(k[1], nxt) is LookupResult.MISS)
        assert m.verified == verified + 1  # only the unannounced block was asked about
        assert mgr.lookup(k[0], nxt) is LookupResult.HIT
        assert mgr.lookup(k[2], nxt) is LookupResult.HIT_PENDING  # its job still runs
        # A failed job: a miss at once.
        mgr.complete_store(k[2:], ctx, success=False)
        assert mgr.lookup(k[2], nxt) is LookupResult.MISS


def test_socket_for_rank_makes_a_relative_path_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gRPC's ``unix://`` takes an absolute path only; a socket named relative
    to the engine's working directory must still reach its daemon."""
    from kvseal.vllm.spec import socket_for_rank

    monkeypatch.chdir(tmp_path)
    assert socket_for_rank({"kvseal_socket": "d/k{rank}.sock"}, 1) == f"unix://{tmp_path}/d/k1.sock"
    assert socket_for_rank({"kvseal_sockets": ["unix:///a.sock"]}, 0) == "unix:///a.sock"
