"""Many tenants (per-user ``cache_salt``) against a real daemon, scheduler side:
a block this engine stored is a hit as soon as its store is reported done,
whether or not the daemon had named the tenant on the mirror's pool by then,
unless the daemon has since removed it; per-tenant state is reclaimed when a
tenant goes idle. The real-engine run of the same is in test_vllm_e2e.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
from kvseal.client import ClientConfig, KVSealClient, KVSealRpcError, tenant_digest
from kvseal.vllm.spec import KVSealLoadStoreSpec, KVSealOffloadingManager, note_request_salt
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from tests_vllm.helpers import wait_for
from tests_vllm.test_adapter import Rank, _key, _named, _one_rank


def _request(mgr: KVSealOffloadingManager, req_id: str, salt: str) -> ReqContext:
    note_request_salt(req_id, salt)
    ctx = ReqContext(req_id=req_id)
    mgr.on_new_request(ctx)
    return ctx


def _worker_pool(rank: Rank) -> str:
    """The worker's pool id: a Drop through it names nothing on the mirror's pool."""
    assert rank.worker.kv is not None
    h = rank.worker.kv.pool.handle
    assert h is not None
    return h.pool_id


def _store(
    mgr: KVSealOffloadingManager, rank: Rank, ctx: ReqContext, ids: list[int]
) -> list[bytes]:
    """prepare_store, the worker's Offload, complete_store: as vLLM drives a job."""
    out = mgr.prepare_store([_key(i) for i in ids], ctx)
    assert out is not None
    st = out.store_spec
    assert isinstance(st, KVSealLoadStoreSpec) and len(st.hashes) == len(ids)
    for b in ids:
        rank.fill(b, b)
    rank.run(True, st.tenant, st.hashes, ids)
    mgr.complete_store(out.keys_to_store, ctx)
    return st.hashes


def test_a_store_before_the_tenant_is_named_is_a_hit_and_its_evictions_arrive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race of issue 20: the daemon streams a tenant's events to the mirror
    only once the tenant is named on the mirror's pool, and a new tenant's first
    store can come first. Here naming (the background Touch) keeps failing, so
    the daemon never announces the store: the block must still be a hit once
    the job is reported done, and the mirror's verifying Lookup, which names the
    tenant, must make the daemon's later removal of it reach the mirror."""
    with _one_rank(tmp_path) as (d, mgr, rank):
        m = mgr.mirrors[0]

        def no_touch(*_a: Any, **_k: Any) -> int:
            raise KVSealRpcError(grpc.StatusCode.UNAVAILABLE, "", "naming held back by the test")

        monkeypatch.setattr(m._client, "touch", no_touch)
        ctx = _request(mgr, "r1", "new-user")
        tenant = tenant_digest("new-user")
        hashes = _store(mgr, rank, ctx, [1, 2])
        assert d.stats()["blocks_ready"] == 2
        assert mgr.lookup(_key(1), ctx) is LookupResult.HIT  # at once, no announcement needed
        assert mgr.lookup(_key(2), ctx) is LookupResult.HIT
        assert wait_for(lambda: tenant in m.named)  # the verification named it
        assert mgr.lookup(_key(1), ctx) is LookupResult.HIT  # and kept both blocks
        assert mgr.lookup(_key(2), ctx) is LookupResult.HIT
        # The daemon drops one: the removal now reaches the mirror as an event.
        with KVSealClient(ClientConfig(target=d.target)) as c:
            assert c.drop(_worker_pool(rank), tenant, [hashes[1]]) == 1
        assert wait_for(lambda: mgr.lookup(_key(2), ctx) is LookupResult.MISS)
        assert mgr.lookup(_key(1), ctx) is LookupResult.HIT
        assert mgr.lookup(_key(1), _request(mgr, "r2", "other-user")) is LookupResult.MISS


def test_a_block_removed_before_its_store_was_reported_is_not_claimed(tmp_path: Path) -> None:
    """The daemon announces a block's removal (here a drop; an eviction alike)
    before vLLM reports the store job that stored it done: the report must not
    bring the block back."""
    with _one_rank(tmp_path) as (d, mgr, rank):
        ctx = _request(mgr, "r1", "alice")
        tenant = tenant_digest("alice")
        assert _named(mgr, tenant)
        out = mgr.prepare_store([_key(3)], ctx)
        assert out is not None and isinstance(out.store_spec, KVSealLoadStoreSpec)
        h = out.store_spec.hashes
        rank.fill(3, 3)
        rank.run(True, tenant, h, [3])
        assert wait_for(lambda: mgr.lookup(_key(3), ctx) is LookupResult.HIT)  # announced
        with KVSealClient(ClientConfig(target=d.target)) as c:
            assert c.drop(_worker_pool(rank), tenant, h) == 1
        assert wait_for(lambda: not mgr.mirrors[0].contains(tenant, h[0]))
        verified = mgr.mirrors[0].verified
        mgr.complete_store(out.keys_to_store, ctx)  # the report comes after the removal
        assert mgr.lookup(_key(3), ctx) is LookupResult.MISS
        assert wait_for(lambda: mgr.mirrors[0].verified > verified)  # asked, and absent
        assert mgr.lookup(_key(3), ctx) is LookupResult.MISS


def test_a_lookup_answer_never_overrides_a_newer_fact(tmp_path: Path) -> None:
    """A resync's (or verification's) Lookup answered "absent", and the block
    was stored after it (its event or its store report reached the mirror while
    the answer travelled): the block stays; and the other way round."""
    with _one_rank(tmp_path) as (_, mgr, _rank):
        m = mgr.mirrors[0]
        t, h, g = tenant_digest("alice"), bytes([7]) * 32, bytes([8]) * 32
        m._set(t, [g], True)
        watch = m._watch_begin()  # a Lookup of h and g is sent
        m._set(t, [h], True)  # h stored meanwhile
        m._set(t, [g], False)  # g removed meanwhile
        m._watch_end(watch)
        m._answer(t, [h, g], [False, True], watch)  # the older answer arrives
        assert m.contains(t, h) and not m.contains(t, g)
        m._answer(t, [h, g], [False, True], set())  # an answer with nothing newer applies
        assert m.contains(t, g) and not m.contains(t, h)


def test_idle_tenants_are_forgotten_and_a_returning_one_gets_its_hits(tmp_path: Path) -> None:
    """Thousands of users, each once: the scheduler's per-tenant state does not
    keep growing. A tenant with no block in the mirror and no request for
    ``tenant_idle_s`` is forgotten; one with blocks stays (its evictions must
    keep arriving); a forgotten tenant that returns is named again and its
    stores are hits."""
    with _one_rank(tmp_path) as (_, mgr, rank):
        m = mgr.mirrors[0]
        m.tenant_idle_s = 0.5
        keeper = _request(mgr, "keep", "keeper")
        _store(mgr, rank, keeper, [1])
        for i in range(300):
            ctx = _request(mgr, f"r{i}", f"user-{i}")
            mgr.on_request_finished(ctx)
        assert m.tenants() >= 300
        assert wait_for(lambda: m.tenants() == 1, 30)  # only the tenant with a block
        assert m.forgotten_tenants >= 300
        assert tenant_digest("keeper") in m.named and tenant_digest("user-0") not in m.named
        assert mgr.lookup(_key(1), keeper) is LookupResult.HIT
        back = _request(mgr, "back", "user-0")
        assert _named(mgr, tenant_digest("user-0"))
        _store(mgr, rank, back, [2])
        assert mgr.lookup(_key(2), back) is LookupResult.HIT
