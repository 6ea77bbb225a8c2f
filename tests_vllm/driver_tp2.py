"""A real vLLM engine with tensor parallelism 2 (CPU platform, two worker
processes), one kvseal daemon per rank (``kvseal_socket`` with ``{rank}``), as
one GPU per rank would have. Two rounds of the same 8 prompts with an engine
cache too small for them: round 2 must come back from both ranks' daemons.
Writes JSON: per request (round, cached tokens, output tokens), per daemon stats.

Options beyond the defaults (the tiny Llama of test_vllm_e2e.py, which uses
none of them): ``--kv-bytes`` (the engine's KV cache per rank), ``--shared-daemon``
(one daemon for both ranks: one ``kvseal_socket`` without ``{rank}``), and
``--stats`` (each worker writes its per-group transfer counts,
``kvseal_stats_path``; the result carries them as ``workers``, rank by rank).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kv-bytes", type=int, default=48 * 16384 // 2)  # per rank: half the heads
    ap.add_argument("--shared-daemon", action="store_true")
    ap.add_argument("--stats", action="store_true")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests_vllm.daemon import Daemon
    from tests_vllm.engine_process import run_engines_in_this_process

    # The engine core in this process (tests_vllm/engine_process.py); the two
    # ranks stay worker processes of their own (TP=2 runs the mp executor).
    run_engines_in_this_process()
    work = Path(args.workdir)
    names = ["daemon"] if args.shared_daemon else [f"gpu{r}" for r in (0, 1)]
    ds = [Daemon(work / n).start() for n in names]
    atexit.register(lambda: [d.stop() for d in ds])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    sock = ds[0].socket if args.shared_daemon else str(work / "gpu{rank}" / "run" / "kvseal.sock")
    extra: dict[str, object] = {"kvseal_socket": sock, "kvseal_transfer_timeout_s": 60}
    stats_path = work / "kvseal-stats"
    if args.stats:
        extra["kvseal_stats_path"] = str(stats_path)
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        block_size=32,
        kv_cache_memory_bytes=args.kv_bytes,
        enforce_eager=True,
        max_model_len=1024,
        max_num_seqs=4,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVSealOffloadingConnector",
            kv_connector_module_path="kvseal.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            # Two engine workers and two daemons share 2 cores here: a longer
            # transfer deadline than the 10 s default keeps a starved moment
            # from turning a restore into a recompute (the tokens would match
            # either way; the test also wants restores on both ranks).
            kv_connector_extra_config=extra,
        ),
    )
    sp = SamplingParams(temperature=0, max_tokens=8, detokenize=False)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 1000) for _ in range(320)] for _ in range(8)]
    outs = []
    for rnd in range(2):
        for p in prompts:
            o = llm.generate([TokensPrompt(prompt_token_ids=p)], sp, use_tqdm=False)[0]
            outs.append((rnd, int(o.num_cached_tokens or 0), list(o.outputs[0].token_ids)))
        time.sleep(1.0)  # offloads are asynchronous
    res: dict[str, object] = {"outs": outs, "stats": [d.stats() for d in ds]}
    if args.stats:
        res["workers"] = [
            json.loads(f.read_text()) if f.exists() else None
            for f in (Path(f"{stats_path}.rank{r}") for r in (0, 1))
        ]
    Path(args.out).write_text(json.dumps(res))
    llm.llm_engine.engine_core.shutdown()
    for d in ds:
        d.stop()
    os._exit(0)
