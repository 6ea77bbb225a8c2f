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
into the tables and plots of docs/serving.md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.serving.model import KV_BYTES_PER_TOKEN, VOCAB, make_model, word  # noqa: E402
from tests_vllm.daemon import Daemon  # noqa: E402

BLOCK = 32
ENGINE_BLOCKS = 128  # engine KV cache: 4,096 tokens
HOST_FACTOR = 2.4  # host tier / engine KV (the seed's ratio)
BLOCK_BYTES = BLOCK * KV_BYTES_PER_TOKEN
HOST_BLOCKS = int(ENGINE_BLOCKS * HOST_FACTOR)
MAX_LEN = 1536
ARMS = ("none", "plain", "wt", "wb")
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


# ---------------------------------------------------------------- arms


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Arm:
    def __init__(self, name: str, model: Path, work: Path, mode: str | None = None) -> None:
        self.name, self.model, self.work = name, model, work / name
        self.mode = mode or name  # the kind of arm (ARMS); the name only labels it
        self.work.mkdir(parents=True, exist_ok=True)
        self.daemon: Daemon | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = free_port()
        self.client = Client(self.port, str(model))

    def kv_transfer(self) -> dict[str, Any] | None:
        if self.mode == "none":
            return None
        if self.mode == "plain":
            return {
                "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "spec_name": "PlainOffloadingSpec",
                    "spec_module_path": "bench.serving.anchor",
                    "cpu_bytes_to_use": HOST_BLOCKS * BLOCK_BYTES,
                },
            }  # fmt: skip
        assert self.daemon is not None
        return {
            "kv_connector": "KVSealOffloadingConnector",
            "kv_connector_module_path": "kvseal.vllm.connector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "kvseal_socket": self.daemon.socket, "kvseal_write_back": self.mode == "wb",
            },
        }  # fmt: skip

    def start(self) -> float:
        t0 = time.monotonic()
        if self.mode in ("wt", "wb"):
            # Host region sized to HOST_BLOCKS sealed blocks (ciphertext + tag).
            self.daemon = Daemon(
                self.work / "daemon", extra=self.daemon_extra(),
                host_bytes=str(HOST_BLOCKS * (BLOCK_BYTES + 64)),
            ).start()  # fmt: skip
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16",
            "--block-size", str(BLOCK), "--enable-prefix-caching", "--enforce-eager",
            "--max-model-len", str(MAX_LEN), "--max-num-seqs", "8", "--seed", "0",
            "--kv-cache-memory-bytes", str(ENGINE_BLOCKS * BLOCK_BYTES),
            "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
        ]  # fmt: skip
        kt = self.kv_transfer()
        if kt is not None:
            args += ["--kv-transfer-config", json.dumps(kt)]
        # Every arm's model threads on the same CPUs. Left to vLLM ("auto"), a
        # server with a KV connector reserves one more core than one without,
        # and on a 2-core machine that gave no offload 1 OpenMP thread and the
        # connector arms 2 (vLLM's ompmultiprocessing: the reservation exceeds
        # the cores and is dropped): a handicap of the baseline, not a cost.
        cpus = sorted(os.sched_getaffinity(0))
        # ROOT, then what the caller set (e.g. a clean copy of the tree to measure).
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, "VLLM_LOGGING_LEVEL": "WARNING",
               "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1",
               "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cpus)}  # fmt: skip
        with open(self.work / "serve.log", "wb") as logf:  # the child keeps its own copy
            self.proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, cwd=self.work)  # fmt: skip
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: vllm serve exited: {self.tail()}")
            try:
                self.client.get("/health")
                return time.monotonic() - t0
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"{self.name}: vllm serve not up: {self.tail()}")

    def daemon_extra(self) -> tuple[str, ...]:
        """More flags for a kvseal arm's daemon (bench/serving/store_points.py)."""
        return ()

    def tail(self) -> str:
        return (self.work / "serve.log").read_text(errors="replace")[-4000:]

    def check_alive(self) -> None:
        """RuntimeError naming the exit status (-9: killed, e.g. by the OOM killer on
        a crowded machine) and the log's tail if the server has exited: failed
        requests would otherwise be all the bench says."""
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(
                f"{self.name}: the server exited (status {self.proc.returncode}): {self.tail()}"
            )

    def cpu_seconds(self) -> dict[str, float]:
        """CPU time (user + system, s) used so far by the engine (every process
        of the server's session: API server, engine core, worker) and by the
        kvseal daemon: where a point's time goes."""
        tick = os.sysconf("SC_CLK_TCK")
        eng = dmn = 0.0
        dpid = self.daemon.proc.pid if self.daemon and self.daemon.proc else -1
        sid = self.proc.pid if self.proc is not None else -2
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                st = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            f = st[st.rindex(")") + 2 :].split()
            t = (int(f[11]) + int(f[12])) / tick  # utime, stime
            if int(d) == dpid:
                dmn += t
            elif int(f[3]) == sid:  # session id
                eng += t
        return {"engine_cpu_s": eng, "daemon_cpu_s": dmn}

    def adjust(self, pt: dict[str, Any]) -> None:
        """Engine-specific corrections of a point's summary (none for vLLM)."""

    def stats(self) -> dict[str, int]:
        if self.daemon is None:
            return {}
        return self.daemon.stats()

    def terminate(self) -> None:
        """SIGTERM to the server's whole session (API server, engine core, workers),
        without waiting: ``stop_arms`` signals every arm before it waits on any. Also
        after the API server itself died: its engine core and workers may not have."""
        if self.proc is not None and (self.proc.poll() is None or session_pids(self.proc.pid)):
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """Stop the server's whole session (the engine core and workers may
        outlive the API server) within 30 s, then SIGKILL what is left; then
        the daemon."""
        if self.proc is not None:
            self.terminate()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and (
                self.proc.poll() is None or session_pids(self.proc.pid)
            ):
                time.sleep(0.2)
            if self.proc.poll() is None or session_pids(self.proc.pid):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait()
        if self.daemon is not None:
            self.daemon.stop()


def session_pids(sid: int) -> list[int]:
    """Live (not zombie) processes of session ``sid``."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            st = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        f = st[st.rindex(")") + 2 :].split()
        if f[0] != "Z" and int(f[3]) == sid:
            out.append(int(d))
    return out


def make_arm(name: str, model: Path, work: Path) -> Arm:
    """A vLLM arm (ARMS) or an SGLang one (bench/serving/sglang_arm.py), which
    needs the SGLang venv: imported only when asked for."""
    if name.startswith("sg-"):
        from bench.serving.sglang_arm import SGLANG_ARMS, SGLangArm

        if name not in SGLANG_ARMS:
            raise SystemExit(f"unknown SGLang arm {name!r}: {', '.join(SGLANG_ARMS)}")
        return SGLangArm(name, model, work)
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
        pts.append(("fits", "rate", F["rate"], lambda cl, p=prompts: run_poisson(
            cl, p, len(p), F["rate"], F["out"], 7)))  # fmt: skip
    return pts


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
        for arm in arms:  # one at a time: startup compiles and loads weights
            r: dict[str, Any] = {"arm": arm.name, "points": []}
            res["arms"][arm.name] = r
            r["start_s"] = round(arm.start(), 1)
            r["engine_blocks"] = arm.client.engine_blocks()
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
        for k in range(1 if pl.get("quick") else 3):
            for arm in arms:
                rounds[arm.name].append(per_token_costs(arm, 99 - k))
                arm.check_alive()
        for arm in arms:
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


def stop_arms(arms: list[Arm]) -> None:
    """Stop every arm, signalling every server before waiting for any, so a
    loaded machine waits for the slowest, not for the sum."""
    for arm in arms:
        arm.terminate()
    for arm in arms:
        arm.stop()


def prepare(work_arg: str, out_arg: str | None) -> tuple[Path, Path, Path]:
    """The work directory (made), the results file and the model (built once)."""
    work = Path(work_arg).resolve()
    work.mkdir(parents=True, exist_ok=True)
    out = Path(out_arg) if out_arg else work / "results.json"
    return work, out, make_model(work / "model")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="one short point per workload")
    ap.add_argument("--arms", default=",".join(ARMS),
                    help="vLLM arms (none,plain,wt,wb) or SGLang arms (sg-none,sg-wt)")  # fmt: skip
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"a subset of {','.join(WORKLOADS)}")  # fmt: skip
    ap.add_argument("--rates", default=None, help="llm-d request rates, e.g. 16,32")
    ap.add_argument("--work", default=str(ROOT / "build" / "bench-serving"))
    ap.add_argument("--out", default=None, help="results JSON (default: WORK/results.json)")
    args = ap.parse_args()
    stop_on_signals()
    work, out, model = prepare(args.work, args.out)
    pl = plan(args.quick)
    if args.rates:
        pl["llmd"]["rates"] = [float(r) for r in args.rates.split(",")]
    pl["workloads"] = args.workloads.split(",")
    pl["quick"] = args.quick
    res: dict[str, Any] = {
        "quick": args.quick, "plan": pl, "cpus": os.cpu_count(),
        "engine_blocks": ENGINE_BLOCKS, "host_blocks": HOST_BLOCKS, "block_tokens": BLOCK,
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "arms": {},
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }  # fmt: skip
    log(f"engine KV {ENGINE_BLOCKS} blocks x {BLOCK} tokens, host tier {HOST_BLOCKS} blocks,"
        f" KV {KV_BYTES_PER_TOKEN} B/token")  # fmt: skip
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
