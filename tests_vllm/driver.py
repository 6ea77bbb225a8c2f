"""Runs one real vLLM engine (CPU platform, tiny local model) through the test
workload and writes what happened as JSON. A process of its own: the engine
runs in it (tests_vllm/engine_process.py), one engine per process.

``--mode baseline``: plain vLLM, prefix caching on, no connector.
``--mode anchor``: the same engine with vLLM's own CPU offloading manager and
plain copies (bench/serving/anchor.py), no kvseal: on the CPU engine vLLM's
offload path itself can change a near-tie greedy token, and the kvseal run must
give exactly its tokens (test_vllm_e2e.py).
``--mode kvseal``: the same engine with kvseal's one-line kv-transfer config
against a real daemon this driver starts (and kills and restarts), with vLLM's
KV events published over ZMQ to a subscriber in this process.

Phases (the same prompts in both modes; each turn's prompt is the whole
conversation so far, including the model's own previous answers):

- ``main``: 8 conversations x 5 turns, round robin; their KV working set is
  more than twice the engine's KV cache, so earlier turns must come back from
  the host tier;
- ``salt``: 3 prompts under salt A, a flood that evicts them from the engine,
  the same prompts under salt B (must not hit), then under A again (must hit);
- ``tamper``: like main; after turn 2 the host region is tampered with (daemon
  run with ``--on-integrity-failure drop``);
- ``tenants``: per-user salts, as confidential serving sets them (issue 20):
  ``TENANTS`` tenants send the *same* conversation (identical token streams)
  under salts of their own; they arrive in waves (``TENANT_WAVE`` new ones per
  round, so later tenants start after earlier ones have stored), each runs
  ``TENANT_TURNS`` turns, and every round ends with a flood that evicts
  everything from the engine's KV cache, so a returning turn can only be served
  by the host tier;
- ``kill``: like main; after turn 2 the daemon is SIGKILLed, turn 3 runs
  without it, then it is restarted and turns 4-6 run.

``--phases`` runs only some phases (for repeated runs of one phase by hand).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

BLOCK = 32
KV_BLOCKS = 48  # engine KV cache, in blocks
MAX_LEN = 1024
OUT_TOKENS = 16
SYS_TOKENS = 96
USER_TOKENS = 64
TENANTS = 9
TENANT_WAVE = 3  # new tenants per round
TENANT_TURNS = 4
FLOOD_TOKENS = 800  # two of these exceed the engine's KV cache (KV_BLOCKS)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


class Engine:
    def __init__(
        self,
        model: str,
        kv_bytes: int,
        kvseal_socket: str | None,
        zmq_port: int,
        extra: dict[str, Any] | None = None,
        anchor: bool = False,
    ) -> None:
        """``extra``: more of kvseal's ``kv_connector_extra_config`` (e.g.
        ``kvseal_lookup_discovery``)."""
        from vllm import LLM, SamplingParams
        from vllm.config import KVEventsConfig, KVTransferConfig

        from tests_vllm.engine_process import run_engines_in_this_process

        run_engines_in_this_process()
        kw: dict[str, Any] = {}
        if anchor:
            root = str(Path(__file__).resolve().parent.parent)  # bench.serving.anchor
            os.environ["PYTHONPATH"] = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                kv_connector_extra_config={
                    "spec_name": "PlainOffloadingSpec",
                    "spec_module_path": "bench.serving.anchor",
                    "cpu_bytes_to_use": 64 << 20,
                },
            )
        elif kvseal_socket is not None:
            # The one config line of docs/vllm.md, as Python objects.
            kw["kv_transfer_config"] = KVTransferConfig(
                kv_connector="KVSealOffloadingConnector",
                kv_connector_module_path="kvseal.vllm.connector",
                kv_role="kv_both",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config={"kvseal_socket": kvseal_socket, **(extra or {})},
            )
            kw["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=f"tcp://127.0.0.1:{zmq_port}",
            )
        self.llm = LLM(
            model=model,
            skip_tokenizer_init=True,
            enable_prefix_caching=True,
            block_size=BLOCK,
            kv_cache_memory_bytes=kv_bytes,
            enforce_eager=True,
            max_model_len=MAX_LEN,
            max_num_seqs=4,
            seed=0,
            **kw,
        )
        self.sp = SamplingParams(temperature=0.0, max_tokens=OUT_TOKENS, detokenize=False)

    def run(self, prompt: list[int], salt: str | None = None) -> dict[str, Any]:
        from vllm.inputs import TokensPrompt

        p = TokensPrompt(prompt_token_ids=prompt)
        if salt is not None:
            p["cache_salt"] = salt
        out = self.llm.generate([p], self.sp, use_tqdm=False)[0]
        return {
            "out": list(out.outputs[0].token_ids),
            "cached": int(out.num_cached_tokens or 0),
            "prompt_len": len(prompt),
        }


class Conversation:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.history = _tokens(self.rng, SYS_TOKENS)

    def next_prompt(self) -> list[int]:
        self.history = self.history + _tokens(self.rng, USER_TOKENS)
        return self.history

    def answered(self, out: list[int]) -> None:
        self.history = self.history + out


class Subscriber:
    """vLLM's KV events over ZMQ, decoded with vLLM's own KVEventBatch."""

    def __init__(self, port: int) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        # vLLM's publisher connects to an endpoint with a host (it binds only to
        # "tcp://*:PORT"): the subscriber binds, on loopback only.
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVTIMEO, 200)
        self.counts: dict[str, int] = {}
        self.cpu_stored_hashes: set[int | bytes] = set()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self.sock.recv_multipart()
            except zmq.Again:
                continue
            batch = dec.decode(payload)
            for ev in batch.events:
                medium = getattr(ev, "medium", None)
                key = f"{type(ev).__name__}:{medium}"
                self.counts[key] = self.counts.get(key, 0) + 1
                if type(ev).__name__ == "BlockStored" and medium == "CPU":
                    self.cpu_stored_hashes.update(ev.block_hashes)

    def close(self) -> dict[str, Any]:
        time.sleep(1.0)  # the publisher flushes asynchronously
        self._stop.set()
        self._t.join(2)
        self.sock.close(0)
        self.ctx.term()
        return {"counts": self.counts, "cpu_stored_unique": len(self.cpu_stored_hashes)}


def _delta(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: b[k] - a.get(k, 0) for k in b}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("baseline", "kvseal", "anchor"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--zmq-port", type=int, default=0)
    ap.add_argument("--phases", default="main,salt,tenants,tamper,kill")
    args = ap.parse_args()
    phases = set(args.phases.split(","))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests_vllm.daemon import Daemon
    from tests_vllm.engine_process import stop_engine

    workdir = Path(args.workdir)
    daemon: Daemon | None = None
    sub: Subscriber | None = None
    res: dict[str, Any] = {"mode": args.mode, "phases": {}}
    # blocks x tokens x layers x K/V x heads x dim x bf16
    kv_bytes = KV_BLOCKS * BLOCK * 2 * 2 * 2 * 32 * 2
    if args.mode == "kvseal":
        daemon = Daemon(workdir / "daemon", extra=("--on-integrity-failure", "drop")).start()
        atexit.register(daemon.stop)  # also when this driver fails
        sub = Subscriber(args.zmq_port)
    t0 = time.monotonic()
    eng = Engine(
        args.model,
        kv_bytes,
        daemon.socket if daemon else None,
        args.zmq_port,
        anchor=args.mode == "anchor",
    )
    res["engine_start_s"] = round(time.monotonic() - t0, 1)

    def stats() -> dict[str, int]:
        if daemon is None or daemon.proc is None or daemon.proc.poll() is not None:
            return {}
        for _ in range(50):
            try:
                return daemon.stats()
            except Exception:
                time.sleep(0.1)
        return {}

    def settle() -> None:
        # Offloads are asynchronous (the worker's thread): let them land before a
        # phase's figures are read.
        time.sleep(1.0)

    def rounds(
        name: str, convs: list[Conversation], turns: int, hook: Any = None
    ) -> dict[str, Any]:
        ph: dict[str, Any] = {"turns": [], "stats_by_turn": []}
        s0 = stats()
        for t in range(turns):
            if hook is not None:
                hook(t, ph)
            turn = []
            for c in convs:
                r = eng.run(c.next_prompt())
                c.answered(r["out"])
                turn.append(r)
            ph["turns"].append(turn)
            settle()
            ph["stats_by_turn"].append(stats())
        ph["stats"] = _delta(s0, stats()) if s0 else {}
        res["phases"][name] = ph
        return ph

    # -- main
    if "main" in phases:
        rounds("main", [Conversation(100 + i) for i in range(8)], 5)
    if "salt" in phases:
        salt_phase(eng, stats, settle, res)
    if "tenants" in phases:
        tenants_phase(eng, stats, settle, res)
    if "tamper" in phases:
        tamper_phase(daemon, rounds)
    if "kill" in phases:
        kill_phase(daemon, stats, rounds, res)

    if sub is not None:
        res["events"] = sub.close()
    res["total_s"] = round(time.monotonic() - t0, 1)
    Path(args.out).write_text(json.dumps(res))
    # Stop the engine now: os._exit below skips the interpreter's own shutdown.
    stop_engine(eng.llm)
    if daemon is not None:
        daemon.stop()
    os._exit(0)  # vLLM's atexit hooks can linger on 2 busy cores; the result is written


def tenants_phase(eng: Engine, stats: Any, settle: Any, res: dict[str, Any]) -> None:
    """See the module doc. Per tenant: each turn's cached tokens, prompt length
    and output, and the round it ran in."""
    rng = random.Random(11)
    convs = [Conversation(500) for _ in range(TENANTS)]  # one seed: identical streams
    ph: dict[str, Any] = {"tenants": [[] for _ in range(TENANTS)], "floods": []}
    s0 = stats()
    rnd = 0
    while any(len(t) < TENANT_TURNS for t in ph["tenants"]):
        active = min(TENANTS, TENANT_WAVE * (rnd + 1))
        for i in range(active):
            if len(ph["tenants"][i]) >= TENANT_TURNS:
                continue
            r = eng.run(convs[i].next_prompt(), f"user-{i}")
            convs[i].answered(r["out"])
            r["round"] = rnd
            ph["tenants"][i].append(r)
        # Evict everything from the engine: the next turns can only hit the tier.
        ph["floods"].append([eng.run(_tokens(rng, FLOOD_TOKENS))["cached"] for _ in range(2)])
        rnd += 1
    settle()
    ph["stats"] = _delta(s0, stats()) if s0 else {}
    res["phases"]["tenants"] = ph


def salt_phase(eng: Engine, stats: Any, settle: Any, res: dict[str, Any]) -> None:
    rng = random.Random(7)
    salted = [_tokens(rng, 256) for _ in range(3)]
    ph: dict[str, Any] = {}
    s0 = stats()
    ph["a1"] = [eng.run(p, "tenant-a") for p in salted]
    settle()
    ph["flood"] = [eng.run(_tokens(rng, 400)) for _ in range(6)]
    settle()
    s1 = stats()
    ph["b"] = [eng.run(p, "tenant-b") for p in salted]
    settle()
    s2 = stats()
    ph["a2"] = [eng.run(p, "tenant-a") for p in salted]
    settle()
    s3 = stats()
    if s0:
        ph["stats_b"] = _delta(s1, s2)
        ph["stats_a2"] = _delta(s2, s3)
    res["phases"]["salt"] = ph


def tamper_phase(daemon: Any, rounds: Any) -> None:
    def tamper_hook(t: int, ph: dict[str, Any]) -> None:
        if t == 2 and daemon is not None:
            ph["flipped"] = daemon.tamper()

    rounds("tamper", [Conversation(200 + i) for i in range(8)], 4, tamper_hook)


def kill_phase(daemon: Any, stats: Any, rounds: Any, res: dict[str, Any]) -> None:
    def kill_hook(t: int, ph: dict[str, Any]) -> None:
        if daemon is None:
            return
        if t == 2:
            ph["before_kill"] = stats()
            daemon.kill()
        elif t == 3:
            daemon.start()
            # Both the scheduler's observer pool and the worker's KV pool come back
            # by themselves (the worker's from its registration thread, after a
            # back-off of at most 10 s). Wait for both, so the turns after the
            # restart can store and restore (the test asserts they did).
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and stats().get("pools", 0) < 2:
                time.sleep(0.2)
            ph["after_restart"] = stats()

    t_kill = time.monotonic()
    rounds("kill", [Conversation(300 + i) for i in range(8)], 7, kill_hook)
    res["phases"]["kill"]["wall_s"] = round(time.monotonic() - t_kill, 1)
    if daemon is not None:
        res["phases"]["kill"]["after"] = stats()
        res["daemon_starts"] = daemon.starts


if __name__ == "__main__":
    main()
