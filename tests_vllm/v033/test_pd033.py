"""The P/D handoff's scheduler-side logic (kvseal.vllm.pd) under vLLM 0.33's and
0.34's own Scheduler and OffloadingConnector code (tests_vllm/v033/engine.py),
against real daemons sharing one sealed store directory: a prefill engine
whose daemon publishes, a decode engine whose daemon finds the blocks there.

- a request with ``do_remote_decode`` finishes with the decode's params
  (counts only), one without keeps vLLM's (none);
- a decode request with the params, whose blocks are not published yet, is
  looked up again (RETRY: not scheduled, the scheduler never blocks) and is
  served from the store once the prefill publishes: restored, byte for byte;
- past the bound (``kvseal_pd_wait_ms``) the request is computed, counted late;
- a request without the params is never held for an absent block;
- an old handoff presented after its tenant was dropped restores nothing:
  the decode computes after the bound (the store's erasure rules).

Run by ``make test-vllm-033`` and ``make test-vllm-034``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvseal.vllm import pd
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request

from tests_vllm.daemon import Daemon
from tests_vllm.helpers import wait_for
from tests_vllm.v033.engine import BLOCK, LAYERS, Engine, page_bytes, write_model_config

BLOCKS = 4
# 0.33/0.34 read the tier's blocks through the store on the decode's daemon.
PAGE_WAIT_S = 60.0  # liveness bounds, not timing assertions


def _flags(store: Path, key: Path) -> tuple[str, ...]:
    return (
        "--store-dir", str(store), "--store-key", f"file:{key}",
        "--store-bytes", "64MiB", "--store-max-block-bytes", "1MiB",
    )  # fmt: skip


@pytest.fixture
def store(tmp_path: Path) -> tuple[Path, Path]:
    key = tmp_path / "key"
    key.write_text(os.urandom(32).hex() + "\n")
    key.chmod(0o600)
    return tmp_path / "store", key


def _daemon(tmp_path: Path, name: str, store: tuple[Path, Path]) -> Daemon:
    return Daemon(tmp_path / name, extra=_flags(*store)).start()


def _engine(tmp_path: Path, d: Daemon, name: str, wait_ms: int) -> Engine:
    e = Engine(
        # One model directory: the two instances' namespaces and deployment
        # identity derive from it (a P/D pair serves the same model).
        write_model_config(tmp_path / "model"),
        d.target,
        extra={"kvseal_pd_wait_ms": wait_ms},
    )
    m = e.manager.mirrors[0]
    assert wait_for(lambda: m.synced.is_set() and e.worker.kv is not None, PAGE_WAIT_S)
    assert e.worker.kv is not None and e.worker.kv.pool.wait_ready(20)
    return e


@pytest.fixture
def pair(tmp_path: Path, store: tuple[Path, Path]) -> Iterator[tuple[Engine, Engine, Daemon]]:
    dp, dd = _daemon(tmp_path, "p", store), _daemon(tmp_path, "d", store)
    engines: list[Engine] = []
    try:
        engines.append(_engine(tmp_path, dp, "p", 60_000))
        engines.append(_engine(tmp_path, dd, "d", 60_000))
        yield engines[0], engines[1], dd
    finally:
        for e in engines:
            e.shutdown()
        dp.stop()
        dd.stop()


def add(e: Engine, req_id: str, tokens: list[int], params: dict[str, Any] | None) -> Request:
    """Engine.add with ``kv_transfer_params`` (vLLM reads them from the
    sampling params' extra args, as the OpenAI server passes them)."""
    sp = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        extra_args={"kv_transfer_params": params} if params is not None else None,
    )
    req = Request(
        request_id=req_id,
        prompt_token_ids=list(tokens),
        sampling_params=sp,
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK, e.hash_fn),
    )
    e.requests[req_id] = req
    e.scheduler.add_request(req)
    return req


def finished_params(e: Engine, req_id: str) -> list[Any]:
    """The kv_transfer_params of ``req_id``'s outputs, every step."""
    return [
        o.kv_transfer_params
        for outs in e.outputs
        for eco in outs.values()
        for o in eco.outputs
        if o.request_id == req_id and o.finished
    ]


def tokens(seed: int) -> list[int]:
    return [(seed * 131 + i * 7) % 1000 + 3 for i in range(BLOCKS * BLOCK + 5)]


def test_prefill_hands_out_counts_only(pair: tuple[Engine, Engine, Daemon]) -> None:
    p, _d, _dd = pair
    add(p, "pd", tokens(1), {"do_remote_decode": True})
    add(p, "plain", tokens(2), None)
    p.run()
    (got,) = finished_params(p, "pd")
    assert got["do_remote_prefill"] is True and got["do_remote_decode"] is False
    assert got[pd.HANDOFF_KEY] == {
        "v": 1, "blocks": BLOCKS, "block_size": BLOCK, "prompt_tokens": BLOCKS * BLOCK + 5,
    }  # fmt: skip
    assert finished_params(p, "plain") == [None]


def test_decode_waits_for_the_prefill_publish_then_restores(
    pair: tuple[Engine, Engine, Daemon],
) -> None:
    p, d, dd = pair
    t = tokens(3)
    params = {
        "do_remote_prefill": True,
        pd.HANDOFF_KEY: {"v": 1, "blocks": BLOCKS, "block_size": BLOCK},
    }
    add(d, "dec", t, params)
    # The prefill has not run: the decode's blocks are nowhere. The request is
    # looked up again each step, never scheduled, never computed.
    for _ in range(40):
        so = d.step()
        assert "dec" not in so.num_scheduled_tokens
        time.sleep(0.01)  # the discovery thread's Lookups run meanwhile
    assert dd.stats()["lookups"] > 0  # asked the daemon (in the background)
    # The prefill computes and publishes; the decode then finds the blocks.
    add(p, "pre", t, {"do_remote_decode": True})
    p.run()
    before = pd.COUNTS["full"]
    d.run(timeout=PAGE_WAIT_S)
    assert dd.stats()["restored_blocks"] >= BLOCKS
    ids = d.last_blocks["dec"]
    for b in range(BLOCKS):
        for layer in range(LAYERS):
            assert d.page(ids[b], layer) == page_bytes(t, b, layer), (b, layer)
    assert pd.COUNTS["full"] == before + 1


def test_past_the_bound_the_decode_computes(tmp_path: Path, store: tuple[Path, Path]) -> None:
    dd = _daemon(tmp_path, "d", store)
    e = _engine(tmp_path, dd, "d", 300)
    try:
        late = pd.COUNTS["late"]
        t = tokens(4)
        add(e, "dec", t, {"do_remote_prefill": True, pd.HANDOFF_KEY: {"v": 1, "blocks": BLOCKS}})
        e.run(timeout=PAGE_WAIT_S)  # nothing was ever published: computed after the bound
        assert dd.stats()["restored_blocks"] == 0
        assert pd.COUNTS["late"] == late + 1
        ids = e.last_blocks["dec"]
        assert e.page(ids[0], 0) == page_bytes(t, 0, 0)  # computed by the "model"
    finally:
        e.shutdown()
        dd.stop()


def test_a_plain_request_is_not_held_for_an_absent_block(
    tmp_path: Path, store: tuple[Path, Path]
) -> None:
    dd = _daemon(tmp_path, "d", store)
    e = _engine(tmp_path, dd, "d", pd.MAX_WAIT_MS)
    try:
        add(e, "plain", tokens(5), None)
        # Discovery asks about the unknown blocks once, then they are known
        # absent and the request runs: a liveness bound well below the
        # handoff's (which would hold a handoff request for MAX_WAIT_MS).
        e.run(timeout=pd.MAX_WAIT_MS / 2000)
        assert finished_params(e, "plain") == [None]
        assert dd.stats()["restored_blocks"] == 0
    finally:
        e.shutdown()
        dd.stop()


def test_an_old_handoff_after_its_tenant_was_dropped_is_computed(
    tmp_path: Path, store: tuple[Path, Path]
) -> None:
    """The prefill publishes a prompt; then the tenant is dropped (on the
    prefill's daemon, which marks the drop in the shared store); then the host
    presents the old handoff to the decode. The store's erasure rules hold for
    handoffs: nothing is restored, the decode computes the prompt after its
    bound, counted late."""
    from kvseal.client import ClientConfig, KVSealClient
    from kvseal.vllm.manager import SHARED_TENANT

    dp, dd = _daemon(tmp_path, "p", store), _daemon(tmp_path, "d", store)
    engines: list[Engine] = []
    try:
        p = _engine(tmp_path, dp, "p", 60_000)
        engines.append(p)
        d = _engine(tmp_path, dd, "d", 1500)
        engines.append(d)
        t = tokens(6)
        add(p, "pre", t, {"do_remote_decode": True})
        p.run()
        (params,) = finished_params(p, "pre")

        def spilled() -> bool:
            with KVSealClient(ClientConfig(target=dp.target)) as c:
                return int(c.stats().store_spilled_blocks) >= BLOCKS

        assert wait_for(spilled, PAGE_WAIT_S), "the prefill never published"
        assert p.worker.kv is not None
        with KVSealClient(ClientConfig(target=dp.target)) as c:
            c.drop(p.worker.kv.pool.handle.pool_id, SHARED_TENANT, all_of_tenant=True)
        late = pd.COUNTS["late"]
        add(d, "dec", t, params)
        d.run(timeout=PAGE_WAIT_S)
        assert dd.stats()["restored_blocks"] == 0
        assert pd.COUNTS["late"] == late + 1
        ids = d.last_blocks["dec"]
        assert d.page(ids[0], 0) == page_bytes(t, 0, 0)  # computed by the "model"
    finally:
        for e in engines:
            e.shutdown()
        dp.stop()
        dd.stop()
