"""The timing, prefix-probe and metrics measurements of ``bench/leak_surface.py``
(sections 2 to 4 of its docstring), and the statistics they are reported with.

Each function talks to a daemon only through the public client; none asserts a
speed. ``leak_surface.py`` owns the daemons, the pools and the report.
"""

from __future__ import annotations

import itertools
import math
import random
import re
import secrets
import statistics
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from bench_cpu import percentile
from kvseal.client import KVSealClient, chain_block_hashes, tenant_digest

BIG_TIMEOUT = 600.0  # seconds: a 64-block request on a loaded 2-core machine


# ---------------------------------------------------------------- 2. timing


@dataclass
class TimingRow:
    blocks: int
    offload: list[float]
    restore: list[float]


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x; returns a, b, R^2."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    b = sxy / sxx if sxx else 0.0
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - (a + b * x)) ** 2 for x, y in zip(xs, ys, strict=True))
    return a, b, 1.0 - ss_res / ss_tot if ss_tot else 1.0


def measure_timing(c: KVSealClient, pool_id: str, batches: list[int], reps: int) -> list[TimingRow]:
    tenant = tenant_digest("timing-salt")
    biggest = max(batches)
    cached = [secrets.token_bytes(32) for _ in range(biggest)]
    c.offload(pool_id, tenant, cached, list(range(biggest)), timeout=BIG_TIMEOUT)
    rows = {n: TimingRow(n, [], []) for n in batches}
    order = [n for n in batches for _ in range(reps + 1)]
    random.shuffle(order)  # interleave sizes so drift on a shared VM hits all alike
    seen: set[int] = set()
    for n in order:
        fresh = [secrets.token_bytes(32) for _ in range(n)]
        t0 = time.perf_counter()
        c.offload(pool_id, tenant, fresh, list(range(n)), timeout=BIG_TIMEOUT)
        t_off = time.perf_counter() - t0
        c.drop(pool_id, tenant, fresh)
        t0 = time.perf_counter()
        c.restore(pool_id, tenant, cached[:n], list(range(n)), timeout=BIG_TIMEOUT)
        t_res = time.perf_counter() - t0
        if n in seen:  # the first of each size is a warm-up
            rows[n].offload.append(t_off)
            rows[n].restore.append(t_res)
        seen.add(n)
    c.drop(pool_id, tenant, cached)
    return [rows[n] for n in batches]


def classify(rows: list[TimingRow], which: str) -> tuple[float, float, float]:
    """The host's guess of n from one latency sample: the measured size whose
    median latency is nearest in log scale (no model). Returns the fraction of
    samples guessed exactly, the fraction within a factor of two, and the
    median relative error |n_hat - n| / n."""
    medians = [(r.blocks, math.log(statistics.median(getattr(r, which)))) for r in rows]
    exact = within2 = 0
    rel: list[float] = []
    for r in rows:
        for t in getattr(r, which):
            guess = min(medians, key=lambda m: abs(m[1] - math.log(t)))[0]
            exact += guess == r.blocks
            within2 += r.blocks / 2 <= guess <= 2 * r.blocks
            rel.append(abs(guess - r.blocks) / r.blocks)
    return exact / len(rel), within2 / len(rel), statistics.median(rel)


def interpolate(rows: list[TimingRow], which: str, n: int) -> float:
    """Median latency at n, linear between measured sizes (clamped at the ends)."""
    pts = [(r.blocks, float(statistics.median(getattr(r, which)))) for r in rows]
    if n <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x0 <= n <= x1:
            return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
    return pts[-1][1]


def pow2_ceil(n: int) -> int:
    return 1 << (n - 1).bit_length()


def entropy_bits(counts: Sequence[int]) -> float:
    total = sum(counts)
    return -sum(k / total * math.log2(k / total) for k in counts if k)


# ---------------------------------------------------------------- 3. probes


@dataclass
class Probe:
    name: str
    who: str
    tenant: bytes
    hashes: list[bytes]
    restore_on_hit: bool
    hits: list[int]
    lookup_s: list[float]
    total_s: list[float]


def measure_probes(
    c: KVSealClient, pool_id: str, tokens_per_page: int, prompt_blocks: int, rounds: int
) -> list[Probe]:
    victim, attacker = "victim-salt-5d1c", "attacker-salt-9e02"
    tv, ta = tenant_digest(victim), tenant_digest(attacker)
    n_tok = prompt_blocks * tokens_per_page
    prompt = [random.randrange(50_000) for _ in range(n_tok)]
    other = [random.randrange(50_000) for _ in range(n_tok)]
    victim_chain = chain_block_hashes(prompt, tokens_per_page, cache_salt=victim)
    c.offload(pool_id, tv, victim_chain, list(range(prompt_blocks)), timeout=BIG_TIMEOUT)
    probes = [
        Probe("cached prompt", "victim", tv, victim_chain, True, [], [], []),
        Probe(
            "never-cached prompt",
            "victim",
            tv,
            chain_block_hashes(other, tokens_per_page, cache_salt=victim),
            True,
            [],
            [],
            [],
        ),
        Probe(
            "victim's prompt, own salt",
            "attacker",
            ta,
            chain_block_hashes(prompt, tokens_per_page, cache_salt=attacker),
            True,
            [],
            [],
            [],
        ),
        Probe(
            "never-cached prompt",
            "attacker",
            ta,
            chain_block_hashes(other, tokens_per_page, cache_salt=attacker),
            True,
            [],
            [],
            [],
        ),
        Probe("victim's exact hashes, own digest", "attacker", ta, victim_chain, True, [], [], []),
    ]
    pages = list(range(prompt_blocks, 2 * prompt_blocks))  # restore into other pages
    order = [p for p in probes for _ in range(rounds + 5)]
    random.shuffle(order)
    warm: dict[int, int] = {}
    for p in order:
        t0 = time.perf_counter()
        hit = c.lookup(pool_id, p.tenant, p.hashes).hit_blocks
        t1 = time.perf_counter()
        if hit and p.restore_on_hit:
            c.restore(pool_id, p.tenant, p.hashes[:hit], pages[:hit], timeout=BIG_TIMEOUT)
        t2 = time.perf_counter()
        k = id(p)
        warm[k] = warm.get(k, 0) + 1
        if warm[k] > 5:  # five warm-ups per probe kind
            p.hits.append(hit)
            p.lookup_s.append(t1 - t0)
            p.total_s.append(t2 - t0)
    c.drop(pool_id, tv, victim_chain)
    return probes


def bootstrap_median_diff(
    a: list[float], b: list[float], n: int = 2000
) -> tuple[float, float, float]:
    rng = random.Random(1)
    point = statistics.median(a) - statistics.median(b)
    diffs = sorted(
        statistics.median(rng.choices(a, k=len(a))) - statistics.median(rng.choices(b, k=len(b)))
        for _ in range(n)
    )
    return point, percentile(diffs, 0.025), percentile(diffs, 0.975)


# ---------------------------------------------------------------- 4. metrics


LABEL_RE = re.compile(r'(\w+)="([^"]*)"')
DIGEST_RE = re.compile(r"^[0-9a-fA-F]{16,}$|^[A-Za-z0-9+/=_-]{22,}$")


def scrape(port: int) -> dict[str, set[tuple[str, str]]]:
    """Family name -> set of (label, value) seen on any of its samples."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    fams: dict[str, set[tuple[str, str]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = re.split(r"[{ ]", line, maxsplit=1)[0]
        base = re.sub(r"_(bucket|count|sum|total|created)$", "", name)
        labels = fams.setdefault(base, set())
        brace = line[line.find("{") + 1 : line.rfind("}")] if "{" in line else ""
        labels.update(LABEL_RE.findall(brace))
    return fams


def stats_delta(before: object, after: object, fields: Sequence[str]) -> dict[str, int]:
    return {f: int(getattr(after, f)) - int(getattr(before, f)) for f in fields}
