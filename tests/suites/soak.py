"""Soak suite (``make soak``; issue 12): a real daemon, several real engine
processes, mixed traffic under constant eviction for ``SOAK_S`` seconds (30 min
by default), then checks that nothing leaks and nothing was ever served wrong.

What runs: ``kvseal.server`` (CPU backend, started by ``tests.conftest.start_daemon``)
with a host tier of ``--host-slots`` 64 KiB blocks, far fewer than the ~550
distinct (tenant, block) pairs the engines use, so almost every offload evicts.
``--engines`` processes (``soak_engine.py``; vLLM per-layer, vLLM cross-layer and
SGLang layouts in turn, all of one model so they share blocks) each register a
shared-memory pool through ``EnginePool`` and run offload / lookup / restore
(write-through and write-back) / touch / drop over chains of three tenants,
checking every restored page byte for byte against the (tenant, hash) → bytes
model. Once per period one engine is restarted, alternately by SIGTERM and by
SIGKILL (its HoldPool ends and the daemon must unregister its pool); each
engine also re-registers a fresh pool every ``--cycle-ops`` operations.

Every ``sample`` seconds the driver records the daemon's VmRSS, RssAnon and
thread count (``/proc/<pid>/status``), open fds (``/proc/<pid>/fd``), mappings
(lines of ``/proc/<pid>/maps``), its Stats, and the engines' counters; it prints
one table row per period (``min(300, SOAK_S / 6)`` seconds).

The checks, after warm-up (the first period; samples from then on are
"steady"; the baseline is the first steady sample):

- RSS: every steady VmRSS within ±5 % of the baseline (max <= 1.05 x base and
  min >= 0.95 x base).
- fds: every steady sample within baseline ± ``fd_slack`` = 2 x (2 x layers + 3):
  one engine's pool (one fd per shared-memory buffer, at most 2 x layers, the
  SGLang layout) plus its connection (at most 3 fds: the accepted public socket
  and, behind the peer-credential relay, both ends of the relay to gRPC's
  internal socket; the soak's owner-only socket has no relay), counted
  twice, because a sample may fall inside a restart or a pool cycle (old pool
  not yet closed, or new one not yet open). A leak of one fd per registration
  (each engine re-registers every few hundred operations) exceeds it within a
  few periods; the exact check is the next one.
- fds at rest: once every engine is gone and the daemon holds no pool, the
  same fd count as before traffic started, ± 1 (whether gRPC keeps an idle
  wakeup fd open at that instant).
- mappings: every steady sample within baseline ± ``maps_slack`` (default 24),
  which covers what legitimately comes and goes: each thread gRPC core adds
  for a while (below) brings a stack and its guard and may bring a glibc
  malloc arena (a heap and its reserved tail), about 8 for two; glibc serves allocations of 128 KiB and
  more (a request's staging buffer: up to 14 blocks of 64 KiB) with their own
  mmap, one or two per request in flight (three engines: about 6); CPython's
  obmalloc arenas (1 MiB each) are mapped and unmapped as the heap breathes.
  A leak (a pool mapped per registration, a buffer kept per request) grows
  without bound and passes it within a period.
- threads: exact, in every sample (warm-up too). The daemon names its own
  threads for the kernel and starts every pool whole (``kvseal.server.threads``),
  so ``/proc/<pid>/task/*/comm`` must show exactly what its configuration says
  (:func:`expected_threads`): ``kvseal-rpc`` = gRPC handler threads (16 +
  8 watchers + ``--max-holds``; each open stream, an engine's HoldPool, holds
  one for its life, each unary call one while it runs), ``kvseal-seal`` =
  ``--workers``, one ``kvseal-expiry`` (hold deadlines of registrations), one
  ``kvseal-devcheck`` (the periodic device check), and two named as the
  process: the main thread and gRPC's Python dispatcher. A connection costs no
  thread. Any other name is gRPC core's (its timer, event-engine and lifeguard
  threads, the number in brackets in the table): an elastic pool of the C
  library's, which adds an event-engine thread while all of its threads are
  busy (at most one a second, so more under CPU starvation) and ends one only
  after it ran nothing for 20 s (which the server's once-a-second poll can put
  off indefinitely): reported (before, peak, after), not checked, since no
  state of the daemon's decides it. (The total used to move 20-28: the
  handler executor started threads on demand and kept them, so it grew to
  the highest concurrency it had seen; the rest was gRPC core's pool.)
- restore latency: every restore call's latency (ok or not, the engine API's
  too) is printed per period as p50/p99/max in ms.
- 0 wrong bytes, 0 integrity failures (every sample), 0 unexpected errors (any
  status other than a raced BLOCK_NOT_PRESENT or a momentary
  CAPACITY_EXHAUSTED), 0 failures without the daemon's verdict (a status with
  no ``kvseal-error`` reason: a call that ran to the client's own deadline or
  lost its connection), traffic really ran (restores checked, evictions seen).
- after traffic stops: no pending or pinned block, no pool, no hold; used
  bytes equal ready blocks x block size (no lost slot), and a fresh pool can
  fill the whole tier and restore every block byte-exact.
- the daemon is alive and SERVING at the end and exits 0 on SIGTERM.

The last line is ``N passed, M failed``; the exit status is 1 if any check
failed. A check whose data cannot be read (``/proc/<pid>/fd`` of a
non-dumpable daemon needs the same uid *and* CAP_SYS_PTRACE or root) is
reported as SKIP and counted in neither.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvseal.client import ClientConfig, KVSealClient, KVSealRpcError, tenant_digest
from kvseal.client.shm import SHM_DIR, KVShape, SharedKVPool
from kvseal.server.config import ServerConfig

from tests.conftest import DaemonProc, start_daemon

from .soak_engine import (
    EXPECTED,
    FINGERPRINT,
    GEOMETRY,
    SLOW_S,
    STUCK_S,
    TENANTS,
    block_content,
)

ENGINE = Path(__file__).with_name("soak_engine.py")
LAYOUTS = ("vllm_per_layer", "vllm_cross_layer", "sglang_per_layer")
BLOCK = KVShape(num_pages=1, **GEOMETRY).block_bytes
RSS_TOLERANCE = 0.05
FD_REST_SLACK = 1
WORKERS = 2  # the daemon's --workers (sealing threads)
MAX_HOLDS = 8  # its --max-holds

# ------------------------------------------------------------------ sampling


@dataclass
class Sample:
    t: float  # seconds since traffic started
    rss_kib: int
    rss_anon_kib: int
    threads: int
    fds: int | None  # None: /proc/<pid>/fd unreadable
    maps: int | None
    stats: dict[str, int]
    engines: dict[str, Any]  # aggregated engine counters (see Totals.snapshot)
    # The daemon's threads by kernel name (thread_census): kvseal's own and the
    # main thread's name exactly; gRPC core's (its C threads) summed.
    own_threads: dict[str, int] = field(default_factory=dict)
    grpc_threads: int = 0


# ------------------------------------------------------------------ threads

MAIN = "<main>"  # the key for threads named as the process (see thread_census)


def expected_threads(workers: int = WORKERS, max_holds: int = MAX_HOLDS) -> dict[str, int]:
    """What the daemon's configuration says its own threads are, by kernel name
    (``kvseal.server.threads``; every pool is started whole): the gRPC handler
    pool (``--grpc-threads`` + watchers + ``--max-holds``, ServerConfig's
    defaults but holds), the sealing threads (``--workers``), the hold-expiry
    thread, the periodic device check, and two threads named as the process:
    the main thread and gRPC's Python dispatcher (``grpc._server._serve``,
    started by the main thread, whose name it inherits). The soak's daemon runs
    the CPU backend on its owner-only socket (no relay thread) without metrics."""
    defaults: dict[str, Any] = {f.name: f.default for f in fields(ServerConfig)}
    rpc = int(defaults["grpc_threads"]) + int(defaults["max_watchers"]) + max_holds
    return {
        "kvseal-rpc": rpc,
        "kvseal-seal": workers,
        "kvseal-expiry": 1,
        "kvseal-devcheck": 1,
        MAIN: 2,
    }


def thread_census(pid: int) -> tuple[dict[str, int], int]:
    """The daemon's threads by kernel name (``/proc/<pid>/task/*/comm``):
    (kvseal's own, named ``kvseal-*``, plus those named as the process under
    :data:`MAIN`; gRPC core's count, every other name: the C library's timer,
    event-engine and lifeguard threads, which it starts and ends by itself).
    A thread that ends while it is read is not counted."""
    main = Path(f"/proc/{pid}/comm").read_text().strip()
    own: Counter[str] = Counter()
    grpc = 0
    for comm in glob.glob(f"/proc/{pid}/task/*/comm"):
        try:
            name = Path(comm).read_text().strip()
        except FileNotFoundError:
            continue
        if name == main:
            own[MAIN] += 1
        elif name.startswith("kvseal-"):
            own[name] += 1
        else:
            grpc += 1
    return dict(own), grpc


# ------------------------------------------------------------------ restore latency


class RestoreLatencies:
    """Reads the engines' ``*.restores`` files (soak_engine: one line per
    restore call as it ends) from where it left off: :meth:`take` returns the
    latencies (ms) of the restore calls that ended since the last take."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._offsets: dict[str, int] = {}

    def take(self) -> list[float]:
        out: list[float] = []
        for path in sorted(glob.glob(str(self.workdir / "*.restores"))):
            with open(path) as f:
                f.seek(self._offsets.get(path, 0))
                while True:
                    line = f.readline()
                    if not line.endswith("\n"):  # none, or one being written
                        break
                    self._offsets[path] = f.tell()
                    parts = line.split()
                    if len(parts) >= 2:
                        out.append(float(parts[1]))
        return out


def percentiles(ms: Sequence[float]) -> str:
    """``p50/p99/max`` in ms (nearest rank), or ``-`` without restores."""
    if not ms:
        return "-"
    v = sorted(ms)

    def rank(q: float) -> float:
        return v[max(0, math.ceil(len(v) * q) - 1)]

    return f"{rank(0.50):.1f}/{rank(0.99):.1f}/{v[-1]:.1f}"


def proc_status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, val = line.partition(":")
            if key in ("VmRSS", "RssAnon", "Threads"):
                out[key] = int(val.split()[0])
    return out


def count_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except PermissionError:
        return None


def count_maps(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return sum(1 for _ in f)
    except PermissionError:
        return None


STAT_FIELDS = (
    "blocks_ready",
    "blocks_pending",
    "blocks_pinned",
    "host_bytes_used",
    "host_bytes_capacity",
    "evicted_blocks",
    "integrity_failures",
    "pools",
    "pool_holds",
    "offloaded_blocks",
    "restored_blocks",
    "lookups",
)


def daemon_stats(c: KVSealClient) -> dict[str, int]:
    st = c.stats()
    return {f: int(getattr(st, f)) for f in STAT_FIELDS}


# ------------------------------------------------------------------ engines


def merge(into: dict[str, Any], c: dict[str, Any]) -> None:
    for k, v in c.items():
        if isinstance(v, dict):
            merge(into.setdefault(k, {}), v)
        elif isinstance(v, int) and k != "pid":
            into[k] = into.get(k, 0) + v
        elif isinstance(v, list):
            into.setdefault(k, []).extend(v)


@dataclass
class EngineProc:
    idx: int
    generation: int
    proc: subprocess.Popen[bytes]
    status: Path
    shm_prefix: str

    def counts(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.status.read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return {}


@dataclass
class Engines:
    target: str
    workdir: Path
    run_tag: str
    n: int
    pause_ms: float
    cycle_ops: int
    live: list[EngineProc] = field(default_factory=list)
    finished: dict[str, Any] = field(default_factory=dict)  # counters of exited engines
    restarts: int = 0
    bad_exits: list[str] = field(default_factory=list)

    def start(self, idx: int, generation: int) -> EngineProc:
        tag = f"{self.run_tag}-e{idx}g{generation}"
        status = self.workdir / f"engine-{tag}.json"
        log = open(self.workdir / f"engine-{idx}.log", "ab")  # noqa: SIM115 - child owns it
        tenants = [str(idx % len(TENANTS)), str((idx + 1) % len(TENANTS))]
        cmd = [
            sys.executable,
            str(ENGINE),
            "--target",
            self.target,
            "--id",
            str(idx),
            "--tenants",
            *tenants,
            "--layout",
            LAYOUTS[idx % len(LAYOUTS)],
            "--seed",
            str(idx * 1000 + generation),
            "--pause-ms",
            str(self.pause_ms),
            "--cycle-ops",
            str(self.cycle_ops),
            "--shm-prefix",
            tag,
            "--status",
            str(status),
        ]
        with log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        return EngineProc(idx, generation, proc, status, tag)

    def start_all(self) -> None:
        self.live = [self.start(i, 0) for i in range(self.n)]

    @staticmethod
    def _wait_started(e: EngineProc, timeout: float = 30.0) -> None:
        """Wait until ``e`` has written its first status (it handles SIGTERM by
        then; the handler goes in before its imports, but the interpreter's own
        start is a window) or exited."""
        end = time.monotonic() + timeout
        while not e.status.exists() and e.proc.poll() is None and time.monotonic() < end:
            time.sleep(0.05)

    def _reap(self, e: EngineProc, how: str) -> None:
        """Stop ``e``: "term" sends SIGTERM, "termed" only waits for an engine
        already sent one (a second SIGTERM could land while its interpreter
        finalizes, where the default action kills it), "kill" sends SIGKILL."""
        if how in ("term", "termed"):
            if how == "term":
                self._wait_started(e)
                e.proc.send_signal(signal.SIGTERM)
            try:
                # An engine finishes its current call first (transfers have a
                # 60 s deadline) and then releases its pool.
                rc = e.proc.wait(90)
            except subprocess.TimeoutExpired:
                e.proc.kill()
                rc = e.proc.wait()
                self.bad_exits.append(f"engine {e.idx} did not stop on SIGTERM")
            if rc != 0:
                self.bad_exits.append(f"engine {e.idx} exited with {rc}")
        else:
            e.proc.kill()
            e.proc.wait()
        # A SIGKILLed engine cannot unlink its shared memory; an engine's own
        # objects all start with its tag.
        for name in os.listdir(SHM_DIR):
            if name.startswith(e.shm_prefix + "-"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(SHM_DIR, name))
        merge(self.finished, e.counts())

    def restart_one(self) -> str:
        """Restart engines round-robin, alternately by SIGTERM and SIGKILL."""
        i = self.restarts % self.n
        how = "term" if self.restarts % 2 == 0 else "kill"
        old = self.live[i]
        self._reap(old, how)
        self.live[i] = self.start(i, old.generation + 1)
        self.restarts += 1
        return how

    def check_alive(self) -> None:
        for i, e in enumerate(self.live):
            if e.proc.poll() is not None:
                self.bad_exits.append(f"engine {e.idx} died with {e.proc.returncode}")
                merge(self.finished, e.counts())
                self.live[i] = self.start(e.idx, e.generation + 1)

    def stop_all(self) -> None:
        for e in self.live:
            self._wait_started(e)
            e.proc.send_signal(signal.SIGTERM)
        for e in self.live:
            self._reap(e, "termed")
        self.live = []

    def totals(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        merge(out, self.finished)
        for e in self.live:
            merge(out, e.counts())
        return out


def summarize(counts: dict[str, Any]) -> dict[str, int]:
    errors: dict[str, int] = counts.get("errors", {})
    return {
        "ops": sum(counts.get("ops", {}).values()),
        "restores_ok": int(counts.get("restores_verified", 0)),
        "checked": int(counts.get("restored_blocks_checked", 0)),
        "wrong": int(counts.get("wrong_bytes", 0)),
        "expected_errors": sum(v for k, v in errors.items() if k in EXPECTED),
        "unexpected_errors": sum(v for k, v in errors.items() if k not in EXPECTED),
    }


# ------------------------------------------------------------------ checks


@dataclass
class Check:
    name: str
    ok: bool | None  # None: skipped (data unreadable)
    detail: str


def flat(name: str, values: Sequence[int | None], slack: int, what: str, unit: str = "") -> Check:
    if not values:
        return Check(name, False, "no steady samples")
    if any(v is None for v in values):
        return Check(name, None, f"{what} unreadable (needs root or CAP_SYS_PTRACE)")
    vals = [int(v) for v in values if v is not None]
    base = vals[0]
    lo, hi = min(vals), max(vals)
    ok = base - slack <= lo and hi <= base + slack
    return Check(name, ok, f"baseline {base}{unit}, steady {lo}..{hi}, allowed ±{slack}")


def steady_samples(samples: Sequence[Sample], warmup_s: float) -> list[Sample]:
    return [s for s in samples if s.t >= warmup_s]


def threads_exact(samples: Sequence[Sample], expected: dict[str, int]) -> Check:
    """Every sample's own threads (thread_census) are exactly ``expected``."""
    name = "daemon's own threads exactly as configured"
    if not samples:
        return Check(name, False, "no samples")
    want = ", ".join(f"{k} {v}" for k, v in expected.items())
    off = [s for s in samples if s.own_threads != expected]
    if off:
        shown = "; ".join(f"t={s.t:.0f} s: {s.own_threads}" for s in off[:3])
        return Check(
            name, False, f"{len(off)} of {len(samples)} samples differ from {want}: {shown}"
        )
    return Check(name, True, f"{want} in all {len(samples)} samples")


def evaluate_steady(
    samples: Sequence[Sample],
    warmup_s: float,
    fd_slack: int,
    maps_slack: int,
    expected: dict[str, int] | None = None,
) -> list[Check]:
    """The checks over the samples taken while traffic ran (see the module doc);
    the thread check covers every sample, warm-up included (the pools are whole
    from the start)."""
    st = steady_samples(samples, warmup_s)
    checks = []
    if not st:
        checks.append(Check("RSS within ±5 % after warm-up", False, "no steady samples"))
    else:
        base = st[0].rss_kib
        lo, hi = min(s.rss_kib for s in st), max(s.rss_kib for s in st)
        ok = hi <= base * (1 + RSS_TOLERANCE) and lo >= base * (1 - RSS_TOLERANCE)
        checks.append(
            Check(
                "RSS within ±5 % after warm-up",
                ok,
                f"baseline {base / 1024:.1f} MiB, steady {lo / 1024:.1f}..{hi / 1024:.1f} MiB "
                f"({(lo - base) / base * 100:+.1f} %..{(hi - base) / base * 100:+.1f} %)",
            )
        )
    checks.append(flat("fd count flat", [s.fds for s in st], fd_slack, "/proc/<pid>/fd"))
    checks.append(flat("mapping count flat", [s.maps for s in st], maps_slack, "/proc/<pid>/maps"))
    checks.append(threads_exact(samples, expected_threads() if expected is None else expected))
    integrity = max((s.stats["integrity_failures"] for s in samples), default=0)
    checks.append(Check("0 integrity failures", integrity == 0, f"{integrity} seen"))
    return checks


def evaluate_traffic(totals: dict[str, Any], evicted: int, bad_exits: Sequence[str]) -> list[Check]:
    s = summarize(totals)
    errs: dict[str, int] = totals.get("errors", {})
    unexpected = {k: v for k, v in errs.items() if k not in EXPECTED}
    by_op: dict[str, int] = totals.get("errors_by_op", {})
    unexpected_by_op = {k: v for k, v in by_op.items() if k.split(" ", 1)[-1] not in EXPECTED}
    examples = totals.get("wrong_examples", [])[:3]
    # A failure without the daemon's reason (``CODE/-``): the call ran to the
    # client's own deadline or lost its connection; the daemon never said.
    no_verdict = {k: v for k, v in by_op.items() if k.endswith("/-")}
    return [
        Check(
            "0 failures without the daemon's verdict",
            not no_verdict,
            json.dumps(no_verdict, sort_keys=True)
            if no_verdict
            else "every failure had its reason",
        ),
        Check(
            "0 wrong bytes",
            s["wrong"] == 0,
            f"{s['wrong']} of {s['checked']} restored blocks wrong"
            + (f": {examples}" if examples else ""),
        ),
        Check(
            "0 unexpected errors",
            not unexpected,
            json.dumps(unexpected_by_op or errs, sort_keys=True),
        ),
        Check(
            "traffic ran under eviction pressure",
            s["restores_ok"] > 0 and s["checked"] > 0 and evicted > 0,
            f"{s['ops']} ops, {s['restores_ok']} restores ok, {evicted} evictions",
        ),
        Check("engines exited cleanly", not bad_exits, "; ".join(bad_exits) or "all exits as sent"),
    ]


# ------------------------------------------------------------------ after traffic


def wait_quiet(c: KVSealClient, timeout: float = 60.0) -> dict[str, int]:
    """Stats once no block is pending or pinned and no pool or hold is left
    (or the timeout passed): a SIGKILLed engine's transfer may still be running
    to its deadline, and a hold's end reaches the daemon asynchronously."""
    end = time.monotonic() + timeout
    while True:
        st = daemon_stats(c)
        quiet = not (st["blocks_pending"] or st["blocks_pinned"] or st["pools"] or st["pool_holds"])
        if quiet or time.monotonic() > end:
            return st
        time.sleep(0.2)


def grpc_core_note(pid: int, before: int, samples: Sequence[Sample]) -> str:
    """One line on gRPC core's own threads (thread_census), which are gRPC's
    elastic event-engine pool, not kvseal's: it adds a thread while all of its
    threads are busy (at most one a second) and ends one only after it ran
    nothing for 20 s, which the server's once-a-second completion-queue poll
    can put off indefinitely. So their count is reported, not checked."""
    _, now = thread_census(pid)
    peak = max((s.grpc_threads for s in samples), default=before)
    return (
        f"gRPC core threads (its own elastic pool, not checked): {before} before traffic, "
        f"at most {peak} during it, {now} after"
    )


def refill_tier(c: KVSealClient, slots: int) -> Check:
    """Register a fresh pool, offload ``slots`` new blocks (the whole tier) and
    restore them all byte-exact: fails if any slot was lost to a leak."""
    tenant = tenant_digest("soak-refill")
    shape = KVShape(num_pages=slots, **GEOMETRY)
    with SharedKVPool(shape, "vllm_per_layer", name_prefix="kvseal-soak-refill") as pool:
        pid = c.register_pool("soak-refill", FINGERPRINT, pool.geometry()).pool_id
        try:
            hashes = [os.urandom(32) for _ in range(slots)]
            pages = list(range(slots))
            for h, p in zip(hashes, pages, strict=True):
                pool.write_block(p, block_content(tenant, h, BLOCK))
            r = c.offload(pid, tenant, hashes, pages)
            hit = c.lookup(pid, tenant, hashes).hit_blocks
            for p in pages:
                pool.fill_page(p, 0xA5)
            c.restore(pid, tenant, hashes, pages)
            wrong = sum(
                pool.read_block(p) != block_content(tenant, h, BLOCK)
                for h, p in zip(hashes, pages, strict=True)
            )
        except KVSealRpcError as e:
            return Check("whole tier refills", False, f"{e}")
        finally:
            c.unregister_pool(pid)
    ok = r.stored_blocks == slots and hit == slots and wrong == 0
    return Check(
        "whole tier refills",
        ok,
        f"{r.stored_blocks}/{slots} stored, {hit} hit, {wrong} restored wrong",
    )


# ------------------------------------------------------------------ report


HEADER = (
    "| t (s) | ops | restores ok | restore ms p50/p99/max | expected errors | wrong (total) "
    "| unexpected (total) | RSS MiB (period min-max) | anon MiB | fds | maps "
    "| threads (gRPC core) | ready/pend/pin | used MiB | evictions | integrity (total) "
    "| restarts (total) |"
)


def row(
    s: Sample,
    period: Sequence[Sample],
    prev: Sample | None,
    restarts: int,
    restore_ms: Sequence[float] = (),
) -> str:
    """One table row: ``s`` the period's last sample, ``restore_ms`` the
    latencies of every restore call that ended in the period."""
    e = summarize(s.engines)
    p = summarize(prev.engines) if prev else summarize({})
    st = s.stats
    lo = min(x.rss_kib for x in period) / 1024
    hi = max(x.rss_kib for x in period) / 1024
    evicted = st["evicted_blocks"] - (prev.stats["evicted_blocks"] if prev else 0)
    return (
        f"| {s.t:.0f} | {e['ops'] - p['ops']} | {e['restores_ok'] - p['restores_ok']} "
        f"| {percentiles(restore_ms)} "
        f"| {e['expected_errors'] - p['expected_errors']} | {e['wrong']} "
        f"| {e['unexpected_errors']} "
        f"| {s.rss_kib / 1024:.1f} ({lo:.1f}-{hi:.1f}) | {s.rss_anon_kib / 1024:.1f} "
        f"| {s.fds if s.fds is not None else 'n/a'} | {s.maps if s.maps is not None else 'n/a'} "
        f"| {s.threads} ({s.grpc_threads}) "
        f"| {st['blocks_ready']}/{st['blocks_pending']}/{st['blocks_pinned']} "
        f"| {st['host_bytes_used'] / 2**20:.2f} | {evicted} | {st['integrity_failures']} "
        f"| {restarts} |"
    )


def print_slow(totals: dict[str, Any]) -> None:
    """List the engine calls that took over SLOW_S (wall-clock start and end,
    outcome): the evidence for a slow-call or deadline failure."""
    slow = sorted(totals.get("slow", []), key=lambda r: r.get("start", 0))
    if not slow:
        return
    print()
    print(f"## calls over {SLOW_S:.0f} s ({len(slow)}; UTC)")
    for r in slow:
        start = time.strftime("%H:%M:%S", time.gmtime(r["start"]))
        end = time.strftime("%H:%M:%S", time.gmtime(r["end"]))
        print(f"- {r['call']}: {start} -> {end} ({r['s']:.1f} s): {r['outcome']}")
    sys.stdout.flush()


def print_checks(checks: Sequence[Check]) -> int:
    """Print each check and the final ``N passed, M failed``; return M."""
    print()
    print("## checks")
    for ch in checks:
        mark = "SKIP" if ch.ok is None else ("PASS" if ch.ok else "FAIL")
        print(f"{mark} {ch.name}: {ch.detail}")
    passed = sum(1 for ch in checks if ch.ok is True)
    failed = sum(1 for ch in checks if ch.ok is False)
    print(f"{passed} passed, {failed} failed", flush=True)
    return failed


# ------------------------------------------------------------------ main


def run(args: argparse.Namespace) -> int:
    duration = float(args.duration)
    period = min(300.0, duration / 6) if args.period is None else float(args.period)
    sample_every = min(10.0, max(1.0, period / 5)) if args.sample is None else float(args.sample)
    warmup = period if args.warmup is None else float(args.warmup)
    slots = args.host_slots
    layers = GEOMETRY["num_layers"]
    fd_slack = 2 * (2 * layers + 3)
    workdir = Path(tempfile.mkdtemp(prefix="kvseal-soak-"))
    run_tag = f"kvseal-soak-{os.getpid()}"
    print("## kvseal soak")
    print(
        f"duration {duration:.0f} s, period {period:.0f} s, sample every {sample_every:.0f} s, "
        f"warm-up {warmup:.0f} s; {args.engines} engine processes (pause {args.pause_ms:.0f} ms, "
        f"new pool every {args.cycle_ops} ops, one engine restarted per period); host tier "
        f"{slots} x {BLOCK // 1024} KiB blocks",
        flush=True,
    )
    d: DaemonProc | None = None
    engines: Engines | None = None
    checks: list[Check] = []
    ok = False
    try:
        d = start_daemon(
            workdir / "daemon",
            "--workers",
            str(WORKERS),
            "--max-holds",
            str(MAX_HOLDS),
            "--on-integrity-failure",
            "drop",
            host_bytes=str(slots * BLOCK),
        )
        pid = d.proc.pid
        c = KVSealClient(ClientConfig(target=d.target, timeout_s=10.0, tenant_key=None))
        daemon_stats(c)  # the sampler's connection exists before the rest baseline
        time.sleep(0.5)
        fds_rest0 = count_fds(pid)
        _, grpc_rest0 = thread_census(pid)
        latencies = RestoreLatencies(workdir)
        restore_ms: list[float] = []
        engines = Engines(d.target, workdir, run_tag, args.engines, args.pause_ms, args.cycle_ops)
        engines.start_all()
        t0 = time.monotonic()
        samples: list[Sample] = []
        period_start = 0
        prev_row: Sample | None = None
        next_period = period
        restarted_this_period = False
        stuck_seen = 0
        print()
        print(HEADER)
        print("|" + " --- |" * (HEADER.count("|") - 1), flush=True)
        while True:
            t = time.monotonic() - t0
            if t >= duration:
                break
            time.sleep(min(sample_every, duration - t))
            t = time.monotonic() - t0
            engines.check_alive()
            if d.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {d.proc.returncode}")
            ps = proc_status(pid)
            own, grpc_core = thread_census(pid)
            s = Sample(
                t,
                ps["VmRSS"],
                ps.get("RssAnon", 0),
                ps["Threads"],
                count_fds(pid),
                count_maps(pid),
                daemon_stats(c),
                engines.totals(),
                own,
                grpc_core,
            )
            restore_ms += latencies.take()
            samples.append(s)
            stuck = int(s.engines.get("stuck", 0))
            if stuck > stuck_seen:
                # An engine's call has been in flight for STUCK_S: the daemon logs
                # every thread's stack (its SIGUSR2 hook), to say where it sits.
                stuck_seen = stuck
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR2)
                print(
                    f"note: t={t:.0f} s: a call in flight for over {STUCK_S:.0f} s "
                    f"({stuck} so far); daemon thread stacks requested (SIGUSR2, in its log)",
                    file=sys.stderr,
                    flush=True,
                )
            if not restarted_this_period and t >= next_period - period / 2:
                engines.restart_one()
                restarted_this_period = True
            if t >= next_period - 1e-6 or t >= duration - 1e-6:
                print(
                    row(s, samples[period_start:], prev_row, engines.restarts, restore_ms),
                    flush=True,
                )
                restore_ms = []
                prev_row = s
                period_start = len(samples)
                next_period += period
                restarted_this_period = False
        evicted = samples[-1].stats["evicted_blocks"] if samples else 0
        engines.stop_all()
        totals = engines.totals()
        checks += evaluate_steady(samples, warmup, fd_slack, args.maps_slack)
        checks += evaluate_traffic(totals, evicted, engines.bad_exits)
        st = wait_quiet(c)
        checks.append(
            Check(
                "nothing pending or pinned after traffic",
                st["blocks_pending"] == 0 and st["blocks_pinned"] == 0,
                f"pending {st['blocks_pending']}, pinned {st['blocks_pinned']}",
            )
        )
        checks.append(
            Check(
                "no pool or hold left after the engines",
                st["pools"] == 0 and st["pool_holds"] == 0,
                f"pools {st['pools']}, holds {st['pool_holds']}",
            )
        )
        checks.append(
            Check(
                "no slot lost (used = ready x block)",
                st["host_bytes_used"] == st["blocks_ready"] * BLOCK
                and st["host_bytes_used"] <= st["host_bytes_capacity"],
                f"used {st['host_bytes_used']} B, ready {st['blocks_ready']} x {BLOCK} B, "
                f"capacity {st['host_bytes_capacity']} B",
            )
        )
        grpc_note = grpc_core_note(pid, grpc_rest0, samples)
        time.sleep(0.5)
        fds_rest1 = count_fds(pid)
        if fds_rest0 is None or fds_rest1 is None:
            checks.append(Check("fds at rest as before traffic", None, "/proc/<pid>/fd unreadable"))
        else:
            checks.append(
                Check(
                    "fds at rest as before traffic",
                    abs(fds_rest1 - fds_rest0) <= FD_REST_SLACK,
                    f"before {fds_rest0}, after {fds_rest1}, allowed ±{FD_REST_SLACK}",
                )
            )
        checks.append(refill_tier(c, slots))
        try:
            health = c.health()
        except KVSealRpcError as e:
            health = str(e)
        checks.append(
            Check(
                "daemon alive and SERVING",
                d.proc.poll() is None and health == "SERVING",
                f"health {health}",
            )
        )
        c.close()
        rc = d.stop()
        checks.append(Check("daemon exits 0 on SIGTERM", rc == 0, f"exit status {rc}"))
        print()
        print(grpc_note)
        failed = print_checks(checks)
        print_slow(totals)
        ok = failed == 0
        return 0 if ok else 1
    except BaseException as exc:
        if not checks:
            print(f"soak aborted: {exc!r}")
            print("0 passed, 1 failed", flush=True)
        raise
    finally:
        if engines is not None:
            for ep in engines.live:
                ep.proc.kill()
                ep.proc.wait()
        if d is not None:
            d.stop()
            if not ok:
                print("--- daemon log (tail) ---", file=sys.stderr)
                print(d.log()[-3000:], file=sys.stderr)
        for name in os.listdir(SHM_DIR):
            if name.startswith(run_tag):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(SHM_DIR, name))
        if ok or not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"logs kept in {workdir}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="kvseal soak suite (make soak)")
    p.add_argument(
        "--duration",
        type=float,
        default=float(os.environ.get("SOAK_S", "1800")),
        help="seconds of traffic [SOAK_S, default 1800]",
    )
    p.add_argument("--period", type=float, default=None, help="seconds per table row")
    p.add_argument("--sample", type=float, default=None, help="seconds between samples")
    p.add_argument("--warmup", type=float, default=None, help="seconds (default: one period)")
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--pause-ms", type=float, default=40.0, help="mean pause between engine ops")
    p.add_argument("--cycle-ops", type=int, default=300)
    p.add_argument("--host-slots", type=int, default=64, help="host tier size in blocks")
    p.add_argument("--maps-slack", type=int, default=24)
    p.add_argument("--keep", action="store_true", help="keep logs of a failed run")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
