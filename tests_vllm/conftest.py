"""Fixtures for the vLLM suite (``make test-vllm``; its own venv, .venv-vllm).

The engine runs are session fixtures: each starts a real vLLM engine
(~45 s on 2 cores) in a driver process (tests_vllm/driver.py) and the tests
read what happened from its JSON. The baseline run has no connector; the
kvseal run has the one-line kv-transfer config and a real daemon; the anchor
run has vLLM's own CPU offloading with plain copies (the reference for tokens
where vLLM's offload path itself changes a near-tie token on this CPU).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
_RESULTS: dict[str, dict[str, Any]] = {}  # the engine runs, for the summary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests_vllm.tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


def _drive(mode: str, model: Path, workdir: Path) -> dict[str, Any]:
    out = workdir / "result.json"
    log = workdir / "driver.log"
    args = [
        sys.executable, str(HERE / "driver.py"), "--mode", mode, "--model", str(model),
        "--workdir", str(workdir), "--out", str(out), "--zmq-port", str(free_port()),
    ]  # fmt: skip
    with open(log, "wb") as f:
        rc = subprocess.run(
            args, stdout=f, stderr=subprocess.STDOUT, cwd=workdir, timeout=900,
            env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
        ).returncode  # fmt: skip
    if rc != 0 or not out.exists():
        tail = log.read_text(errors="replace")[-6000:]
        raise RuntimeError(f"{mode} driver failed (exit {rc}):\n{tail}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


@pytest.fixture(scope="session")
def baseline(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    _RESULTS["baseline"] = r = _drive("baseline", tiny_model, tmp_path_factory.mktemp("baseline"))
    return r


@pytest.fixture(scope="session")
def anchor(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """vLLM's own CPU offloading (plain copies, no kvseal) on the same workload:
    what vLLM's offload path itself gives (driver.py, ``--mode anchor``)."""
    _RESULTS["anchor"] = r = _drive("anchor", tiny_model, tmp_path_factory.mktemp("anchor"))
    return r


@pytest.fixture(scope="session")
def with_kvseal(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    _RESULTS["kvseal"] = r = _drive("kvseal", tiny_model, tmp_path_factory.mktemp("kvseal"))
    return r


def _summary(k: dict[str, Any], b: dict[str, Any]) -> list[str]:
    lines = []
    for n in ("main", "tamper", "kill"):
        pk, pb = k["phases"][n], b["phases"][n]
        ck = sum(r["cached"] for t in pk["turns"] for r in t)
        cb = sum(r["cached"] for t in pb["turns"] for r in t)
        tot = sum(r["prompt_len"] for t in pk["turns"] for r in t)
        st = pk["stats"]
        if n == "kill":  # two daemons: the killed one's figures, then its successor's
            st = {
                f: pk["before_kill"].get(f, 0)
                - k["phases"]["tamper"]["stats_by_turn"][-1].get(f, 0)
                + pk["after"].get(f, 0)
                for f in ("restored_blocks", "offloaded_blocks", "integrity_failures", "lookups")
            }
        lines.append(
            f"{n:7s} prompt tokens {tot}, cached by the engine: {ck} with kvseal, {cb} without;"
            f" kvseal restored {st.get('restored_blocks')} blocks, offloaded"
            f" {st.get('offloaded_blocks')}, integrity failures {st.get('integrity_failures')},"
            f" Lookup RPCs {st.get('lookups')}"
        )
    lines.append(f"KV events received: {k.get('events', {}).get('counts')}")
    lines.append(
        f"engine start {k['engine_start_s']} s (kvseal) / {b['engine_start_s']} s (baseline);"
        f" whole driver {k['total_s']} s / {b['total_s']} s"
    )
    return lines


def pytest_terminal_summary(terminalreporter: Any) -> None:
    k, b = _RESULTS.get("kvseal"), _RESULTS.get("baseline")
    if k is None or b is None:
        return
    terminalreporter.section(f"kvseal x vLLM figures (this machine: {os.cpu_count()} CPUs, no GPU)")
    for line in _summary(k, b):
        terminalreporter.write_line(line)
