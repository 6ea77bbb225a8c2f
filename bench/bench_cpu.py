"""CPU-backend benchmark: sealed offload/restore, through a real daemon and
in process, next to raw AES-256-GCM of the same bytes, plus the
small-request round trip with and without the peer-credential gate.

Run: ``make bench`` (or ``.venv/bin/python bench/bench_cpu.py [--quick]``).

What it does, in one run:

1. Starts ``python -m kvseal.server --backend cpu`` on a Unix socket in a
   private temp directory and waits for health SERVING.
2. Registers a :class:`~kvseal.client.shm.SharedKVPool` with Qwen3-32B
   geometry (64 layers, 8 KV heads, head dim 128, bf16, 16-token pages: 4 MiB
   blocks of 128 per-layer segments), filled with random bytes.
3. For each batch size (default 16, 64 and 256 blocks = 64 MiB, 256 MiB and
   1 GiB), N interleaved repetitions of: raw single-thread
   ``AESGCM.encrypt_into``, sealed offload in process (the daemon's
   ``CpuBackend`` classes, same thread count), sealed offload through the
   daemon (one gRPC call, fresh hashes, dropped untimed), raw
   ``decrypt_into``, sealed restore in process, sealed write-through restore
   through the daemon (see ``cpu_transfers.py``). Ratios are per repetition.
4. ``Lookup`` of one hash, N calls, through the public socket (the gate's
   relay) and straight to the daemon's internal gRPC socket
   (a fresh ``.kvseal-*`` directory; the daemon logs it): p50/p99.
5. Prints markdown tables (last), stops the daemon with SIGTERM.

Throughput is GB/s = 1e9 bytes/s of plaintext. No GPU is used.
"""

from __future__ import annotations

import argparse
import glob
import os
import platform
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import cpu_transfers
from kvseal.client import ClientConfig, KVSealClient, KVSealRpcError
from kvseal.client.shm import LAYOUTS, KVShape, SharedKVPool

QWEN3_32B = {"tokens_per_page": 16, "num_layers": 64, "num_kv_heads": 8, "head_dim": 128}
TABLE_TITLE = "## kvseal CPU backend benchmark"
MiB = 1024 * 1024


# ---------------------------------------------------------------- helpers


def cpu_label() -> str:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {model or platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]


@dataclass
class Daemon:
    proc: subprocess.Popen[bytes]
    socket: str
    log: Path

    @property
    def target(self) -> str:
        return "unix://" + self.socket

    @property
    def internal_target(self) -> str:
        """gRPC's private socket: a fresh 0700 ``.kvseal-*`` directory next to
        the public socket (the bench's socket directory is private)."""
        found = glob.glob(os.path.join(os.path.dirname(self.socket), ".kvseal-*", "grpc.sock"))
        if len(found) != 1:
            raise RuntimeError(f"expected one internal socket, found {found}")
        return "unix://" + found[0]


@contextmanager
def run_daemon(workdir: Path, host_bytes: int, extra: list[str]) -> Iterator[Daemon]:
    sock_dir = workdir / "run"
    sock_dir.mkdir(mode=0o700)
    sock = str(sock_dir / "kvseal.sock")
    log = workdir / "daemon.log"
    args = [
        sys.executable,
        "-m",
        "kvseal.server",
        "--listen",
        "unix://" + sock,
        "--host-bytes",
        str(host_bytes),
        "--backend",
        "cpu",
        "--log-level",
        "WARNING",
        *extra,
    ]
    with open(log, "wb") as logf:
        proc = subprocess.Popen(args, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    d = Daemon(proc, sock, log)
    try:
        wait_serving(d)
        yield d
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.returncode not in (0, None):
            sys.stderr.write(f"daemon exited with {proc.returncode}:\n{log.read_text()[-4000:]}\n")


def wait_serving(d: Daemon, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    with KVSealClient(ClientConfig(target=d.target, timeout_s=1.0)) as c:
        while time.monotonic() < deadline:
            if d.proc.poll() is not None:
                raise SystemExit(f"daemon exited with {d.proc.returncode}:\n{d.log.read_text()}")
            try:
                if c.health() == "SERVING":
                    return
            except KVSealRpcError:
                pass
            time.sleep(0.05)
    raise SystemExit(f"daemon did not become SERVING in {timeout}s:\n{d.log.read_text()}")


# ---------------------------------------------------------------- measurements


def measure_rtt(target: str, pool_id: str, calls: int) -> tuple[float, float]:
    """p50, p99 of a one-hash Lookup in microseconds."""
    tenant = secrets.token_bytes(32)
    one = [secrets.token_bytes(32)]
    with KVSealClient(ClientConfig(target=target, lookup_timeout_s=10.0, timeout_s=10.0)) as c:
        for _ in range(min(100, calls)):  # warm-up: connect, caches
            c.lookup(pool_id, tenant, one)
        samples = []
        for _ in range(calls):
            t0 = time.perf_counter_ns()
            c.lookup(pool_id, tenant, one)
            samples.append((time.perf_counter_ns() - t0) / 1000.0)
    samples.sort()
    return percentile(samples, 0.50), percentile(samples, 0.99)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument(
        "--quick", action="store_true", help="smoke test: small batches, few repetitions"
    )
    p.add_argument(
        "--blocks",
        default=None,
        help="comma-separated batch sizes in blocks (default 16,64,256; --quick: 2,4)",
    )
    p.add_argument("--layout", choices=LAYOUTS, default="vllm_per_layer", help="pool layout")
    p.add_argument(
        "--reps", type=int, default=None, help="repetitions per measurement (default 7; --quick: 2)"
    )
    p.add_argument(
        "--rtt-calls",
        type=int,
        default=None,
        help="Lookup calls per socket (default 2000; --quick: 100)",
    )
    p.add_argument(
        "--workers", type=int, default=2, help="sealing threads, daemon and in process (default 2)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    batches = sorted(
        {int(x) for x in (args.blocks or ("2,4" if args.quick else "16,64,256")).split(",")}
    )
    if not batches or batches[0] < 1:
        raise SystemExit("--blocks must be positive integers")
    reps = args.reps or (2 if args.quick else 7)
    rtt_calls = args.rtt_calls or (100 if args.quick else 2000)
    shape = KVShape(num_pages=max(batches), dtype="bfloat16", **QWEN3_32B)
    block_bytes = shape.block_bytes
    # The tier holds the largest batch twice (restore set + a fresh offload) plus slack.
    host_bytes = 2 * max(batches) * block_bytes + 64 * MiB
    if args.workers < 1:
        raise SystemExit("--workers must be positive")
    extra = ["--workers", str(args.workers)]

    print(cpu_label(), flush=True)
    print(
        f"geometry: Qwen3-32B, {shape.num_layers} layers, {shape.num_kv_heads} KV heads, head dim "
        f"{shape.head_dim}, bf16, {shape.tokens_per_page}-token pages -> {block_bytes // MiB} MiB "
        f"blocks; layout {args.layout}; batches {batches}; {reps} reps (median)",
        flush=True,
    )
    load_before = cpu_transfers.load_average()
    with (
        tempfile.TemporaryDirectory(prefix="kvseal-bench-") as tmp,
        run_daemon(Path(tmp), host_bytes, extra) as daemon,
        SharedKVPool(shape, args.layout, name_prefix="kvseal-bench") as pool,
        KVSealClient(ClientConfig(target=daemon.target, timeout_s=30.0)) as client,
    ):
        for buf in pool.buffers:  # random plaintext: AES speed does not depend on it, but honest
            for off in range(0, buf.size, 8 * MiB):
                n = min(8 * MiB, buf.size - off)
                buf.view[off : off + n] = os.urandom(n)
        handle = client.register_pool(
            f"bench-{os.getpid()}", b"kvseal-bench/qwen3-32b", pool.geometry()
        )
        detail = client.stats().backend_detail
        print(f"daemon pid {daemon.proc.pid}: {detail}", flush=True)
        rows = cpu_transfers.measure(
            pool,
            client,
            handle.pool_id,
            batches,
            reps,
            args.workers,
            lambda line: print(line, flush=True),
        )
        gate = measure_rtt(daemon.target, handle.pool_id, rtt_calls)
        direct = measure_rtt(daemon.internal_target, handle.pool_id, rtt_calls)
        client.unregister_pool(handle.pool_id)
    load_after = cpu_transfers.load_average()

    print()
    print(TABLE_TITLE)
    print()
    print(
        f"{cpu_label()}; load average {load_before} before, {load_after} after; daemon: "
        f"{detail}; in process: the same CpuBackend, {args.workers} threads; Qwen3-32B "
        f"{block_bytes // MiB} MiB blocks, layout {args.layout}; median of {reps} interleaved "
        "repetitions, ratios per repetition as median (min-max); GB/s = 1e9 B/s of plaintext"
    )
    print()
    for line in cpu_transfers.table(rows):
        print(line)
    print()
    print(f"| Lookup (1 hash), {rtt_calls} calls | p50 µs | p99 µs |")
    print("|---|---:|---:|")
    print(f"| public socket (peer-credential gate relay) | {gate[0]:.0f} | {gate[1]:.0f} |")
    print(f"| internal gRPC socket (no gate) | {direct[0]:.0f} | {direct[1]:.0f} |")
    print(f"| gate cost | {gate[0] - direct[0]:+.0f} | {gate[1] - direct[1]:+.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
