"""bench/pd.py's engine-free parts: its options and its summary (no engine
starts here; ``make bench-pd`` runs the servers)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import pd


def test_default_lengths_reach_8k_within_the_context() -> None:
    args = pd.parse_args([])
    assert args.lengths == [512, 1024, 2048, 4096, 8192]
    assert args.reps == 2
    assert max(args.lengths) < pd.MAX_LEN  # the prompt and its answer's token fit


def test_a_length_beyond_the_context_is_refused() -> None:
    with pytest.raises(SystemExit):
        pd.parse_args(["--lengths", f"512,{pd.MAX_LEN}"])


def test_summary_is_medians_in_ms_and_the_ratio() -> None:
    s = pd.summarize({"handoff": [0.5, 0.7, 9.0], "recompute": [3.0, 3.2, 3.4],
                      "one_engine": [3.1]})  # fmt: skip
    assert s["handoff"] == 700.0 and s["recompute"] == 3200.0 and s["one_engine"] == 3100.0
    assert s["recompute_over_handoff"] == round(3200.0 / 700.0, 2)
    assert s["samples_ms"]["handoff"] == [500.0, 700.0, 9000.0]
