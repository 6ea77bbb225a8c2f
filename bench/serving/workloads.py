"""The serving benchmark's HTTP client and workloads (bench/serving/run.py):
an OpenAI-completions client on stdlib ``http.client`` (streamed, for TTFT),
the llm-d shared-prefix, conversation and fits workloads, and the plan that
sizes them for this machine. Every point has prompts (and salts) of its own,
seeded, the same for every arm.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

from bench.serving.model import VOCAB, word

WORKLOADS = ("llmd", "conv", "conv-salted", "fits")
PROBE = [3 + (i * 37) % (VOCAB - 3) for i in range(200)]  # the fixed greedy probe


def log(msg: str) -> None:
    print(time.strftime("%H:%M:%S"), msg, flush=True)


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def text(ids: list[int]) -> str:
    return " ".join(word(i) for i in ids)


# ---------------------------------------------------------------- HTTP client


@dataclass
class Result:
    ok: bool
    ttft: float
    latency: float
    prompt_tokens: int
    cached_tokens: int
    out_tokens: int
    text: str
    start: float
    # Salted conversations only: the request's tenant (salt index; -1 when no
    # salt was sent), its turn in the conversation, and whether it was its
    # tenant's first request with no other request of that tenant sent while
    # it ran (so any cached token it reports came from another tenant).
    tenant: int = -1
    turn: int = -1
    isolated_first: bool = False


class Client:
    def __init__(self, port: int, model: str) -> None:
        self.port, self.model = port, model

    def complete(self, prompt: str, max_tokens: int, stream: bool = True,
                 salt: str | None = None) -> Result:  # fmt: skip
        req: dict[str, Any] = {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None,
        }  # fmt: skip
        if salt is not None:  # vLLM's per-request prefix-cache isolation (CVE-2025-46570)
            req["cache_salt"] = salt
        body = json.dumps(req)
        t0 = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        ttft = -1.0
        out: list[str] = []
        usage: dict[str, Any] = {}
        try:
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                resp.read()
                return Result(False, 0, 0, 0, 0, 0, "", t0)
            if not stream:
                d = json.loads(resp.read())
                usage = d.get("usage") or {}
                out.append(d["choices"][0]["text"])
                ttft = time.monotonic() - t0
            else:
                for raw in resp:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    d = json.loads(data)
                    if d.get("usage"):
                        usage = d["usage"]
                    for ch in d.get("choices") or []:
                        if ch.get("text"):
                            if ttft < 0:
                                ttft = time.monotonic() - t0
                            out.append(ch["text"])
        except (OSError, http.client.HTTPException, ValueError):
            return Result(False, 0, 0, 0, 0, 0, "", t0)
        finally:
            conn.close()
        lat = time.monotonic() - t0
        details = usage.get("prompt_tokens_details") or {}
        return Result(
            True, ttft if ttft >= 0 else lat, lat, int(usage.get("prompt_tokens", 0)),
            int(details.get("cached_tokens") or 0), int(usage.get("completion_tokens", 0)),
            "".join(out), t0,
        )  # fmt: skip

    def status(self, path: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            r.read()
            return r.status
        finally:
            conn.close()

    def get(self, path: str) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", path)
            return conn.getresponse().read().decode()
        finally:
            conn.close()

    def engine_blocks(self) -> int | None:
        """The KV cache size the engine reports (``num_gpu_blocks`` of
        ``vllm:cache_config_info``), which may differ from what was asked."""
        m = re.search(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', self.get("/metrics"))
        return int(m.group(1)) if m else None

    def metrics(self) -> dict[str, float]:
        """vLLM's prefix-cache counters (tokens): the engine's own cache and the
        connector's (external) tier; and kvseal's own family in vLLM's /metrics,
        the blocks it could not restore (vLLM recomputed them)."""
        out: dict[str, float] = {}
        for line in self.get("/metrics").splitlines():
            m = re.match(
                r"vllm:((?:external_)?prefix_cache_(?:queries|hits)|kvseal_load_failed_blocks)"
                r"_total\{.*\} (\S+)",
                line,
            )
            if m:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        return out


# ---------------------------------------------------------------- workloads


def llmd_requests(seed: int, groups: int, per_group: int, prefix: int,
                  question: int, passes: int = 1,
                  question_seed: int | None = None) -> list[str]:  # fmt: skip
    """``groups`` x ``per_group`` prompts (a group's shared prefix + a fresh
    question each), shuffled once and then sent ``passes`` times over in that
    order: what llm-d's harness (inference-perf's shared-prefix generator)
    does: it shuffles its prompt list once and cycles through it for the
    whole run, so every prompt recurs once per cycle. ``question_seed``: the
    same prefixes (``seed``'s) with questions of that seed's own."""
    rng = random.Random(seed)
    prefixes = [words(rng, prefix) for _ in range(groups)]
    qrng = rng if question_seed is None else random.Random(question_seed)
    out = [text(prefixes[g] + words(qrng, question)) for g in range(groups)
           for _ in range(per_group)]  # fmt: skip
    rng.shuffle(out)
    return out * passes


def run_poisson(cl: Client, prompts: list[str], n: int, rate: float, out_tokens: int,
                seed: int) -> tuple[list[Result], float]:  # fmt: skip
    rng = random.Random(seed)
    results: list[Result] = []
    lock = threading.Lock()
    threads = []
    t0 = time.monotonic()
    at = 0.0
    for i in range(n):
        at += rng.expovariate(rate)
        delay = t0 + at - time.monotonic()
        if delay > 0:
            time.sleep(delay)

        def one(p: str = prompts[i]) -> None:
            r = cl.complete(p, out_tokens)
            with lock:
                results.append(r)

        th = threading.Thread(target=one, daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return results, time.monotonic() - t0


def run_conversations(cl: Client, seed: int, convs: int, turns: int, sys_tokens: int,
                      user_tokens: int, out_tokens: int, gap: float, concurrency: int,
                      shared_tokens: int = 0,
                      tenants: int = 0) -> tuple[list[Result], float]:  # fmt: skip
    """All ``convs`` conversations are open at once; ``concurrency`` workers
    each take the conversation whose next turn is due first (a turn is due
    ``gap`` seconds after the previous answer), send its whole history (its
    own answers included, as text) and put it back. With gap 0 the workers
    cycle through every conversation: the saturated point.

    ``shared_tokens``: every conversation starts with the same prompt of
    that many tokens (a deployment's system prompt) before its own
    ``sys_tokens``. ``tenants`` > 0: conversation i sends the ``cache_salt``
    of tenant ``i % tenants`` (random 256-bit hex strings, as a CC
    deployment would issue), so with one tenant every conversation shares
    the shared prompt's blocks and with one per conversation none does."""
    rng = random.Random(seed)
    # Drawn only when asked for, so the unsalted ``conv`` prompts stay what
    # they were in earlier runs.
    shared = words(rng, shared_tokens) if shared_tokens else []
    state = [[text(shared + words(rng, sys_tokens)),
              [words(rng, user_tokens) for _ in range(turns)], 0.0]
             for _ in range(convs)]  # fmt: skip
    srng = random.Random(seed + 7919)
    salts = [f"{srng.getrandbits(256):064x}" for _ in range(tenants)]
    sent = [0] * tenants  # requests sent so far, per tenant
    ready: list[tuple[float, int]] = [(0.0, i) for i in range(convs)]
    results: list[Result] = []
    cv = threading.Condition()
    t0 = time.monotonic()
    busy = [0]

    def worker() -> None:
        while True:
            with cv:
                while True:
                    if not ready and not busy[0]:
                        cv.notify_all()
                        return
                    if ready:
                        ready.sort()
                        due, i = ready[0]
                        wait = t0 + due - time.monotonic()
                        if wait <= 0:
                            ready.pop(0)
                            busy[0] += 1
                            tenant = i % tenants if tenants else -1
                            before = sent[tenant] if tenants else -1
                            if tenants:
                                sent[tenant] += 1
                            break
                        cv.wait(min(wait, 0.5))
                    else:
                        cv.wait(0.5)
            hist, users, _ = state[i]
            turn_no = turns - len(users)
            turn = users.pop(0)
            hist = hist + " " + text(turn)
            r = cl.complete(hist, out_tokens, salt=salts[tenant] if tenants else None)
            if r.ok:
                hist = hist + " " + r.text.strip()
            with cv:
                r.tenant, r.turn = tenant, turn_no
                # Its tenant's first request, and no other of that tenant was sent
                # while it ran: nothing of this salt was cached before it, so a
                # cached token here is another tenant's block.
                r.isolated_first = tenants > 0 and before == 0 and sent[tenant] == 1
                results.append(r)
                state[i][0] = hist
                busy[0] -= 1
                if users:
                    ready.append((time.monotonic() - t0 + gap, i))
                cv.notify_all()

    ths = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    return results, time.monotonic() - t0


def plan(quick: bool) -> dict[str, Any]:
    """Workload shapes (tokens), scaled to this machine keeping the seed's ratios:
    llm-d working set (groups x prefix) 2.25x the engine KV, fits 0.4x.

    ``conv-salted``: the conversation shape with its 512-token system prompt
    split into a 256-token prompt shared by every conversation and 256 tokens
    of the conversation's own, so the number of tenants decides how much is
    shared: final working set 8 + 12 x 18 = 224 blocks (1.75x the engine KV)
    with one salt for all, 312 (2.4x, conv's) with one per conversation."""
    p: dict[str, Any] = {
        "llmd": {"groups": 12, "per_group": 5, "prefix": 768, "question": 32, "out": 8,
                 "passes": 2, "rates": [2.0, 4.0, 8.0]},
        "conv": {"convs": 12, "turns": 4, "sys": 512, "user": 64, "out": 16,
                 "gaps": [0.0, 2.0, 6.0], "concurrency": 4, "rounds": 3},
        "conv-salted": {"convs": 12, "turns": 4, "shared": 256, "sys": 256, "user": 64,
                        "out": 16, "gap": 2.0, "tenants": [1, 4, 12], "concurrency": 4,
                        "rounds": 3},
        "fits": {"groups": 2, "per_group": 10, "prefix": 768, "question": 32, "out": 8,
                 "passes": 4, "rate": 32.0},
    }  # fmt: skip
    if quick:
        # A smoke (tests_vllm/test_serving_smoke.py), not a measurement: as few
        # requests as still exercise every path, 30 per arm, so that it passes on a
        # loaded 2-core machine.
        p["llmd"].update(rates=[4.0], groups=4, per_group=2, passes=1)
        p["conv"].update(convs=3, turns=2, gaps=[1.0], concurrency=2, rounds=1)
        p["fits"].update(per_group=2, passes=1)
        # One salted point, one salt per conversation (the CC default); with
        # 512 tokens of their own the six conversations' first turns alone
        # (6 x 26 blocks) outgrow the engine's 128, and all six are sent before
        # any second turn, so the second turns come from the tier even in this
        # short point.
        p["conv-salted"].update(
            convs=6, turns=2, sys=512, gap=1.0, tenants=[6], concurrency=2, rounds=1
        )
    return p


def workload_points(pl: dict[str, Any]) -> list[tuple[str, str, float, Any]]:
    """Every point of the plan as (workload, x name, x, run(client)): each point
    has prompts of its own, the same for every arm."""
    wls = pl.get("workloads", list(WORKLOADS))
    pts: list[tuple[str, str, float, Any]] = []
    L = pl["llmd"]
    for i, rate in enumerate(L["rates"] if "llmd" in wls else []):
        prompts = llmd_requests(1000 + i, L["groups"], L["per_group"], L["prefix"],
                                L["question"], L["passes"])  # fmt: skip
        pts.append(("llmd", "rate", rate, lambda cl, p=prompts, r=rate, i=i:
                    run_poisson(cl, p, len(p), r, L["out"], i)))  # fmt: skip
    C = pl["conv"]
    # Conversation points are short (tens of seconds), so they run in rounds
    # (all gaps, then all gaps again, each round with conversations of its
    # own) and the report takes each arm's median: one round swings with the
    # machine's load by more than the 10% the anchor goal allows.
    for r in range(C.get("rounds", 1) if "conv" in wls else 0):
        for i, gap in enumerate(C["gaps"]):
            pts.append(("conv", "gap", gap, lambda cl, g=gap, seed=2000 + i + 100 * r:
                        run_conversations(cl, seed, C["convs"], C["turns"], C["sys"],
                                          C["user"], C["out"], g, C["concurrency"])))  # fmt: skip
    S = pl["conv-salted"]
    # Rounds as for ``conv``; within a round the tenant counts share nothing
    # (each point has prompts and salts of its own).
    for r in range(S.get("rounds", 1) if "conv-salted" in wls else 0):
        for i, n in enumerate(S["tenants"]):
            pts.append(("conv-salted", "tenants", n, lambda cl, n=n, seed=4000 + i + 100 * r:
                        run_conversations(cl, seed, S["convs"], S["turns"], S["sys"], S["user"],
                                          S["out"], S["gap"], S["concurrency"],
                                          shared_tokens=S["shared"], tenants=n)))  # fmt: skip
    F = pl["fits"]
    if "fits" in wls:
        prompts = llmd_requests(3000, F["groups"], F["per_group"], F["prefix"],
                                F["question"], F["passes"])  # fmt: skip
        # Rounds (--fits-rounds) repeat the same prompts: the working set stays
        # the one that fits, and the report takes each arm's median round.
        for _ in range(F.get("rounds", 1)):
            pts.append(("fits", "rate", F["rate"], lambda cl, p=prompts: run_poisson(
                cl, p, len(p), F["rate"], F["out"], 7)))  # fmt: skip
    return pts
