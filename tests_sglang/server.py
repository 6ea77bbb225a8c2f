"""A real ``sglang.launch_server`` process on the CPU, with or without kvseal.

The server runs from this venv's interpreter with the documented flag line
(docs/sglang.md) when a daemon is given; ``SGLANG_USE_CPU_ENGINE`` and the
placeholder ``sgl_kernel`` come from the environment ``make test-sglang`` sets
(they are set here too, so a test run by hand works the same). Requests go
through SGLang's native ``/generate`` with token ids (the tiny model has no
tokenizer), greedy, so outputs are comparable token for token.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

STUB = Path(__file__).resolve().parent / "stub"
ROOT = Path(__file__).resolve().parent.parent
DOC_SOCKET = "/run/kvseal/kvseal.sock"
MARK = re.compile(r"<!-- tested: ([\w-]+) -->\n```sh\n(.*?)```", re.S)
# What the CPU test platform adds to a documented command: SGLang's CPU engine,
# no tokenizer (the tiny model has none), a small KV pool.
CPU_FLAGS = ("--device", "cpu", "--disable-overlap-schedule", "--skip-tokenizer-init")


def documented_commands(kind: str = "sglang-serve") -> dict[str, str]:
    """The ``kind`` block of README.md and docs/sglang.md, continuation lines
    joined: {file name: command}."""
    out = {}
    for path in (ROOT / "README.md", ROOT / "docs" / "sglang.md"):
        for k, body in MARK.findall(path.read_text()):
            if k == kind:
                out[path.name] = body.replace("\\\n", " ").strip()
    return out


def documented_argv(cmd: str, model: Path, port: int, socket_path: str) -> list[str]:
    """The documented command as an argv for this machine: MODEL, the port and
    the daemon's socket substituted, this venv's python; nothing else changed."""
    argv = shlex.split(cmd)
    assert argv[0] == "python", cmd
    argv[0] = sys.executable
    argv = [str(model) if a == "MODEL" else str(port) if a == "30000" else a for a in argv]
    return [a.replace(DOC_SOCKET, socket_path) for a in argv]


def linker_flags(socket_path: str, **extra: Any) -> list[str]:
    """SGLang's flags that enable kvseal (docs/sglang.md, the flag line)."""
    cfg = {
        "linker": "KVSealLinker",
        "linker_module_path": "kvseal.sglang.linker",
        "linker_extra_config": {"socket": socket_path, **extra},
    }
    return [
        "--enable-unified-cache-external-linker",
        "--unified-cache-external-linker-backend", "dynamic",
        "--unified-cache-external-linker-config", json.dumps(cfg),
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One SGLang server. ``start`` waits until it answers (or raises with its
    log); ``stop`` ends it (SIGTERM, then SIGKILL of its process group)."""

    def __init__(
        self,
        model: Path,
        workdir: Path,
        *,
        kv_tokens: int = 512,
        page_size: int = 16,
        kvseal_socket: str | None = None,
        linker: dict[str, Any] | None = None,
        extra: tuple[str, ...] = (),
        documented: str | None = None,
    ) -> None:
        self.model = model
        self.workdir = workdir
        self.kv_tokens = kv_tokens
        self.page_size = page_size
        self.kvseal_socket = kvseal_socket
        self.linker = linker or {}
        self.extra = extra
        self.documented = documented  # a documented command to run instead (documented_argv)
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.workdir / f"sglang-{self.starts}.log"

    def args(self) -> list[str]:
        if self.documented is not None:
            assert self.kvseal_socket is not None
            return [
                *documented_argv(self.documented, self.model, self.port, self.kvseal_socket),
                *CPU_FLAGS, "--max-total-tokens", str(self.kv_tokens),
            ]  # fmt: skip
        a = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(self.model), "--device", "cpu",
            "--disable-overlap-schedule", "--skip-tokenizer-init",
            "--max-total-tokens", str(self.kv_tokens), "--page-size", str(self.page_size),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--random-seed", "1", "--log-level", "info", *self.extra,
        ]  # fmt: skip
        if self.kvseal_socket is not None:
            a += linker_flags(self.kvseal_socket, **self.linker)
        return a

    def start(self, timeout: float = 240.0) -> Server:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        self.port = free_port()
        env = dict(os.environ)
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STUB), env.get("PYTHONPATH", "")) if p)
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                self.args(), stdout=logf, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, cwd=self.workdir,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang exited {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"sglang did not start in {timeout:.0f} s:\n{self.log()}")

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def log(self) -> str:
        text = self.log_path.read_text(errors="replace")
        # The server_args line is kilobytes long: keep the lines around it.
        lines = [
            ln for ln in text.splitlines() if "server_args=" not in ln and "Ignore import" not in ln
        ]
        return "\n".join(lines[-60:])

    def generate(
        self, ids: list[int], *, salt: str | None = None, max_new: int = 8, timeout: float = 120.0
    ) -> dict[str, Any]:
        """``{"ids": output token ids, "cached": cached prompt tokens, "status": HTTP}``.
        An error status (SGLang aborted the request) comes back as such, never raised."""
        body: dict[str, Any] = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True},
        }
        if salt is not None:
            body["cache_salt"] = salt
        req = urllib.request.Request(
            self.url("/generate"), json.dumps(body).encode(), {"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                d = json.loads(r.read())
                return {
                    "ids": d["output_ids"],
                    "cached": d["meta_info"]["cached_tokens"],
                    "status": r.status,
                }
        except urllib.error.HTTPError as e:
            return {
                "ids": [],
                "cached": 0,
                "status": e.code,
                "error": e.read().decode(errors="replace"),
            }

    def flush(self) -> None:
        """Empty SGLang's own prefix cache (``/flush_cache``; retried while
        requests are still running, which makes SGLang refuse it)."""
        for _ in range(100):
            req = urllib.request.Request(self.url("/flush_cache"), b"", method="POST")
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("sglang refused /flush_cache")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        try:
            os.killpg(p.pid, sig)
            p.wait(30)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(30)


def prompt(seed: int, n: int, vocab: int = 1024) -> list[int]:
    """``n`` token ids fixed by ``seed`` (a simple LCG: no numpy needed)."""
    x = seed * 2654435761 % (1 << 32) or 1
    out = []
    for _ in range(n):
        x = (1103515245 * x + 12345) % (1 << 31)
        out.append(3 + x % (vocab - 3))
    return out
