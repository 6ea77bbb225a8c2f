"""GPU benchmark of the CUDA backend, side by side on the same data (``make bench-gpu``).

Run: ``python bench/bench_gpu.py [--device N] [--quick] [--emulate]``.

In one run, on one pool of real geometry (Qwen3-32B: 64 layers x K,V x 16 tokens x 8
heads x 128 x bf16 = 4 MiB blocks):

1. kernel throughput device-to-device: ``kvseal_seal`` (pool -> device staging) and
   ``kvseal_verify`` + ``kvseal_open`` (staging -> pool), timed with CUDA events;
2. sealed offload (GPU -> host region) and sealed restore (host -> GPU) through
   ``CudaBackend.seal_blocks`` / ``open_blocks`` (wall clock: that is what an RPC
   waits for), next to plaintext pinned DMA of the same bytes (one contiguous copy,
   CUDA events: the best case), and the ``mapped`` seal mode (kernel writes straight
   into mapped pinned memory) when CC is off;
3. the classic CC path, emulated: plaintext DMA into pinned memory + single-thread
   CPU AES-256-GCM (``cryptography``), and the reverse for restore;
4. restore latency p50 for 1, 64 and 1024 blocks (1024 blocks = 4 GiB);
5. kernel launches per request.

Warm-up first, median of repeats. The markdown table is printed LAST, labelled with
the GPU name the driver reports. GB/s = 1e9 bytes/s of plaintext. ``--emulate`` runs
the same code on the CPU emulator with tiny sizes (a smoke test of this script; its
numbers mean nothing).
"""

from __future__ import annotations

import argparse
import ctypes
import secrets
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from kvseal.server.backend import BlockIO
from kvseal.server.cuda import probe
from kvseal.server.cuda.backend import (
    CudaBackend,
    CudaDevice,
    Device,
    EmulatedDevice,
    chunk_batch,
    fill_descriptors,
    request_layout,
    staging_layout,
)
from kvseal.server.hostregion import Extent
from kvseal.server.pools import BufferSpec, Geometry, PoolSpec, SegmentSpec
from kvseal.server.sealing import BlockAD, SealingError

LAYERS, TOKENS, HEADS, DIM, ELEM = 64, 16, 8, 128, 2
KV_BYTES = TOKENS * HEADS * DIM * ELEM  # one page of K (or V) of one layer: 32 KiB
BLOCK = 2 * LAYERS * KV_BYTES  # 4 MiB


class BenchKeys:
    """A DeviceKeySource for the benchmark: one random key, a nonce counter."""

    def __init__(self) -> None:
        self._key = (ctypes.c_char * 32)()
        ctypes.memmove(self._key, secrets.token_bytes(32), 32)
        self._prefix = secrets.token_bytes(4)
        self._counter = 0
        self._lock = threading.Lock()

    def allocate_for_device(self, n: int) -> tuple[int, list[bytes]]:
        with self._lock:
            c, self._counter = self._counter, self._counter + n
        return 0, [self._prefix + struct.pack(">Q", c + i) for i in range(n)]

    def export_key_to(self, epoch: int, dst: ctypes.Array[ctypes.c_char]) -> None:
        if epoch != 0:
            raise SealingError("no such epoch")
        ctypes.memmove(dst, self._key, 32)

    def live_epoch_ids(self) -> frozenset[int]:
        return frozenset({0})

    def forget(self, epoch_index: int) -> None:
        pass

    def raw_key(self) -> bytes:
        return bytes(self._key)


class Timer:
    """CUDA-event timing on a real device, wall clock on the emulator."""

    def __init__(self, dev: Device) -> None:
        self.dev = dev
        self.cu: Any = None
        if isinstance(dev, CudaDevice):
            cu = probe.driver_module()
            self.cu = cu
            self.start = self._ok(cu.cuEventCreate(0))
            self.stop = self._ok(cu.cuEventCreate(0))

    @staticmethod
    def _ok(r: Any) -> Any:
        err, *v = r if isinstance(r, tuple) else (r,)
        if int(err) != 0:
            raise RuntimeError(f"CUDA event call failed: {err!r}")
        return v[0] if v else None

    def time(self, stream: Any, fn: Callable[[], None]) -> float:
        """Seconds that ``fn``'s work on ``stream`` took."""
        if self.cu is None:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        cu = self.cu
        self.dev.sync(stream)
        self._ok(cu.cuEventRecord(self.start, stream))
        fn()
        self._ok(cu.cuEventRecord(self.stop, stream))
        self._ok(cu.cuEventSynchronize(self.stop))
        return float(self._ok(cu.cuEventElapsedTime(self.start, self.stop))) / 1e3


def median_time(fn: Callable[[], float], reps: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(fn() for _ in range(reps))


def wall(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="fewer repeats, no 1024-block latency")
    ap.add_argument("--emulate", action="store_true", help="CPU emulator, tiny sizes (smoke test)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)

    global LAYERS, BLOCK
    if args.emulate:
        LAYERS, BLOCK = 1, 2 * KV_BYTES // 64  # 2 KiB blocks: the emulator is slow
        dev: Device = EmulatedDevice()
        label, cc = "CPU emulator (numbers meaningless)", "n/a"
        sizes, big, pages = [1, 4, 16], 16, 16
    else:
        ok, why = probe.cuda_available(args.device)
        if not ok:
            print(f"bench_gpu: no usable GPU: {why}", file=sys.stderr)
            return 2
        dev = CudaDevice(args.device)
        cc = probe.cc_mode()
        label = f"{dev.name} (device {args.device}, {dev.arch}), CC {cc}"
        sizes = [1, 64] if args.quick else [1, 64, 1024]
        big, pages = 256, max([*sizes, 256])
    kv = KV_BYTES if not args.emulate else BLOCK // 2
    keys = BenchKeys()
    backend = CudaBackend(keys, args.device, dev=dev, cc=cc if cc != "n/a" else "off")
    rows: list[tuple[str, str, str]] = []
    launches: list[tuple[str, int, int]] = []
    try:
        dev.make_current()
        # ---- the pool: vLLM per-layer buffers [2, pages, tokens, heads, dim] ------------
        layer_bytes = 2 * pages * kv
        bases = [dev.alloc(layer_bytes) for _ in range(LAYERS)]
        for b in bases:  # contents do not matter to AES-GCM's speed
            dev.memset_async(b, layer_bytes, dev.compute_stream)
        dev.sync(dev.compute_stream)
        segs = tuple(
            SegmentSpec(layer, half * pages * kv, kv, kv)
            for layer in range(LAYERS)
            for half in (0, 1)
        )
        g = Geometry(
            pages,
            TOKENS,
            LAYERS,
            HEADS,
            DIM,
            "bfloat16",
            "L,KV,T,H,D",
            tuple(BufferSpec(None, b"\0" * 64, 0, layer_bytes, args.device) for _ in bases),
            segs,
        )
        spec = PoolSpec("bench", b"bench", g, "cuda")
        pool = backend.map_local_pool(spec, bases)
        region = backend.make_region(pages * BLOCK, None)
        print(f"# {label}; host region: {region.description}", file=sys.stderr)
        timer = Timer(dev)

        def blocks(n: int, first: int = 0) -> list[BlockIO]:
            return [
                BlockIO(
                    p,
                    Extent(p * BLOCK, BLOCK),
                    BlockAD(b"N" * 32, b"T" * 32, p.to_bytes(32, "big"), 1),
                    BLOCK,
                )
                for p in range(first, first + n)
            ]

        # ---- 1. kernels device-to-device --------------------------------------------
        n = big
        lay = request_layout(n)
        offs, total = staging_layout(n, BLOCK)
        staging = dev.alloc(total)
        host = dev.host_alloc(lay.total, mapped=False)
        desc = dev.alloc(lay.total)
        epoch, nonces = keys.allocate_for_device(n)
        bl = blocks(n)
        fill_descriptors(
            host,
            lay.total,
            lay,
            pages=[b.page for b in bl],
            staging_offsets=offs,
            nonces=nonces,
            aads=[b.ad.encode() for b in bl],
        )
        sk = dev.compute_stream
        dev.h2d_async(desc, host, lay.upload_seal, sk)
        dev.memset_async(desc + lay.ws, lay.total - lay.ws, sk)
        dev.sync(sk)
        key = backend._key_ctx(epoch)

        def batch(all_or_nothing: bool = False) -> Any:
            return chunk_batch(
                key=key,
                pool=pool.desc,
                desc=desc,
                lay=lay,
                staging=staging,
                start=0,
                stop=n,
                config=backend.config,
                all_or_nothing=all_or_nothing,
            )

        def run(kernel: str, aon: bool = False) -> None:
            b = batch(aon)
            dev.launch(kernel, b.num_blocks * b.ctas_per_block, b.threads_per_cta, [b], sk)

        t_seal = median_time(lambda: timer.time(sk, lambda: run("kvseal_seal")), args.reps)
        # verify needs the tags seal wrote: they are in the device descriptor area already.
        t_vo = median_time(
            lambda: timer.time(sk, lambda: (run("kvseal_verify"), run("kvseal_open", True))),
            args.reps,
        )
        rows.append(
            (
                "kernel seal, device to device",
                f"{gbps(n * BLOCK, t_seal):.1f} GB/s",
                f"{n} x {BLOCK / 2**20:g} MiB",
            )
        )
        rows.append(
            (
                "kernel verify + open, device to device",
                f"{gbps(n * BLOCK, t_vo):.1f} GB/s",
                f"{n} x {BLOCK / 2**20:g} MiB",
            )
        )
        dev.free(staging)
        dev.free(desc)
        dev.host_free(host)

        # ---- 2. sealed offload / restore vs plaintext DMA -----------------------------
        bl = blocks(n)
        recs: list[Any] = []

        def seal() -> None:
            recs[:] = backend.seal_blocks(pool, bl, region)

        before = backend.launches
        seal()
        launches.append(("offload", n, backend.launches - before))
        t_off = median_time(lambda: wall(seal), args.reps)
        t_res = median_time(
            lambda: wall(lambda: backend.open_blocks(pool, bl, recs, region)), args.reps
        )
        plain_host = dev.host_alloc(n * BLOCK, mapped=False)
        plain_dev = dev.alloc(n * BLOCK)
        sc = dev.copy_stream
        t_d2h = median_time(
            lambda: timer.time(sc, lambda: dev.d2h_async(plain_host, plain_dev, n * BLOCK, sc)),
            args.reps,
        )
        t_h2d = median_time(
            lambda: timer.time(sc, lambda: dev.h2d_async(plain_dev, plain_host, n * BLOCK, sc)),
            args.reps,
        )
        rows.append(
            (
                "sealed offload GPU to host (seal_blocks)",
                f"{gbps(n * BLOCK, t_off):.1f} GB/s",
                f"{n} blocks, wall",
            )
        )
        rows.append(
            (
                "plaintext pinned DMA D2H, same bytes",
                f"{gbps(n * BLOCK, t_d2h):.1f} GB/s",
                "1 contiguous copy",
            )
        )
        rows.append(
            (
                "sealed restore host to GPU (open_blocks)",
                f"{gbps(n * BLOCK, t_res):.1f} GB/s",
                f"{n} blocks, wall",
            )
        )
        rows.append(
            (
                "plaintext pinned DMA H2D, same bytes",
                f"{gbps(n * BLOCK, t_h2d):.1f} GB/s",
                "1 contiguous copy",
            )
        )
        if region.device_ptr is not None:
            backend.seal_mode = "mapped"
            try:
                t_map = median_time(lambda: wall(seal), args.reps)
                rows.append(
                    (
                        "sealed offload, kernel writes mapped host memory",
                        f"{gbps(n * BLOCK, t_map):.1f} GB/s",
                        "seal_mode=mapped",
                    )
                )
            finally:
                backend.seal_mode = "dma"
        else:
            rows.append(
                (
                    "sealed offload, kernel writes mapped host memory",
                    "n/a",
                    "region not mapped (CC on)",
                )
            )

        # ---- 3. the classic CC path: DMA plaintext, AES-GCM on one CPU thread ----------
        m = min(n, 64)
        aead = AESGCM(keys.raw_key())
        buf = (ctypes.c_char * (m * BLOCK)).from_address(plain_host)
        view = memoryview(buf).cast("B")
        out = bytearray(BLOCK + 16)

        def classic_offload() -> None:
            dev.d2h_async(plain_host, plain_dev, m * BLOCK, sc)
            dev.sync(sc)
            for i in range(m):
                aead.encrypt_into(
                    secrets.token_bytes(12), view[i * BLOCK : (i + 1) * BLOCK], None, out
                )

        sealed_one = aead.encrypt(b"\0" * 12, bytes(view[:BLOCK]), None)

        def classic_restore() -> None:
            dst = bytearray(BLOCK)
            for _ in range(m):
                aead.decrypt_into(b"\0" * 12, sealed_one, None, dst)
            dev.h2d_async(plain_dev, plain_host, m * BLOCK, sc)
            dev.sync(sc)

        t_co = median_time(lambda: wall(classic_offload), max(1, args.reps // 2))
        t_cr = median_time(lambda: wall(classic_restore), max(1, args.reps // 2))
        rows.append(
            (
                "classic CC path offload: DMA + 1-thread CPU AES-GCM",
                f"{gbps(m * BLOCK, t_co):.1f} GB/s",
                f"{m} blocks",
            )
        )
        rows.append(
            (
                "classic CC path restore: 1-thread CPU AES-GCM + DMA",
                f"{gbps(m * BLOCK, t_cr):.1f} GB/s",
                f"{m} blocks",
            )
        )
        view.release()
        dev.free(plain_dev)
        dev.host_free(plain_host)

        # ---- 4./5. restore latency and launches per request -----------------------------
        for size in sizes:
            bl = blocks(size)
            recs = backend.seal_blocks(pool, bl, region)
            before = backend.launches
            backend.open_blocks(pool, bl, recs, region)
            launches.append(("restore", size, backend.launches - before))
            reps = 20 if size == 1 else (10 if size <= 64 else 3)
            lat = median_time(
                lambda bl=bl, recs=recs: wall(lambda: backend.open_blocks(pool, bl, recs, region)),
                reps,
            )
            rows.append(
                (
                    f"restore latency p50, {size} block(s)",
                    f"{lat * 1e3:.2f} ms",
                    f"{size * BLOCK / 2**20:.0f} MiB",
                )
            )
        for what, size, count in launches:
            rows.append((f"kernel launches per {what} request", str(count), f"{size} blocks"))
        pool.close()
        region.close()
        for b in bases:
            dev.free(b)
    finally:
        backend.close()

    print()
    print(f"## kvseal GPU benchmark: {label}")
    print()
    print("| measurement | result | notes |")
    print("|---|---|---|")
    for name, value, note in rows:
        print(f"| {name} | {value} | {note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
