"""Shared fixtures: a real daemon process on a real Unix socket.

``daemon_factory`` starts ``python -m kvseal.server`` with the given flags in
a private temp directory, waits until the gRPC health service says SERVING,
and stops it at the end of the test (SIGTERM, then SIGKILL if it hangs).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kvseal.client import ClientConfig, KVSealClient, KVSealRpcError
from kvseal.client.shm import KVShape, SharedKVPool

# Scaled-down Qwen3-32B: real per-token geometry (64 layers, 8 KV heads, head
# dim 128, bf16, 16-token pages -> 4 MiB blocks), few pages.
QWEN3_32B = {"tokens_per_page": 16, "num_layers": 64, "num_kv_heads": 8, "head_dim": 128}
# Small geometry for tests that need many blocks but not realistic sizes.
SMALL = {"tokens_per_page": 4, "num_layers": 2, "num_kv_heads": 2, "head_dim": 16}


def until(cond: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """Wait for something the daemon does asynchronously (not a timing check: the
    bound only keeps a broken build from hanging the suite)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.02)


@dataclass
class DaemonProc:
    proc: subprocess.Popen[bytes]
    socket: str
    workdir: Path
    region: Path | None
    log_path: Path
    args: list[str] = field(default_factory=list)

    @property
    def target(self) -> str:
        return "unix://" + self.socket

    def client(self, **kw: object) -> KVSealClient:
        return KVSealClient(ClientConfig(target=self.target, **kw))  # type: ignore[arg-type]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_exit(self, timeout: float = 15.0) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait()
        return self.proc.returncode


def wait_serving(
    target: str, proc: subprocess.Popen[bytes], log_path: Path, timeout: float = 60.0
) -> None:
    deadline = time.monotonic() + timeout
    with KVSealClient(ClientConfig(target=target, timeout_s=0.5)) as c:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {proc.returncode}:\n{log_path.read_text()}")
            try:
                if c.health() == "SERVING":
                    return
            except KVSealRpcError:
                pass
            time.sleep(0.05)
    raise RuntimeError(f"daemon did not become SERVING:\n{log_path.read_text()}")


def start_daemon(
    workdir: Path,
    *extra: str,
    region: bool = False,
    host_bytes: str = "256MiB",
    socket_name: str = "kvseal.sock",
    wait: bool = True,
    env: dict[str, str] | None = None,
) -> DaemonProc:
    workdir.mkdir(parents=True, exist_ok=True)
    sock = str(workdir / "run" / socket_name)
    region_path = workdir / "host-region.bin" if region else None
    args = [
        sys.executable,
        "-m",
        "kvseal.server",
        "--listen",
        "unix://" + sock,
        "--backend",
        "cpu",
        "--host-bytes",
        host_bytes,
        "--grace",
        "2",
    ]
    if region_path is not None:
        args += ["--host-region", str(region_path)]
    args += list(extra)
    log_path = workdir / "daemon.log"
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(
            args,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    d = DaemonProc(proc, sock, workdir, region_path, log_path, args)
    if wait:
        try:
            wait_serving(d.target, proc, log_path)
        except BaseException:
            d.stop()
            raise
    return d


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProc]]:
    started: list[DaemonProc] = []
    counter = iter(range(1000))

    def factory(*extra: str, **kw: object) -> DaemonProc:
        d = start_daemon(tmp_path / f"d{next(counter)}", *extra, **kw)  # type: ignore[arg-type]
        started.append(d)
        return d

    yield factory
    for d in started:
        d.stop()


@pytest.fixture
def daemon(daemon_factory: Callable[..., DaemonProc]) -> DaemonProc:
    return daemon_factory()


@pytest.fixture
def pool_factory() -> Iterator[Callable[..., SharedKVPool]]:
    pools: list[SharedKVPool] = []

    def factory(
        num_pages: int = 8,
        layout: str = "vllm_per_layer",
        geometry: dict[str, int] | None = None,
        dtype: str = "bfloat16",
    ) -> SharedKVPool:
        shape = KVShape(num_pages=num_pages, dtype=dtype, **(geometry or SMALL))
        p = SharedKVPool(shape, layout, name_prefix="kvseal-test")
        pools.append(p)
        return p

    yield factory
    for p in pools:
        p.close()


def fill_random(pool: SharedKVPool, pages: list[int] | None = None) -> dict[int, bytes]:
    """Random plaintext into pages; returns page -> bytes written."""
    out = {}
    for p in pages if pages is not None else range(pool.shape.num_pages):
        data = os.urandom(pool.shape.block_bytes)
        pool.write_block(p, data)
        out[p] = data
    return out


POISON = 0xA5


def poison(pool: SharedKVPool, pages: list[int]) -> None:
    for p in pages:
        pool.fill_page(p, POISON)


def is_poisoned(pool: SharedKVPool, page: int) -> bool:
    return pool.read_block(page) == bytes([POISON]) * pool.shape.block_bytes
