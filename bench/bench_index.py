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
   4,096-block store (touches must leave nothing for the planner to skip).

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
import sys
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=1_000_000, help="blocks in the cache")
    ap.add_argument("--quick", action="store_true", help="100,000 blocks (smoke run)")
    ap.add_argument("--seed", type=int, default=1)
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
    del idx, chains
    gc.collect()

    print("## kvseal trusted-index eviction benchmark")
    print()
    print(cpu_line() + f"; Python {platform.python_version()}; shared machine, noisy figures.")
    print("Times are wall clock around each call (the call holds the index lock throughout).")
    print()
    print(rows.table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
