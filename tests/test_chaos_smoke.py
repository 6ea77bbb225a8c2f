"""A short run of the chaos suite (``make chaos`` runs the long one), and proof
that its checks can fail: the engine's page model reports a late write, the
table reports a failed or never-exercised check."""

from __future__ import annotations

import io
import os
from pathlib import Path

from kvseal.client.shm import SHM_DIR, KVShape, SharedKVPool

from tests.suites import chaos, chaos_engine


def test_ten_kills_leave_everything_intact(tmp_path: Path) -> None:
    out = io.StringIO()
    cfg = chaos.Config(kills=10, seed=12, engines=2, checkpoint_every=5, workdir=tmp_path)
    run = chaos.ChaosRun(cfg, out)
    rc = run.run()
    text = out.getvalue()
    assert rc == 0, text
    assert text.rstrip().splitlines()[-1] == f"{len(run.checks) + 1} passed, 0 failed", text
    # The run did what it claims: kills of both kinds, verified restores.
    assert run.counts["engine SIGKILL"] >= 1 and run.c_release.passed >= 1, text
    assert run.c_restart.passed >= 2 and run.c_clean.passed >= 2, text
    assert run.c_bytes.passed >= 1 and run.c_deadline.passed >= 1, text
    assert not [p for p in os.listdir(SHM_DIR) if p.startswith(run.shm_prefix)]


def test_report_counts_failed_and_unexercised_checks() -> None:
    out = io.StringIO()
    run = chaos.ChaosRun(chaos.Config(kills=1), out)
    try:
        run.c_bytes.record(False, "page 3: wrong bytes")
        run.c_deadline.record(True)
        rc = run.report(kills=1, reached=True, wall=1.0)
    finally:
        run._teardown()
    lines = out.getvalue().splitlines()
    assert rc == 1
    # Passed: the kill count, the deadline row and the optional graceful-stop row;
    # every other required row failed or ran nothing.
    assert lines[-1] == f"3 passed, {len(run.checks) - 2} failed"
    assert any("page 3: wrong bytes" in line for line in lines)


class _FakeEngine:
    """What a Worker needs of its engine, without a daemon."""

    def __init__(self, pool: SharedKVPool, log: chaos_engine.Log) -> None:
        self.pool = pool
        self.log = log


def test_page_model_reports_a_write_after_a_failed_call(tmp_path: Path) -> None:
    shape = KVShape(num_pages=4, dtype="bfloat16", **chaos_engine.SHAPE)
    pool = SharedKVPool(shape, "vllm_per_layer", name_prefix="kvseal-test")
    log_path = tmp_path / "engine.log"
    try:
        eng = _FakeEngine(pool, chaos_engine.Log(str(log_path)))
        w = chaos_engine.Worker(eng, 0, 0, 4, seed=1)  # type: ignore[arg-type]
        w._give_back([1, 2])
        h = chaos_engine.universe_hash(7)
        # A daemon writing page 2 after the call returned:
        pool.write_block(2, chaos_engine.content(h, shape.block_bytes))
        w.sweep("test")
    finally:
        pool.close()
    lines = log_path.read_text().splitlines()
    late = [line for line in lines if line.startswith("V late_write")]
    assert len(late) == 1 and "page=2" in late[0], lines
    assert "K 1" in lines  # page 1 was checked untouched
