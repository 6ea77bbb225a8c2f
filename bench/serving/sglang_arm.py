"""The serving benchmark's SGLang arms: a real ``sglang.launch_server`` (CPU
engine, the same local model and word-level tokenizer as the vLLM arms), driven
by the same OpenAI-completions client and workloads (bench/serving/run.py).

Arms: ``sg-none`` (SGLang's own radix cache only), ``sg-wt`` (kvseal's
linker, write-through: the only policy SGLang 0.5.23 offers a direct linker,
docs/sglang.md "Write-back") and ``sg-ev`` (kvseal's linker with
``offload_policy: "evict"``: a page is sealed when SGLang evicts it,
docs/sglang.md "Offload at eviction") and ``sg-ewb`` (``write_back: true`` over
it: a restore releases the host copy), each kvseal arm with a real daemon
whose host tier has the vLLM arms' size. SGLang's engine KV is the vLLM
arms' (4,096 tokens in pages of 32), its prompt-cache report
(``--enable-cache-report``) gives each request's cached tokens; which tier
served them comes from the daemon's restored blocks (SGLang exports no
external-hit counter): ``cached_tier`` is restored blocks x block tokens
over prompt tokens, ``cached_engine`` the rest.

Runs from the SGLang venv (``make bench-serving-sglang``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Any

from bench.serving.arms import (
    BLOCK,
    BLOCK_BYTES,
    ENGINE_BLOCKS,
    MAX_LEN,
    ROOT,
    Arm,
    host_blocks,
)
from tests_vllm.daemon import Daemon

SGLANG_ARMS = ("sg-none", "sg-wt", "sg-ev", "sg-ewb")
STUB = ROOT / "tests_sglang" / "stub"


class SGLangArm(Arm):
    """An arm whose server is SGLang (see module doc); the rest of ``Arm``
    (CPU accounting, daemon Stats, stop) is shared."""

    def start(self) -> float:
        t0 = time.monotonic()
        args = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model),
            "--device", "cpu", "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "bfloat16", "--page-size", str(BLOCK),
            "--max-total-tokens", str(ENGINE_BLOCKS * BLOCK), "--context-length", str(MAX_LEN),
            "--max-running-requests", "8", "--disable-overlap-schedule",
            "--enable-cache-report", "--random-seed", "0", "--log-level", "warning",
        ]  # fmt: skip
        if self.name in ("sg-wt", "sg-ev", "sg-ewb"):
            self.daemon = Daemon(
                self.work / "daemon", host_bytes=str(host_blocks() * BLOCK_BYTES)
            ).start()
            cfg = {
                "linker": "KVSealLinker", "linker_module_path": "kvseal.sglang.linker",
                "linker_extra_config": {
                    "socket": self.daemon.socket, "staging_bytes": 64 << 20,
                    "offload_policy": "write_through" if self.name == "sg-wt" else "evict",
                    "write_back": self.name == "sg-ewb",
                },
            }  # fmt: skip
            args += [
                "--enable-unified-cache-external-linker",
                "--unified-cache-external-linker-backend", "dynamic",
                "--unified-cache-external-linker-config", json.dumps(cfg),
            ]  # fmt: skip
        # OMP_WAIT_POLICY=PASSIVE as for the vLLM arms: an idle server's OpenMP
        # threads must not spin on the cores another arm is being measured on.
        env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1",
               "OMP_WAIT_POLICY": "PASSIVE",
               "PYTHONPATH": f"{STUB}{os.pathsep}{ROOT}"}  # fmt: skip
        with open(self.work / "serve.log", "wb") as logf:
            self.proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, cwd=self.work)  # fmt: skip
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: sglang exited: {self.tail()}")
            try:
                if self.client.status("/health") == 200:
                    return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name}: sglang not up: {self.tail()}")

    def adjust(self, pt: dict[str, Any]) -> None:
        """Split the cached share into tiers (module doc)."""
        prompt = pt.get("prompt_tokens") or 0
        restored = pt.get("restored_blocks") or 0
        tier = min(pt["cached_usage"], restored * BLOCK / prompt) if prompt else 0.0
        pt["cached_tier"] = tier
        pt["cached_engine"] = max(0.0, pt["cached_usage"] - tier)
