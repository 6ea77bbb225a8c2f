"""Fixtures for the vLLM suite (``make test-vllm``; its own venv, .venv-vllm).

The engine runs are session fixtures: each starts a real vLLM engine (its
engine core and worker in the driver process: tests_vllm/engine_process.py)
in a driver process (tests_vllm/driver.py) and the tests
read what happened from its JSON. The baseline run has no connector; the
kvseal run has the one-line kv-transfer config and a real daemon; the anchor
run has vLLM's own CPU offloading with plain copies (the reference for tokens
where vLLM's offload path itself changes a near-tie token on this CPU).

The runs the session's tests need (read from their fixture names, so a test
run alone starts only its own) start together when the first is asked for:
each engine computes on one thread, so three at once keep both cores busy
where three in turn would leave one idle. (test_vllm_e2e.py's TP=2 run stays
apart, after them: its two ranks meet at every step, and beside three engines
it took twice as long as alone.) Each has ``DRIVER_TIMEOUT_S`` from its start;
a run that fails (or outlives it) fails the tests that need it, with its log.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
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


# A driver's bound from its start, for three engines at once on a loaded 2-core
# machine (alone: about 3 minutes); pytest-timeout (mk/vllm.mk) is longer, so a
# slow run ends here, with the driver's log, not with a bare timeout.
DRIVER_TIMEOUT_S = 900
# fixture -> driver.py --mode
E2E_RUNS = {"baseline": "baseline", "anchor": "anchor", "with_kvseal": "kvseal"}


class Drivers:
    """The session's driver runs (driver.py), started together; owns their
    processes: ``close`` kills what is still running (each driver is a session
    of its own, so its engine core and worker go with it)."""

    def __init__(self, model: Path, factory: pytest.TempPathFactory, modes: list[str]) -> None:
        self.model, self.factory, self.modes = model, factory, modes
        self.procs: dict[str, tuple[subprocess.Popen[bytes], Path, float]] = {}
        self.results: dict[str, dict[str, Any]] = {}

    def _start(self, mode: str) -> None:
        workdir = self.factory.mktemp(mode)
        args = [
            sys.executable, str(HERE / "driver.py"), "--mode", mode, "--model", str(self.model),
            "--workdir", str(workdir), "--out", str(workdir / "result.json"),
            "--zmq-port", str(free_port()),
        ]  # fmt: skip
        # PASSIVE: OMP threads that spin while they wait would take the cores from
        # the other engines (and their daemons); the tokens do not depend on it.
        env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "OMP_WAIT_POLICY": "PASSIVE"}
        with open(workdir / "driver.log", "wb") as log:
            p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
                                 env=env, start_new_session=True)  # fmt: skip
        self.procs[mode] = (p, workdir, time.monotonic())

    def result(self, mode: str) -> dict[str, Any]:
        """``mode``'s JSON, once its driver has exited; the first call starts every
        run of ``modes`` (and ``mode``) not started yet."""
        if mode in self.results:
            return self.results[mode]
        for m in dict.fromkeys([*self.modes, mode]):
            if m not in self.procs:
                self._start(m)
        p, workdir, t0 = self.procs[mode]
        try:
            rc: int | None = p.wait(max(1.0, t0 + DRIVER_TIMEOUT_S - time.monotonic()))
        except subprocess.TimeoutExpired:
            rc = None
            self._kill(p)
        out, log = workdir / "result.json", workdir / "driver.log"
        if rc != 0 or not out.exists():
            tail = log.read_text(errors="replace")[-6000:]
            why = f"past its {DRIVER_TIMEOUT_S} s bound" if rc is None else f"exit {rc}"
            raise RuntimeError(f"{mode} driver failed ({why}):\n{tail}")
        r: dict[str, Any] = json.loads(out.read_text())
        self.results[mode] = r
        return r

    @staticmethod
    def _kill(p: subprocess.Popen[bytes]) -> None:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def close(self) -> None:
        for p, _, _ in self.procs.values():
            self._kill(p)


@pytest.fixture(scope="session")
def drivers(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Drivers]:
    names: set[str] = set()
    for item in request.session.items:
        names.update(getattr(item, "fixturenames", ()))
    d = Drivers(tiny_model, tmp_path_factory, [m for f, m in E2E_RUNS.items() if f in names])
    try:
        yield d
    finally:
        d.close()


@pytest.fixture(scope="session")
def baseline(drivers: Drivers) -> dict[str, Any]:
    _RESULTS["baseline"] = r = drivers.result("baseline")
    return r


@pytest.fixture(scope="session")
def anchor(drivers: Drivers) -> dict[str, Any]:
    """vLLM's own CPU offloading (plain copies, no kvseal) on the same workload:
    what vLLM's offload path itself gives (driver.py, ``--mode anchor``)."""
    _RESULTS["anchor"] = r = drivers.result("anchor")
    return r


@pytest.fixture(scope="session")
def with_kvseal(drivers: Drivers) -> dict[str, Any]:
    _RESULTS["kvseal"] = r = drivers.result("kvseal")
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
