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

Budget: the bench gets ``BENCH_BUDGET_S`` (its own bound, for a loaded 2-core
machine), and pytest-timeout fires only after that bound plus the time the
cleanup may take (``STOP_GRACE_S`` + ``SWEEP_S``), so the bench's bound is what
ends a slow run, with its log. Whatever ends the test (the bound, pytest-timeout's
signal, a failed assert), the ``bench_procs`` finalizer stops every process the
bench started: the bench first (SIGTERM: it stops its servers and daemons, each
in a session of its own), then every process whose environment carries this
test's marker (``MARK``), which reaches the API servers, their engine cores and
workers, and the daemons even when the bench itself was SIGKILLed. The two
``test_*_leaves_nothing`` tests prove that: one ends a pytest run with the
signal pytest-timeout sends, the other the bench alone.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MARK = "KVSEAL_SERVING_SMOKE_RUN"  # environment marker every descendant inherits
OUTER = "KVSEAL_SERVING_SMOKE_OUTER"  # the same, for a test around a pytest run of it
# The quick bench on this machine's CPU: 4 servers started one after the other,
# 30 requests per arm. KVSEAL_SERVING_SMOKE_BUDGET raises it for a slower machine.
BENCH_BUDGET_S = int(os.environ.get("KVSEAL_SERVING_SMOKE_BUDGET", "1500"))
STOP_GRACE_S = 90  # the bench stops its servers (30 s each at most, all in parallel)
SWEEP_S = 30  # what is left after that: SIGTERM, then SIGKILL
PYTEST_TIMEOUT_S = BENCH_BUDGET_S + STOP_GRACE_S + SWEEP_S + 60


def marked(token: str, var: str = MARK) -> dict[int, str]:
    """Live processes (not zombies) whose environment carries ``var=token``:
    pid -> command line."""
    want = f"{var}={token}".encode()
    found: dict[int, str] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
            if stat[stat.rindex(b")") + 2 :].startswith(b"Z"):
                continue  # exited, not yet reaped: holds nothing
            with open(f"/proc/{d}/environ", "rb") as f:
                if want not in f.read().split(b"\0"):
                    continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                found[int(d)] = f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except (OSError, ValueError):
            continue  # gone meanwhile, or not ours to read
    return found


def settled(token: str, var: str = MARK, timeout: float = SWEEP_S) -> dict[int, str]:
    """``marked(token, var)`` once it is empty, or after ``timeout`` s (processes
    already signalled take a moment to exit)."""
    deadline = time.monotonic() + timeout
    while (left := marked(token, var)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def sweep(token: str, var: str = MARK, grace: float = SWEEP_S) -> dict[int, str]:
    """Stop every process ``marked(token, var)``: SIGTERM, up to ``grace`` s, then
    SIGKILL. Returns what it found running."""
    found = marked(token, var)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in marked(token, var):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if not settled(token, var, grace):
            break
    return found


class BenchProcs:
    """Processes a test starts with this test's marker in their environment;
    ``close`` (the fixture's finalizer) stops them all."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(8)
        self.procs: list[subprocess.Popen[bytes]] = []

    def env(self) -> dict[str, str]:
        return {**os.environ, MARK: self.token, "VLLM_LOGGING_LEVEL": "WARNING"}

    def start(self, args: list[str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "wb") as f:
            # A session of its own: a signal meant for pytest never reaches it
            # unasked, and its own children are stopped by it or by the sweep.
            p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                 env=self.env(), start_new_session=True)  # fmt: skip
        self.procs.append(p)
        return p

    def close(self) -> dict[int, str]:
        """Stop what is still running; returns what the sweep found left over."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # the bench stops its servers itself
                try:
                    p.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        left = sweep(self.token)
        if left:
            print(f"bench_procs: swept {len(left)} leftover processes: {left}", flush=True)
        else:
            print("bench_procs: swept 0 leftover processes", flush=True)
        return left


@pytest.fixture
def bench_procs() -> Iterator[BenchProcs]:
    """Runs even when pytest-timeout's signal (its default method, asked for
    below) or an assert ends the test."""
    procs = BenchProcs()
    try:
        yield procs
    finally:
        procs.close()


def bench_cmd(work: Path, *more: str) -> list[str]:
    """The quick bench on the smoke's model (bench/serving/model.py: the bench
    model's KV shape, so the same engine and tier blocks and the same paths, with
    a sliver of its compute), every arm's server started at once: every
    assertion here is about what each arm serves, restores and isolates, none
    about the model's cost per token or a start-up's time, which made the smoke
    the suite's slowest test."""
    return [sys.executable, "-m", "bench.serving.run", "--quick", "--small-model",
            "--parallel-start", "--work", str(work), *more]  # fmt: skip


@pytest.mark.timeout(PYTEST_TIMEOUT_S, method="signal")
def test_bench_serving_quick_all_arms(
    tmp_path_factory: pytest.TempPathFactory, bench_procs: BenchProcs
) -> None:
    work = tmp_path_factory.mktemp("serving")
    out = work / "results.json"
    proc = bench_procs.start(bench_cmd(work, "--out", str(out)), work / "run.log")
    try:
        rc = proc.wait(BENCH_BUDGET_S)
    except subprocess.TimeoutExpired:
        rc = None
    log = (work / "run.log").read_text(errors="replace")[-6000:]
    assert rc is not None, f"the quick bench ran past its {BENCH_BUDGET_S} s bound:\n{log}"
    assert rc == 0 and out.exists(), log
    # The bench stopped every server and daemon it started before it exited.
    assert settled(bench_procs.token) == {}, log
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


def wait_for(what: str, cond: Callable[[], bool], timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(1)
    pytest.fail(f"{what} not within {timeout:g} s:\n{log.read_text(errors='replace')[-4000:]}")


def server_up(log: Path) -> bool:
    return "server up in" in log.read_text(errors="replace")


# An inner pytest run of the smoke's own machinery (fixture, start, wait), ended
# by the outer test with pytest-timeout's own signal (SIGALRM: what its default
# method arms) once a server is up; its timeout is long enough never to fire itself.
INNER = """
import pytest
from tests_vllm.test_serving_smoke import bench_cmd, bench_procs  # noqa: F401

@pytest.mark.timeout(3000, method="signal")
def test_inner(tmp_path, bench_procs):
    proc = bench_procs.start(bench_cmd(tmp_path / "w", "--arms", "wt"), tmp_path / "bench.log")
    print("inner: bench started", tmp_path / "bench.log", flush=True)
    proc.wait(3000)
"""


TIMED_OUT_TEST = "test_a_timed_out_smoke_leaves_nothing"
KILLED_TEST = "test_a_killed_bench_leaves_nothing_after_the_sweep"


class InnerRun:
    """The timed-out test's inner pytest run (its own session, this test's
    ``OUTER`` marker in its environment), launched, not yet waited for."""

    def __init__(self, tmp: Path) -> None:
        (tmp / "test_inner.py").write_text(INNER)
        # A short base directory of its own: the daemon's socket path stays under
        # the 108-byte limit, and the inner run prunes nobody's numbered pytest
        # directories.
        self.base = Path(tempfile.mkdtemp(prefix="kvs-smoke-"))
        self.outer = secrets.token_hex(8)
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, OUTER: self.outer, "PYTHONPATH": path}
        self.log = tmp / "inner.log"
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pytest", str(tmp / "test_inner.py"), "-s", "-q",
                 "-p", "no:cacheprovider", "--rootdir", str(tmp), "-c", os.devnull,
                 "--basetemp", str(self.base / "t")],
                stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True,
            )  # fmt: skip

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        sweep(self.outer, OUTER)
        shutil.rmtree(self.base, ignore_errors=True)


class KilledRun:
    """The killed-bench test's bench (``--arms wt``), launched, not yet waited for."""

    def __init__(self, tmp: Path) -> None:
        self.procs = BenchProcs()
        self.log = tmp / "bench.log"
        self.proc = self.procs.start(bench_cmd(tmp / "w", "--arms", "wt"), self.log)

    def close(self) -> None:
        self.procs.close()


class LeaveRuns:
    """The two ``*_leaves_nothing`` tests' runs, launched together at the first
    one's need (each waits through a server's start-up, most of its time, and
    two start-ups at once take far less than two in turn on a 2-core machine);
    only the ones collected. Each test ends its own run; ``close`` (the
    fixture's finalizer) ends whatever a failed test left."""

    def __init__(self, factory: pytest.TempPathFactory, want: list[str]) -> None:
        self.factory, self.want = factory, want
        self.runs: dict[str, InnerRun | KilledRun] = {}

    def get(self, name: str) -> InnerRun | KilledRun:
        for n in dict.fromkeys([*self.want, name]):
            if n not in self.runs:
                tmp = self.factory.mktemp("leave")
                self.runs[n] = InnerRun(tmp) if n == TIMED_OUT_TEST else KilledRun(tmp)
        return self.runs[name]

    def close(self) -> None:
        for r in self.runs.values():
            r.close()


@pytest.fixture(scope="module")
def leave_runs(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[LeaveRuns]:
    names = {getattr(i, "originalname", i.name) for i in request.session.items}
    runs = LeaveRuns(tmp_path_factory, [n for n in (TIMED_OUT_TEST, KILLED_TEST) if n in names])
    try:
        yield runs
    finally:
        runs.close()


@pytest.mark.timeout(900, method="signal")
def test_a_timed_out_smoke_leaves_nothing(leave_runs: LeaveRuns) -> None:
    """A pytest run of the smoke's machinery, ended by pytest-timeout's signal while
    a kvseal arm (a real daemon, a real ``vllm serve`` with its engine core) is up:
    nothing it started is left running once that pytest run has exited. On the old
    test (``subprocess.run``, whose timeout SIGKILLs the bench, and servers in
    sessions of their own) the API server, its engine core and the daemon stayed."""
    run = leave_runs.get(TIMED_OUT_TEST)
    assert isinstance(run, InnerRun)
    inner, log, outer = run.proc, run.log, run.outer
    try:
        wait_for("the inner bench", lambda: "inner: bench started" in log.read_text(), 120, log)
        bench_log = Path(log.read_text().split("inner: bench started ", 1)[1].split("\n", 1)[0])
        wait_for("a kvseal arm's server", lambda: server_up(bench_log), 600, bench_log)
        seen = marked(outer, OUTER)
        assert any("vllm.entrypoints" in c for c in seen.values()), seen
        assert any("kvseal.server" in c for c in seen.values()), seen
        inner.send_signal(signal.SIGALRM)  # pytest-timeout's signal method fires
        rc = inner.wait(STOP_GRACE_S + SWEEP_S + 60)
        text = log.read_text(errors="replace")
        assert rc == 1 and "Timeout" in text, text[-4000:]
        left = settled(outer, OUTER)
        assert left == {}, (left, text[-4000:])
        # The bench stopped its own servers on SIGTERM: the sweep found nothing.
        assert "bench_procs: swept 0 leftover processes" in text, text[-4000:]
    finally:
        run.close()


@pytest.mark.timeout(900, method="signal")
def test_a_killed_bench_leaves_nothing_after_the_sweep(leave_runs: LeaveRuns) -> None:
    """The bench SIGKILLed while a kvseal arm is up (what the fixture does to a
    bench that did not stop within its grace): it can do nothing, its server (a
    session of its own, engine core included) and daemon stay, and the marker
    sweep stops every one of them."""
    run = leave_runs.get(KILLED_TEST)
    assert isinstance(run, KilledRun)
    procs, proc, log = run.procs, run.proc, run.log
    try:
        wait_for("a kvseal arm's server", lambda: server_up(log), 600, log)
        proc.send_signal(signal.SIGKILL)
        proc.wait(STOP_GRACE_S)
        left = sweep(procs.token)
        assert any("vllm.entrypoints" in c for c in left.values()), left
        assert any("kvseal.server" in c for c in left.values()), left
        assert marked(procs.token) == {}
    finally:
        procs.close()
