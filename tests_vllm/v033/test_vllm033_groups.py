"""kvseal under vLLM 0.33's own OffloadingConnector code with several KV-cache
groups (issue 27), against a real daemon.

The engines (tests_vllm/v033/engine.py, ``hybrid=``) are planned by vLLM
0.33's own engine-core code for a hybrid model: full attention plus a
sliding-window group (64-token window, 32-token blocks) or plus a Mamba group
in ``align`` mode, the groups' tensors aliasing one backing allocation as the
hybrid allocator lays them out. vLLM's real Scheduler and OffloadingConnector
decide what each group stores and loads; kvseal seals and restores it:

- every group's blocks are stored and restored byte for byte, per group;
- the sliding-window group restores only the chunks in the window of the hit,
  and vLLM never looks up (so never misses) the chunks before it;
- one group's block tampered with in the daemon's host region fails the
  request's load as a whole: vLLM recomputes the request from its first
  token, and never caches what the failed load wrote;
- two salted tenants never hit each other's blocks, in any group;
- a hybrid model never loads expedited (vLLM 0.33 could not recompute such a
  load when it fails);
- groups vLLM 0.33 selects but kvseal cannot carry (Mamba state outside align
  mode, chunked local attention) stop the engine's start, with the reason.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvseal.vllm import keys
from kvseal.vllm.groups import FULL, MAMBA, SLIDING_WINDOW
from vllm.v1.kv_offload.base import LookupResult

from tests_vllm.daemon import Daemon
from tests_vllm.helpers import wait_for
from tests_vllm.v033.engine import HBLOCK, Engine, write_model_config

BLOCKS = 6  # full blocks per prompt (and one token more)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path / "d", extra=("--on-integrity-failure", "drop"))
    d.start()
    yield d
    d.stop()


@pytest.fixture
def make_engine(daemon: Daemon, tmp_path: Path) -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(kind: str, **extra: Any) -> Engine:
        e = Engine(write_model_config(tmp_path / "model"), daemon.target, extra, hybrid=kind)
        made.append(e)
        mgr = e.manager
        assert wait_for(lambda: all(m.synced.is_set() for m in mgr.mirrors))
        assert wait_for(lambda: len(e.worker.pools) == e.num_groups)
        assert all(p.pool.wait_ready(20) for p in e.worker.pools)
        return e

    yield make
    for e in made:
        e.shutdown()


def _prompt(seed: int, blocks: int = BLOCKS) -> list[int]:
    return [(seed * 7919 + i) % 1000 + 1 for i in range(blocks * HBLOCK + 1)]


def _reset(e: Engine) -> None:
    """vLLM's prefix-cache reset, and the pool scrubbed: any request bytes the
    KV cache holds afterwards were restored (or computed) after this point."""
    assert e.scheduler.reset_prefix_cache(reset_connector=True)
    e.buf.zero_()


class LookupSpy:
    """Records every ``lookup`` vLLM's scheduler makes on kvseal's manager
    (group, result), delegating to the real one."""

    def __init__(self, e: Engine) -> None:
        self.calls: list[tuple[int, bytes, LookupResult]] = []
        mgr = e.manager
        real = mgr.lookup

        def lookup(key: Any, ctx: Any) -> LookupResult:
            r = real(key, ctx)
            vh, group = keys.split_offload_key(bytes(key))
            self.calls.append((group, vh, r))
            return r

        mgr.lookup = lookup  # type: ignore[method-assign]


def _group_pages_match(e: Engine, req_id: str, tokens: list[int]) -> dict[int, list[int]]:
    """Per group, the block positions of the request whose pages hold what the
    forward pass wrote for them (every layer); asserts every non-null block of
    an attention group that lies in the prompt does."""
    out: dict[int, list[int]] = {}
    for gi, ids in enumerate(e.group_block_ids(req_id)):
        layers = len(e.kv_cache_config.kv_cache_groups[gi].layer_names)
        good = []
        for b, bid in enumerate(ids):
            if bid == 0 or (b + 1) * HBLOCK > len(tokens):
                continue
            end = (b + 1) * HBLOCK
            if all(
                e.page(bid, li, gi) == e.expected_page(tokens, gi, li, end) for li in range(layers)
            ):
                good.append(b)
        out[gi] = good
    return out


# Per kind: the block positions of group 1 a 6-block prompt stores and
# restores (sliding window: the window before the hit's end, two blocks;
# Mamba: the one state at the hit's end).
GROUP1_BLOCKS = {"swa": [BLOCKS - 2, BLOCKS - 1], "mamba": [BLOCKS - 1]}


@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_every_group_is_stored_and_restored_byte_exact(
    make_engine: Callable[..., Engine], daemon: Daemon, kind: str
) -> None:
    e = make_engine(kind)
    assert [g.kind for g in e.worker.layouts] == [FULL, SLIDING_WINDOW if kind == "swa" else MAMBA]
    want1 = GROUP1_BLOCKS[kind]
    p = _prompt(1)
    e.add("a", p)
    e.run()
    gs = e.worker.group_stats
    assert gs[0]["stored"] == BLOCKS and gs[1]["stored"] == len(want1)
    assert wait_for(lambda: e.manager._ready_blocks == BLOCKS + len(want1))
    assert daemon.stats()["offloaded_blocks"] == BLOCKS + len(want1)

    _reset(e)
    spy = LookupSpy(e)
    e.add("b", p)
    e.run()
    assert e.worker.stats["loads"] == 1 and e.worker.stats["failed_loads"] == 0
    assert gs[0]["restored"] == BLOCKS and gs[1]["restored"] == len(want1)
    # Byte for byte, per group and layer; group 1 holds nothing but the window
    # (vLLM's null block before it).
    ids = e.group_block_ids("b")
    assert _group_pages_match(e, "b", p) == {0: list(range(BLOCKS)), 1: want1}
    assert [b for b in range(BLOCKS) if ids[1][b] != 0] == want1
    assert e.requests["b"].num_computed_tokens == len(p)
    # vLLM looked up the full-attention prefix and, in group 1, only the
    # window: every lookup a hit, so no chunk out of the window is a miss.
    hashes = [bytes(h) for h in e.requests["b"].block_hashes]
    by_group = {g: [(h, r) for gg, h, r in spy.calls if gg == g] for g in (0, 1)}
    assert by_group[0] == [(hashes[b], LookupResult.HIT) for b in range(BLOCKS)]
    assert sorted(by_group[1]) == sorted((hashes[b], LookupResult.HIT) for b in want1)
    st = daemon.stats()
    assert st["restored_blocks"] == BLOCKS + len(want1) and st["integrity_failures"] == 0


def _spy_offloads(e: Engine, daemon: Daemon, group: int) -> list[tuple[int, int]]:
    """Record where in the host region each store of ``group``'s pool lands:
    (first, last) changed byte of every Offload call, read around the real call.
    The worker sends a job's groups at the same time; here every pool's
    Offload takes one lock, so a diff holds one call's bytes only."""
    spans: list[tuple[int, int]] = []
    lock = threading.Lock()

    def spy(gi: int, real: Callable[..., bool]) -> Callable[..., bool]:
        def offload(*a: Any, **kw: Any) -> bool:
            with lock:
                before = np.fromfile(daemon.region, dtype=np.uint8)
                ok = real(*a, **kw)
                after = np.fromfile(daemon.region, dtype=np.uint8)
            n = min(len(before), len(after))
            diff = np.flatnonzero(before[:n] != after[:n])
            if gi == group and len(diff):
                spans.append((int(diff[0]), int(diff[-1])))
            return bool(ok)

        return offload

    for gi, pool in enumerate(e.worker.pools):
        pool.offload = spy(gi, pool.offload)  # type: ignore[method-assign]
    return spans


def _flip(daemon: Daemon, at: int) -> None:
    """Play the host: flip one byte of the sealed region, in place."""
    with open(daemon.region, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def _dst_by_group(e: Engine, spec: Any) -> list[list[tuple[int, int]]]:
    """A load job's destination, per group: (block position in the request,
    block id)."""
    ids, out, at = list(spec.block_ids), [], 0
    for size, start in zip(spec.group_sizes, spec.block_indices, strict=True):
        out.append([(start + k, ids[at + k]) for k in range(size)])
        at += size
    return out


def _written(e: Engine, tokens: list[int], gi: int, dst: list[tuple[int, int]]) -> bool:
    layers = len(e.kv_cache_config.kv_cache_groups[gi].layer_names)
    return any(
        e.page(bid, li, gi) == e.expected_page(tokens, gi, li, (pos + 1) * HBLOCK)
        for pos, bid in dst
        for li in range(layers)
    )


@pytest.mark.parametrize(("kind", "group"), [("swa", 0), ("swa", 1), ("mamba", 1)])
def test_one_groups_tampered_block_fails_the_whole_load_and_vllm_recomputes(
    make_engine: Callable[..., Engine], daemon: Daemon, kind: str, group: int
) -> None:
    e = make_engine(kind)
    spans = _spy_offloads(e, daemon, group)
    p = _prompt(2)
    e.add("a", p)
    e.run()
    assert wait_for(lambda: e.manager._ready_blocks == BLOCKS + len(GROUP1_BLOCKS[kind]))
    assert spans  # where this group's blocks were sealed
    _flip(daemon, spans[0][0] + 100)  # one byte of one block of this group only
    _reset(e)

    e.add("b", p)
    so = e.scheduler.schedule()
    meta: Any = so.kv_connector_metadata
    (job,) = meta.load_jobs.values()  # one load, every group's blocks
    assert not job.sync and "b" not in so.num_scheduled_tokens
    dst = _dst_by_group(e, job.dst_spec)
    assert [len(d) for d in dst] == [BLOCKS, len(GROUP1_BLOCKS[kind])]
    e.finish_step(so)
    deadline = time.monotonic() + 30
    while True:  # until vLLM schedules the request again
        assert time.monotonic() < deadline, "the request was never rescheduled"
        so = e.scheduler.schedule()
        if "b" in so.num_scheduled_tokens:
            break
        e.finish_step(so)
        time.sleep(0.005)
    # The failed receive: vLLM recomputes from the first token (num_computed_tokens
    # back to 0, nothing of the load cached or hit), before any forward pass
    # (Mamba align mode prefills in block-aligned chunks: the first is 6 blocks).
    req = e.requests["b"]
    assert req.num_computed_tokens == so.num_scheduled_tokens["b"] >= BLOCKS * HBLOCK
    assert e.worker.stats["failed_loads"] == 1
    # What the failed load left in the pool: nothing of the failed group (each
    # group's Restore is all or nothing). The other groups' parts run at the
    # same time (kvseal.vllm.worker): one that verified (the request's own
    # tenant) may have been written, into blocks vLLM freed uncached and
    # recomputes (above): no request ever reads them as a hit.
    assert not _written(e, p, group, dst[group]), group
    e.finish_step(so)
    e.run()
    req = e.requests["b"]
    assert req.is_finished() and req.num_computed_tokens == len(p)
    assert daemon.stats()["integrity_failures"] >= 1
    assert _group_pages_match(e, "b", p)[0] == list(range(BLOCKS))  # recomputed
    # vllm:kvseal_load_failed_blocks counts every block of the failed job.
    counted = [
        v
        for out in e.outputs
        for o in out.values()
        if o.scheduler_stats is not None and o.scheduler_stats.kv_connector_stats
        for v in o.scheduler_stats.kv_connector_stats.get("data", {})
        .get("vllm:kvseal_load_failed_blocks", {})
        .values()
    ]
    assert sum(counted) == BLOCKS + len(GROUP1_BLOCKS[kind])


def test_salted_tenants_do_not_hit_each_other_in_any_group(
    make_engine: Callable[..., Engine], daemon: Daemon
) -> None:
    e = make_engine("swa")
    p = _prompt(3)
    e.add("alice1", p, "alice")
    e.run()
    assert wait_for(lambda: e.manager._ready_blocks == BLOCKS + 2)
    _reset(e)
    spy = LookupSpy(e)
    e.add("bob1", p, "bob")  # vLLM salts bob's hashes: nothing of alice's is his
    e.run()
    assert e.worker.stats["loads"] == 0
    assert spy.calls and {r for _g, _h, r in spy.calls} == {LookupResult.MISS}
    assert wait_for(lambda: e.manager._ready_blocks == 2 * (BLOCKS + 2))  # bob's own
    _reset(e)
    spy.calls.clear()
    e.add("alice2", p, "alice")
    e.run()
    assert e.worker.stats["loads"] == 1 and e.worker.stats["failed_loads"] == 0
    assert {r for _g, _h, r in spy.calls} == {LookupResult.HIT}
    assert _group_pages_match(e, "alice2", p) == {0: list(range(BLOCKS)), 1: GROUP1_BLOCKS["swa"]}
    # Alice's and bob's blocks are different hashes in both groups.
    for g in e.manager.groups:
        assert len(g.ready) == 2
        a, b = g.ready.values()
        assert not a & b


def test_a_hybrid_model_never_loads_expedited(
    make_engine: Callable[..., Engine], daemon: Daemon
) -> None:
    # vLLM 0.33 cannot recompute a failed expedited load of several groups (block
    # ids are refused, a running request's failed receive ignored): kvseal turns
    # them off for a hybrid model, so a tampered block is a failed receive and
    # the request is recomputed, never run on a missing window.
    e = make_engine("swa", sync_load_budget_bytes=64 << 20)
    spans = _spy_offloads(e, daemon, 1)
    p = _prompt(4)
    e.add("a", p)
    e.run()
    assert wait_for(lambda: e.manager._ready_blocks == BLOCKS + 2)
    _flip(daemon, spans[0][0] + 100)
    _reset(e)
    e.add("b", p)
    so = e.scheduler.schedule()
    meta: Any = so.kv_connector_metadata
    assert [j.sync for j in meta.load_jobs.values()] == [False] and not so.num_scheduled_tokens
    e.finish_step(so)
    e.run()
    assert e.worker.stats["expedited_loads"] == 0 and e.worker.stats["failed_loads"] == 1
    assert e.requests["b"].num_computed_tokens == len(p)
    # Recomputed: every group's pages are the request's own, window included.
    m = _group_pages_match(e, "b", p)
    assert m[0] == list(range(BLOCKS)) and set(GROUP1_BLOCKS["swa"]) <= set(m[1])


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("mamba-none", r"group 1: Mamba state in cache mode 'none'.*--mamba-cache-mode align"),
        ("chunked", r"group 1: ChunkedLocalAttentionSpec: chunked local attention is not"),
    ],
    ids=["mamba-none", "chunked"],
)
def test_groups_kvseal_cannot_carry_are_refused_at_start(
    daemon: Daemon, tmp_path: Path, kind: str, reason: str
) -> None:
    # vLLM 0.33's offloading config selects these groups (prefix-cacheable);
    # kvseal's spec refuses the engine's start, naming the group and why,
    # rather than offload state it cannot restore correctly.
    with pytest.raises(ValueError, match=r"kvseal cannot offload KV-cache " + reason):
        Engine(write_model_config(tmp_path / "model"), daemon.target, hybrid=kind)
