"""Where a one-block Offload or Restore spends its time, through a real daemon
over its real Unix-socket gRPC: the breakdown behind docs/benchmarks.md, "The
fixed cost of a request".

Run: ``.venv/bin/python bench/request_profile.py [--mode restore|offload]
[--twin] [--requests N]``. It starts the daemon (``--backend cpu``) as a child
of this script with per-stage timers installed, registers a Qwen3-32B pool
(4 MiB blocks of 128 segments) or, with ``--twin``, its 4 KiB-block twin
(``request_cost.TWIN``: the same 128 segments, next to no bytes: the fixed
cost), runs N one-block requests from this process through ``KVSealClient``
and prints, per request, the median of each stage.

The timers wrap the daemon's own functions (and two of grpcio's private
server functions, for the hand-off to the handler thread) from outside: no
code of the daemon changes, and nothing is installed unless this script
starts it. Each wrapped call costs about a microsecond, so the stages add up
to a little more than an untimed request (``make bench`` has those).
Stages: gRPC on both sides outside the handler (the client's wall time less
the handler's, request by request), the hand-off to the gRPC worker thread,
the handler's own bookkeeping (validation, pool lease, deadline, counters,
reply), the index, the pool size check, sealing (cipher set-up, AES, tag) and
the copies (region and engine pool).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HOP = "hop into the gRPC worker"


def serve_instrumented(out: str, argv: list[str]) -> int:
    """The daemon with timers on its request path; the lists go to ``out``
    (JSON: name -> nanoseconds per call, in call order) when it exits."""
    import grpc._server as grpc_server
    from cryptography.hazmat.primitives.ciphers import base as cipher_base
    from kvseal.server import hostregion, sealing, sealstream, service, threads
    from kvseal.server.backends.cpu import backend, shmpool
    from kvseal.server.cache import cache
    from kvseal.server.index import index
    from kvseal.server.main import main

    times: dict[str, list[int]] = {}

    def timed(owner: Any, attr: str) -> None:
        fn = getattr(owner, attr)
        name = f"{getattr(owner, '__name__', owner)}.{attr}"
        out_list = times.setdefault(name, [])

        @functools.wraps(fn)
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                out_list.append(time.perf_counter_ns() - t0)

        setattr(owner, attr, wrapper)

    for attr in ("Offload", "Restore"):
        timed(service.KVSealServicer, attr)
    for attr in ("begin_restore", "complete_restore", "begin_store", "complete_store"):
        timed(index.Index, attr)
    for attr in ("open_blocks", "seal_blocks"):
        timed(backend.CpuBackend, attr)
    for attr in ("write_pages", "read_chunk", "check"):
        timed(shmpool.CpuMappedPool, attr)
    for attr in ("read_at", "write_at"):
        timed(hostregion.HostRegion, attr)
    for cls in (sealstream.OpenStream, sealstream.SealStream):
        for attr in ("update", "finish"):
            timed(cls, attr)
    for attr in ("begin_open", "begin_seal"):
        timed(sealing.BlockSealer, attr)
    timed(cipher_base.Cipher, "decryptor")
    timed(cipher_base.Cipher, "encryptor")
    timed(cache.SealedCache, "offload")
    timed(cache.SealedCache, "restore")
    timed(grpc_server, "_unary_response_in_pool")
    hops = times.setdefault(HOP, [])
    submit = threads.FixedPool.submit

    def timed_submit(self: Any, fn: Callable[..., Any], /, *a: Any, **k: Any) -> Any:
        if self.name != "kvseal-rpc":
            return submit(self, fn, *a, **k)
        t0 = time.perf_counter_ns()

        def run(*aa: Any, **kk: Any) -> Any:
            hops.append(time.perf_counter_ns() - t0)
            return fn(*aa, **kk)

        return submit(self, run, *a, **k)

    threads.FixedPool.submit = timed_submit  # type: ignore[method-assign]
    try:
        return main(argv)
    finally:
        Path(out).write_text(json.dumps(times))


def _median_us(values: list[int]) -> float:
    return statistics.median(values) / 1e3 if values else 0.0


def breakdown(
    times: dict[str, list[int]], client: list[int], restore: bool
) -> list[tuple[str, float]]:
    """Per-request medians of each stage (µs) from the last ``len(client)``
    requests; the gRPC stage pairs each request's client time with its
    handler time."""
    n = len(client)
    method = "Restore" if restore else "Offload"

    def last(name: str, per: int = 1) -> list[int]:
        return times.get(name, [])[-n * per :]

    calls = len(times.get(f"KVSealServicer.{method}", [])) or 1

    def med(name: str) -> float:
        """A stage's median call times its calls per request (16 chunks of a
        4 MiB block, two pool checks, ...: counted over the whole run)."""
        per = max(1, round(len(times.get(name, [])) / calls))
        return _median_us(last(name, per)) * per

    handler = last(f"KVSealServicer.{method}")
    # Offload mode sends an untimed Drop after each Offload: every other hop.
    hop = last(HOP, 1 if restore else 2)[:: 1 if restore else 2]
    grpc_out = [c - h - p for c, h, p in zip(client, handler, hop, strict=False)]
    if restore:
        index = med("Index.begin_restore") + med("Index.complete_restore")
        seal = med("BlockSealer.begin_open") + med("OpenStream.update") + med("OpenStream.finish")
        copies = med("HostRegion.read_at") + med("CpuMappedPool.write_pages")
        backend = med("CpuBackend.open_blocks")
    else:
        index = med("Index.begin_store") + med("Index.complete_store")
        seal = med("BlockSealer.begin_seal") + med("SealStream.update") + med("SealStream.finish")
        copies = med("HostRegion.write_at") + med("CpuMappedPool.read_chunk")
        backend = med("CpuBackend.seal_blocks")
    checks = med("CpuMappedPool.check")
    return [
        ("client wall time (p50)", _median_us(client)),
        ("gRPC, client and server, outside the handler", _median_us(grpc_out)),
        ("hand-off to the gRPC worker thread", _median_us(hop)),
        (
            "handler bookkeeping: validation, lease, deadline, counters, reply",
            _median_us(handler) - backend - index,
        ),
        ("index (reserve/pin, publish/unpin)", index),
        ("pool size check", checks),
        ("sealing: cipher set-up, AES-GCM, tag", seal),
        ("copies: region and engine pool", copies),
        ("backend, the rest (staging, threads, deadline checks)", backend - seal - copies - checks),
    ]


def drive(restore: bool, twin: bool, requests: int) -> list[tuple[str, float]]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_cpu
    import request_cost
    from kvseal.client import ClientConfig, KVSealClient
    from kvseal.client.shm import KVShape, SharedKVPool

    geometry = request_cost.TWIN if twin else bench_cpu.QWEN3_32B
    shape = KVShape(num_pages=4, dtype="bfloat16", **geometry)
    with tempfile.TemporaryDirectory(prefix="kvseal-profile-") as tmp:
        run = Path(tmp) / "run"
        run.mkdir(mode=0o700)
        sock, out, log = str(run / "kvseal.sock"), Path(tmp) / "times.json", Path(tmp) / "log"
        args = ["--listen", "unix://" + sock, "--host-bytes", str(64 << 20), "--backend", "cpu"]
        args += ["--log-level", "WARNING", "--workers", "2"]
        with open(log, "wb") as logf:
            proc = subprocess.Popen(
                [sys.executable, __file__, "--serve-instrumented", str(out), "--", *args],
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        daemon = bench_cpu.Daemon(proc, sock, log)
        client_ns: list[int] = []
        try:
            bench_cpu.wait_serving(daemon)
            with (
                SharedKVPool(
                    shape, "vllm_per_layer", name_prefix=f"kvseal-prof-{os.getpid()}"
                ) as pool,
                KVSealClient(ClientConfig(target=daemon.target, timeout_s=30.0)) as client,
            ):
                pool_id = client.register_pool(
                    "profile", b"kvseal-profile", pool.geometry()
                ).pool_id
                tenant, stored = secrets.token_bytes(32), [secrets.token_bytes(32)]
                client.offload(pool_id, tenant, stored, [0])
                for i in range(requests + requests // 5):  # the first fifth warms up
                    if restore:
                        t0 = time.perf_counter_ns()
                        client.restore(pool_id, tenant, stored, [0])
                        dt = time.perf_counter_ns() - t0
                    else:
                        fresh = [secrets.token_bytes(32)]
                        t0 = time.perf_counter_ns()
                        client.offload(pool_id, tenant, fresh, [1])
                        dt = time.perf_counter_ns() - t0
                        client.drop(pool_id, tenant, fresh)
                    if i >= requests // 5:
                        client_ns.append(dt)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        return breakdown(json.loads(out.read_text()), client_ns, restore)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-instrumented"]:
        return serve_instrumented(argv[1], argv[3:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--mode", choices=("restore", "offload"), default="restore")
    p.add_argument("--twin", action="store_true", help="4 KiB blocks of 128 segments (fixed cost)")
    p.add_argument("--requests", type=int, default=400)
    args = p.parse_args(argv)
    rows = drive(args.mode == "restore", args.twin, args.requests)
    size = "4 KiB twin" if args.twin else "4 MiB"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"One-block {args.mode} ({size} block), {args.requests} requests, load average {load}")
    print()
    print("| stage | µs per request (median) |")
    print("|---|---:|")
    for name, us in rows:
        print(f"| {name} | {us:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
