"""``make bench-serving``: a real ``vllm serve`` (CPU platform, the local model
of model.py) with four second-tier arms, driven over HTTP by this module's
own clients (stdlib ``http.client`` in threads, streamed completions for TTFT).

Arms (one server each, in this order, same prompts): ``none`` (prefix caching
only), ``plain`` (the plaintext anchor, bench/serving/anchor.py), ``wt``
(kvseal write-through) and ``wb`` (kvseal write-back), each kvseal arm with a
real daemon of its own. Workloads: ``llmd`` (prefix groups x prompts, long
shared prefix, short question and answer, Poisson arrivals, rate sweep),
``conv`` (multi-turn conversations replayed with bounded concurrency, whole
history resent each turn, inter-turn gap sweep plus a saturated point),
``conv-salted`` (conversations under per-tenant ``cache_salt``s, a sweep of
the number of tenants from one salt shared by all to one per conversation,
the confidential-serving default) and ``fits`` (working set well inside the
engine's KV cache). Every point uses prompts (and salts) of its own (seeded),
so no point reuses another's blocks.

Writes a results JSON (``--out``); ``python -m bench.serving.report`` turns it
into the tables (bench/serving/history/) and plots (docs/serving.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.serving.arms import (  # noqa: E402
    ARMS,
    BLOCK,
    ENGINE_BLOCKS,
    HYBRID_ARMS,
    HYBRID_ENGINE_BYTES,
    HYBRID_HOST_BYTES,
    SHAPE,
    Arm,
    host_blocks,
    stop_arms,
)
from bench.serving.model import KV_BYTES_PER_TOKEN, make_hybrid_model, make_model  # noqa: E402
from bench.serving.workloads import (  # noqa: E402
    PROBE,
    WORKLOADS,
    Result,
    log,
    plan,
    text,
    words,
    workload_points,
)


def make_arm(name: str, model: Path, work: Path) -> Arm:
    """A vLLM arm (ARMS), one of the hybrid model (HYBRID_ARMS), or an SGLang
    one (bench/serving/sglang_arm.py), which needs the SGLang venv: imported
    only when asked for."""
    if name.startswith("sg-"):
        from bench.serving.sglang_arm import SGLANG_ARMS, SGLangArm

        if name not in SGLANG_ARMS:
            raise SystemExit(f"unknown SGLang arm {name!r}: {', '.join(SGLANG_ARMS)}")
        return SGLangArm(name, model, work)
    if name.startswith("h-"):
        if name not in HYBRID_ARMS:
            raise SystemExit(f"unknown hybrid arm {name!r}: {', '.join(HYBRID_ARMS)}")
        # The hybrid model is built beside the Llama, once (model.make_hybrid_model).
        return Arm(name, make_hybrid_model(model.parent / "model-hybrid"), work,
                   mode=name[2:], hybrid=True)  # fmt: skip
    return Arm(name, model, work)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def summarize(results: list[Result], wall: float, m0: dict[str, float], m1: dict[str, float],
              s0: dict[str, int], s1: dict[str, int]) -> dict[str, Any]:  # fmt: skip
    ok = [r for r in results if r.ok]
    tt = [r.ttft for r in ok]
    d = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in m1}
    prompt = sum(r.prompt_tokens for r in ok)
    eng = d.get("prefix_cache_hits", 0.0)
    ext = d.get("external_prefix_cache_hits", 0.0)
    sd = {k: s1.get(k, 0) - s0.get(k, 0) for k in s1}
    return {
        "requests": len(results), "failed": len(results) - len(ok), "wall_s": round(wall, 2),
        "req_s": len(ok) / wall if wall else 0.0,
        "out_tok_s": sum(r.out_tokens for r in ok) / wall if wall else 0.0,
        "ttft_mean": statistics.fmean(tt) if tt else 0.0,
        "ttft_p50": pct(tt, 0.5), "ttft_p99": pct(tt, 0.99),
        "prompt_tokens": prompt,
        "cached_engine": eng / prompt if prompt else 0.0,
        "cached_tier": ext / prompt if prompt else 0.0,
        "cached_usage": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "restored_blocks": sd.get("restored_blocks"),
        "offloaded_blocks": sd.get("offloaded_blocks"),
        "integrity_failures": sd.get("integrity_failures", 0),
        "evicted_blocks": sd.get("evicted_blocks"),
        # vLLM creates the labelled series at the first failure: none yet is 0.
        "load_failed_blocks": None if sd.get("restored_blocks") is None
        else int(d.get("kvseal_load_failed_blocks", 0)),
        **tenant_summary(ok),
    }  # fmt: skip


def tenant_summary(ok: list[Result]) -> dict[str, Any]:
    """Per-tenant figures of a salted point (empty for unsalted ones).

    vLLM's usage reports a request's cached tokens (engine and tier together)
    but not which tier served them, so per tenant this is the cached share of
    its returning turns (turn >= 1): the issue's failure, a whole tenant
    whose returning turns all miss while the others hit, shows as a tenant at
    0 (``tenants_starved``) next to arms where it is not.
    ``cross_tenant_cached``: cached tokens reported by tenants' isolated first
    requests (``Result.isolated_first``), which must be 0 in every arm: a
    salt not honoured by a tier shows here as the shared prompt's tokens.
    """
    salted = [r for r in ok if r.tenant >= 0]
    if not salted:
        return {}
    prompt: dict[int, int] = {}
    cached: dict[int, int] = {}
    for r in salted:
        if r.turn >= 1:
            prompt[r.tenant] = prompt.get(r.tenant, 0) + r.prompt_tokens
            cached[r.tenant] = cached.get(r.tenant, 0) + r.cached_tokens
    shares = [cached[t] / prompt[t] for t in prompt if prompt[t]]
    firsts = [r for r in salted if r.isolated_first]
    return {
        "tenants": len({r.tenant for r in salted}),
        "tenant_min_cached": min(shares) if shares else 0.0,
        "tenant_max_cached": max(shares) if shares else 0.0,
        "tenants_starved": sum(1 for t in prompt if prompt[t] and not cached[t]),
        "first_turns_checked": len(firsts),
        "cross_tenant_cached": sum(r.cached_tokens for r in firsts),
    }


def per_token_costs(arm: Arm, seed: int) -> dict[str, float]:
    """Prefill cost per token (a cold prompt, alone) and, for an offload arm, the
    cost per token of the same prompt restored from the tier after a flood
    evicted it from the engine (TTFT of one request each; both include the
    fixed cost of a request, which the longer prompt makes small)."""
    rng = random.Random(seed)
    n = 1024
    p = text(words(rng, n))
    # 2 output tokens, not 1: a request that ends in its prefill step has its
    # blocks stored only at the next engine step (vLLM defers stores).
    # Another arm's last request may still be offloading in the background
    # (write-through): let it settle, or this arm's cold prefill shares the CPU.
    time.sleep(1.0)
    cold = arm.client.complete(p, 2)
    out = {"cold_ttft_s": cold.ttft, "compute_ms_per_token": 1e3 * cold.ttft / n}
    if arm.name not in ("none", "sg-none"):
        time.sleep(1.0)
        for _ in range(5):  # 5 x 1,024 tokens > the engine's 4,096
            arm.client.complete(text(words(rng, n)), 2)
        time.sleep(1.0)
        warm = arm.client.complete(p, 2)
        out["restored_ttft_s"] = warm.ttft
        out["restored_cached_tokens"] = warm.cached_tokens
        out["restore_ms_per_token"] = 1e3 * warm.ttft / n
    return out


def _point_log(name: str, pt: dict[str, Any]) -> None:
    log(f"[{name}] {pt['workload']} {pt['x_name']}={pt['x']}: {pt['req_s']:.2f} req/s,"
        f" {pt['out_tok_s']:.1f} tok/s, TTFT p50 {pt['ttft_p50']:.2f} p99 {pt['ttft_p99']:.2f} s,"
        f" cached engine {pt['cached_engine']:.0%} tier {pt['cached_tier']:.0%}, restored"
        f" {pt['restored_blocks']} offloaded {pt['offloaded_blocks']} restore-failed"
        f" {pt['load_failed_blocks']}, integrity failures"
        f" {pt['integrity_failures']}, failed {pt['failed']}, load {pt['load_avg']:.1f},"
        f" CPU s engine {pt['engine_cpu_s']} daemon {pt['daemon_cpu_s']}")  # fmt: skip
    if "tenants" in pt:
        log(f"[{name}] {pt['workload']} {pt['tenants']} tenants: cached share of returning"
            f" turns per tenant {pt['tenant_min_cached']:.0%}-{pt['tenant_max_cached']:.0%},"
            f" starved tenants {pt['tenants_starved']}, cross-tenant cached tokens"
            f" {pt['cross_tenant_cached']} on {pt['first_turns_checked']} first turns")  # fmt: skip


def measure(arm: Arm, fn: Any) -> dict[str, Any]:
    """Run one point, ``fn(client)``, on an arm: its summary from the engine's
    and the daemon's counters before and after, and the CPU time it took."""
    arm.check_alive()
    m0, s0, c0 = arm.client.metrics(), arm.stats(), arm.cpu_seconds()
    results, wall = fn(arm.client)
    time.sleep(1.0)  # asynchronous offloads land before the counters are read
    pt = summarize(results, wall, m0, arm.client.metrics(), s0, arm.stats())
    arm.adjust(pt)
    c1 = arm.cpu_seconds()
    pt.update({k: round(c1[k] - c0[k], 2) for k in c1})
    return pt


def run_arms(names: list[str], model: Path, work: Path, pl: dict[str, Any],
             res: dict[str, Any], save: Any) -> None:  # fmt: skip
    """All arms' servers up at once, then every point run arm after arm (the
    order rotating from point to point), so a slow drift of the machine's load
    reaches every arm alike rather than whichever arm ran last."""
    arms = [make_arm(n, model, work) for n in names]
    try:
        if pl.get("parallel_start"):
            # The smoke (--parallel-start): every server starts at once, which on
            # a 2-core machine takes far less than in turn (a start-up leaves the
            # cores idle much of the time); the start times measure nothing then.
            for arm in arms:
                arm.launch()
        for arm in arms:  # else one at a time: startup compiles and loads weights
            r: dict[str, Any] = {"arm": arm.name, "points": []}
            res["arms"][arm.name] = r
            r["start_s"] = round(arm.wait_up() if pl.get("parallel_start") else arm.start(), 1)
            r["engine_blocks"] = arm.client.engine_blocks()
            r["bytes"] = {"engine": arm.engine_bytes, "tier": arm.tier_bytes}
            # kvseal's family registered in the API server's /metrics (a kvseal arm)
            r["kvseal_metrics"] = "# TYPE vllm:kvseal_load_failed_blocks" in arm.client.get(
                "/metrics"
            )
            log(f"[{arm.name}] server up in {r['start_s']} s, engine KV cache"
                f" {r['engine_blocks']} blocks")  # fmt: skip
            arm.client.complete(text(PROBE[:40]), 4)  # warm-up
            r["probe"] = arm.client.complete(text(PROBE), 16, stream=False).text
        # Per-token costs: three rounds, arm after arm, each arm's median kept
        # (a single cold prefill swings with the machine's load).
        rounds: dict[str, list[dict[str, float]]] = {a.name: [] for a in arms}
        n_costs = pl.get("cost_rounds")
        if n_costs is None:
            n_costs = 1 if pl.get("quick") else 3
        # 0: none, e.g. for a fits-only run, whose engines must start with nothing
        # to evict (a cost round's flood fills the engine's cache).
        for k in range(n_costs):
            for arm in arms:
                rounds[arm.name].append(per_token_costs(arm, 99 - k))
                arm.check_alive()
        for arm in arms if n_costs else ():
            rs = rounds[arm.name]
            r = res["arms"][arm.name]
            r["costs"] = {key: statistics.median(x[key] for x in rs) for key in rs[0]}
            r["costs_rounds"] = rs
            costs = {k: round(v, 3) for k, v in r["costs"].items()}
            log(f"[{arm.name}] per-token costs (median of {len(rs)}) {json.dumps(costs)}")
        save()
        for k, (wl, key, val, fn) in enumerate(workload_points(pl)):
            for arm in arms[k % len(arms) :] + arms[: k % len(arms)]:
                pt = measure(arm, fn)
                pt.update(workload=wl, x_name=key, x=val, load_avg=os.getloadavg()[0])
                res["arms"][arm.name]["points"].append(pt)
                _point_log(arm.name, pt)
                save()
        for arm in arms:
            r = res["arms"][arm.name]
            r["probe_after"] = arm.client.complete(text(PROBE), 16, stream=False).text
            r["stats_total"] = arm.stats()
            r["tier"] = arm.tier_summary()
    finally:
        stop_arms(arms)


def stop_on_signals() -> None:
    """Make SIGTERM, SIGINT and SIGHUP end the bench through SystemExit, so that
    the ``finally`` of whatever runs stops every server and daemon it started: each
    runs in a session of its own, which a signal to the bench's process group never
    reaches (a test that times out, a CI job cancelled, a closed terminal)."""

    sigs = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def handler(signum: int, _frame: Any) -> None:
        # Once: a second signal must not cut the cleanup short (whoever sent it
        # can still SIGKILL the bench, and then sweep what it started).
        for s in sigs:
            signal.signal(s, signal.SIG_IGN)
        log(f"signal {signum}: stopping every server and daemon")
        raise SystemExit(128 + signum)

    for s in sigs:
        signal.signal(s, handler)


def machine() -> str:
    """This machine, as a results file records it (``machine``) and a figure's
    title shows it (report.where): the CPU count, the CPU model's vendor and
    family (``/proc/cpuinfo``'s first ``model name``, its first two words) and
    "no GPU": every arm runs its engine on the CPU. Unknown parts are left out,
    never guessed."""
    family = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                family = " ".join(line.split(":", 1)[1].split()[:2])
                break
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs" + (f" ({family})" if family else "") + ", no GPU"


def prepare(work_arg: str, out_arg: str | None, small: bool = False) -> tuple[Path, Path, Path]:
    """The work directory (made), the results file and the model (built once;
    ``small``: the smoke's model, model.py)."""
    work = Path(work_arg).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = Path(out_arg) if out_arg else work / "results.json"
    return work, out, make_model(work / "model", small=small)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="one short point per workload")
    ap.add_argument("--arms", default=",".join(ARMS),
                    help="vLLM arms (none,plain,wt,wb), the hybrid model's (h-none,h-plain,h-wt)"
                    " or SGLang arms (sg-none,sg-wt)")  # fmt: skip
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"a subset of {','.join(WORKLOADS)}")  # fmt: skip
    ap.add_argument("--rates", default=None, help="llm-d request rates, e.g. 16,32")
    ap.add_argument(
        "--llmd-per-group",
        type=int,
        default=None,
        help="llm-d prompts per prefix group (a shorter point on a busy machine)",
    )
    ap.add_argument(
        "--cost-rounds",
        type=int,
        default=None,
        help="rounds of the per-token costs (default 3; 1 with --quick; 0: none)",
    )
    ap.add_argument(
        "--fits-rounds",
        type=int,
        default=None,
        help="run the fits point this many times, same prompts (the report takes medians)",
    )
    ap.add_argument(
        "--fits-question",
        type=int,
        default=None,
        help="tokens after the fits prefix (default 32: the prompt ends on a block boundary)",
    )
    ap.add_argument("--conv-gaps", default=None, help="conversation gaps in seconds, e.g. 6")
    ap.add_argument(
        "--host-factor",
        type=float,
        default=None,
        help="the Llama arms' host tier / engine KV (default 2.4, the seed's ratio)",
    )
    ap.add_argument(
        "--max-batched-tokens",
        type=int,
        default=None,
        help="vLLM's --max-num-batched-tokens for every vLLM arm (default: vLLM's)",
    )
    ap.add_argument(
        "--small-model",
        action="store_true",
        help="the smoke's model: the same KV shape, a sliver of the compute (measures nothing)",
    )
    ap.add_argument(
        "--parallel-start",
        action="store_true",
        help="start every vLLM arm's server at once (the smoke; start times then measure nothing)",
    )
    ap.add_argument("--work", default=str(ROOT / "build" / "bench-serving"))
    ap.add_argument("--out", default=None, help="results JSON (default: WORK/results.json)")
    args = ap.parse_args()
    if args.parallel_start and any(n.startswith("sg-") for n in args.arms.split(",")):
        ap.error("--parallel-start: vLLM arms only (an SGLang arm starts its own way)")
    stop_on_signals()
    work, out, model = prepare(args.work, args.out, args.small_model)
    pl = plan(args.quick)
    if args.rates:
        pl["llmd"]["rates"] = [float(r) for r in args.rates.split(",")]
    if args.llmd_per_group:
        pl["llmd"]["per_group"] = args.llmd_per_group
    if args.fits_rounds:
        pl["fits"]["rounds"] = args.fits_rounds
    if args.fits_question:
        pl["fits"]["question"] = args.fits_question
    if args.conv_gaps:
        pl["conv"]["gaps"] = [float(g) for g in args.conv_gaps.split(",")]
    if args.host_factor:
        SHAPE["host_blocks"] = int(ENGINE_BLOCKS * args.host_factor)
    if args.max_batched_tokens:
        SHAPE["max_batched_tokens"] = args.max_batched_tokens
    pl["shape"] = dict(SHAPE)
    pl["cost_rounds"] = args.cost_rounds
    pl["workloads"] = args.workloads.split(",")
    pl["quick"] = args.quick
    pl["parallel_start"] = args.parallel_start
    res: dict[str, Any] = {
        "quick": args.quick, "small_model": args.small_model, "plan": pl,
        "cpus": os.cpu_count(), "machine": machine(),
        "engine_blocks": ENGINE_BLOCKS, "host_blocks": host_blocks(), "block_tokens": BLOCK,
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "arms": {},
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }  # fmt: skip
    log(f"engine KV {ENGINE_BLOCKS} blocks x {BLOCK} tokens, host tier {host_blocks()} blocks,"
        f" KV {KV_BYTES_PER_TOKEN} B/token (the Llama's; hybrid arms: engine KV"
        f" {HYBRID_ENGINE_BYTES} B, tier {HYBRID_HOST_BYTES} B)")  # fmt: skip
    run_arms(args.arms.split(","), model, work, pl, res,
             lambda: out.write_text(json.dumps(res, indent=1)))  # fmt: skip
    res["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    out.write_text(json.dumps(res, indent=1))
    log(f"results: {out}")
    from bench.serving.report import summary_lines

    for line in summary_lines(res):
        print(line)


if __name__ == "__main__":
    main()
