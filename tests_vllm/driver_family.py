"""Runs one real vLLM engine (CPU platform) on a tiny model of one family
(tests_vllm/families.py) through a workload that overflows the engine's KV
cache, and writes what happened as JSON. A process of its own: the engine
runs in it (tests_vllm/engine_process.py), one engine per process.

``--mode baseline``: plain vLLM, prefix caching on. ``--mode kvseal``: the
same engine with kvseal's one-line kv-transfer config against a real daemon
this driver starts (``--on-integrity-failure drop``, the region in a file so
the driver can play the host).

Phases (the same prompts in both modes, each prompt the whole conversation so
far, one request at a time so greedy decoding is reproducible):

- ``main``: ``CONVS`` conversations x ``TURNS`` turns, round robin: their KV is
  several times the engine's cache, so earlier turns come back from the tier;
- ``salt``: a prompt under salt A, a flood, the same prompt under salt B (no
  hit across salts), a flood, under A again (a hit from the tier);
- ``tamper``: conversations like main; after turn 1 the host flips a byte in
  every sealed block: every restore fails verification, the requests are
  recomputed, the answers stay the same.

The kvseal worker writes its per-group transfer counts (``kvseal_stats_path``);
the result carries them with the daemon's counts after each phase.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

BLOCK = 32
MAX_LEN = 512
OUT_TOKENS = 8
SYS_TOKENS = 128
USER_TOKENS = 48
CONVS = 6
TURNS = 3
FLOOD_TOKENS = 480


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("baseline", "kvseal", "anchor"), required=True)
    ap.add_argument("--family", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kv-bytes", type=int, required=True)
    ap.add_argument("--phases", default="main,salt,tamper")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from tests_vllm.daemon import Daemon
    from tests_vllm.engine_process import (
        run_engines_in_this_process,
        stop_engine,
        unlink_kv_objects,
    )
    from tests_vllm.families import FAMILIES

    run_engines_in_this_process()

    workdir = Path(args.workdir)
    stats_path = workdir / "kvseal-stats"
    daemon: Daemon | None = None
    kw: dict[str, Any] = dict(FAMILIES[args.family])
    if args.mode == "kvseal":
        daemon = Daemon(workdir / "daemon", extra=("--on-integrity-failure", "drop")).start()
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVSealOffloadingConnector",
            kv_connector_module_path="kvseal.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "kvseal_socket": daemon.socket,
                "kvseal_stats_path": str(stats_path),
                # Families, not deadlines: on a loaded 2-core machine a restore
                # can outlast the 10 s default, fail, and be recomputed, and a
                # recompute may flip a near-tie token (module doc of test_families).
                "kvseal_transfer_timeout_s": 60,
            },
        )
    if args.mode == "anchor":
        # vLLM's own CPU offloading manager with plain copies (bench/serving/anchor.py):
        # what vLLM's plaintext offload does with the same groups and workload.
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]
        )
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "PlainOffloadingSpec",
                "spec_module_path": "bench.serving.anchor",
                "cpu_bytes_to_use": 64 << 20,
            },
        )
    res: dict[str, Any] = {"mode": args.mode, "family": args.family, "phases": {}}
    t0 = time.monotonic()
    try:
        llm = LLM(
            model=args.model,
            skip_tokenizer_init=True,
            enable_prefix_caching=True,
            block_size=BLOCK,
            kv_cache_memory_bytes=args.kv_bytes,
            enforce_eager=True,
            max_model_len=MAX_LEN,
            max_num_seqs=1,
            seed=0,
            **kw,
        )
    except Exception as e:  # the start-up refusal is a result too
        res["start_error"] = f"{type(e).__name__}: {e}"
        Path(args.out).write_text(json.dumps(res))
        unlink_kv_objects()
        if daemon is not None:
            daemon.stop()
        os._exit(0)
    res["engine_start_s"] = round(time.monotonic() - t0, 1)
    sp = SamplingParams(temperature=0.0, max_tokens=OUT_TOKENS, detokenize=False)

    def run(prompt: list[int], salt: str | None = None) -> dict[str, Any]:
        p = TokensPrompt(prompt_token_ids=prompt)
        if salt is not None:
            p["cache_salt"] = salt
        out = llm.generate([p], sp, use_tqdm=False)[0]
        return {"out": list(out.outputs[0].token_ids), "cached": int(out.num_cached_tokens or 0)}

    def snapshot() -> dict[str, Any]:
        time.sleep(1.0)  # offloads are asynchronous: let them land
        snap: dict[str, Any] = {}
        if daemon is not None:
            snap["daemon"] = daemon.stats()
            f = Path(f"{stats_path}.rank0")
            if f.exists():
                snap["worker"] = json.loads(f.read_text())
        return snap

    def conversations(name: str, seed: int, hook: Any = None) -> None:
        rngs = [random.Random(seed + i) for i in range(CONVS)]
        hist = [_tokens(r, SYS_TOKENS) for r in rngs]
        turns = []
        for t in range(TURNS):
            if hook is not None:
                hook(t)
            turn = []
            for i, r in enumerate(rngs):
                hist[i] = hist[i] + _tokens(r, USER_TOKENS)
                out = run(hist[i])
                hist[i] = hist[i] + out["out"]
                turn.append(out)
            turns.append(turn)
        res["phases"][name] = {"turns": turns, **snapshot()}

    phases = set(args.phases.split(","))
    if "main" in phases:
        conversations("main", 100)
    if "salt" in phases:
        rng = random.Random(7)
        prompt = _tokens(rng, 256)
        flood = _tokens(rng, FLOOD_TOKENS)
        ph: dict[str, Any] = {"a1": run(prompt, "tenant-a")}
        run(flood)
        ph["b"] = run(prompt, "tenant-b")
        run(flood[::-1])
        ph["a2"] = run(prompt, "tenant-a")
        res["phases"]["salt"] = {**ph, **snapshot()}
    if "tamper" in phases:

        def tamper(t: int) -> None:
            if t == 1 and daemon is not None:
                time.sleep(1.0)
                res["flipped"] = daemon.tamper()

        conversations("tamper", 200, tamper)
    res["total_s"] = round(time.monotonic() - t0, 1)
    Path(args.out).write_text(json.dumps(res))
    stop_engine(llm)
    if daemon is not None:
        daemon.stop()
    os._exit(0)  # vLLM's atexit hooks can linger on 2 busy cores; the result is written


if __name__ == "__main__":
    main()
