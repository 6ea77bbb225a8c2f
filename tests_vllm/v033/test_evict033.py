"""Offload at eviction (``"kvseal_offload": "eviction"``, kvseal.vllm.evict) under
vLLM 0.33's own scheduler, block pool and offloading connector, against a real
daemon (tests_vllm/v033/engine.py: vLLM 0.33 has no CPU engine build, so the
forward pass is the fake one that writes each block's bytes from its prefix).

What vLLM 0.33 must give the mode, checked here on its real objects: the
binding at the first request (the connector's scheduler, its block pool,
``_reuse_watchers``, ``get_new_blocks`` popping the free queue's head), store
jobs in its metadata with ids from its own counter, completions taken out of
``completed_jobs`` before its scheduler (which would ``KeyError`` on a job it
did not make) reads them, ``jobs_to_flush`` honoured by its worker before the
forward that reuses a block, and the write-through fallback with the reason
when ``get_new_blocks`` is not the one the mode checks.

The engine has 48 blocks (47 usable) of 16 tokens; the horizon is set (the
default, 2.5 steps of 1,024 batched tokens, would be the whole pool here).
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvseal.vllm import keys
from vllm.v1.core.block_pool import BlockPool

from tests_vllm.daemon import Daemon
from tests_vllm.helpers import wait_for
from tests_vllm.v033.engine import BLOCK, LAYERS, Engine, page_bytes, write_model_config

HORIZON = 10


def _prompt(seed: int, blocks: int) -> list[int]:
    """``blocks`` full blocks and one token more (the token vLLM computes)."""
    return [(seed * 7919 + i * 31) % 1000 + 1 for i in range(blocks * BLOCK + 1)]


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path / "d")
    d.start()
    yield d
    d.stop()


def _engine(daemon: Daemon, tmp_path: Path, **extra: Any) -> Engine:
    e = Engine(
        write_model_config(tmp_path / "model"),
        daemon.target,
        extra={"kvseal_offload": "eviction", **extra},
    )
    m = e.manager.mirrors[0]
    assert wait_for(lambda: m.synced.is_set() and e.worker.kv is not None)
    assert e.worker.kv is not None and e.worker.kv.pool.wait_ready(20)
    return e


@pytest.fixture
def engine(daemon: Daemon, tmp_path: Path) -> Iterator[Engine]:
    e = _engine(daemon, tmp_path, kvseal_eviction_horizon_blocks=HORIZON)
    try:
        yield e
    finally:
        e.shutdown()


def _serve(e: Engine, req_id: str, tokens: list[int]) -> None:
    e.add(req_id, tokens)
    e.run()


def _pages_match(e: Engine, req_id: str, tokens: list[int], blocks: int) -> None:
    ids = e.block_ids(req_id)
    for b in range(blocks):
        for layer in range(LAYERS):
            assert e.page(ids[b], layer) == page_bytes(tokens, b, layer), (req_id, b, layer)


def test_fits_seals_nothing_pressure_seals_what_is_evicted(engine: Engine, daemon: Daemon) -> None:
    e = engine
    a, b = _prompt(1, 6), _prompt(2, 6)
    # Fits: two prompts, twice; the second time they are the engine's own hits.
    _serve(e, "a0", a)
    _serve(e, "b0", b)
    e.add("a1", a)
    assert e.step().num_scheduled_tokens == {"a1": 1}  # 6 blocks from the GPU's cache
    e.run()
    _serve(e, "b1", b)
    ev = e.manager.evict
    assert ev is not None and ev.state == "active", (ev and ev.state, ev and ev.reason)
    assert ev.horizon == HORIZON
    assert ev.stats["blocks"] == 0 and ev.stats["jobs"] == 0
    assert daemon.stats()["offloaded_blocks"] == 0  # no Offload at all
    assert e.worker.stats["stores"] == 0

    # Pressure: 5 prompts of 8 blocks each (45 blocks with their last ones)
    # push a's and b's blocks to the free queue's head: sealed there, then
    # handed out (evicted) to the later prompts.
    for i in range(5):
        _serve(e, f"p{i}", _prompt(10 + i, 8))
    assert wait_for(lambda: not ev.busy)
    sealed = ev.stats["blocks"]
    assert sealed >= 12, ev.stats  # at least a's and b's 6 + 6
    st = daemon.stats()
    assert st["offloaded_blocks"] == sealed and st["integrity_failures"] == 0
    assert ev.stats["done_jobs"] == ev.stats["jobs"]
    # a again: the GPU lost it; all 6 blocks come from the tier, byte for byte.
    e.add("a2", a)
    e.run()
    assert e.worker.stats["loads"] == 1 and e.worker.take_failed_block_ids() == set()
    assert e.requests["a2"].num_computed_tokens == len(a)
    _pages_match(e, "a2", a, 6)
    assert daemon.stats()["restored_blocks"] == 6


def test_a_block_reused_at_once_is_sealed_before_the_forward_overwrites_it(
    daemon: Daemon, tmp_path: Path
) -> None:
    # A horizon of 4, prompts of 3 blocks and a token (4 blocks each): each
    # scan seals the hashed blocks among the 4 at the free queue's head (an
    # old request's, freed last block first, so its whole prefix), and the
    # next request, arriving at once, takes those 4 in its allocation in the
    # same step that carries their store job, before any worker can have reported it. vLLM 0.33's
    # worker must finish the job (jobs_to_flush) before the forward writes the
    # new request's KV into those blocks; a torn seal would restore the later
    # request's bytes, which _pages_match catches.
    e = _engine(daemon, tmp_path, kvseal_eviction_horizon_blocks=4)
    try:
        prompts = {f"q{i}": _prompt(20 + i, 3) for i in range(20)}
        for rid, toks in prompts.items():
            # Back to back: the next request arrives in the step after this
            # one finished, whose output scan made the head's store jobs.
            req = e.add(rid, toks)
            while not req.is_finished():
                e.step()
        e.run()
        ev = e.manager.evict
        assert ev is not None and ev.state == "active"
        assert wait_for(lambda: not ev.busy)
        assert ev.stats["flushed_jobs"] > 0, ev.stats
        assert ev.stats["done_jobs"] == ev.stats["jobs"] > 0
        # Every prompt again: what comes from the tier is its own bytes (what
        # the engine computes again is by construction).
        for rid, toks in prompts.items():
            e.add(f"{rid}-again", toks)
            e.run()
            assert e.requests[f"{rid}-again"].num_computed_tokens == len(toks)
            _pages_match(e, f"{rid}-again", toks, 3)
        assert e.worker.stats["loads"] > 0 and daemon.stats()["restored_blocks"] > 0
        assert e.worker.take_failed_block_ids() == set()
        assert daemon.stats()["integrity_failures"] == 0
    finally:
        e.shutdown()


def test_a_prefix_cache_reset_with_store_jobs_in_flight_loses_no_seal(
    daemon: Daemon, tmp_path: Path
) -> None:
    """vLLM 0.33's prefix-cache reset while this mode's store jobs are sent but
    not reported (the daemon is stopped, so their Offload hangs). The reset
    fires the blocks' reuse watchers (the mode fences its jobs), pops them and
    drops every block hash; the next request is handed those blocks with no
    watcher left. vLLM's reset knows only its own jobs (it discards worker
    reports of ids below its counter: the mode takes its own out first) and
    calls on_reset_flushed at once. The fence holds the forward that
    overwrites the blocks until the seal read them: they come back from the
    tier byte for byte."""
    e = _engine(daemon, tmp_path, kvseal_eviction_horizon_blocks=4)
    assert daemon.proc is not None
    pid = daemon.proc.pid
    stopped = False
    try:
        ev = e.manager.evict
        assert ev is not None
        g = e.manager.groups[0]
        prompts: dict[str, list[int]] = {}
        for i in range(30):  # until a step sends jobs (freed blocks reach the head)
            e.run()
            assert wait_for(lambda: not ev.busy)  # every earlier job reported
            prompts[f"r{i}"] = _prompt(40 + i, 3)
            os.kill(pid, signal.SIGSTOP)
            stopped = True
            req = e.add(f"r{i}", prompts[f"r{i}"])
            while not req.is_finished():
                e.step()
            if ev._jobs:
                break
            os.kill(pid, signal.SIGCONT)
            stopped = False
        assert stopped and ev.state == "active" and ev._jobs, ev.stats
        pending = dict(ev._jobs)
        sealed = {(j.tenant, h) for j in pending.values() for h in j.hashes}
        keys_ = {k for j in pending.values() for k in j.keys}
        owner = [
            rid
            for rid in prompts
            if keys_ & {keys.make_offload_key(bytes(h), 0) for h in e.requests[rid].block_hashes}
        ]
        assert len(owner) == 1, owner  # one earlier prompt's blocks
        first, toks = owner[0], prompts[owner[0]]
        flushed_before = e.manager.resets_flushed
        assert e.scheduler.reset_prefix_cache(reset_connector=True)
        assert e.manager.resets_flushed == flushed_before + 1
        assert set(pending) <= ev._flush  # fenced by the reset's reuse notice
        pool = e.scheduler.kv_cache_manager.block_pool
        assert not any(b in pool._reuse_watchers for j in pending.values() for b in j.block_ids)
        os.kill(pid, signal.SIGCONT)
        stopped = False
        # The next prompts are handed those blocks (the free queue's head) and
        # overwrite them in their forward.
        for i in range(5):
            _serve(e, f"n{i}", _prompt(80 + i, 3))
        assert wait_for(lambda: not ev.busy)
        assert ev.stats["done_jobs"] == ev.stats["jobs"]  # reported, not stale-dropped
        # The reset cleared the pending-store claims: the blocks become hits
        # when the daemon announces them.
        assert wait_for(lambda: all(h in g.ready.get(t, ()) for t, h in sealed))
        restored = daemon.stats()["restored_blocks"]
        e.add(f"{first}-again", toks)
        e.run()
        assert e.worker.take_failed_block_ids() == set()
        assert daemon.stats()["restored_blocks"] >= restored + len(sealed)
        _pages_match(e, f"{first}-again", toks, 3)
        assert daemon.stats()["integrity_failures"] == 0
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        e.shutdown()


def test_a_get_new_blocks_that_does_not_fit_falls_back_to_write_through(
    daemon: Daemon, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    orig = BlockPool.get_new_blocks

    def get_new_blocks(self: BlockPool, num_blocks: int) -> Any:  # no reuse watchers
        return orig(self, num_blocks)

    monkeypatch.setattr(BlockPool, "get_new_blocks", get_new_blocks)
    caplog.set_level(logging.WARNING, logger="kvseal")
    e = _engine(daemon, tmp_path, kvseal_eviction_horizon_blocks=HORIZON)
    try:
        p = _prompt(3, 4)
        _serve(e, "w", p)
        ev = e.manager.evict
        assert ev is not None and ev.state == "write-through"
        assert "get_new_blocks" in ev.reason
        assert any("kvseal runs write-through" in r.getMessage() for r in caplog.records)
        # Write-through: the request's blocks are stored as they are computed.
        assert wait_for(lambda: daemon.stats()["offloaded_blocks"] == 4)
        assert e.worker.stats["stores"] >= 1
    finally:
        e.shutdown()
