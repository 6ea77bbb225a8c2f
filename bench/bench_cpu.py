"""CPU-backend benchmark: sealed offload/restore through a real daemon, next
to the two things it is made of (a plain copy and raw AES-256-GCM), plus the
small-request round trip with and without the peer-credential gate.

Run: ``make bench`` (or ``.venv/bin/python bench/bench_cpu.py [--quick]``).

What it does, in one run:

1. Starts ``python -m kvseal.server --backend cpu`` on a Unix socket in a
   private temp directory and waits for health SERVING.
2. Registers a :class:`~kvseal.client.shm.SharedKVPool` with Qwen3-32B
   geometry (64 layers, 8 KV heads, head dim 128, bf16, 16-token pages: 4 MiB
   blocks), filled with random bytes.
3. For each batch size (default 16 and 64 blocks = 64 MiB and 256 MiB):
   a. sealed offload (fresh hashes every repetition; dropped afterwards, not
      timed) and sealed write-through restore, each one gRPC call, through
      the daemon's public socket; median of N repetitions;
   b. a plain copy of the same pages (``ctypes.memmove`` segment by segment,
      the daemon's own gather) into a same-sized private buffer, one thread;
   c. raw ``AESGCM.encrypt_into`` / ``decrypt_into`` of the same bytes, 4 MiB
      per call, one thread; and the ratios sealed/raw.
4. ``Lookup`` of one hash, N calls, through the public socket (the gate's
   relay) and straight to the daemon's internal gRPC socket
   (a fresh ``.kvseal-*`` directory; the daemon logs it): p50/p99.
5. Prints a markdown table (last), stops the daemon with SIGTERM.

Throughput is GB/s = 1e9 bytes/s of plaintext. No GPU is used.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
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


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def median_time(
    fn: Callable[[], object], reps: int, setup: Callable[[], object] | None = None
) -> float:
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


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


class PageCopier:
    """The daemon's gather, done here: each segment's bytes of a page, by
    address, with ``ctypes.memmove`` (which releases the GIL)."""

    def __init__(self, pool: SharedKVPool) -> None:
        self._anchors = [(ctypes.c_char * b.size).from_buffer(b.map) for b in pool.buffers]
        bases = [ctypes.addressof(a) for a in self._anchors]
        self.segments = [
            (bases[s.buffer] + s.offset, s.page_stride, s.bytes) for s in pool.segments
        ]
        self.block_bytes = sum(n for _, _, n in self.segments)

    def gather(self, page: int, dst: int) -> None:
        pos = 0
        for base, stride, n in self.segments:
            ctypes.memmove(dst + pos, base + page * stride, n)
            pos += n

    def close(self) -> None:
        self._anchors.clear()


# ---------------------------------------------------------------- measurements


@dataclass
class Row:
    blocks: int
    nbytes: int
    offload_s: float
    restore_s: float
    copy_s: float
    enc_s: float
    dec_s: float


def measure_batch(
    client: KVSealClient, pool_id: str, copier: PageCopier, blocks: int, reps: int
) -> Row:
    bb = copier.block_bytes
    nbytes = blocks * bb
    pages = list(range(blocks))
    tenant = secrets.token_bytes(32)
    timeout = 600.0

    # (a) sealed offload: fresh hashes each repetition, dropped (untimed) after.
    offload_times = []
    for rep in range(reps + 1):  # first one is a warm-up
        hashes = [secrets.token_bytes(32) for _ in pages]
        t0 = time.perf_counter()
        r = client.offload(pool_id, tenant, hashes, pages, timeout=timeout)
        dt = time.perf_counter() - t0
        if r.stored_blocks != blocks:
            raise SystemExit(f"offload stored {r.stored_blocks} of {blocks} blocks")
        client.drop(pool_id, tenant, hashes)
        if rep:
            offload_times.append(dt)

    # (a) sealed restore, write-through (the blocks stay in the tier).
    hashes = [secrets.token_bytes(32) for _ in pages]
    client.offload(pool_id, tenant, hashes, pages, timeout=timeout)
    restore_times = []
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        r2 = client.restore(pool_id, tenant, hashes, pages, release=False, timeout=timeout)
        dt = time.perf_counter() - t0
        if r2.restored_blocks != blocks:
            raise SystemExit(f"restore restored {r2.restored_blocks} of {blocks} blocks")
        if rep:
            restore_times.append(dt)
    client.drop(pool_id, tenant, hashes)

    # (b) plain copy of the same pages into a same-sized private buffer.
    dst = bytearray(nbytes)
    dst_anchor = (ctypes.c_char * nbytes).from_buffer(dst)
    dst_addr = ctypes.addressof(dst_anchor)

    def copy_all() -> None:
        for i, p in enumerate(pages):
            copier.gather(p, dst_addr + i * bb)

    copy_all()  # warm-up (faults the destination in)
    copy_s = median_time(copy_all, reps)

    # (c) raw AES-256-GCM of the same bytes, one 4 MiB block per call, one thread.
    aead = AESGCM(AESGCM.generate_key(bit_length=256))
    nonce = bytes(12)  # one throwaway key: nonce reuse is irrelevant here
    aad = bytes(112)
    src = memoryview(dst)
    sealed = bytearray(nbytes + 16 * blocks)
    sealed_mv = memoryview(sealed)
    plain_out = bytearray(nbytes)
    plain_mv = memoryview(plain_out)

    def encrypt_all() -> None:
        for i in range(blocks):
            aead.encrypt_into(
                nonce,
                src[i * bb : (i + 1) * bb],
                aad,
                sealed_mv[i * (bb + 16) : (i + 1) * (bb + 16)],
            )

    def decrypt_all() -> None:
        for i in range(blocks):
            aead.decrypt_into(
                nonce,
                sealed_mv[i * (bb + 16) : (i + 1) * (bb + 16)],
                aad,
                plain_mv[i * bb : (i + 1) * bb],
            )

    encrypt_all()
    enc_s = median_time(encrypt_all, reps)
    decrypt_all()
    dec_s = median_time(decrypt_all, reps)
    if plain_out != dst:
        raise SystemExit("raw AES-GCM round trip mismatch")

    src.release()
    sealed_mv.release()
    plain_mv.release()
    del dst_anchor
    return Row(
        blocks,
        nbytes,
        statistics.median(offload_times),
        statistics.median(restore_times),
        copy_s,
        enc_s,
        dec_s,
    )


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
        help="comma-separated batch sizes in blocks (default 16,64; --quick: 2,4)",
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
    p.add_argument("--workers", type=int, default=0, help="daemon sealing threads (0: its default)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    batches = sorted(
        {int(x) for x in (args.blocks or ("2,4" if args.quick else "16,64")).split(",")}
    )
    if not batches or batches[0] < 1:
        raise SystemExit("--blocks must be positive integers")
    reps = args.reps or (2 if args.quick else 7)
    rtt_calls = args.rtt_calls or (100 if args.quick else 2000)
    shape = KVShape(num_pages=max(batches), dtype="bfloat16", **QWEN3_32B)
    block_bytes = shape.block_bytes
    # The tier holds the largest batch twice (restore set + a fresh offload) plus slack.
    host_bytes = 2 * max(batches) * block_bytes + 64 * MiB
    extra = ["--workers", str(args.workers)] if args.workers else []

    print(cpu_label(), flush=True)
    print(
        f"geometry: Qwen3-32B, {shape.num_layers} layers, {shape.num_kv_heads} KV heads, head dim "
        f"{shape.head_dim}, bf16, {shape.tokens_per_page}-token pages -> {block_bytes // MiB} MiB "
        f"blocks; layout {args.layout}; batches {batches}; {reps} reps (median)",
        flush=True,
    )
    rows: list[Row] = []
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
        copier = PageCopier(pool)
        try:
            for b in batches:
                row = measure_batch(client, handle.pool_id, copier, b, reps)
                rows.append(row)
                n = row.nbytes
                print(
                    f"  {b} blocks: offload {gbps(n, row.offload_s):.2f} GB/s, restore "
                    f"{gbps(n, row.restore_s):.2f} GB/s, copy {gbps(n, row.copy_s):.2f} GB/s, "
                    f"AES enc {gbps(n, row.enc_s):.2f} / dec {gbps(n, row.dec_s):.2f} GB/s",
                    flush=True,
                )
            gate = measure_rtt(daemon.target, handle.pool_id, rtt_calls)
            direct = measure_rtt(daemon.internal_target, handle.pool_id, rtt_calls)
        finally:
            copier.close()
        client.unregister_pool(handle.pool_id)

    print()
    print(TABLE_TITLE)
    print()
    print(
        f"{cpu_label()}; daemon: {detail}; Qwen3-32B {block_bytes // MiB} MiB blocks, layout "
        f"{args.layout}; median of {reps}; GB/s = 1e9 B/s of plaintext"
    )
    print()
    print(
        "| batch | bytes | sealed offload GB/s | sealed restore GB/s | plain copy GB/s "
        "| raw AES-GCM enc GB/s (1 thread) | raw dec GB/s (1 thread) "
        "| offload / raw enc | restore / raw dec | offload / copy |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        sealed_off, res = gbps(r.nbytes, r.offload_s), gbps(r.nbytes, r.restore_s)
        cp, enc, dec = gbps(r.nbytes, r.copy_s), gbps(r.nbytes, r.enc_s), gbps(r.nbytes, r.dec_s)
        cells = [f"{r.blocks} blocks", f"{r.nbytes // MiB} MiB"] + [
            f"{v:.2f}" for v in (sealed_off, res, cp, enc, dec)
        ]
        cells += [f"{sealed_off / enc:.2f}", f"{res / dec:.2f}", f"{sealed_off / cp:.2f}"]
        print("| " + " | ".join(cells) + " |")
    print()
    print(f"| Lookup (1 hash), {rtt_calls} calls | p50 µs | p99 µs |")
    print("|---|---:|---:|")
    print(f"| public socket (peer-credential gate relay) | {gate[0]:.0f} | {gate[1]:.0f} |")
    print(f"| internal gRPC socket (no gate) | {direct[0]:.0f} | {direct[1]:.0f} |")
    print(f"| gate cost | {gate[0] - direct[0]:+.0f} | {gate[1] - direct[1]:+.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
