"""Trusted-index benchmark: how long one store holds the index lock while it
plans and settles an eviction, with a million blocks in the cache.

Run: ``make bench-index`` (or ``.venv/bin/python bench/bench_index.py
[--blocks N] [--quick]``).

Pure index work (no daemon, no sealing): the index is what every request
takes the global lock for, so its time under the lock is what stalls other
calls. Each row is one ``begin_store`` (plan + doom victims + place the new
blocks) and its settlement (``complete_store`` on success, ``abort_store``
with nothing written on failure), timed around the call: both hold the lock
for the whole call. Workloads, each on a fresh index filled to capacity:

1. one chain of N blocks (the issue's case: only its tail is a leaf), then
   stores of 1, 64 and 4,096 new blocks;
2. N/8 chains of 8 blocks, half of them touched in random order (stale
   heap items behind), then the same stores;
3. the 4,096-block store of (1) aborted: every victim reinstated;
4. then every chain of (2) touched once more, in random order, and a
   4,096-block store (touches must leave nothing for the planner to skip);
5. on the index of (2): an 8-block lookup timed again and again while
   another thread calls, every millisecond, ``stats()``, ``drop`` of every block of a
   tenant that has none, or on ``drop`` of one small tenant's blocks (stored
   again each round), beside the same lookups with nothing else running and
   with a full walk of the map under the lock in the loop (what ``stats`` and
   a tenant's drop each did before their counts and scopes were kept as
   they change): the stall an admitted peer polling ``Stats`` (or a metrics
   scrape) puts on every engine's Lookup.

"examined" is the number of candidate entries the planner looked at (the
old planner rescanned the LRU from the oldest block for every victim: for a
chain of N blocks that is about victims x N). Prints a markdown table, last.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable

from kvseal.server.hostregion import SLOT_ALIGN
from kvseal.server.index import Index, StorePlan
from kvseal.server.sealing import SealRecord

NS = b"N" * 32
T_FILL = b"f" * 32
T_NEW = b"n" * 32
BLOCK = SLOT_ALIGN  # one slot per block: capacity counts in blocks
REC = SealRecord(0, bytes(12), bytes(16))  # the index never looks inside a record
BATCH = 10_000


def cpu_line() -> str:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU: {model or platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def hashes(tag: bytes, start: int, n: int) -> list[bytes]:
    return [tag + i.to_bytes(32 - len(tag), "big") for i in range(start, start + n)]


def fill_chain(idx: Index, n: int) -> None:
    parent: bytes | None = None
    for start in range(0, n, BATCH):
        hs = hashes(b"c", start, min(BATCH, n - start))
        plan = idx.begin_store(NS, T_FILL, parent, hs, BLOCK)
        idx.complete_store(plan.new, [REC] * len(plan.new))
        parent = hs[-1]


def fill_short_chains(idx: Index, n: int, length: int) -> list[list[bytes]]:
    chains = [hashes(b"s" + i.to_bytes(4, "big"), 0, length) for i in range(n // length)]
    for c in chains:
        plan = idx.begin_store(NS, T_FILL, None, c, BLOCK)
        idx.complete_store(plan.new, [REC] * len(plan.new))
    return chains


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


class Rows:
    def __init__(self) -> None:
        self.rows: list[tuple[str, int, int, int, float, str, float]] = []
        self.tag = 0

    def store(self, idx: Index, label: str, k: int, *, abort: bool = False) -> None:
        cached = idx.stats().ready
        self.tag += 1
        new = hashes(b"n" + self.tag.to_bytes(2, "big"), 0, k)
        before = idx.examined
        plan, t_plan = timed(lambda: idx.begin_store(NS, T_NEW, None, new, BLOCK))
        assert isinstance(plan, StorePlan)
        examined = idx.examined - before
        if abort:
            _, t_settle = timed(lambda: idx.abort_store(plan, set()))
            settle = "abort_store"
        else:
            _, t_settle = timed(lambda: idx.complete_store(plan.new, [REC] * len(plan.new)))
            settle = "complete_store"
        self.rows.append((label, cached, len(plan.evicted), examined, t_plan, settle, t_settle))

    def table(self) -> str:
        out = [
            "| workload | blocks in cache | victims | examined | begin_store ms "
            "| settle | settle ms | total ms under lock |",
            "|---|---:|---:|---:|---:|---|---:|---:|",
        ]
        for label, cached, victims, examined, t_plan, settle, t_settle in self.rows:
            out.append(
                f"| {label} | {cached:,} | {victims:,} | {examined:,} | {t_plan:.2f} "
                f"| {settle} | {t_settle:.2f} | {t_plan + t_settle:.2f} |"
            )
        return "\n".join(out)


def lookups_beside(
    idx: Index, chains: list[list[bytes]], loop: Callable[[], object] | None, seconds: float
) -> tuple[float, float, float, int, int]:
    """p50, p99 and max µs of 8-block lookups made back to back for ``seconds``
    while another thread calls ``loop`` every millisecond (None: nothing else
    runs), how many lookups took over 1 ms, and how many calls the loop made."""
    stop = threading.Event()
    calls = 0

    def spin() -> None:
        nonlocal calls
        while not stop.wait(0.001):  # a poller: 1 ms between calls
            loop()  # type: ignore[misc]
            calls += 1

    t = threading.Thread(target=spin, daemon=True) if loop is not None else None
    if t is not None:
        t.start()
    lat = []
    try:
        end = time.perf_counter() + seconds
        i = 0
        while time.perf_counter() < end:
            i += 1
            c = chains[(i * 7919) % len(chains)]
            t0 = time.perf_counter()
            idx.lookup(NS, T_FILL, c)
            lat.append((time.perf_counter() - t0) * 1e6)
    finally:
        stop.set()
        if t is not None:
            t.join()
    lat.sort()
    slow = sum(1 for x in lat if x > 1000)
    return statistics.median(lat), lat[int(len(lat) * 0.99) - 1], lat[-1], slow, calls


def stalls(
    idx: Index, chains: list[list[bytes]], seconds: float
) -> list[tuple[str, float, float, float, int, int]]:
    """Workload 5 (module docstring): one row per background loop."""
    small = hashes(b"t", 0, 8)
    t_small = b"s" * 32
    t_none = b"z" * 32

    def drop_small() -> None:
        plan = idx.begin_store(NS, t_small, None, small, BLOCK)
        idx.complete_store(plan.new, [REC] * len(plan.new))
        idx.drop(NS, t_small, None)

    def full_walk() -> None:  # what stats() and drop(all_of_tenant) did before
        with idx._lock:
            sum(1 for e in idx._map.values() if e.pins)
            [e for k, e in idx._map.items() if k[1] == t_none]

    beside = [
        ("nothing else running", None),
        ("stats() in a loop", idx.stats),
        ("drop(all of a tenant with no blocks) in a loop", lambda: idx.drop(NS, t_none, None)),
        ("store + drop(all) of an 8-block tenant in a loop", drop_small),
        ("reference: a full walk of the map under the lock, in a loop", full_walk),
    ]
    return [(label, *lookups_beside(idx, chains, loop, seconds)) for label, loop in beside]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1_000_000, help="blocks in the cache")
    ap.add_argument("--quick", action="store_true", help="100,000 blocks (smoke run)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--stall-seconds", type=float, default=None, help="lookups per row of workload 5 (3 s)"
    )
    args = ap.parse_args(argv)
    n = 100_000 if args.quick else args.blocks
    rng = random.Random(args.seed)
    rows = Rows()
    gc.disable()  # a collection pass over a million entries is not index work
    sizes = [k for k in (1, 64, 4096) if k < n // 2]

    def step(msg: str) -> None:
        print(f"[bench-index] {msg}", file=sys.stderr, flush=True)

    step(f"one chain of {n:,} blocks")
    idx = Index(n * BLOCK)
    fill_chain(idx, n)
    for k in sizes:
        rows.store(idx, "one long chain", k)
    rows.store(idx, "one long chain, store fails", sizes[-1], abort=True)
    del idx
    gc.collect()

    step(f"{n // 8:,} chains of 8 blocks")
    idx = Index(n * BLOCK)
    chains = fill_short_chains(idx, n, 8)
    for c in rng.sample(chains, len(chains) // 2):
        idx.touch(NS, T_FILL, c)
    for k in sizes:
        rows.store(idx, "chains of 8, half touched", k)
    step("every chain touched once more")
    rng.shuffle(chains)
    for c in chains:
        idx.touch(NS, T_FILL, c)
    rows.store(idx, "chains of 8, all touched since", sizes[-1])

    step("lookups beside Stats and drops")
    seconds = args.stall_seconds or (0.5 if args.quick else 3.0)
    cached = idx.stats().ready
    stall_rows = stalls(idx, chains, seconds)
    del idx, chains
    gc.collect()

    print("## kvseal trusted-index eviction benchmark")
    print()
    print(cpu_line() + f"; Python {platform.python_version()}; shared machine, noisy figures.")
    print("Times are wall clock around each call (the call holds the index lock throughout).")
    print()
    print(rows.table())
    print()
    print(
        f"8-block lookups on {cached:,} cached blocks while another thread calls the row's "
        f"operation every ms (lookups back to back for {seconds:g} s per row; µs per lookup, "
        "wall clock):"
    )
    print()
    print(
        "| beside the lookups | lookup p50 µs | p99 µs | max µs | lookups over 1 ms "
        "| the row's calls meanwhile |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for label, p50, p99, mx, slow, calls in stall_rows:
        print(f"| {label} | {p50:.1f} | {p99:.1f} | {mx:.1f} | {slow:,} | {calls:,} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
