"""Chaos suite: kill -9 the daemon and engine processes at random points of their
transfers, restart them, and check what must survive any crash.

``make chaos`` (or ``python -m tests.suites.chaos``) runs a real daemon
(``tests.conftest.start_daemon``: CPU backend, real Unix socket, sometimes a
``--host-region`` file, always the same socket path so every restart meets the
previous daemon's ``<socket>.lock`` and single-instance lock) and several real
engine processes (``chaos_engine.py``: ``EnginePool`` and ``KVSealClient`` over a
``SharedKVPool``, with their own byte-exact model of every page). This module is
the orchestrator: it SIGKILLs the daemon or an engine (aimed, most of the time,
into a large transfer), restarts it, and now and then restarts the daemon
gracefully, until ``CHAOS_KILLS`` kills (default 200) or ``CHAOS_TIME_S``.

Checks (one table row each; a row fails on any failed instance, and a required
row also fails when it was never exercised):

- every engine call returned within its deadline (``timeout + transfer_grace_s``,
  or the lookup timeout) plus ``CHAOS_SLACK_S`` (a generous bound for a loaded
  machine, not a latency claim; the maximum overshoot is reported);
- no successful restore ever gave wrong bytes; no page was written after its
  call failed (engine contract);
- every restart on the same socket succeeded (no stale socket or lock blocks
  it); a restarted daemon starts clean (new instance, first key epoch, empty
  cache: the previous daemon's probe block is gone; with engines paused, every
  counter is zero);
- a SIGKILLed daemon leaves no process behind; a graceful stop exits 0;
- after an engine is SIGKILLed the daemon drops every fd and mapping of that
  engine's shared memory (HoldPool); the orchestrator then unlinks the dead
  engine's objects, which the engine itself cannot do;
- engines never hang (they pause when asked, keep logging while alive, exit
  cleanly on SIGTERM and unlink their own pools then);
- the daemon's fd count is flat at quiet points (no engine alive);
- at the end: no shared-memory object of this run is left, no daemon process.

Prints the table and a last line ``N passed, M failed`` (rows); exits 1 on any
failure.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from kvseal.client import tenant_digest
from kvseal.client.shm import KVShape, SharedKVPool

from tests.conftest import SMALL, DaemonProc, start_daemon

ENGINE_SCRIPT = Path(__file__).with_name("chaos_engine.py")
PROBE_FP = b"model:chaos-probe"
PROBE_TENANT = tenant_digest("chaos-probe")
SHM_DIR = Path("/dev/shm")  # POSIX shm objects live here on Linux


@dataclass
class Check:
    name: str
    required: bool = True
    passed: int = 0
    failed: int = 0
    notes: list[str] = field(default_factory=list)

    def record(self, ok: bool, note: str = "") -> bool:
        if ok:
            self.passed += 1
        else:
            self.failed += 1
            if note and len(self.notes) < 5:
                self.notes.append(note)
        return ok

    @property
    def ok(self) -> bool:
        return self.failed == 0 and (self.passed > 0 or not self.required)


@dataclass
class Config:
    kills: int = 200
    seed: int = 0
    time_s: float = 1800.0
    engines: int = 3
    slack_s: float = 5.0
    checkpoint_every: int = 40
    transfer_timeout_s: float = 2.0
    grace_s: float = 0.3
    host_bytes: str = "32MiB"  # < the engines' 48 MiB universe of blocks: stores evict
    workdir: Path | None = None
    verbose: bool = False


class EngineProc:
    """One engine incarnation in a slot; its log is parsed as it grows."""

    def __init__(self, run: ChaosRun, slot: int, gen: int) -> None:
        self.run = run
        self.slot = slot
        base = run.workdir / f"engine{slot}.{gen}"
        self.log_path = Path(f"{base}.log")
        self.state_path = Path(f"{base}.state")
        self.err_path = Path(f"{base}.err")
        self.shm: list[str] = []
        self.pauses = 0
        self.exit_line: int | None = None
        self.ready = False  # its "R" line: start-up is over, the workers run
        self.stalls: list[str] = []  # its "W" lines: a pause not acknowledged in time
        self.started = self.last_line = time.monotonic()
        self._offset = 0
        self._partial = b""
        cfg = run.cfg
        with open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    str(ENGINE_SCRIPT),
                    "--target",
                    run.target,
                    "--log",
                    str(self.log_path),
                    "--pause-file",
                    str(run.pause_file),
                    "--state-file",
                    str(self.state_path),
                    "--name",
                    f"chaos-engine-{slot}",
                    "--shm-prefix",
                    run.shm_prefix,
                    "--seed",
                    str(run.rng.randrange(1 << 30)),
                    "--transfer-timeout",
                    str(cfg.transfer_timeout_s),
                    "--grace",
                    str(cfg.grace_s),
                ],
                stdout=err,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def poll(self) -> None:
        """Read the lines the engine appended since the last poll."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        if not data:
            return
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        self.last_line = time.monotonic()
        for raw in lines:
            self.run.engine_line(self, raw.decode(errors="replace").split())

    def in_big_transfer(self) -> bool:
        try:
            fd = os.open(self.state_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            return any(os.pread(fd, 64, 0))
        finally:
            os.close(fd)

    def alive(self) -> bool:
        return self.proc.poll() is None


def _fd_links(pid: int) -> list[str]:
    out = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


def _holds_any(pid: int, names: list[str]) -> list[str]:
    """Which of the shm objects ``names`` the process has open or mapped."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        maps = ""
    text = maps + "\n" + "\n".join(_fd_links(pid))
    return [n for n in names if f"/dev/shm/{n}" in text]


def _until(cond: Callable[[], bool], timeout: float, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if cond():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(step)


class ChaosRun:
    def __init__(self, cfg: Config, out: TextIO) -> None:
        self.cfg = cfg
        self.out = out
        self.rng = random.Random(cfg.seed)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if cfg.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvseal-chaos-")
            self.workdir = Path(self._tmp.name)
        else:
            self.workdir = cfg.workdir
            self.workdir.mkdir(parents=True, exist_ok=True)
        self.daemon_dir = self.workdir / "daemon"
        self.pause_file = self.workdir / "pause"
        self.shm_prefix = f"kvseal-chaos-{os.getpid()}"
        self.target = "unix://" + str(self.daemon_dir / "run" / "kvseal.sock")
        self.daemon: DaemonProc | None = None
        self.engines: dict[int, EngineProc] = {}
        self.pauses = 0
        self.engine_gens = [0] * cfg.engines
        self.probe_pool: SharedKVPool | None = None
        self.probe_hash: bytes | None = None
        self.instances: set[str] = set()
        self.daemon_pids: list[int] = []
        self.fd_samples: list[tuple[int, int]] = []  # (daemon pid, fds) at quiet points
        self.counts = {
            "daemon SIGKILL": 0,
            "daemon SIGTERM restart": 0,
            "engine SIGKILL": 0,
            "kills aimed into a transfer": 0,
            "daemon starts with --host-region": 0,
            "engine calls": 0,
            "engine calls failed": 0,
            "restored blocks verified": 0,
        }
        self.max_over_ms = float("-inf")
        c = [
            Check("engine calls within deadline + slack"),
            Check("restored bytes exact (no wrong bytes)"),
            Check("no page written after its call failed"),
            Check("restart on the same socket succeeds"),
            Check("restarted daemon starts clean"),
            Check("killed daemon leaves no process"),
            Check("graceful daemon stop exits 0", required=False),
            Check("daemon drops a killed engine's shm fds/maps"),
            Check("engines never hang (pause acks, liveness)"),
            Check("engines exit cleanly on SIGTERM, unlink own pool"),
            Check("engines never crash or raise"),
            Check("daemon fd count flat at quiet points"),
            Check("no leaked shm objects, no daemon left at end"),
        ]
        self.checks = {x.name: x for x in c}
        (
            self.c_deadline,
            self.c_bytes,
            self.c_late,
            self.c_restart,
            self.c_clean,
            self.c_noproc,
            self.c_graceful,
            self.c_release,
            self.c_hang,
            self.c_exit,
            self.c_crash,
            self.c_fds,
            self.c_end,
        ) = c

    # ------------------------------------------------------------- engines

    def engine_line(self, e: EngineProc, parts: list[str]) -> None:
        if not parts:
            return
        tag = parts[0]
        if tag == "C" and len(parts) == 8:
            _, op, via, _n, ok, code, elapsed, bound = parts
            self.counts["engine calls"] += 1
            if ok != "1":
                self.counts["engine calls failed"] += 1
            over = float(elapsed) - float(bound)
            self.max_over_ms = max(self.max_over_ms, over)
            self.c_deadline.record(
                over <= self.cfg.slack_s * 1000,
                f"{op} via {via} ({code}) took {elapsed} ms, bound {bound} ms",
            )
        elif tag == "B":
            good, bad = int(parts[1]), int(parts[2])
            self.counts["restored blocks verified"] += good + bad
            self.c_bytes.passed += good
            for _ in range(bad):
                self.c_bytes.record(False, "a restore reported success with wrong bytes")
        elif tag == "K":
            self.c_late.passed += int(parts[1])
        elif tag == "V":
            kind = parts[1]
            note = f"engine {e.slot}: {' '.join(parts[1:])}"
            if kind == "late_write":
                self.c_late.record(False, note)
            elif kind == "wrong_bytes":
                pass  # counted by its "B" line
            elif kind == "engine_hang":
                self.c_hang.record(False, note)
            else:
                self.c_crash.record(False, note)
        elif tag == "S":
            e.shm = parts[1:]
        elif tag == "P":
            e.pauses = int(parts[1])
        elif tag == "X":
            e.exit_line = int(parts[1])
        elif tag == "R":
            e.ready = True
        elif tag == "W":
            e.stalls.append(" ".join(parts[1:]))

    def start_engine(self, slot: int) -> None:
        self.engine_gens[slot] += 1
        self.engines[slot] = EngineProc(self, slot, self.engine_gens[slot])

    def poll_engines(self) -> None:
        """Parse new log lines; an engine that died on its own, or went silent
        for far longer than any call may take, is a failure."""
        silent_limit = self.cfg.transfer_timeout_s + self.cfg.grace_s + self.cfg.slack_s + 20
        for slot, e in list(self.engines.items()):
            e.poll()
            if not e.alive():
                e.poll()
                tail = e.err_path.read_text(errors="replace")[-400:]
                self.c_crash.record(False, f"engine {slot} exited {e.proc.returncode}: {tail}")
                self._cleanup_shm(e)
                self.start_engine(slot)
            elif not self.pause_file.exists() and time.monotonic() - e.last_line > silent_limit:
                self.c_hang.record(False, f"engine {slot} silent for {silent_limit:.0f} s")
                e.last_line = time.monotonic()

    def _cleanup_shm(self, e: EngineProc) -> None:
        """The orchestrator's job: a SIGKILLed engine cannot unlink its pool."""
        for n in e.shm:
            (SHM_DIR / n).unlink(missing_ok=True)

    def kill_engine(self, slot: int, aim: bool) -> None:
        e = self.engines[slot]
        self._aim([e] if aim else [])
        e.poll()
        if not e.alive():
            self.poll_engines()
            return
        silent_limit = self.cfg.transfer_timeout_s + self.cfg.grace_s + self.cfg.slack_s + 20
        self.c_hang.record(
            time.monotonic() - e.last_line <= silent_limit,
            f"engine {slot} was silent for {time.monotonic() - e.last_line:.0f} s when killed",
        )
        e.proc.send_signal(signal.SIGKILL)
        e.proc.wait()
        self.counts["engine SIGKILL"] += 1
        self.c_crash.record(True)  # it ran until it was killed
        e.poll()
        d = self.daemon
        if d is not None and d.proc.poll() is None and e.shm:
            released = _until(lambda: not _holds_any(d.proc.pid, e.shm), 20.0)
            self.c_release.record(
                released,
                f"daemon pid {d.proc.pid} still holds {_holds_any(d.proc.pid, e.shm)} "
                "20 s after their engine was killed",
            )
        self._cleanup_shm(e)
        del self.engines[slot]

    def _aim(self, candidates: list[EngineProc]) -> None:
        """Wait for a large transfer of one of ``candidates`` to be under way, then
        a random moment into it; without candidates (or none in time), a random
        delay."""
        if candidates:
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                if any(e.in_big_transfer() for e in candidates):
                    self.counts["kills aimed into a transfer"] += 1
                    time.sleep(self.rng.uniform(0, 0.03))
                    return
                time.sleep(0.002)
        time.sleep(self.rng.uniform(0, 0.3))

    # ------------------------------------------------------------- daemon

    def start_daemon(self, paused: bool) -> None:
        region = self.rng.random() < 0.4
        self.counts["daemon starts with --host-region"] += int(region)
        d = None
        err = ""
        for _ in range(2):  # a retry is recorded as a failure, then the run goes on
            try:
                d = start_daemon(
                    self.daemon_dir,
                    "--workers",
                    "2",
                    region=region,
                    host_bytes=self.cfg.host_bytes,
                )
                break
            except RuntimeError as e:
                err = str(e)[-600:]
                self.c_restart.record(False, err)
        if d is None:
            raise RuntimeError(f"the daemon does not start on its socket any more: {err}")
        self.c_restart.record(True)
        self.daemon = d
        self.daemon_pids.append(d.proc.pid)
        self._check_clean(d, paused)

    def _check_clean(self, d: DaemonProc, paused: bool) -> None:
        problems = []
        with d.client(timeout_s=5.0) as c:
            s = c.stats()
            if s.server_instance in self.instances:
                problems.append(f"instance {s.server_instance} seen before")
            self.instances.add(s.server_instance)
            if paused:  # no engine call can have reached it yet: all of it must be empty
                # Key epochs are numbered across scopes (one per pool namespace and
                # tenant), so only a daemon that has sealed nothing is at epoch 0;
                # unpaused engines may have stored blocks already.
                if s.key_epoch != 0:
                    problems.append(f"key epoch {s.key_epoch}")
                busy = {
                    k: getattr(s, k)
                    for k in (
                        "host_bytes_used",
                        "blocks_ready",
                        "blocks_pending",
                        "blocks_pinned",
                        "lookups",
                        "offloaded_blocks",
                        "restored_blocks",
                        "evicted_blocks",
                        "dropped_blocks",
                        "integrity_failures",
                        "seals_under_current_key",
                    )
                    if getattr(s, k)
                }
                if busy:
                    problems.append(f"not empty: {busy}")
            # The previous daemon's probe block must be gone (new key, empty cache).
            assert self.probe_pool is not None
            pid = c.register_pool("chaos-probe", PROBE_FP, self.probe_pool.geometry()).pool_id
            if self.probe_hash is not None:
                hit = c.lookup(pid, PROBE_TENANT, [self.probe_hash]).hit_blocks
                if hit:
                    problems.append("the previous daemon's probe block is still cached")
            self.probe_hash = os.urandom(32)
            self.probe_pool.write_block(0, os.urandom(self.probe_pool.shape.block_bytes))
            c.offload(pid, PROBE_TENANT, [self.probe_hash], [0], timeout=10.0)
        self.c_clean.record(not problems, "; ".join(problems))

    def _no_daemon_process(self, pid: int) -> bool:
        """Nothing is left of a stopped daemon: its process group is empty."""
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        return False

    def restart_daemon(self, graceful: bool, aim: bool) -> None:
        d = self.daemon
        assert d is not None
        self._aim(list(self.engines.values()) if aim else [])
        if graceful:
            d.proc.send_signal(signal.SIGTERM)
            try:
                rc = d.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                d.proc.kill()
                rc = d.proc.wait()
            self.counts["daemon SIGTERM restart"] += 1
            self.c_graceful.record(rc == 0, f"daemon exited {rc} after SIGTERM")
        else:
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait()
            self.counts["daemon SIGKILL"] += 1
        self.c_noproc.record(
            _until(lambda: self._no_daemon_process(d.proc.pid), 10.0),
            f"processes of daemon group {d.proc.pid} outlived it",
        )
        self.daemon = None
        paused = self.rng.random() < 0.5
        if paused:
            self._pause()
        try:
            self.start_daemon(paused)
        finally:
            if paused:
                self.pause_file.unlink(missing_ok=True)

    def _pause(self) -> None:
        """Ask every engine to idle (it finishes its call, sweeps its pages, acks)."""
        before = {slot: e.pauses for slot, e in self.engines.items()}
        # Each pause has its own content (written whole: a rename), so an engine that
        # slept through the unpause before this one still tells them apart.
        self.pauses += 1
        tmp = self.pause_file.with_suffix(".tmp")
        tmp.write_text(str(self.pauses))
        os.replace(tmp, self.pause_file)
        bound = self.cfg.transfer_timeout_s + self.cfg.grace_s + self.cfg.slack_s + 10

        def acked() -> bool:
            self.poll_engines()
            return all(
                e.pauses > before.get(slot, -1) or slot not in before
                for slot, e in self.engines.items()
            )

        _until(acked, bound)
        for slot, e in self.engines.items():
            if slot in before:
                self.c_hang.record(e.pauses > before[slot], self._stall_note(e, bound))

    def _stall_note(self, e: EngineProc, bound: float) -> str:
        """Why an engine did not ack a pause: its age, whether it had finished
        starting, and the stacks it dumped (its ``W`` line; chaos_engine.py)."""
        e.poll()
        age = time.monotonic() - e.started
        note = (
            f"engine {e.slot} did not pause within {bound:.0f} s "
            f"(started {age:.1f} s ago, {'running' if e.ready else 'still starting'}"
        )
        if e.stalls:
            note += f"; stalled workers (W) {e.stalls[-1]}"
        dump = e.err_path.read_text(errors="replace")
        at = dump.rfind("--- pause not acknowledged")
        return note + (f"); stacks:\n{dump[at:][-3000:]}" if at >= 0 else ")")

    # ------------------------------------------------------------- quiet points

    def checkpoint(self, final: bool) -> None:
        """No engine alive (SIGKILLed, or SIGTERMed at the end): the daemon must
        hold nothing of theirs and be back at its fd count."""
        if final:  # SIGTERM only engines that are up (their handler is installed)

            def up() -> bool:
                for e in self.engines.values():
                    e.poll()
                return all(e.shm for e in self.engines.values())

            _until(up, 60.0)
        for slot in list(self.engines):
            e = self.engines[slot]
            if final:
                e.proc.send_signal(signal.SIGTERM)
                try:
                    rc = e.proc.wait(timeout=90)
                except subprocess.TimeoutExpired:
                    e.proc.kill()
                    rc = e.proc.wait()
                e.poll()
                left = [n for n in e.shm if (SHM_DIR / n).exists()]
                self.c_exit.record(
                    rc == 0 and e.exit_line == 0 and not left,
                    f"engine {slot}: exit {rc}, X line {e.exit_line}, left {left}",
                )
                self._cleanup_shm(e)
                del self.engines[slot]
            else:
                self.kill_engine(slot, aim=False)
        d = self.daemon
        assert d is not None
        with d.client(timeout_s=5.0) as c:
            quiet = _until(lambda: c.stats().pools == 1 and c.stats().pool_holds == 0, 20.0)
            s = c.stats()
        base = self.fd_samples[0][1] if self.fd_samples else None
        same = [f for p, f in self.fd_samples if p == d.proc.pid]

        def flat_now() -> bool:
            # Across restarts the count may differ by the region's fds (memfd or a
            # file); within one daemon's life it must not grow at all. A killed
            # engine's relayed connection (3 fds: both relay halves and gRPC's end)
            # closes a moment after its pool is gone: wait for that, not a leak.
            fds = len(_fd_links(d.proc.pid))
            return (base is None or fds <= base + 2) and (not same or fds <= min(same))

        flat = _until(flat_now, 10.0)
        fds = len(_fd_links(d.proc.pid))
        self.fd_samples.append((d.proc.pid, fds))
        base = self.fd_samples[0][1]
        self.c_fds.record(
            quiet and flat,
            f"pid {d.proc.pid}: {fds} fds (first quiet point {base}, this daemon {same}); "
            f"pools {s.pools}, holds {s.pool_holds}; {sorted(_fd_links(d.proc.pid))}",
        )

    def end_checks(self) -> None:
        d = self.daemon
        assert d is not None
        rc = d.stop()
        if self.probe_pool is not None:
            self.probe_pool.close()
            self.probe_pool = None
        problems = []
        if rc != 0:
            problems.append(f"final SIGTERM: daemon exited {rc}")
        sock = str(self.daemon_dir / "run" / "kvseal.sock")
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                if sock.encode() in cmd or self.shm_prefix.encode() in cmd:
                    problems.append(f"process {pid} still runs: {cmd[:120]!r}")
        leaked = sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(self.shm_prefix))
        if leaked:
            problems.append(f"{len(leaked)} shm objects left: {leaked[:4]}")
            for n in leaked:
                (SHM_DIR / n).unlink(missing_ok=True)
        self.c_end.record(not problems, "; ".join(problems))

    # ------------------------------------------------------------- main loop

    def run(self) -> int:
        cfg = self.cfg
        t_end = time.monotonic() + cfg.time_s
        started = time.monotonic()
        self.probe_pool = SharedKVPool(
            KVShape(num_pages=1, dtype="bfloat16", **SMALL), "vllm_per_layer", self.shm_prefix
        )
        try:
            self.start_daemon(paused=True)
            for slot in range(cfg.engines):
                self.start_engine(slot)
            kills = since_checkpoint = 0
            while kills < cfg.kills and time.monotonic() < t_end:
                # Let the engines work a while (their calls reach a fresh daemon,
                # re-register, evict...) before the next blow.
                time.sleep(self.rng.uniform(0.1, 1.0))
                self.poll_engines()
                r = self.rng.random()
                aim = self.rng.random() < 0.7
                if r < 0.3:
                    self.restart_daemon(graceful=False, aim=aim)
                    kills += 1
                elif r < 0.35:
                    self.restart_daemon(graceful=True, aim=aim)
                else:
                    slot = self.rng.randrange(cfg.engines)
                    self.kill_engine(slot, aim)
                    self.start_engine(slot)
                    kills += 1
                since_checkpoint += 1
                if since_checkpoint >= cfg.checkpoint_every:
                    before = self.counts["engine SIGKILL"]
                    self.checkpoint(final=False)
                    kills += self.counts["engine SIGKILL"] - before
                    for slot in range(cfg.engines):
                        self.start_engine(slot)
                    since_checkpoint = 0
                if cfg.verbose:
                    print(f"[{time.monotonic() - started:6.1f} s] kills {kills}", file=self.out)
            # Let the last engines run a moment, then stop them cleanly.
            time.sleep(1.0)
            self.poll_engines()
            self.checkpoint(final=True)
            self.poll_engines()
            self.end_checks()
            reached = kills >= cfg.kills
        except Exception as e:  # the driver cannot go on: that is a failure too
            self.c_restart.record(False, f"run aborted: {type(e).__name__}: {e}")
            reached = False
            kills = self.counts["daemon SIGKILL"] + self.counts["engine SIGKILL"]
        finally:
            self._teardown()
        return self.report(kills, reached, time.monotonic() - started)

    def _teardown(self) -> None:
        for e in self.engines.values():
            if e.alive():
                e.proc.kill()
                e.proc.wait()
            self._cleanup_shm(e)
        self.engines.clear()
        if self.daemon is not None and self.daemon.proc.poll() is None:
            self.daemon.stop()
        if self.probe_pool is not None:
            self.probe_pool.close()
        self.pause_file.unlink(missing_ok=True)
        for p in SHM_DIR.iterdir():
            if p.name.startswith(self.shm_prefix):
                p.unlink(missing_ok=True)
        if self._tmp is not None:
            self._tmp.cleanup()

    def report(self, kills: int, reached: bool, wall: float) -> int:
        out = self.out
        kill_row = Check(f"kills reached ({kills} of {self.cfg.kills})")
        kill_row.record(reached, f"only {kills} kills in {self.cfg.time_s:.0f} s")
        rows = [kill_row, *self.checks.values()]
        print(
            f"kvseal chaos: seed {self.cfg.seed} (CHAOS_SEED={self.cfg.seed} replays the "
            f"schedule), {self.cfg.engines} engines, {wall:.0f} s",
            file=out,
        )
        for k, v in self.counts.items():
            print(f"  {k:<34} {v}", file=out)
        print(f"  {'max call overshoot past deadline':<34} {self.max_over_ms:.1f} ms", file=out)
        width = max(len(r.name) for r in rows)
        print(f"\n| {'check':<{width}} | {'passed':>8} | {'failed':>6} | result |", file=out)
        print(f"| {'-' * width} | {'-' * 8} | {'-' * 6} | ------ |", file=out)
        for r in rows:
            res = "ok" if r.ok else ("FAIL" if r.failed else "not run")
            print(f"| {r.name:<{width}} | {r.passed:>8} | {r.failed:>6} | {res:<6} |", file=out)
        for r in rows:
            for n in r.notes:
                print(f"  {r.name}: {n}", file=out)
        npass = sum(r.ok for r in rows)
        nfail = len(rows) - npass
        print(f"{npass} passed, {nfail} failed", file=out)
        return 1 if nfail else 0


def _env_int(name: str, default: int) -> int:
    """An integer from the environment; unset or empty means ``default``."""
    return int(os.environ.get(name) or default)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="kvseal chaos suite (kill -9 daemon and engines)")
    ap.add_argument("--kills", type=int, default=_env_int("CHAOS_KILLS", 200))
    ap.add_argument(
        "--seed", type=int, default=_env_int("CHAOS_SEED", random.SystemRandom().randrange(1 << 31))
    )
    ap.add_argument("--time", type=float, default=float(os.environ.get("CHAOS_TIME_S") or 1800))
    ap.add_argument("--engines", type=int, default=_env_int("CHAOS_ENGINES", 3))
    ap.add_argument("--slack", type=float, default=float(os.environ.get("CHAOS_SLACK_S") or 5))
    ap.add_argument("--checkpoint-every", type=int, default=40)
    ap.add_argument("--workdir", type=Path, default=None, help="keep logs here")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    cfg = Config(
        kills=a.kills,
        seed=a.seed,
        time_s=a.time,
        engines=a.engines,
        slack_s=a.slack,
        checkpoint_every=a.checkpoint_every,
        workdir=a.workdir,
        verbose=a.verbose,
    )
    return ChaosRun(cfg, sys.stdout).run()


if __name__ == "__main__":
    sys.exit(main())
