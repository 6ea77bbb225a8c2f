"""Runs one real vLLM 0.32 engine (CPU platform, tiny local model) for
test_evict.py and writes what happened as JSON (a process of its own: the
engine runs in it, tests_vllm/engine_process.py).

``--mode baseline``: the engine alone (prefix caching, no connector).
``--mode eviction``: kvseal with ``"kvseal_offload": "eviction"`` against a
real daemon this driver starts.
``--mode writeback``: eviction mode with ``"kvseal_write_back": true``: a
restore releases the block's host copy and the block is sealed again at its
next eviction.
``--mode fallback``: the same config, but this vLLM's ``BlockPool.get_new_blocks``
is replaced by a wrapper whose source no longer pops the free queue and
notifies reuse watchers: eviction mode's start-up check must refuse it and
kvseal must run write-through. The patch reaches the engine's scheduler
because every mode's engine runs in this process (tests_vllm/engine_process.py).

Every engine: KV cache of ``KV_BLOCKS`` blocks, ``STEP_TOKENS`` tokens per
step (chunked prefill), so the default horizon is
ceil(2.5 x STEP_TOKENS / BLOCK) = 10 blocks. Phases, one request at a time:

- ``fits``: 2 short conversations x 3 turns: about 20 blocks, well inside the
  cache (more than the horizon of never-used blocks stay ahead of theirs);
- ``tenants``: ``TENANTS`` tenants (a ``cache_salt`` each) send the same
  prompt of ``TENANT_BLOCKS`` full blocks, round robin, ``TENANT_ROUNDS``
  rounds: a working set of 120 distinct blocks, more than the engine's cache
  (47 usable blocks) and than a tier of ``--host-bytes 1536KiB`` (94 blocks of
  this model) alone, within both together. A tier that keeps restored blocks
  (eviction mode) holds what the engine holds too, and a cycle longer than the
  tier misses in it; write-back keeps each block in one of the two;
- ``pressure``: 8 conversations x 5 turns round robin (final working set
  about 2.5x the cache): earlier turns must come back from the tier.

``--horizon 4`` (one step's allocation, ``kvseal_eviction_horizon_blocks``)
makes every block stored at eviction one the very next step hands out: its
store job cannot have been reported done by then (vLLM's worker submits a
step's stores at the next step), so the reuse watcher must fence it, and
without the fence the daemon would read the page after the forward pass
overwrote it.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests_vllm.driver import BLOCK, MAX_LEN, OUT_TOKENS, Conversation  # noqa: E402

KV_BLOCKS = 48
STEP_TOKENS = 128
TENANTS = 12
TENANT_BLOCKS = 10  # full blocks of the tenants' prompt (plus 8 tokens)
TENANT_ROUNDS = 3
STAT_FIELDS = (
    "offloaded_blocks",
    "restored_blocks",
    "evicted_blocks",
    "dropped_blocks",
    "seals_under_current_key",
    "integrity_failures",
    "lookups",
    "blocks_ready",
)


class Tenant:
    """One tenant of the ``tenants`` phase: the same prompt every turn (every
    tenant's tokens alike), under a ``cache_salt`` of its own."""

    def __init__(self, i: int) -> None:
        rng = random.Random(900)
        self.prompt = [rng.randrange(3, 1000) for _ in range(TENANT_BLOCKS * BLOCK + 8)]
        self.salt = f"tenant-{i}"

    def next_prompt(self) -> list[int]:
        return self.prompt

    def answered(self, out: list[int]) -> None:
        return


def misfit_block_pool() -> None:
    """Replace ``BlockPool.get_new_blocks`` by a wrapper of the same behaviour
    whose source eviction mode does not recognise (what another vLLM's
    allocation would look like to its check)."""
    from vllm.v1.core.block_pool import BlockPool

    orig = BlockPool.get_new_blocks

    def get_new_blocks(self: Any, num_blocks: int) -> Any:
        return orig(self, num_blocks)

    BlockPool.get_new_blocks = get_new_blocks  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--mode", choices=("baseline", "eviction", "writeback", "fallback"), required=True
    )
    ap.add_argument("--model", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--horizon", type=int, default=0)  # 0: the default horizon
    ap.add_argument("--phases", default="fits,pressure")
    ap.add_argument("--host-bytes", default="64MiB")  # the daemon's tier
    args = ap.parse_args()
    workdir = Path(args.workdir)
    from kvseal.client import ClientConfig, KVSealClient
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from tests_vllm.daemon import Daemon
    from tests_vllm.engine_process import run_engines_in_this_process, stop_engine

    # Every mode's engine core in this process (tests_vllm/engine_process.py): the
    # fallback mode's patch below reaches it there.
    run_engines_in_this_process()
    if args.mode == "fallback":
        misfit_block_pool()
    daemon: Daemon | None = None
    kw: dict[str, Any] = {}
    stats_path = workdir / "kvseal-stats"
    if args.mode != "baseline":
        daemon = Daemon(workdir / "daemon", host_bytes=args.host_bytes).start()
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVSealOffloadingConnector",
            kv_connector_module_path="kvseal.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "kvseal_socket": daemon.socket,
                "kvseal_offload": "eviction",
                "kvseal_stats_path": str(stats_path),
                **({"kvseal_eviction_horizon_blocks": args.horizon} if args.horizon else {}),
                **({"kvseal_write_back": True} if args.mode == "writeback" else {}),
            },
        )
    t0 = time.monotonic()
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        enable_prefix_caching=True,
        block_size=BLOCK,
        kv_cache_memory_bytes=KV_BLOCKS * BLOCK * 2 * 2 * 2 * 32 * 2,
        enforce_eager=True,
        max_model_len=MAX_LEN,
        max_num_seqs=4,
        max_num_batched_tokens=STEP_TOKENS,
        seed=0,
        **kw,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=OUT_TOKENS, detokenize=False)
    res: dict[str, Any] = {"mode": args.mode, "engine_start_s": round(time.monotonic() - t0, 1)}

    def stats() -> dict[str, int]:
        if daemon is None:
            return {}
        with KVSealClient(ClientConfig(target=daemon.target)) as c:
            s = c.stats()
        return {f: int(getattr(s, f)) for f in STAT_FIELDS}

    def files() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, p in (("evict", f"{stats_path}.evict"), ("worker", f"{stats_path}.rank0")):
            try:
                out[name] = json.loads(Path(p).read_text())
            except (OSError, ValueError):
                out[name] = {}
        return out

    def phase(name: str, convs: list[Any], turns: int) -> None:
        s0, e0 = stats(), files()["evict"]
        ph: dict[str, Any] = {"turns": []}
        t1 = time.monotonic()
        for _ in range(turns):
            turn = []
            for c in convs:
                prompt = c.next_prompt()
                tp = TokensPrompt(prompt_token_ids=prompt)
                if getattr(c, "salt", None):
                    tp["cache_salt"] = c.salt
                o = llm.generate([tp], sp, use_tqdm=False)[0]
                out = list(o.outputs[0].token_ids)
                c.answered(out)
                turn.append(
                    {"out": out, "cached": int(o.num_cached_tokens or 0), "len": len(prompt)}
                )
            ph["turns"].append(turn)
        ph["wall_s"] = round(time.monotonic() - t1, 1)
        time.sleep(1.0)  # stores are asynchronous: let them land
        s1 = stats()
        ph["stats"] = {k: s1[k] - s0.get(k, 0) for k in s1}
        ph["files"] = files()
        ev = ph["files"]["evict"]  # cumulative: this phase's share
        ph["evict_delta"] = {k: v - e0.get(k, 0) for k, v in ev.items() if isinstance(v, int)}
        res[name] = ph

    if "fits" in args.phases:
        phase("fits", [Conversation(700 + i) for i in range(2)], 3)
    if "tenants" in args.phases:
        phase("tenants", [Tenant(i) for i in range(TENANTS)], TENANT_ROUNDS)
    if "pressure" in args.phases:
        phase("pressure", [Conversation(800 + i) for i in range(8)], 5)
    res["total_s"] = round(time.monotonic() - t0, 1)
    Path(args.out).write_text(json.dumps(res))
    stop_engine(llm)
    if daemon is not None:
        daemon.stop()
    os._exit(0)  # vLLM's atexit hooks can linger on 2 busy cores; the result is written


if __name__ == "__main__":
    main()
