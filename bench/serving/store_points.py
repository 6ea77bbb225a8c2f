"""``make bench-serving-store``: the daemon's sealed store tier (docs/store.md)
behind a real ``vllm serve``, at the two points it exists for.

- *restart-warm*: an engine and its kvseal daemon (``--store-dir``, a
  ``file:`` deployment key) serve a round of llm-d style requests (shared
  prefixes, bench/serving/run.py's ``llmd_requests``); then both are stopped
  and started again on the same directory and key (the daemon's host tier and
  the engine's prefix cache are empty) and serve the same prefixes with new
  questions.
- *second replica*: pair A serves the first round and stops; a new pair B (a
  new engine, a new daemon on another socket and port, the same directory and
  key) serves the second.
- *second replica on S3 / on Mooncake Store* (``--backends dir,s3,mooncake``):
  the same, with the store on a real S3 server (SeaweedFS's ``weed mini``) or
  a real Mooncake Store (``mooncake_master`` and one node mounting the
  cluster's memory, this process: the daemons mount none, so what A stored
  outlives A, as on a fleet's store nodes), both started here
  (bench/store_backends.py). Mooncake needs tests_stores/netns.sh's network
  namespace; ``make bench-serving-store`` runs the whole bench in it.

The baseline is a no-offload engine that serves the first round, is
restarted, and serves the second: a restarted engine and a fresh replica
without a second tier are the same thing (an empty prefix cache), so one
no-offload run per repetition is the baseline of both points. A control,
``none-b``, is a fresh no-offload engine serving only the second round with
arrivals drawn from another seed (the same prompts in other batches: how far
batching alone moves greedy answers). Each repetition runs the four one
after another, the order rotating from repetition to repetition; only one
engine runs at a time. Every repetition sends the same prompts (seeded), each
kvseal point into a fresh store directory.

Measured on the second round: TTFT (mean, p50, p99), the share of prompt
tokens served from the engine's prefix cache, from the kvseal tier
(vLLM's external prefix-cache hits: here the store, through the host tier)
and computed, and the store's own counters from the daemon's ``/metrics``.

    python -m bench.serving.store_points [--quick] [--reps N] [--work DIR] [--out FILE]
        [--backends dir,s3,mooncake] [--points restart,none,replica,none-b]
    python -m bench.serving.store_points --report RESULTS.json
        [--md bench/serving/history/README.md] [--png docs/serving-store.png]
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import shutil
import statistics
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.serving.arms import BLOCK, ENGINE_BLOCKS, HOST_BLOCKS, Arm, free_port  # noqa: E402
from bench.serving.model import KV_BYTES_PER_TOKEN  # noqa: E402
from bench.serving.report import _median_point, where, write_section  # noqa: E402
from bench.serving.run import machine, measure, prepare, stop_on_signals  # noqa: E402
from bench.serving.workloads import (  # noqa: E402
    PROBE,
    Client,
    Result,
    llmd_requests,
    log,
    run_poisson,
    text,
)
from bench.store_backends import Skip, mooncake_master, weed_server  # noqa: E402

STORE_BYTES = "256MiB"  # a round's blocks are ~25 MiB of records
# "none-b": a fresh no-offload engine serving only the second round, its
# arrivals drawn from another seed: other batches, the same prompts (how much
# batching alone moves greedy tokens on this model).
POINTS = ("restart", "none", "replica", "none-b")
# The second replica with the store on another backend (--backends).
BACKEND_POINTS = {"s3": "replica-s3", "mooncake": "replica-mooncake"}
TITLES = {"restart": "restart-warm", "replica": "second replica", "none": "no offload",
          "none-b": "no offload, other arrivals", "replica-s3": "second replica, S3",
          "replica-mooncake": "second replica, Mooncake"}  # fmt: skip
STORE_POINTS = ("restart", "replica", *BACKEND_POINTS.values())
# Per request to S3 or the Mooncake master: a loaded 2-core machine keeps
# either busy past the backends' 1 s default, and a timeout is a miss.
BACKEND_TIMEOUT_S = 5
BASELINES = ("none", "none-b")
SECTION = "store-tables"
COMPARED = (
    ("restart", "none", "restart-warm vs no offload, same repetition"),
    ("replica", "none", "second replica vs no offload, same repetition"),
    ("replica-s3", "none", "second replica on S3 vs no offload, same repetition"),
    ("replica-mooncake", "none", "second replica on Mooncake vs no offload, same repetition"),
    ("restart", "replica", "restart-warm vs second replica, same repetition"),
    ("none-b", "none", "no offload, other arrivals vs no offload, same repetition"),
    ("none", "none", "no offload vs no offload, across repetitions (the same arrivals)"),
)


class RecordingClient(Client):
    """The benchmark's client, keeping each prompt's answer (greedy tokens, to
    compare a kvseal arm's answers with the recomputing baseline's)."""

    def __init__(self, port: int, model: str) -> None:
        super().__init__(port, model)
        self.answers: dict[str, str] = {}

    def complete(self, prompt: str, max_tokens: int, stream: bool = True,
                 salt: str | None = None) -> Result:  # fmt: skip
        r = super().complete(prompt, max_tokens, stream, salt)
        if r.ok:
            self.answers[prompt] = r.text
        return r


class StoreArm(Arm):
    """kvseal write-through whose daemon has the store tier (a directory and a
    ``file:`` key), its Prometheus endpoint on, and the adapter's lookup
    discovery on (docs/vllm.md: store blocks are announced by no event)."""

    def __init__(self, name: str, model: Path, work: Path, store: Path | str, key: Path) -> None:
        """``store``: a directory, or a ``--store`` URL (s3://, mooncake://)."""
        super().__init__(name, model, work, mode="wt")
        self.store, self.key, self.mport = store, key, free_port()

    def daemon_extra(self) -> tuple[str, ...]:
        where = (("--store-dir", str(self.store)) if isinstance(self.store, Path)
                 else ("--store", self.store))  # fmt: skip
        return (*where, "--store-key", f"file:{self.key}",
                "--store-bytes", STORE_BYTES, "--store-max-block-bytes", "1MiB",
                "--metrics-address", f"127.0.0.1:{self.mport}")  # fmt: skip

    def kv_transfer(self) -> dict[str, Any] | None:
        kt = super().kv_transfer()
        assert kt is not None
        kt["kv_connector_extra_config"]["kvseal_lookup_discovery"] = True
        return kt

    def store_metrics(self) -> dict[str, float]:
        """The daemon's ``kvseal_store_*`` families (``_total`` dropped)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.mport, timeout=30)
        try:
            conn.request("GET", "/metrics")
            body = conn.getresponse().read().decode()
        finally:
            conn.close()
        out: dict[str, float] = {}
        for m in re.finditer(r"^kvseal_store_(\w+?)(?:_total)? (\S+)$", body, re.M):
            if not m.group(1).endswith("_created"):
                out[m.group(1)] = float(m.group(2))
        return out

    def drain(self, timeout: float = 180.0) -> None:
        """Wait until the spill queue is empty and the spill counters stand
        still: a stopping daemon discards what is still queued."""
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            m = self.store_metrics()
            done = (m.get("spills", 0), m.get("spills_present", 0), m.get("spills_skipped", 0))
            if m.get("spill_queue", 0) == 0 and done == last:
                return
            last = done
            time.sleep(0.5)
        log(f"[{self.name}] spill queue not drained after {timeout:.0f} s")


def key_file(path: Path) -> Path:
    """A deployment key file: 32 random bytes, mode 0600."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(32))
    return path


def store_usage(store: Path) -> dict[str, int]:
    """Block objects (64 hex digits) in a store directory and their bytes."""
    files = [f for f in store.glob("*/*") if re.fullmatch(r"[0-9a-f]{64}", f.name)]
    return {"objects": len(files), "bytes": sum(f.stat().st_size for f in files)}


def plan(quick: bool) -> dict[str, Any]:
    """The llm-d shape (run.py's plan), smaller: 8 prefix groups x 4 prompts, a
    768-token prefix, a 32-token question, 8 tokens out, Poisson at 1 req/s:
    a working set of 192 prefix blocks, 1.5x the engine's KV cache and inside
    the host tier (307 blocks), so the first round fills the store with every
    prefix; the second round sends the same prefixes with new questions."""
    p = {"groups": 8, "per_group": 4, "prefix": 768, "question": 32, "out": 8, "rate": 1.0,
         "reps": 3, "seed": 5000}  # fmt: skip
    if quick:
        p.update(groups=4, per_group=2, rate=2.0, reps=1)
    return p


def serve(arm: Arm, prompts: list[str], pl: dict[str, Any], seed: int) -> dict[str, Any]:
    """Start ``arm`` (a fresh client), warm it up, serve one round, summarize it."""
    arm.client = RecordingClient(arm.port, str(arm.model))
    start_s = arm.start()
    arm.client.complete(text(PROBE[:40]), 4)  # warm-up (not one of the prefixes)
    st0 = arm.store_metrics() if isinstance(arm, StoreArm) else {}
    pt = measure(arm, lambda cl: run_poisson(cl, prompts, len(prompts), pl["rate"],
                                             pl["out"], seed))  # fmt: skip
    if isinstance(arm, StoreArm):
        arm.drain()
        st1 = arm.store_metrics()
        pt["store"] = {k: st1[k] - st0.get(k, 0.0) for k in st1}
    assert isinstance(arm.client, RecordingClient)
    pt.update(start_s=round(start_s, 1), load_avg=os.getloadavg()[0],
              answers=[arm.client.answers.get(p) for p in prompts],
              probe=arm.client.complete(text(PROBE), 16, stream=False).text)  # fmt: skip
    pt["computed"] = max(0.0, 1.0 - pt["cached_engine"] - pt["cached_tier"])
    return pt


def run_point(point: str, rep: int, model: Path, work: Path, key: Path,
              pl: dict[str, Any], urls: dict[str, str]) -> dict[str, Any]:  # fmt: skip
    """One point of one repetition: round 1, the restart (or the new replica),
    round 2 (``none-b``: round 2 only, other arrival times). ``urls``: each
    started backend's ``--store`` URL, a ``{point}`` in it for the key prefix
    (every point and repetition a store of its own)."""
    s = pl["seed"]
    first = llmd_requests(s, pl["groups"], pl["per_group"], pl["prefix"], pl["question"])
    second = llmd_requests(s, pl["groups"], pl["per_group"], pl["prefix"], pl["question"],
                           question_seed=s + 1)  # fmt: skip
    store = work / f"store-{point}-{rep}"
    shutil.rmtree(store, ignore_errors=True)
    a: Arm
    if point in BASELINES:
        a = b = Arm(f"{point}-{rep}", model, work, mode="none")
    elif point == "restart":
        a = b = StoreArm(f"restart-{rep}", model, work, store, key)
    elif point in BACKEND_POINTS.values():
        url = urls[point.removeprefix("replica-")].format(point=f"{point}-{rep}")
        a = StoreArm(f"{point}-a-{rep}", model, work, url, key)
        b = StoreArm(f"{point}-b-{rep}", model, work, url, key)
    else:
        a = StoreArm(f"replica-a-{rep}", model, work, store, key)
        b = StoreArm(f"replica-b-{rep}", model, work, store, key)
    out: dict[str, Any] = {"point": point, "rep": rep}
    if point != "none-b":
        try:
            out["round1"] = serve(a, first, pl, s)
        finally:
            a.stop()
    if point in ("restart", "replica"):
        out["store_after_round1"] = store_usage(store)
    if b is a:
        a.port = free_port()  # the old one may linger in TIME_WAIT
    try:
        out["round2"] = serve(b, second, pl, s + 2 if point == "none-b" else s + 1)
    finally:
        b.stop()
    for k in ("round1", "round2") if point != "none-b" else ("round2",):
        r = out[k]
        st = r.get("store", {})
        log(f"[{point} {rep}] {k}: TTFT mean {r['ttft_mean']:.2f} p50 {r['ttft_p50']:.2f}"
            f" p99 {r['ttft_p99']:.2f} s, cached engine {r['cached_engine']:.0%} tier"
            f" {r['cached_tier']:.0%} computed {r['computed']:.0%}, failed {r['failed']},"
            f" store promoted {st.get('promoted_blocks', '-')} spills {st.get('spills', '-')},"
            f" start {r['start_s']} s, load {r['load_avg']:.1f}")  # fmt: skip
    return out


# ---------------------------------------------------------------- report


def _rounds(res: dict[str, Any], point: str, key: str) -> list[dict[str, Any]]:
    return [r[key] for r in res["runs"] if r["point"] == point and key in r]


def _same_answers(res: dict[str, Any], x: str, y: str) -> tuple[int, int, int]:
    """Second-round answers (the same prompts) of point ``x`` equal to those of
    point ``y``: in the same repetition, or, for ``x == y``, across every pair of
    repetitions: (equal, first token equal, compared)."""
    runs = {(r["point"], r["rep"]): r["round2"]["answers"] for r in res["runs"] if "round2" in r}
    reps = sorted({rep for _, rep in runs})
    pairs = [(i, j) for i in reps for j in reps if (i < j if x == y else i == j)]
    eq = first = n = 0
    for i, j in pairs:
        if (x, i) in runs and (y, j) in runs:
            for u, v in zip(runs[(x, i)], runs[(y, j)], strict=True):
                if u is not None and v is not None:
                    n += 1
                    eq += u == v
                    first += u.split()[:1] == v.split()[:1]
    return eq, first, n


def tables(res: dict[str, Any]) -> list[str]:
    pl = res["plan"]
    reps = len({r["rep"] for r in res["runs"]})
    out = [
        f"{res.get('started', '?')} to {res.get('finished', 'unfinished')},"
        f" {res.get('cpus')} CPUs, {'quick' if res.get('quick') else 'full'} run:"
        f" {pl['groups']} prefix groups x {pl['per_group']} prompts, {pl['prefix']}-token"
        f" prefixes, {pl['question']}-token questions, {pl['out']} tokens out, Poisson"
        f" {pl['rate']:g} req/s, {reps} repetition(s); engine KV {res['engine_blocks']}"
        f" blocks of {res['block_tokens']} tokens, host tier {res['host_blocks']} blocks,"
        f" store {res['store_bytes']} (fsync on). Figures: the median over the"
        " repetitions, TTFT p50 per repetition in brackets.",
        "",
        "| point | round | arm | TTFT mean / p50 / p99 s | TTFT p50 per repetition"
        " | cached: engine / kvseal tier / computed | store blocks promoted / spilled"
        " | req/s | failed | TTFT no offload / kvseal: mean, p50, p99 | CPU s: engine / daemon"
        " | load |",
        "| --- " * 12 + "|",
    ]
    for key, label in (("round2", "2 (measured)"), ("round1", "1 (fills the store)")):
        base = _rounds(res, "none", key)
        b = _median_point(base) if base else None
        for point in (*STORE_POINTS, "none", "none-b"):
            rs = _rounds(res, point, key)
            if not rs:
                continue
            p = _median_point(rs)
            st = [r.get("store", {}) for r in rs]
            promoted = statistics.median(s.get("promoted_blocks", 0) for s in st)
            spilled = statistics.median(s.get("spills", 0) for s in st)
            sb = "—" if point in BASELINES else f"{promoted:.0f} / {spilled:.0f}"
            ratio = "—"
            if b is not None and point not in BASELINES and p["ttft_mean"] and p["ttft_p50"]:
                ratio = (f"{b['ttft_mean'] / p['ttft_mean']:.2f}x, "
                         f"{b['ttft_p50'] / p['ttft_p50']:.2f}x, "
                         f"{b['ttft_p99'] / p['ttft_p99']:.2f}x")  # fmt: skip
            arm = "no offload" if point in BASELINES else "kvseal + store"
            dcpu = "—" if point in BASELINES else f"{p['daemon_cpu_s']:.1f}"
            per = ", ".join(f"{r['ttft_p50']:.2f}" for r in rs)
            out.append(
                f"| {TITLES[point]} | {label} | {arm} | {p['ttft_mean']:.2f} /"
                f" {p['ttft_p50']:.2f} / {p['ttft_p99']:.2f} | {per} |"
                f" {p['cached_engine']:.0%} / {p['cached_tier']:.0%} / {p['computed']:.0%} |"
                f" {sb} | {p['req_s']:.2f} | {p['failed']:.0f} | {ratio} | {p['engine_cpu_s']:.1f}"
                f" / {dcpu} |"
                f" {p['load_avg']:.1f} |"
            )  # fmt: skip
    out += ["", "Second-round answers (8 greedy tokens, the same prompts) that are equal:", "",
            "| compared | equal / compared | first token equal |",
            "| --- | --- | --- |"]  # fmt: skip
    for x, y, what in COMPARED:
        eq, first, n = _same_answers(res, x, y)
        out.append(f"| {what} | {eq} / {n} | {first} / {n} |")
    out += ["", "| | restart-warm | second replica |", "| --- | --- | --- |"]
    cells = []
    for point in ("restart", "replica"):
        us = [r["store_after_round1"] for r in res["runs"]
              if r["point"] == point and "store_after_round1" in r]  # fmt: skip
        cells.append(", ".join(f"{u['objects']} ({u['bytes'] / 2**20:.1f} MiB)" for u in us))
    out.append(f"| store objects after round 1, per repetition | {cells[0]} | {cells[1]} |")
    probes = {r[k]["probe"] for r in res["runs"] for k in ("round1", "round2") if k in r}
    out += ["", f"Greedy probe (200-token prompt, 16 tokens, alone) identical in every engine"
            f" of the run: {len(probes) == 1}."]  # fmt: skip
    return out


def plot(res: dict[str, Any], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(8.5, 3.4))
    labels, eng, tier, comp = [], [], [], []
    i = -1
    for point in ("none", *STORE_POINTS):
        rs = _rounds(res, point, "round2")
        if not rs:
            continue
        i += 1
        p = _median_point(rs)
        labels.append(TITLES[point] if point != "none" else "no offload\n(restarted)")
        ax.bar([i - 0.2], [p["ttft_p50"]], 0.4, color="C0", label="p50" if i == 0 else None)
        ax.bar([i + 0.2], [p["ttft_p99"]], 0.4, color="C1", label="p99" if i == 0 else None)
        eng.append(p["cached_engine"])
        tier.append(p["cached_tier"])
        comp.append(p["computed"])
    xs = list(range(len(labels)))
    ax.set_xticks(xs, labels, fontsize=8)
    ax.set_ylabel("TTFT, s (median of repetitions)")
    ax.set_title("second round: TTFT", fontsize=9)
    ax.legend(fontsize=8)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.1)
    bottom = [e + t for e, t in zip(eng, tier, strict=True)]
    bx.bar(xs, eng, label="engine prefix cache")
    bx.bar(xs, tier, bottom=eng, label="kvseal tier (store)")
    bx.bar(xs, comp, bottom=bottom, label="computed")
    bx.set_xticks(xs, labels, fontsize=8)
    bx.set_ylabel("share of prompt tokens")
    bx.set_title("second round: where prompt tokens came from", fontsize=9)
    bx.set_ylim(0, 1.3)
    bx.legend(fontsize=7, loc="upper center", ncol=3)
    # Where it ran, on the figure itself: a PNG travels without its page.
    fig.suptitle(f"sealed store tier, {where(res)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="4 groups x 2 prompts, one repetition")
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default: 3, quick 1)")
    ap.add_argument("--work", default=str(ROOT / "build" / "bench-serving-store"))
    ap.add_argument("--out", default=None, help="results JSON (default: WORK/results.json)")
    ap.add_argument("--report", metavar="RESULTS", help="only write the tables (and plot)")
    ap.add_argument("--md", help="with --report: write the tables into this file's"
                    f" <!-- {SECTION}:begin/end --> markers")  # fmt: skip
    ap.add_argument("--png", help="with --report: write the plot here")
    ap.add_argument("--backends", default="dir", help="dir,s3,mooncake: s3 and mooncake"
                    " each add a second-replica point (their servers started here)")  # fmt: skip
    ap.add_argument("--points", default=",".join(POINTS),
                    help=f"the directory points and baselines, of {POINTS}")  # fmt: skip
    args = ap.parse_args()
    if args.report:
        done = json.loads(Path(args.report).read_text())
        if args.md:
            write_section(Path(args.md), SECTION, tables(done))
        else:
            print("\n".join(tables(done)))
        if args.png:
            plot(done, args.png)
        return
    stop_on_signals()
    work, out, model = prepare(args.work, args.out)
    pl = plan(args.quick)
    if args.reps:
        pl["reps"] = args.reps
    key = key_file(work / "store.key")
    points = [p for p in args.points.split(",") if p]
    if not set(points) <= set(POINTS):
        raise SystemExit(f"--points: of {','.join(POINTS)}")
    backends = [b for b in args.backends.split(",") if b]
    if not set(backends) <= {"dir", *BACKEND_POINTS}:
        raise SystemExit("--backends: of dir,s3,mooncake")
    with contextlib.ExitStack() as servers:
        urls, skipped = start_backends(servers, work, backends)
        points += [BACKEND_POINTS[b] for b in backends if b in urls]
        run_all(args, work, out, model, key, pl, points, urls, skipped)


def start_backends(
    servers: contextlib.ExitStack, work: Path, backends: list[str]
) -> tuple[dict[str, str], dict[str, str]]:
    """Start the S3 and Mooncake servers ``backends`` names (stopped when
    ``servers`` closes); their daemons' ``--store`` URLs (``{point}``: the
    key prefix), and why any could not start."""
    urls: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for b in backends:
        if b == "dir":
            continue
        root = work / f"server-{b}"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        try:
            if b == "s3":
                url = servers.enter_context(weed_server(root))
                u = urllib.parse.urlsplit(url)
                urls[b] = f"s3://{u.netloc}/{{point}}?{u.query}&timeout={BACKEND_TIMEOUT_S}"
            else:
                # This process is the cluster's store node: it mounts the
                # memory, the daemons mount none (segment=0).
                url = servers.enter_context(mooncake_master(root, 1 << 30))
                servers.enter_context(mooncake_node(url))
                u = urllib.parse.urlsplit(url)
                q = dict(urllib.parse.parse_qsl(u.query))
                q.update(segment="0", prefix="{point}/", timeout=str(BACKEND_TIMEOUT_S))
                query = "&".join(f"{k}={v}" for k, v in q.items())
                urls[b] = f"mooncake://{u.netloc}?{query}"
        except Skip as e:
            skipped[b] = str(e)
            log(f"{b}: skipped: {e}")
    return urls, skipped


@contextlib.contextmanager
def mooncake_node(url: str) -> Iterator[None]:
    """A Mooncake client in this process mounting the segment ``url`` names."""
    from kvseal.server.store.mooncake import MooncakeLocation
    from mooncake.store import MooncakeDistributedStore

    loc = MooncakeLocation.parse(url)
    node = MooncakeDistributedStore()
    rc = node.setup(loc.local, loc.metadata, loc.segment_bytes, 16 << 20, "tcp", "", loc.master)
    if rc != 0:
        raise Skip(f"the Mooncake store node did not start: error {rc}")
    try:
        yield
    finally:
        node.close()


def run_all(args: argparse.Namespace, work: Path, out: Path, model: Path, key: Path,
            pl: dict[str, Any], points: list[str], urls: dict[str, str],
            skipped: dict[str, str]) -> None:  # fmt: skip
    """Every repetition of ``points`` (rotating their order), one at a time."""
    res: dict[str, Any] = {
        "quick": args.quick, "plan": pl, "cpus": os.cpu_count(), "machine": machine(),
        "store_bytes": STORE_BYTES,
        "engine_blocks": ENGINE_BLOCKS, "host_blocks": HOST_BLOCKS, "block_tokens": BLOCK,
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "runs": [],
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "points": points, "skipped": skipped,
    }  # fmt: skip
    for rep in range(pl["reps"]):
        k = rep % len(points)
        for point in points[k:] + points[:k]:
            res["runs"].append(run_point(point, rep, model, work, key, pl, urls))
            out.write_text(json.dumps(res, indent=1))
    res["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    out.write_text(json.dumps(res, indent=1))
    log(f"results: {out}")
    print("\n".join(tables(res)))


if __name__ == "__main__":
    main()
