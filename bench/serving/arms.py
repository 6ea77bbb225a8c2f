"""The serving benchmark's arms (bench/serving/run.py): one ``vllm serve``
each (CPU platform, the local model of model.py), its kvseal daemon where it
has one, CPU accounting and a stop that reaches every process of the server's
session. The SGLang arms (bench/serving/sglang_arm.py) subclass ``Arm``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvseal.client.errors import KVSealRpcError

from bench.serving.model import KV_BYTES_PER_TOKEN
from bench.serving.workloads import Client
from tests_vllm.daemon import Daemon

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
ENGINE_BLOCKS = 128  # engine KV cache: 4,096 tokens
HOST_FACTOR = 2.4  # host tier / engine KV (the seed's ratio)
BLOCK_BYTES = BLOCK * KV_BYTES_PER_TOKEN
HOST_BLOCKS = int(ENGINE_BLOCKS * HOST_FACTOR)
MAX_LEN = 1536
ARMS = ("none", "plain", "wt", "wb")
# Arms asked for by name only (--arms): kvseal offloading at eviction, and
# write-back over it (docs/vllm.md "Offload at eviction").
MORE_ARMS = ("ev", "ewb")
KVSEAL_MODES = ("wt", "wb", "ev", "ewb")  # the arms with a daemon
# The hybrid model's arms (model.make_hybrid_model): "h-" and a mode of ARMS.
# Its engine KV cache is smaller in bytes: a cached prefix keeps every
# full-attention block but only the sliding-window blocks inside the window,
# about 2.5x fewer bytes per token than the Llama, so this keeps the llm-d
# working set a few times the engine's cache. Both offload arms get the same
# tier bytes (HOST_FACTOR x the engine's): the anchor's chunks and kvseal's
# sealed blocks (ciphertext, tag and record header) each come out of them.
HYBRID_ARMS = ("h-none", "h-plain", "h-wt")
HYBRID_ENGINE_BYTES = 7 << 20
HYBRID_HOST_BYTES = int(HYBRID_ENGINE_BYTES * HOST_FACTOR)
# A run's changes to the engine shape (bench/serving/run.py: --host-factor,
# --max-batched-tokens), the same for every arm of the run: "host_blocks" (the
# Llama arms' tier) and "max_batched_tokens" (vLLM's per-step budget; unset,
# vLLM's default, which on this engine lets one step allocate the whole cache).
SHAPE: dict[str, int] = {}


def host_blocks() -> int:
    """The Llama arms' host tier in blocks: HOST_BLOCKS unless the run set it."""
    return SHAPE.get("host_blocks", HOST_BLOCKS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Arm:
    def __init__(self, name: str, model: Path, work: Path, mode: str | None = None,
                 hybrid: bool = False) -> None:  # fmt: skip
        self.name, self.model, self.work = name, model, work / name
        self.mode = mode or name  # the kind of arm (ARMS); the name only labels it
        self.hybrid = hybrid  # the hybrid model (HYBRID_ARMS): its engine and tier bytes
        self.engine_bytes = HYBRID_ENGINE_BYTES if hybrid else ENGINE_BLOCKS * BLOCK_BYTES
        # Llama arms: HOST_BLOCKS blocks, kvseal's each with its 64 sealed bytes more.
        self.tier_bytes = HYBRID_HOST_BYTES if hybrid else host_blocks() * BLOCK_BYTES
        self.work.mkdir(parents=True, exist_ok=True)
        self.daemon: Daemon | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.launched_at = 0.0  # time.monotonic() at launch()
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
                    "cpu_bytes_to_use": self.tier_bytes,
                },
            }  # fmt: skip
        assert self.daemon is not None
        return {
            "kv_connector": "KVSealOffloadingConnector",
            "kv_connector_module_path": "kvseal.vllm.connector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "kvseal_socket": self.daemon.socket,
                "kvseal_write_back": self.mode in ("wb", "ewb"),
                "kvseal_offload": "eviction" if self.mode in ("ev", "ewb") else "write-through",
            },
        }  # fmt: skip

    def start(self) -> float:
        """Start the arm and wait until its server answers; the seconds that took."""
        self.launch()
        return self.wait_up()

    def launch(self) -> None:
        """Start the daemon (a kvseal arm's: returns once it serves) and the server
        process, without waiting for the server (``wait_up``): run.py's
        ``--parallel-start`` launches every arm before it waits for any."""
        self.launched_at = time.monotonic()
        if self.mode in KVSEAL_MODES:
            # Llama: host region sized to HOST_BLOCKS sealed blocks (ciphertext +
            # tag); hybrid: the anchor's bytes exactly (tokens per tier byte).
            host = self.tier_bytes if self.hybrid else host_blocks() * (BLOCK_BYTES + 64)
            self.daemon = Daemon(
                self.work / "daemon", extra=self.daemon_extra(), host_bytes=str(host)
            ).start()
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16",
            "--block-size", str(BLOCK), "--enable-prefix-caching", "--enforce-eager",
            "--max-model-len", str(MAX_LEN), "--max-num-seqs", "8", "--seed", "0",
            "--kv-cache-memory-bytes", str(self.engine_bytes),
            "--enable-prompt-tokens-details", "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if "max_batched_tokens" in SHAPE:
            args += ["--max-num-batched-tokens", str(SHAPE["max_batched_tokens"])]
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

    def wait_up(self) -> float:
        """Wait (600 s at most) until the launched server answers ``/health``; the
        seconds since ``launch``. RuntimeError with the log's tail if it exits or
        does not come up."""
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: vllm serve exited: {self.tail()}")
            try:
                self.client.get("/health")
                return time.monotonic() - self.launched_at
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"{self.name}: vllm serve not up: {self.tail()}")

    def daemon_extra(self) -> tuple[str, ...]:
        """More flags for a kvseal arm's daemon (bench/serving/store_points.py)."""
        return ()

    def tail(self, n: int | None = 4000) -> str:
        """The server log's last ``n`` characters (all of it for None)."""
        text = (self.work / "serve.log").read_text(errors="replace")
        return text if n is None else text[-n:]

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

    def tier_summary(self) -> dict[str, Any]:
        """What the second tier can hold, for tokens per tier byte: the anchor's
        chunks (its capacity; vLLM's manager allocates one per (block hash,
        group) key, ``chunk_bytes`` each) or kvseal's (the region's capacity over
        the bytes a held sealed block takes, from the daemon's Stats at the end;
        ``held``: the blocks it holds then). Each entry is one group's block of
        ``BLOCK`` tokens. Empty for no offload."""
        out: dict[str, Any] = {"tier_bytes": self.tier_bytes}
        if self.mode == "plain":
            m = re.search(r"kvseal-bench-anchor: chunks=(\d+) chunk_bytes=(\d+)", self.tail(None))
            if m is None:
                return {}
            out.update(entries=int(m.group(1)), entry_bytes=int(m.group(2)), full=True)
        elif self.daemon is not None:
            from kvseal.client import ClientConfig, KVSealClient

            with KVSealClient(ClientConfig(target=self.daemon.target)) as c:
                st = c.stats()
            held = int(st.blocks_ready)
            if not held:
                return {}
            # The bytes a sealed block takes in the region (ciphertext, tag and
            # record header, slot-aligned), measured; capacity follows from them.
            per = int(st.host_bytes_used) // held
            out.update(entries=int(st.host_bytes_capacity) // per, entry_bytes=per,
                       held=held, full=int(st.evicted_blocks) > 0)  # fmt: skip
        else:
            return {}
        out["tokens_per_mib"] = out["entries"] * BLOCK / (self.tier_bytes / (1 << 20))
        return out

    def stats(self) -> dict[str, int]:
        """The daemon's counters; a Stats call that timed out is asked again
        (twice, after a pause): under SGLang's arms the load reached 18-22 and
        one deadline ended a whole run. A third failure ends it."""
        if self.daemon is None:
            return {}
        for attempt in range(3):
            try:
                return self.daemon.stats()
            except KVSealRpcError:
                if attempt == 2:
                    raise
                time.sleep(2.0)
        raise AssertionError("unreachable")

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


def stop_arms(arms: list[Arm]) -> None:
    """Stop every arm, signalling every server before waiting for any, so a
    loaded machine waits for the slowest, not for the sum."""
    for arm in arms:
        arm.terminate()
    for arm in arms:
        arm.stop()
