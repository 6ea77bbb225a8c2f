"""A real kvseal daemon process for the vLLM tests (the idea of tests/conftest.py,
without depending on it: this suite runs in its own venv).

The daemon runs from the interpreter of this venv (kvseal-server is installed
into .venv-vllm), on a real Unix socket, with its ciphertext region in a file
the tests own (``--host-region``), so a test can play the host and tamper.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvseal.client import ClientConfig, KVSealClient, KVSealRpcError


@dataclass
class Daemon:
    workdir: Path
    extra: tuple[str, ...] = ()
    host_bytes: str = "64MiB"
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    args: list[str] = field(default_factory=list)
    # Another interpreter and environment for the daemon (a store backend's
    # client library lives outside this venv: tests_vllm/store_backends.py).
    python: str = sys.executable
    env: dict[str, str] | None = None

    @property
    def socket(self) -> str:
        return str(self.workdir / "run" / "kvseal.sock")

    @property
    def target(self) -> str:
        return "unix://" + self.socket

    @property
    def region(self) -> Path:
        return self.workdir / "host-region.bin"

    @property
    def log_path(self) -> Path:
        return self.workdir / "daemon.log"

    def start(self, timeout: float = 30.0) -> Daemon:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.args = [
            self.python, "-m", "kvseal.server",
            "--listen", self.target, "--backend", "cpu",
            "--host-bytes", self.host_bytes, "--grace", "2",
            "--host-region", str(self.region), *self.extra,
        ]  # fmt: skip
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                self.args,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
            )
        self.starts += 1
        deadline = time.monotonic() + timeout
        with KVSealClient(ClientConfig(target=self.target, timeout_s=0.5)) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited {self.proc.returncode}: {self.log()}")
                try:
                    if c.health() == "SERVING":
                        return self
                except KVSealRpcError:
                    pass
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"daemon did not become SERVING: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye (what a crash looks like to the engine)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def stats(self) -> dict[str, int]:
        with KVSealClient(ClientConfig(target=self.target)) as c:
            s = c.stats()
        return {
            f: int(getattr(s, f))
            for f in (
                "pools", "lookups", "lookup_hit_blocks", "offloaded_blocks", "restored_blocks",
                "evicted_blocks", "dropped_blocks", "integrity_failures", "blocks_ready",
            )
        }  # fmt: skip

    def tamper(self) -> int:
        """Play the host: flip one byte in every 256 of the region's written part.
        Returns the number of bytes flipped."""
        data = self.region.read_bytes()
        flipped = 0
        # In place (never rewrite the file): a store the daemon publishes meanwhile
        # keeps its own bytes.
        with open(self.region, "r+b") as f:
            for i in range(0, len(data), 256):
                if any(data[i : i + 256]):
                    f.seek(i)
                    f.write(bytes([data[i] ^ 0xFF]))
                    flipped += 1
        return flipped
