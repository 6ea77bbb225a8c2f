"""Static checks are part of the suite: ruff (lint + format) and mypy --strict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


# What ruff checks and formats (make lint names the same directories).
LINTED = ("client", "server", "tests", "tests_sglang", "tests_vllm", "bench", "scripts")


@pytest.mark.parametrize(
    "cmd",
    [["ruff", "check", *LINTED], ["ruff", "format", "--check", *LINTED], ["mypy"]],
    ids=["ruff-check", "ruff-format", "mypy"],
)
def test_static_checks(cmd: list[str]) -> None:
    r = subprocess.run(
        [str(BIN / cmd[0]), *cmd[1:]], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout + r.stderr
