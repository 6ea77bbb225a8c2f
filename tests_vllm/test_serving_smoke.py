"""Smoke of ``make bench-serving ARGS=--quick`` (bench/serving/run.py): a real
``vllm serve`` per arm (no offload, plaintext anchor, kvseal write-through,
kvseal write-back, each kvseal arm with a real daemon) driven over HTTP.

Asserts only what must hold whatever the machine's speed: every arm served
every request of every point, no block failed verification, and the greedy
answer to a fixed probe prompt is the same in every arm, before and after the
workloads (restored blocks produce the tokens recomputed ones would). The
salted conversation point (one ``cache_salt`` per conversation, every
conversation starting with the same shared prompt) must have sent one salt
per conversation and, in every arm, no tenant's first request may report a
cached token: another tenant's blocks, from the engine or from a tier that
ignored the salt. No timing is asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_bench_serving_quick_all_arms(tmp_path_factory: pytest.TempPathFactory) -> None:
    work = tmp_path_factory.mktemp("serving")
    out = work / "results.json"
    with open(work / "run.log", "wb") as f:
        rc = subprocess.run(
            [sys.executable, "-m", "bench.serving.run", "--quick", "--work", str(work),
             "--out", str(out)],
            stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, timeout=1500,
            env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
        ).returncode  # fmt: skip
    log = (work / "run.log").read_text(errors="replace")[-6000:]
    assert rc == 0 and out.exists(), log
    res = json.loads(out.read_text())
    assert list(res["arms"]) == ["none", "plain", "wt", "wb"], log
    probes = set()
    for name, arm in res["arms"].items():
        assert {p["workload"] for p in arm["points"]} == {"llmd", "conv", "conv-salted", "fits"}, (
            name
        )
        for p in arm["points"]:
            assert p["requests"] > 0 and p["failed"] == 0, (name, p)
            assert p["integrity_failures"] == 0, (name, p)
        salted = [p for p in arm["points"] if p["workload"] == "conv-salted"]
        for p in salted:
            convs = res["plan"]["conv-salted"]["convs"]
            assert p["tenants"] == p["x"] == convs, (name, p)  # one salt per conversation
            # Tenants that started after another tenant had cached the shared
            # prompt: the check is not vacuous.
            assert p["first_turns_checked"] > 2, (name, p)
            assert p["cross_tenant_cached"] == 0, (name, p)
            if name == "plain":
                # The six first turns outgrow the engine's cache, so returning
                # turns need the tier: the point exercises it (the anchor's,
                # which does not depend on kvseal's tenant handling).
                assert p["cached_tier"] > 0, p
        if name in ("wt", "wb"):  # kvseal's family in the API server's /metrics
            assert arm["kvseal_metrics"], name
            assert all(isinstance(p["load_failed_blocks"], int) for p in arm["points"]), name
        assert arm["probe"], name
        assert arm["probe_after"] == arm["probe"], name
        probes.add(arm["probe"])
    assert len(probes) == 1, res["arms"]
