"""Tables and plots of the serving benchmark from a results JSON of bench.serving.run.

    python -m bench.serving.report RESULTS.json [--md OUT.md] [--png-prefix docs/serving]

writes the markdown tables (to stdout, or between the ``<!-- tables -->``
markers of ``--md``: ``make serving-report`` names bench/serving/history/README.md,
where the full tables and the log of runs live) and the PNG plots (throughput
vs rate, TTFT p50/p99 vs gap, cached share per arm, and, when the results have
salted conversations, tier share per tenant count), which docs/serving.md
shows. Every plot's title says where its results were measured (``where``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

NAMES = {"none": "no offload", "plain": "plaintext anchor", "wt": "kvseal write-through",
         "wb": "kvseal write-back", "ev": "kvseal offload at eviction",
         "ewb": "kvseal write-back over eviction",
         "sg-none": "SGLang, no offload",
         "sg-wt": "SGLang + kvseal write-through",
         "sg-ev": "SGLang + kvseal offload at eviction",
         "sg-ewb": "SGLang + kvseal write-back over eviction", "h-none": "hybrid, no offload",
         "h-plain": "hybrid, plaintext anchor",
         "h-wt": "hybrid, kvseal write-through"}  # fmt: skip
BASELINES = ("none", "sg-none", "h-none")  # arms with no second tier


def _base(arm: str) -> str:
    """The no-offload arm an arm is compared with: SGLang's for SGLang arms,
    the hybrid model's for its arms."""
    return "sg-none" if arm.startswith("sg-") else "h-none" if arm.startswith("h-") else "none"


def where(res: dict[str, Any]) -> str:
    """Where a results file was measured, for a figure's title: the machine
    that ``bench.serving.run`` recorded (``machine``), else what every results
    file holds (its CPU count). Every arm of the serving benchmark runs its
    engine on the CPU (vLLM's CPU platform, SGLang ``--device cpu``), so a file
    written before ``machine`` was recorded was measured without a GPU too."""
    m = res.get("machine") or f"{res.get('cpus', '?')} CPUs, no GPU"
    day = str(res.get("started") or "").split(" ")[0]
    return f"measured on {m}, engines on the CPU" + (f", {day}" if day else "")


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


BEGIN, END = _markers("tables")
SALTED = "conv-salted"
# Fields of a salted point where the rounds' worst value is the one to show,
# not their median: one round in which a tenant starved or saw another
# tenant's blocks is a failure that a median of three would hide.
WORST_MAX = ("tenants_starved", "cross_tenant_cached", "integrity_failures")
WORST_MIN = ("tenant_min_cached",)


def _points(res: dict[str, Any], arm: str, wl: str) -> list[dict[str, Any]]:
    """An arm's points of one workload by x; a point run in several rounds
    (conversations) is their median, field by field, with ``rounds`` and
    ``req_s_all`` (every round's req/s) added."""
    by_x: dict[float, list[dict[str, Any]]] = {}
    for p in res["arms"].get(arm, {}).get("points", []):
        if p["workload"] == wl:
            by_x.setdefault(float(p["x"]), []).append(p)
    return [_median_point(by_x[x]) for x in sorted(by_x)]


def _median_point(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(rounds[0])
    for k, v in rounds[0].items():
        vals = [r.get(k) for r in rounds]
        if isinstance(v, (int, float)) and not isinstance(v, bool) and None not in vals:
            out[k] = (max(vals) if k in WORST_MAX else min(vals) if k in WORST_MIN
                      else statistics.median(vals))  # fmt: skip
    out["rounds"] = len(rounds)
    out["req_s_all"] = [r["req_s"] for r in rounds]
    return out


def _req_s(p: dict[str, Any]) -> str:
    """req/s, with the range over rounds when there were several."""
    if p.get("rounds", 1) > 1:
        return f"{p['req_s']:.3f} ({min(p['req_s_all']):.2f}-{max(p['req_s_all']):.2f})"
    return f"{p['req_s']:.3f}"


def _match(res: dict[str, Any], arm: str, p: dict[str, Any]) -> dict[str, Any] | None:
    for q in _points(res, arm, p["workload"]):
        if q["x"] == p["x"]:
            return q
    return None


def _cpu(p: dict[str, Any]) -> str:
    n = p.get("requests") or 0
    if "engine_cpu_s" not in p or not n:
        return "—"
    d = "—" if p.get("restored_blocks") is None else f"{1e3 * p['daemon_cpu_s'] / n:.0f}"
    return f"{1e3 * p['engine_cpu_s'] / n:.0f} / {d}"


def tables(res: dict[str, Any]) -> list[str]:
    out: list[str] = []
    arms = list(res["arms"])
    eb = {res["arms"][a].get("engine_blocks") for a in arms}
    # SGLang arms report no block count (vLLM's cache_config_info): the size asked for.
    seen = ", ".join(str(b) for b in sorted(eb, key=str) if b is not None)
    where = f"as vLLM reports it: {seen}" if seen else f"as asked: {res.get('engine_blocks')}"
    llama = " (Llama arms)" if any(a.startswith("h-") for a in arms) else ""
    out.append(
        f"Engine KV cache {where}"
        f" blocks of {res.get('block_tokens')} tokens; second tier {res.get('host_blocks')}"
        f" blocks{llama}. *load*: the machine's 1-minute load average when the point ended"
        f" ({res.get('cpus')} CPUs)."
    )
    hybrid = [a for a in arms if a.startswith("h-")]
    if hybrid:
        b = res["arms"][hybrid[0]].get("bytes") or {}
        out.append("")
        out.append(
            "Hybrid arms (the Gemma-3-like model of bench/serving/model.py, four KV-cache"
            f" groups): engine KV cache {b.get('engine', 0) / 2**20:.1f} MiB"
            f" ({res['arms'][hybrid[0]].get('engine_blocks')} blocks of the shared pool),"
            f" second tier {b.get('tier', 0) / 2**20:.1f} MiB per offload arm."
        )
    out.append("")
    out.append("Per-token costs (one request alone, TTFT / 1,024 prompt tokens):")
    out.append("")
    out.append(
        "| arm | compute (cold prefill), ms/token | restored from the tier, ms/token"
        " | tokens restored |"
    )
    out.append("| --- | --- | --- | --- |")
    for a in arms:
        c = res["arms"][a].get("costs", {})
        r = c.get("restore_ms_per_token")
        rs = "—" if r is None else f"{r:.3f}"
        n = c.get("restored_cached_tokens", "—")
        out.append(f"| {NAMES.get(a, a)} | {c.get('compute_ms_per_token', 0):.3f} | {rs} | {n} |")
    for wl, title in (("llmd", "llm-d shape (Poisson arrivals)"),
                      ("conv", "conversation replay (gap 0 = saturated; req/s: median of"
                               " the rounds, their range in brackets)"),
                      ("fits", "fits in the engine cache")):  # fmt: skip
        if any(_points(res, a, wl) for a in arms):  # a run of some workloads only
            out += ["", f"**{title}**", "", *_workload_table(res, arms, wl)]
    if any(_points(res, a, SALTED) for a in arms):
        out += _salted_tables(res, arms)
    return out + tier_table(res) + sealed_table(res)


def sealed_table(res: dict[str, Any]) -> list[str]:
    """Bytes sealed per prompt token served, per kvseal arm and workload: the
    daemon's offloaded blocks (plaintext bytes of each) over the prompt tokens
    of the workload's points, and the share of those tokens the tier served.
    Write-through seals every computed block; offload at eviction only what
    the engine was about to lose."""
    bb = int(res.get("kv_bytes_per_token") or 0) * int(res.get("block_tokens") or 0)
    rows = []
    # Hybrid arms' blocks are another size (a group's block, not the Llama's).
    for a, r in ((a, r) for a, r in res["arms"].items() if not a.startswith("h-")):
        by_wl: dict[str, list[dict[str, Any]]] = {}
        for p in r.get("points", []):
            if p.get("offloaded_blocks") is not None:
                by_wl.setdefault(p["workload"], []).append(p)
        for wl, pts in by_wl.items():
            prompt = sum(p["prompt_tokens"] for p in pts)
            sealed = sum(p["offloaded_blocks"] for p in pts)
            tier = sum(p["cached_tier"] * p["prompt_tokens"] for p in pts)
            rows.append((a, wl, sealed, prompt, tier))
    if not rows or not bb:
        return []
    out = ["", "**Bytes sealed per prompt token** (all points of a workload; a block is"
           f" {bb:,} bytes of KV)", "",
           "| arm | workload | blocks sealed | prompt tokens | sealed bytes per prompt token"
           " | served from the tier |", "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for a, wl, sealed, prompt, tier in rows:
        per = sealed * bb / prompt if prompt else 0.0
        share = tier / prompt if prompt else 0.0
        out.append(f"| {NAMES.get(a, a)} | {wl} | {sealed:,} | {prompt:,} | {per:,.0f} |"
                   f" {share:.0%} |")  # fmt: skip
    return out


def _workload_table(res: dict[str, Any], arms: list[str], wl: str) -> list[str]:
    """One workload's table, a row per arm and point; salted conversations add
    their per-tenant columns (run.py's ``tenant_summary``)."""
    salted = wl == SALTED
    extra_h = ""
    if salted:
        extra_h = (" cached share of returning turns per tenant: min-max | starved tenants"
                   " | cross-tenant cached tokens (first turns checked) |")  # fmt: skip
    out = [
        "| arm | point | req/s | out tok/s | TTFT mean / p50 / p99 s | cached: engine / tier"
        " | restored / offloaded / restore-failed blocks | integrity failures"
        " | req/s vs no offload | load"
        " | CPU ms/request: engine / daemon |" + extra_h,
        "| --- " * (14 if salted else 11) + "|",
    ]
    for a in arms:
        for p in _points(res, a, wl):
            base = _match(res, _base(a), p)
            ratio = f"{p['req_s'] / base['req_s']:.2f}x" if base and base["req_s"] else "—"
            lf = p.get("load_failed_blocks")  # absent from runs before run 7
            rb = (
                "—"
                if p["restored_blocks"] is None
                else f"{p['restored_blocks']} / {p['offloaded_blocks']}"
                f" / {'—' if lf is None else lf}"
            )
            extra = ""
            if salted:
                extra = (f" {p['tenant_min_cached']:.0%}-{p['tenant_max_cached']:.0%} |"
                         f" {p['tenants_starved']} | {p['cross_tenant_cached']}"
                         f" ({p['first_turns_checked']}) |")  # fmt: skip
            out.append(
                f"| {NAMES.get(a, a)} | {p['x_name']} {p['x']} | {_req_s(p)} |"
                f" {p['out_tok_s']:.1f} | {p['ttft_mean']:.2f} / {p['ttft_p50']:.2f} /"
                f" {p['ttft_p99']:.2f} | {p['cached_engine']:.0%} / {p['cached_tier']:.0%} |"
                f" {rb} | {p['integrity_failures']} | {ratio} |"
                f" {p.get('load_avg', float('nan')):.1f} | {_cpu(p)} |{extra}"
            )  # fmt: skip
    return out


def _salted_tables(res: dict[str, Any], arms: list[str]) -> list[str]:
    """The salted conversations' table and the tier share per tenant count:
    one row per tenant count, one column per arm (tier share, and in brackets
    all cached tokens, engine's included), then kvseal write-through's tier
    share over the anchor's (the goal's ratio)."""
    out = ["", "**conversations under per-tenant cache salts** (one salt for all ..."
           " one per conversation; req/s: median of the rounds, their range in brackets;"
           " per-tenant columns: the worst round)", ""]  # fmt: skip
    out += _workload_table(res, arms, SALTED)
    out += ["", "**Tier share per tenant count** (share of prompt tokens served from the"
            " second tier; in brackets engine and tier together)", ""]  # fmt: skip
    out.append("| tenants | " + " | ".join(NAMES.get(a, a) for a in arms)
               + " | write-through / anchor, tier share |")  # fmt: skip
    out.append("| --- " * (len(arms) + 2) + "|")
    xs = sorted({p["x"] for a in arms for p in _points(res, a, SALTED)})
    for x in xs:
        cells = []
        by_arm: dict[str, dict[str, Any]] = {}
        for a in arms:
            q = next((p for p in _points(res, a, SALTED) if p["x"] == x), None)
            if q is None:
                cells.append("—")
                continue
            by_arm[a] = q
            cells.append(f"{q['cached_tier']:.1%} ({q['cached_engine'] + q['cached_tier']:.0%})")
        wt, pl = by_arm.get("wt"), by_arm.get("plain")
        r = (
            f"{wt['cached_tier'] / pl['cached_tier']:.3f}x"
            if wt and pl and pl["cached_tier"]
            else "—"
        )
        out.append(f"| {x:g} | " + " | ".join(cells) + f" | {r} |")
    return out


def goals(res: dict[str, Any]) -> list[str]:
    """The issue's goals, checked point by point against this results file.

    Throughput >= 2x no offload is a goal for kvseal where an offload can
    reach it at all: the plaintext anchor (the same tier without
    confidentiality) bounds what any offload gets from a workload, so where
    the anchor itself stays below 2x (an offered rate or an inter-turn gap
    that no offload can beat) and kvseal is within 10% of the anchor, the
    verdict is "bound" (the workload's), not "no".
    """
    out = ["", "**Goals, checked on this run**", ""]
    out.append("| goal | point | measured | met |")
    out.append("| --- | --- | --- | --- |")

    def row(goal: str, p: dict[str, Any], measured: str, ok: bool | str) -> None:
        verdict = ok if isinstance(ok, str) else ("yes" if ok else "no")
        out.append(f"| {goal} | {p['workload']} {p['x_name']} {p['x']} | {measured} |"
                   f" {verdict} |")  # fmt: skip

    for a in ("wt", "wb"):
        # Throughput, TTFT and the anchor: kvseal's default, write-through. Write-back
        # is measured for its own goal (below): on vLLM 0.32 it cannot keep a block
        # the engine evicts (docs/serving.md), so it is not the mode to judge by.
        for wl in ("llmd", "conv") if a == "wt" else ():
            for p in _points(res, a, wl):
                b, pl = _match(res, "none", p), _match(res, "plain", p)
                anchor = pl["req_s"] / b["req_s"] if pl and b and b["req_s"] else None
                near = bool(pl and pl["req_s"] and p["req_s"] / pl["req_s"] >= 0.9)
                if b and b["req_s"]:
                    r = p["req_s"] / b["req_s"]
                    if r >= 2.0:
                        row(f"{a}: throughput >= 2x no offload", p, f"{r:.2f}x", True)
                    elif anchor is not None and anchor < 2.0 and near:
                        row(f"{a}: throughput >= 2x no offload", p,
                            f"{r:.2f}x; plaintext anchor {anchor:.2f}x", "bound")  # fmt: skip
                    else:
                        row(f"{a}: throughput >= 2x no offload", p, f"{r:.2f}x", False)
                    row(f"{a}: TTFT p99 below no offload", p,
                        f"{p['ttft_p99']:.2f} s vs {b['ttft_p99']:.2f} s",
                        p["ttft_p99"] < b["ttft_p99"])  # fmt: skip
                if pl and pl["req_s"]:
                    r = p["req_s"] / pl["req_s"]
                    row(f"{a}: within 10% of the plaintext anchor", p, f"{r:.2f}x", r >= 0.9)
        for p in _points(res, a, "fits"):
            b = _match(res, "none", p)
            if b and b["req_s"]:
                loss = 1 - p["req_s"] / b["req_s"]
                row(f"{a}: fits-in-cache loss <= 2%", p, f"{loss:+.1%}", loss <= 0.02)
    # SGLang (issue 21): kvseal's linker against SGLang's own radix cache alone
    # (there is no plaintext anchor on SGLang: its host tier needs
    # cudaHostRegister, docs/sglang.md).
    for wl in ("llmd", "conv"):
        for p in _points(res, "sg-wt", wl):
            b = _match(res, "sg-none", p)
            if b and b["req_s"]:
                r = p["req_s"] / b["req_s"]
                row("sg-wt: throughput >= 2x SGLang no offload", p, f"{r:.2f}x", r >= 2.0)
                row("sg-wt: TTFT p99 below SGLang no offload", p,
                    f"{p['ttft_p99']:.2f} s vs {b['ttft_p99']:.2f} s",
                    p["ttft_p99"] < b["ttft_p99"])  # fmt: skip
            row("sg-wt: no integrity failure", p, str(p["integrity_failures"]),
                p["integrity_failures"] == 0)  # fmt: skip
    # Salted conversations (issue 20): the tier must serve every tenant what the
    # anchor serves it (tier share >= 0.98x; the anchor's tier is keyed by
    # vLLM's salted block hashes), at the anchor's throughput and faster than
    # recomputing; and no arm may serve a tenant's first request from another
    # tenant's blocks.
    for p in _points(res, "wt", SALTED):
        b, pl = _match(res, "none", p), _match(res, "plain", p)
        if pl is not None:
            t, ta = p["cached_tier"], pl["cached_tier"]
            ok = t >= 0.98 * ta
            shown = f"{t:.1%} vs {ta:.1%}" + (f" ({t / ta:.3f}x)" if ta else "")
            row("wt: tier share >= 0.98x the plaintext anchor", p, shown, ok)
            if pl["req_s"]:
                r = p["req_s"] / pl["req_s"]
                row("wt: within 10% of the plaintext anchor", p, f"{r:.2f}x", r >= 0.9)
        if b is not None:
            row("wt: TTFT p99 below no offload", p,
                f"{p['ttft_p99']:.2f} s vs {b['ttft_p99']:.2f} s",
                p["ttft_p99"] < b["ttft_p99"])  # fmt: skip

    # Per arm over every tenant count: the tenants' isolated first requests
    # (one tenant has none: nobody else to leak from) and the starved tenants.
    def xs(pts: list[dict[str, Any]]) -> str:
        return f"{SALTED} tenants " + ", ".join(f"{p['x']:g}" for p in pts)

    def line(goal: str, where: str, measured: str, ok: bool) -> None:
        out.append(f"| {goal} | {where} | {measured} | {'yes' if ok else 'no'} |")

    for a in res["arms"]:
        pts = [p for p in _points(res, a, SALTED) if p["first_turns_checked"]]
        if pts:
            leaked = sum(p["cross_tenant_cached"] for p in pts)
            checked = sum(p["first_turns_checked"] for p in pts)
            line(f"{a}: no first turn served from another tenant's blocks", xs(pts),
                 f"{leaked} tokens on {checked} first turns", leaked == 0)  # fmt: skip
    wt = _points(res, "wt", SALTED)
    if wt:
        pl = [_match(res, "plain", p) for p in wt]
        mine = [p["tenants_starved"] for p in wt]
        theirs = ["—" if q is None else str(q["tenants_starved"]) for q in pl]
        ok = all(q is not None and m <= q["tenants_starved"] for m, q in zip(mine, pl, strict=True))
        line("wt: no tenant starved (every returning turn missed) that the anchor served",
             xs(wt), f"{'/'.join(map(str, mine))} (anchor {'/'.join(theirs)})", ok)  # fmt: skip
    for p in _points(res, "wb", "conv"):
        q = _match(res, "wt", p)
        if q is not None:
            sb = p["cached_engine"] + p["cached_tier"]
            st = q["cached_engine"] + q["cached_tier"]
            row("write-back caches more than write-through", p, f"{sb:.0%} vs {st:.0%}", sb > st)
    out += _hybrid_goals(res, row)
    _evict_goals(res, row)
    return out


def _evict_goals(res: dict[str, Any], row: Any) -> None:
    """Issue 29's goals for the modes that seal at eviction (``ev``, ``ewb``,
    ``sg-ev``): *fits* costs at most 1% against no offload (and is no worse
    than the plaintext anchor) and seals nothing; write-back over eviction
    caches at least what write-through caches on conversations. Rows go
    through ``row`` into goals' table."""
    for a in ("ev", "ewb", "sg-ev", "sg-ewb"):
        for p in _points(res, a, "fits"):
            b, pl = _match(res, _base(a), p), _match(res, "plain", p)
            if b and b["req_s"]:
                loss = 1 - p["req_s"] / b["req_s"]
                row(f"{a}: fits costs <= 1%", p, f"{loss:+.1%}", loss <= 0.01)
            if pl and pl["req_s"] and not a.startswith("sg-"):
                r = p["req_s"] / pl["req_s"]
                row(f"{a}: fits at least the plaintext anchor", p, f"{r:.3f}x", r >= 1.0)
            # Every round's seals (the median would hide a first round's).
            rounds = [q for q in res["arms"][a]["points"] if q["workload"] == "fits"
                      and float(q["x"]) == float(p["x"])]  # fmt: skip
            n = sum(q.get("offloaded_blocks") or 0 for q in rounds)
            row(f"{a}: fits seals nothing", p, f"{n} blocks in {len(rounds)} round(s)", n == 0)
    for a, ref in (("ewb", "wt"), ("ev", "wt"), ("sg-ev", "sg-wt"), ("sg-ewb", "sg-wt")):
        for p in _points(res, a, "conv"):
            q = _match(res, ref, p)
            if q is not None:
                sa = p["cached_engine"] + p["cached_tier"]
                sr = q["cached_engine"] + q["cached_tier"]
                row(f"{a}: caches at least what {ref} caches", p, f"{sa:.0%} vs {sr:.0%}",
                    sa >= sr)  # fmt: skip


def _hybrid_goals(res: dict[str, Any], row: Any) -> list[str]:
    """Issue 27's goals for the hybrid model (Gemma-3-like, four KV-cache
    groups) on the llm-d shape: >= 2x no offload at the saturated points (the
    offered rates at which no offload completes fewer requests than offered),
    >= 0.95x the plaintext anchor's throughput, and at least the anchor's
    tokens per tier byte. Rows go through ``row`` into goals' table."""
    for p in _points(res, "h-wt", "llmd"):
        b, pl = _match(res, "h-none", p), _match(res, "h-plain", p)
        if b and b["req_s"]:
            r = p["req_s"] / b["req_s"]
            saturated = b["req_s"] < 0.9 * float(p["x"])
            goal = "h-wt: throughput >= 2x no offload" + ("" if saturated else " (not saturated)")
            row(goal, p, f"{r:.2f}x", r >= 2.0 if saturated else "—")
        if pl and pl["req_s"]:
            r = p["req_s"] / pl["req_s"]
            row("h-wt: >= 0.95x the plaintext anchor", p, f"{r:.2f}x", r >= 0.95)
        row("h-wt: no integrity failure", p, str(p["integrity_failures"]),
            p["integrity_failures"] == 0)  # fmt: skip
    mine = res["arms"].get("h-wt", {}).get("tier") or {}
    theirs = res["arms"].get("h-plain", {}).get("tier") or {}
    if mine.get("tokens_per_mib") and theirs.get("tokens_per_mib"):
        a, b = mine["tokens_per_mib"], theirs["tokens_per_mib"]
        return [
            f"| h-wt: tokens per tier byte >= the plaintext anchor's | end of run |"
            f" {a:.0f} vs {b:.0f} tokens/MiB ({a / b:.3f}x) | {'yes' if a >= b else 'no'} |"
        ]
    return []


def tier_table(res: dict[str, Any]) -> list[str]:
    """What each offload arm's tier holds at the end (arms.Arm.tier_summary):
    entries (one group's block each), their bytes, tokens per tier MiB."""
    rows = [(a, r["tier"]) for a, r in res["arms"].items() if r.get("tier")]
    if not rows:
        return []
    out = ["", "**Tier capacity** (an entry is one KV-cache group's block of"
           f" {res.get('block_tokens')} tokens)", "",
           "| arm | tier bytes | entries | bytes per entry | tokens per tier MiB |",
           "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for a, t in rows:
        held = f" ({t['held']:,} held at the end)" if "held" in t else ""
        out.append(f"| {NAMES.get(a, a)} | {t['tier_bytes']:,} | {t['entries']:,}{held} |"
                   f" {t['entry_bytes']:,} | {t['tokens_per_mib']:.0f} |")  # fmt: skip
    return out


def summary_lines(res: dict[str, Any]) -> list[str]:
    lines = tables(res) + goals(res)
    probes = {a: r.get("probe") for a, r in res["arms"].items()}
    same = len(set(probes.values())) == 1
    lines.append("")
    lines.append(f"greedy probe identical across arms: {same}")
    return lines


def plots(res: dict[str, Any], prefix: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(res["arms"])
    files = []
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for a in arms:
        pts = _points(res, a, "llmd")
        ax.plot([p["x"] for p in pts], [p["req_s"] for p in pts], marker="o", label=NAMES.get(a, a))
    ax.set_xlabel("offered rate, requests/s")
    ax.set_ylabel("completed requests/s")
    ax.set_title("llm-d shape: throughput vs rate\n" + where(res), fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    files.append(f"{prefix}-throughput.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for a in arms:
        pts = _points(res, a, "conv")
        xs = [p["x"] for p in pts]
        ln = ax.plot(xs, [p["ttft_p50"] for p in pts], marker="o", label=f"{NAMES.get(a, a)} p50")
        ax.plot(xs, [p["ttft_p99"] for p in pts], marker="x", ls="--", color=ln[0].get_color(),
                label=f"{NAMES.get(a, a)} p99")  # fmt: skip
    ax.set_xlabel("inter-turn gap, s (0 = saturated)")
    ax.set_ylabel("TTFT, s")
    ax.set_title("conversation replay: TTFT vs gap\n" + where(res), fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    files.append(f"{prefix}-ttft.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    if any(_points(res, a, SALTED) for a in arms):
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for a in arms:
            pts = _points(res, a, SALTED)
            xs = [p["x"] for p in pts]
            # No offload has no tier: only its engine's share is drawn.
            color = None
            if a not in BASELINES:
                ln = ax.plot(xs, [p["cached_tier"] for p in pts], marker="o",
                             label=f"{NAMES.get(a, a)} tier")  # fmt: skip
                color = ln[0].get_color()
            ax.plot(xs, [p["cached_engine"] + p["cached_tier"] for p in pts], marker="x",
                    ls="--", color=color, label=f"{NAMES.get(a, a)} engine + tier")  # fmt: skip
        ax.set_xscale("log")
        ax.minorticks_off()
        ticks = sorted({p["x"] for a in arms for p in _points(res, a, SALTED)})
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.set_xlabel("tenants (cache salts); conversations per point fixed")
        ax.set_ylabel("share of prompt tokens")
        ax.set_title("salted conversations: tier share per tenant count\n" + where(res), fontsize=9)
        ax.legend(fontsize=7, ncol=2)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        files.append(f"{prefix}-salted.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    labels: list[str] = []
    eng: list[float] = []
    tier: list[float] = []
    for a in arms:
        for p in (q for wl in ("llmd", "conv", "fits") for q in _points(res, a, wl)):
            labels.append(f"{a}\n{p['workload']} {p['x']:g}")
            eng.append(p["cached_engine"])
            tier.append(p["cached_tier"])
    xs = list(range(len(labels)))
    ax.bar(xs, eng, label="engine prefix cache")
    ax.bar(xs, tier, bottom=eng, label="second tier")
    ax.set_xticks(xs, labels, fontsize=5, rotation=90)
    ax.set_ylabel("share of prompt tokens")
    ax.set_title("prompt tokens served from cache, per arm and point\n" + where(res), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(f"{prefix}-cached.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    return files


def write_section(md: Path, section: str, lines: list[str]) -> None:
    """Replace what lies between ``<!-- SECTION:begin -->`` and ``:end`` in ``md``."""
    s = md.read_text()
    begin, end = _markers(section)
    i, j = s.index(begin) + len(begin), s.index(end)
    md.write_text(s[:i] + "\n" + "\n".join(lines) + "\n" + s[j:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+", help="results JSONs; later files add points")
    ap.add_argument("--md", help="a markdown file whose tables section is replaced")
    ap.add_argument("--png-prefix", help="write the plots as PREFIX-*.png")
    ap.add_argument("--merged", help="also write the merged results JSON here")
    ap.add_argument("--section", default="tables",
                    help="the markers of --md to write between (<!-- NAME:begin -->)")  # fmt: skip
    args = ap.parse_args()
    res = json.loads(Path(args.results[0]).read_text())
    for extra in args.results[1:]:  # e.g. a separate run of more llm-d rates
        more = json.loads(Path(extra).read_text())
        for a, r in more["arms"].items():
            arm = res["arms"].setdefault(a, {"points": []})
            # A later file's points replace the earlier ones of the same workload and x.
            new = {(p["workload"], p["x"]) for p in r["points"]}
            arm["points"] = [p for p in arm["points"] if (p["workload"], p["x"]) not in new]
            arm["points"] += r["points"]
    if args.merged:
        Path(args.merged).write_text(json.dumps(res, indent=1))
    lines = summary_lines(res)
    if args.md:
        write_section(Path(args.md), args.section, lines)
    else:
        print("\n".join(lines))
    if args.png_prefix:
        for f in plots(res, args.png_prefix):
            print("wrote", f)


if __name__ == "__main__":
    main()
