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
4. Round trips (``measure_round_trips``, its own daemons): a bare grpcio
   unary echo over a Unix socket (the reference row), then ``Lookup`` of one
   hash through the public socket of a default daemon (owner-only: gRPC's own
   socket, the kernel's check) and of one with ``--socket-group`` (the
   SO_PEERCRED relay), and straight to the latter's internal gRPC socket (a
   fresh ``.kvseal-*`` directory): p50/p99 and p50 / echo p50, the cases
   taking turns in blocks of calls. ``--round-trip-only`` runs just this.
5. The fixed cost of a request (``request_cost.py``): one-block to 256-block
   ``Offload``/``Restore`` through the same daemon next to raw AES of the
   same bytes, and the same requests on a 4 KiB-block twin pool (same pages,
   same 128 segments per block): its time is the fixed cost per request.
   ``--cost-only`` runs just this (and ``--cost-blocks`` picks the sizes).
6. The store tier's rows (``store_transfers.py``): sealed spill and store
   restore of the same 4 MiB blocks against a plain file copy of the same
   bytes, in process, in a temp directory; then each store backend
   (``store_backends.py``: S3 through ``weed mini``, Mooncake Store through
   ``mooncake_master``, started here) against its own client's raw put and
   get of the same bytes, beside the directory's rows; a backend that cannot
   start here is skipped with the reason. ``--store-only`` runs just this.
7. Prints markdown tables (last), stops the daemons with SIGTERM.

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import cpu_transfers
import grpc
import request_cost
import store_backends
import store_transfers
from kvseal.client import ClientConfig, KVSealClient, KVSealRpcError
from kvseal.client.shm import LAYOUTS, KVShape, SharedKVPool
from kvseal.v1 import kvseal_pb2 as pb

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


ECHO_SERVER = r"""
import sys
from concurrent import futures
import grpc
handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
server.add_generic_rpc_handlers(
    (grpc.method_handlers_generic_handler("bench.Echo", {"Echo": handler}),)
)
server.add_insecure_port("unix://" + sys.argv[1])
server.start()
print("READY", flush=True)
server.wait_for_termination()
"""
ECHO_LABEL = "bare grpcio unary echo, Unix socket (reference)"


@dataclass
class RoundTrip:
    label: str
    p50_us: float
    p99_us: float


@contextmanager
def run_echo_server(path: str) -> Iterator[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", ECHO_SERVER, path], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"READY":
            raise SystemExit(f"echo server exited with {proc.wait()}")
        yield "unix://" + path
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def measure_round_trips(workdir: Path, calls: int, block: int) -> list[RoundTrip]:
    """p50/p99 (µs) of a bare gRPC echo and of a one-hash ``Lookup`` (through
    ``KVSealClient``, as an engine calls it), in one run.

    Two daemons: the default, owner-only (gRPC listens on the public socket;
    the kernel's check on the 0600 socket is the uid check), and one with
    ``--socket-group`` (the SO_PEERCRED relay in front of gRPC's own socket,
    which is measured too, so the relay's cost shows). The cases take turns in
    blocks of ``block`` calls, so a load change on a shared machine falls on
    all of them; the echo request is as large as the Lookup request."""
    tenant, one = secrets.token_bytes(32), [secrets.token_bytes(32)]
    observer = pb.PoolGeometry(block_bytes=4 * MiB, dtype="bfloat16", layout="vllm_per_layer")
    relay_flags = ["--socket-group", str(os.getgid())]
    for name in ("owner-only", "relay"):
        (workdir / name).mkdir()
    with (
        run_echo_server(str(workdir / "echo.sock")) as echo_target,
        run_daemon(workdir / "owner-only", 64 * MiB, []) as owner,
        run_daemon(workdir / "relay", 64 * MiB, relay_flags) as relayed,
        grpc.insecure_channel(echo_target) as echo_channel,
    ):
        clients = {
            name: KVSealClient(ClientConfig(target=t, lookup_timeout_s=10.0, timeout_s=10.0))
            for name, t in (
                ("owner", owner.target),
                ("relay", relayed.target),
                ("internal", relayed.internal_target),
            )
        }
        try:
            pool_ids = {
                name: c.register_pool(f"rtt-{name}", b"kvseal-bench/rtt", observer, observer=True)
                for name, c in clients.items()
                if name != "internal"
            }
            pool_ids["internal"] = pool_ids["relay"]
            size = pb.LookupRequest(
                pool_id=pool_ids["owner"].pool_id, tenant=tenant, block_hashes=one
            ).ByteSize()
            echo = echo_channel.unary_unary("/bench.Echo/Echo")
            payload = os.urandom(size)

            def lookup(name: str) -> Callable[[], object]:
                c, pool_id = clients[name], pool_ids[name].pool_id
                return lambda: c.lookup(pool_id, tenant, one)

            cases: list[tuple[str, Callable[[], object]]] = [
                (ECHO_LABEL, lambda: echo(payload, timeout=10.0)),
                (
                    "Lookup (1 hash), public socket, owner-only: kernel check, no relay",
                    lookup("owner"),
                ),
                (
                    "Lookup (1 hash), public socket, --socket-group: SO_PEERCRED relay",
                    lookup("relay"),
                ),
                (
                    "Lookup (1 hash), that daemon's internal gRPC socket (no relay)",
                    lookup("internal"),
                ),
            ]
            samples: dict[str, list[float]] = {label: [] for label, _ in cases}
            for _, fn in cases:  # warm-up: connect, caches
                for _ in range(min(100, calls)):
                    fn()
            for _ in range(max(1, calls // block)):
                for label, fn in cases:
                    out = samples[label]
                    for _ in range(block):
                        t0 = time.perf_counter_ns()
                        fn()
                        out.append((time.perf_counter_ns() - t0) / 1000.0)
        finally:
            for c in clients.values():
                c.close()
    result = []
    for label, values in samples.items():
        values.sort()
        result.append(RoundTrip(label, percentile(values, 0.50), percentile(values, 0.99)))
    return result


def print_round_trips(rows: list[RoundTrip], calls: int, block: int) -> None:
    """The round-trip table; the first row is the reference, and the goal
    (issue 14) is the owner-only Lookup's p50 at most 1.25x it."""
    ref = rows[0]
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"Round trips, one run: {calls} calls per row in turns of {block}; "
        f"load average {load}; goal: owner-only Lookup p50 <= 1.25x the echo"
    )
    print()
    print("| round trip | p50 µs | p99 µs | p50 / echo p50 |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r.label} | {r.p50_us:.0f} | {r.p99_us:.0f} | {r.p50_us / ref.p50_us:.2f} |")
    relay, internal = rows[2], rows[3]
    cost50, cost99 = relay.p50_us - internal.p50_us, relay.p99_us - internal.p99_us
    print(f"| relay cost (relayed public - internal socket) | {cost50:+.0f} | {cost99:+.0f} | |")


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
        help="round-trip calls per row (default 4000; --quick: 100)",
    )
    p.add_argument(
        "--round-trip-only", action="store_true", help="only the round-trip table (no sealing)"
    )
    p.add_argument("--store-only", action="store_true", help="only the store tier's rows")
    p.add_argument(
        "--cost-blocks",
        default=None,
        help="batch sizes of the fixed-cost table (default 1,8,64,256; --quick: 1,2)",
    )
    p.add_argument(
        "--cost-only", action="store_true", help="only the fixed cost of a request (and raw AES)"
    )
    p.add_argument(
        "--store-blocks",
        type=int,
        default=None,
        help="4 MiB blocks per store repetition (default 64; --quick: 4)",
    )
    p.add_argument(
        "--store-backend-blocks",
        type=int,
        default=None,
        help="4 MiB blocks per repetition on S3 and Mooncake (default 16; --quick: 4)",
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
    cost_batches = sorted(
        {int(x) for x in (args.cost_blocks or ("1,2" if args.quick else "1,8,64,256")).split(",")}
    )
    if not batches or batches[0] < 1 or not cost_batches or cost_batches[0] < 1:
        raise SystemExit("--blocks and --cost-blocks must be positive integers")
    if args.cost_only:
        batches = []
    reps = args.reps or (2 if args.quick else 7)
    rtt_calls = args.rtt_calls or (100 if args.quick else 4000)
    top = max(batches + cost_batches)
    shape = KVShape(num_pages=top, dtype="bfloat16", **QWEN3_32B)
    twin_shape = request_cost.twin_shape(shape)
    block_bytes = shape.block_bytes
    # The tier holds the largest batch twice (restore set + a fresh offload), the
    # twin pool's the same, plus slack.
    host_bytes = 2 * top * (block_bytes + twin_shape.block_bytes) + 64 * MiB
    if args.workers < 1:
        raise SystemExit("--workers must be positive")
    extra = ["--workers", str(args.workers)]

    store_blocks = args.store_blocks or (4 if args.quick else 64)
    backend_blocks = args.store_backend_blocks or (4 if args.quick else 16)
    if args.round_trip_only:
        print(cpu_label(), flush=True)
        print()
        return round_trip_table(rtt_calls)
    if args.store_only:
        print(cpu_label(), flush=True)
        print()
        return store_table(block_bytes, store_blocks, reps, backend_blocks)

    print(cpu_label(), flush=True)
    print(
        f"geometry: Qwen3-32B, {shape.num_layers} layers, {shape.num_kv_heads} KV heads, head dim "
        f"{shape.head_dim}, bf16, {shape.tokens_per_page}-token pages -> {block_bytes // MiB} MiB "
        f"blocks; layout {args.layout}; batches {batches}; {reps} reps (median)",
        flush=True,
    )
    load_before = cpu_transfers.load_average()
    prefix = f"kvseal-bench-{os.getpid()}"
    with (
        tempfile.TemporaryDirectory(prefix="kvseal-bench-") as tmp,
        run_daemon(Path(tmp), host_bytes, extra) as daemon,
        SharedKVPool(shape, args.layout, name_prefix=prefix) as pool,
        SharedKVPool(twin_shape, args.layout, name_prefix=prefix + "-twin") as twin,
        KVSealClient(ClientConfig(target=daemon.target, timeout_s=30.0)) as client,
    ):
        for p in (pool, twin):  # random plaintext: AES speed does not depend on it, but honest
            for buf in p.buffers:
                for off in range(0, buf.size, 8 * MiB):
                    n = min(8 * MiB, buf.size - off)
                    buf.view[off : off + n] = os.urandom(n)
        handle = client.register_pool(
            f"bench-{os.getpid()}", b"kvseal-bench/qwen3-32b", pool.geometry()
        )
        twin_handle = client.register_pool(
            f"bench-{os.getpid()}-twin", b"kvseal-bench/twin", twin.geometry()
        )
        detail = client.stats().backend_detail
        print(f"daemon pid {daemon.proc.pid}: {detail}", flush=True)
        progress = lambda line: print(line, flush=True)  # noqa: E731
        rows = (
            cpu_transfers.measure(
                pool, client, handle.pool_id, batches, reps, args.workers, progress
            )
            if batches
            else []
        )
        print(f"fixed cost per request: batches {cost_batches}", flush=True)
        cost_load = cpu_transfers.load_average()
        costs = request_cost.measure(
            client,
            pool,
            handle.pool_id,
            twin,
            twin_handle.pool_id,
            cost_batches,
            reps,
            progress,
            most_reps=reps if args.quick else 40,
        )
        client.unregister_pool(twin_handle.pool_id)
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
    if rows:
        for line in cpu_transfers.table(rows):
            print(line)
        print()
    print(
        f"Fixed cost per request: the same Offload/Restore on a {twin_shape.block_bytes // 1024} "
        f"KiB-block twin pool (same pages, {2 * shape.num_layers} segments per block) in the same "
        f"daemon; raw AES-GCM 1 thread, side by side; load average {cost_load} at the start; "
        "medians, ratios per repetition as median (min-max)"
    )
    print()
    for line in request_cost.table(costs):
        print(line)
    print()
    if args.cost_only:
        return 0
    store_table(block_bytes, store_blocks, reps, backend_blocks)
    return round_trip_table(rtt_calls)


def store_table(block_bytes: int, blocks: int, reps: int, backend_blocks: int) -> int:
    """Measure the store tier's rows and print their table, then each
    backend's against its raw client (``store_backends.py``) beside the
    directory's."""
    say = lambda line: print(line, flush=True)  # noqa: E731
    fs, rows = store_transfers.measure(block_bytes, blocks, reps, say)
    print()
    for line in store_transfers.table(fs, block_bytes, blocks, reps, rows):
        print(line)
    print()
    backends = store_backends.measure(block_bytes, backend_blocks, reps, say)
    labels = ("spill (put) vs plain write, fsync", "restore (get) vs plain read, page cache")
    dir_rows = [
        (label, r.sealed_gbs, r.plain_gbs, r.ratios)
        for label, r in zip(labels, rows[:2], strict=True)
    ]
    print()
    for line in store_backends.table(block_bytes, backend_blocks, reps, backends, dir_rows):
        print(line)
    print()
    return 0


def round_trip_table(calls: int) -> int:
    """Measure the round trips (after the sealing runs: their daemon is gone) and
    print their table."""
    block = min(50, calls)
    with tempfile.TemporaryDirectory(prefix="kvseal-bench-rtt-") as tmp:
        rows = measure_round_trips(Path(tmp), calls, block)
    print_round_trips(rows, calls, block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
