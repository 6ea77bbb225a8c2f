"""GPU benchmark of the CUDA backend, side by side on the same data (``make bench-gpu``).

Run: ``python bench/bench_gpu.py [--device N] [--quick] [--emulate] [--budget S]``.

In one run, on one pool of real geometry (Qwen3-32B: 64 layers x K,V x 16 tokens x 8
heads x 128 x bf16 = 4 MiB blocks):

1. kernel throughput device-to-device: ``kvseal_seal`` (pool -> device staging) and
   ``kvseal_verify`` + ``kvseal_open`` (staging -> pool), timed with CUDA events; then
   the ok[] flags of a fresh verify are read back (all must be 1);
2. sealed offload (GPU -> host region) and sealed restore (host -> GPU) of 256 blocks
   through ``CudaBackend.seal_blocks`` / ``open_blocks`` (wall clock: that is what an
   RPC waits for), next to plaintext pinned DMA of the same bytes (one contiguous
   copy, CUDA events: the best case), and their ratios;
3. offload and restore latency p50 for 1, 64 and 1024 blocks (1024 blocks = 4 GiB,
   in a host region of their own) with the kernel launches of each request, then the
   fixed cost per request derived from them;
4. the classic CC path, emulated: plaintext DMA into pinned memory + single-thread
   CPU AES-256-GCM (``cryptography``), and the reverse for restore;
5. last, because it is the riskiest (the kernel writes host memory over the bus): the
   ``mapped`` seal mode, when the host region is mapped into the device.

Every restore is checked: ``open_blocks`` must return ``[]`` (else the GB/s would be
those of a request that wrote nothing). Each section runs on its own: a failure
becomes a ``FAILED: ...`` row and the next section runs, except after a sticky CUDA
error (the context is lost; no more GPU work is issued). Rows go to stderr as they
are measured; the markdown table goes to stdout LAST, labelled with the GPU name the
driver reports, even after a failure, a spent ``--budget`` or SIGTERM.

Goals, reported as PASS/MISS verdicts and never asserted (this is a measurement, not a
test): sealed/plaintext throughput >= 0.9 for offload and restore, kernels >= 200 GB/s,
fixed cost <= 1 ms per request, kernel launches per request bounded whatever the
block count. GB/s = 1e9 bytes/s of plaintext; times are medians after a warm-up.
``--emulate`` runs the same code on the CPU emulator with tiny sizes (a smoke test of
this script; its numbers and verdicts mean nothing). Exit status: 0 every section ran
(whatever the verdicts), 1 a section failed, was skipped or interrupted, 2 no GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import secrets
import signal
import sys
import time
from typing import Any

from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from gpu_report import (
    BenchKeys,
    Interrupted,
    Report,
    Timer,
    fmt_rate,
    gbps,
    is_sticky,
    median_time,
    mib,
    on_sigterm,
    verdict,
    wall,
)
from kvseal.server.backends.base import BlockIO
from kvseal.server.backends.cuda import probe
from kvseal.server.backends.cuda.backend import CudaBackend
from kvseal.server.backends.cuda.device import CudaDevice, Device
from kvseal.server.backends.cuda.emulated_device import EmulatedDevice
from kvseal.server.backends.cuda.launch import (
    DEFAULT_MIN_CHUNK_BYTES,
    chunk_batch,
    fill_descriptors,
    request_layout,
    staging_layout,
)
from kvseal.server.backends.cuda.region import CudaHostRegion
from kvseal.server.hostregion import Extent
from kvseal.server.pools import BufferSpec, Geometry, PoolSpec, SegmentSpec
from kvseal.server.sealing import BlockAD, SealRecord

LAYERS, TOKENS, HEADS, DIM, ELEM = 64, 16, 8, 128, 2
KV_BYTES = TOKENS * HEADS * DIM * ELEM  # one page of K (or V) of one layer: 32 KiB
BLOCK = 2 * LAYERS * KV_BYTES  # 4 MiB

# Goals the table reports verdicts against (see the module docstring).
GOAL_RATIO = 0.9  # sealed GB/s / plaintext pinned DMA GB/s, offload and restore
GOAL_KERNEL_GBPS = 200.0  # kernel seal and verify+open, device to device
GOAL_FIXED_MS = 1.0  # fixed cost per request, offload and restore


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="fewer repeats, no 1024-block latency")
    ap.add_argument("--emulate", action="store_true", help="CPU emulator, tiny sizes (smoke test)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--budget",
        type=float,
        default=0.0,
        help="seconds after which the remaining sections are skipped (0: no limit)",
    )
    args = ap.parse_args(argv)
    t_start = time.monotonic()
    signal.signal(signal.SIGTERM, on_sigterm)

    global LAYERS, BLOCK
    dev: Device
    if args.emulate:
        LAYERS, BLOCK = 1, 2 * KV_BYTES // 64  # 1 KiB blocks: the emulator is slow
        label, cc = "CPU emulator (numbers meaningless)", "n/a"
        sizes, big = [1, 4, 16], 8  # 16 > big: exercises the separate large region
    else:
        ok, why = probe.cuda_available(args.device)
        if not ok:
            print(f"bench_gpu: no usable GPU: {why}", file=sys.stderr)
            return 2
        cc = probe.cc_mode()  # "on", "off", or "unknown: why" (the why goes to stderr)
        label = f"GPU {args.device}"
        print(f"# CC mode: {cc}", file=sys.stderr, flush=True)
        sizes = [1, 64] if args.quick else [1, 64, 1024]
        big = 256
    pages = max([*sizes, big])  # device memory: 4 GiB of pool for 1024 blocks
    kv = KV_BYTES if not args.emulate else BLOCK // 2
    keys = BenchKeys()
    rep = Report(deadline=t_start + args.budget if args.budget > 0 else float("inf"))
    backend: CudaBackend | None = None
    bases: list[int] = []
    pool: Any = None
    region: CudaHostRegion | None = None
    timer_box: list[Timer] = []  # made in setup: CUDA events need the context
    # What later sections derive from earlier ones (missing when a section failed).
    found: dict[str, float] = {}
    launches: dict[str, dict[int, int]] = {"offload": {}, "restore": {}}

    def be() -> CudaBackend:
        assert backend is not None, "setup made it"
        return backend

    def blocks(n: int) -> list[BlockIO]:
        return [
            BlockIO(
                p,
                Extent(p * BLOCK, BLOCK),
                BlockAD(b"N" * 32, b"T" * 32, p.to_bytes(32, "big"), 1),
                BLOCK,
            )
            for p in range(n)
        ]

    def restore_checked(bl: list[BlockIO], recs: list[SealRecord], reg: CudaHostRegion) -> None:
        """One restore that must verify: a failed one writes nothing (all or nothing),
        so its time would be that of a request that did not restore anything."""
        bad = be().open_blocks(pool, bl, recs, reg)
        if bad:
            raise RuntimeError(
                f"open_blocks failed verification of {len(bad)} of {len(bl)} blocks "
                f"(first: {bad[:5]}): restore figures would be meaningless"
            )

    def sealed_timed(
        bl: list[BlockIO], recs: list[SealRecord], reg: CudaHostRegion, reps: int
    ) -> float:
        """Median wall time of seal_blocks; ``recs`` ends up holding the records of
        what the region holds now (every seal draws new nonces)."""

        def once() -> None:
            recs[:] = be().seal_blocks(pool, bl, reg)

        return median_time(lambda: wall(once), reps)

    def restore_timed(
        bl: list[BlockIO], recs: list[SealRecord], reg: CudaHostRegion, reps: int
    ) -> float:
        """Median wall time of open_blocks; the last one must have verified too."""
        bad: list[int] = []

        def once() -> None:
            bad[:] = be().open_blocks(pool, bl, recs, reg)

        t = median_time(lambda: wall(once), reps)
        if bad:
            raise RuntimeError(f"timed restores failed verification ({len(bad)} blocks)")
        return t

    # ---- setup: the device (kernels via NVRTC), the pool, vLLM per-layer buffers
    # [2, pages, tokens, heads, dim], the host region --------------------------------
    def setup() -> None:
        nonlocal dev, backend, label, pool, region
        dev = EmulatedDevice() if args.emulate else CudaDevice(args.device)
        if isinstance(dev, CudaDevice):
            label = f"{dev.name} (device {args.device}, {dev.arch}), CC {cc.split(':')[0]}"
        # The emulator's blocks are tiny: a small minimum chunk so that its requests
        # split into chunks as 4 MiB blocks do on the GPU (the launch counts compare).
        backend = CudaBackend(
            keys,
            args.device,
            dev=dev,
            cc=cc if cc != "n/a" else "off",
            min_chunk_bytes=4 * BLOCK if args.emulate else DEFAULT_MIN_CHUNK_BYTES,
        )
        dev.make_current()
        layer_bytes = 2 * pages * kv
        for _ in range(LAYERS):
            bases.append(dev.alloc(layer_bytes))
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
        pool = be().map_local_pool(PoolSpec("bench", b"bench", g, "cuda"), bases)
        # The 256-block sections' region (1 GiB); the 1024-block latency pins its own
        # 4 GiB only for its own step, so that a refusal costs one row, not the run.
        region = be().make_region(big * BLOCK, None)
        print(f"# {label}; host region: {region.description}", file=sys.stderr, flush=True)
        timer_box.append(Timer(dev))

    # ---- 1. kernels device-to-device, then the ok[] flags of a fresh verify --------
    def kernels() -> None:
        n = big
        timer = timer_box[0]
        lay = request_layout(n)
        offs, total = staging_layout(n, BLOCK)
        staging = dev.alloc(total)
        host = desc = 0
        try:
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
            key = be()._keys.context(epoch)

            def run(kernel: str, aon: bool = False) -> None:
                b = chunk_batch(
                    key=key,
                    pool=pool.desc,
                    desc=desc,
                    lay=lay,
                    staging=staging,
                    start=0,
                    stop=n,
                    config=be().config,
                    all_or_nothing=aon,
                )
                dev.launch(kernel, b.num_blocks * b.ctas_per_block, b.threads_per_cta, [b], sk)

            t_seal = median_time(lambda: timer.time(sk, lambda: run("kvseal_seal")), args.reps)
            size = f"{n} x {mib(BLOCK)}"
            seal_rate = gbps(n * BLOCK, t_seal)
            rep.add(
                "kernel seal, device to device",
                fmt_rate(seal_rate),
                size,
                f">= {GOAL_KERNEL_GBPS:g} GB/s",
                verdict(seal_rate >= GOAL_KERNEL_GBPS),
            )

            def verify_open() -> None:
                # verify needs the tags seal wrote: they are in the device descriptor area.
                run("kvseal_verify")
                run("kvseal_open", True)

            t_vo = median_time(lambda: timer.time(sk, verify_open), args.reps)
            # All-or-nothing open writes nothing when a flag is not 1, so a broken verify
            # would make open look fast: clear the flags, verify once more, read them.
            dev.memset_async(desc + lay.ok, n, sk)
            run("kvseal_verify")
            dev.d2h_async(host + lay.ok, desc + lay.ok, n, sk)
            dev.sync(sk)
            flags = ctypes.string_at(host + lay.ok, n)
            good = sum(1 for f in flags if f == 1)
            vo_rate = gbps(n * BLOCK, t_vo)
            rep.add(
                "kernel verify + open, device to device",
                fmt_rate(vo_rate),
                size if good == n else f"{size}; INVALID: verify failed",
                f">= {GOAL_KERNEL_GBPS:g} GB/s",
                verdict(vo_rate >= GOAL_KERNEL_GBPS) if good == n else "INVALID",
            )
            rep.add(
                "kernel verify of what seal wrote: ok[] flags",
                f"{good}/{n} ok",
                "read back after the timed runs",
                "all 1",
                "PASS" if good == n else "FAILED",
            )
        finally:
            dev.free(staging)
            if desc:
                dev.free(desc)
            if host:
                dev.host_free(host)

    # ---- 2. sealed offload / restore vs plaintext DMA ------------------------------
    def offload_restore() -> None:
        assert region is not None
        reg, timer, n = region, timer_box[0], big
        bl = blocks(n)
        recs: list[SealRecord] = []
        t_off = sealed_timed(bl, recs, reg, args.reps)
        restore_checked(bl, recs, reg)
        t_res = restore_timed(bl, recs, reg, args.reps)
        found["offload_gbps"] = gbps(n * BLOCK, t_off)
        found["restore_gbps"] = gbps(n * BLOCK, t_res)
        rep.add(
            "sealed offload GPU to host (seal_blocks)",
            fmt_rate(found["offload_gbps"]),
            f"{n} blocks, wall",
        )
        rep.add(
            "sealed restore host to GPU (open_blocks)",
            fmt_rate(found["restore_gbps"]),
            f"{n} blocks, wall, verified",
        )
        plain_host = dev.host_alloc(n * BLOCK, mapped=False)
        plain_dev = 0
        try:
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
        finally:
            if plain_dev:
                dev.free(plain_dev)
            dev.host_free(plain_host)
        found["d2h_gbps"] = gbps(n * BLOCK, t_d2h)
        rep.add(
            "plaintext pinned DMA D2H, same bytes",
            fmt_rate(found["d2h_gbps"]),
            "1 contiguous copy, CUDA events",
        )
        rep.add(
            "plaintext pinned DMA H2D, same bytes",
            fmt_rate(gbps(n * BLOCK, t_h2d)),
            "1 contiguous copy, CUDA events",
        )
        for what, plain, sealed in (("offload", t_d2h, t_off), ("restore", t_h2d, t_res)):
            ratio = plain / sealed
            rep.add(
                f"sealed / plaintext {what}",
                f"{ratio:.2f}",
                f"t_{'d2h' if what == 'offload' else 'h2d'} / t_{what[:3]}",
                f">= {GOAL_RATIO:g}",
                verdict(ratio >= GOAL_RATIO),
            )

    # ---- 3. latency per request, and its kernel launches ---------------------------
    def latency(size: int) -> None:
        assert region is not None
        reg: CudaHostRegion = region
        own: CudaHostRegion | None = None
        if size > big:
            try:
                own = be().make_region(size * BLOCK, None)
            except Exception as e:
                if is_sticky(e):
                    raise
                first = (str(e).strip().splitlines() or [""])[0][:200]
                why = f"pinned host region of {mib(size * BLOCK)} refused: {first}"
                for what in ("offload", "restore"):
                    rep.add(f"{what} latency p50, {size} blocks", "n/a", why)
                return
            reg = own
        try:
            bl = blocks(size)
            before = be().launches
            recs = be().seal_blocks(pool, bl, reg)
            launches["offload"][size] = be().launches - before
            reps = 20 if size == 1 else (10 if size <= 64 else 3)
            mb = mib(size * BLOCK)
            t_off = found[f"lat_offload_{size}"] = sealed_timed(bl, recs, reg, reps)
            rep.add(f"offload latency p50, {size} block(s)", f"{t_off * 1e3:.2f} ms", mb)
            before = be().launches
            restore_checked(bl, recs, reg)
            launches["restore"][size] = be().launches - before
            t_res = found[f"lat_restore_{size}"] = restore_timed(bl, recs, reg, reps)
            rep.add(
                f"restore latency p50, {size} block(s)", f"{t_res * 1e3:.2f} ms", f"{mb}, verified"
            )
        finally:
            if own is not None:
                own.close()

    def derived() -> None:
        """Fixed cost per request and launches per request, from the rows above.
        lat(n) = F + n*t, so F = (k*lat(1) - lat(k)) / (k - 1) with k the second size;
        the other estimate is lat(1) minus one block at the 256-block GB/s (it charges
        the pipelining a single block cannot have to F, so it is the pessimistic one)."""
        k = sizes[1]
        for what in ("offload", "restore"):
            lat1, latk = found.get(f"lat_{what}_1"), found.get(f"lat_{what}_{k}")
            if lat1 is None or latk is None:
                rep.add(f"fixed cost per {what} request", "n/a", "a latency row is missing")
                continue
            fixed = (k * lat1 - latk) / (k - 1)
            r = found.get(f"{what}_gbps")
            alt = (
                f"; lat(1) - {mib(BLOCK)} at {fmt_rate(r)} = "
                f"{(lat1 - BLOCK / (r * 1e9)) * 1e3:.2f} ms"
                if r
                else ""
            )
            rep.add(
                f"fixed cost per {what} request",
                f"{fixed * 1e3:.2f} ms",
                f"({k} x lat(1) - lat({k})) / {k - 1}{alt}",
                f"<= {GOAL_FIXED_MS:g} ms",
                verdict(fixed * 1e3 <= GOAL_FIXED_MS),
            )
        for what, bound, why in (
            ("offload", be().max_chunks, "max_chunks"),
            ("restore", be().max_chunks + 1, "max_chunks + 1 open"),
        ):
            got = launches[what]
            if not got:
                rep.add(f"kernel launches per {what} request", "n/a", "no latency row")
                continue
            counts = " / ".join(str(got[s]) for s in sorted(got))
            at = " / ".join(str(s) for s in sorted(got))
            rep.add(
                f"kernel launches per {what} request",
                counts,
                f"at {at} blocks (bounded, not constant: {be().max_chunks}-chunk split)",
                f"bounded: <= {bound} ({why}) whatever the block count",
                verdict(max(got.values()) <= bound),
            )

    # ---- 4. the classic CC path: DMA plaintext, AES-GCM on one CPU thread ----------
    def classic() -> None:
        m = min(big, 64)
        aead = AESGCM(keys.raw_key())
        sc = dev.copy_stream
        plain_host = dev.host_alloc(m * BLOCK, mapped=False)
        plain_dev = 0
        view: memoryview | None = None
        try:
            plain_dev = dev.alloc(m * BLOCK)
            dev.memset_async(plain_dev, m * BLOCK, sc)
            dev.sync(sc)
            buf = (ctypes.c_char * (m * BLOCK)).from_address(plain_host)
            view = memoryview(buf).cast("B")
            v = view
            out = bytearray(BLOCK + 16)

            def classic_offload() -> None:
                dev.d2h_async(plain_host, plain_dev, m * BLOCK, sc)
                dev.sync(sc)
                for i in range(m):
                    aead.encrypt_into(
                        secrets.token_bytes(12), v[i * BLOCK : (i + 1) * BLOCK], None, out
                    )

            sealed_one = aead.encrypt(b"\0" * 12, bytes(v[:BLOCK]), None)

            def classic_restore() -> None:
                dst = bytearray(BLOCK)
                for _ in range(m):
                    aead.decrypt_into(b"\0" * 12, sealed_one, None, dst)
                dev.h2d_async(plain_dev, plain_host, m * BLOCK, sc)
                dev.sync(sc)

            t_co = median_time(lambda: wall(classic_offload), max(1, args.reps // 2))
            t_cr = median_time(lambda: wall(classic_restore), max(1, args.reps // 2))
        finally:
            if view is not None:
                view.release()
            if plain_dev:
                dev.free(plain_dev)
            dev.host_free(plain_host)
        rep.add(
            "classic CC path offload: DMA + 1-thread CPU AES-GCM",
            fmt_rate(gbps(m * BLOCK, t_co)),
            f"{m} blocks, for contrast",
        )
        rep.add(
            "classic CC path restore: 1-thread CPU AES-GCM + DMA",
            fmt_rate(gbps(m * BLOCK, t_cr)),
            f"{m} blocks, for contrast",
        )

    # ---- 5. last: the kernel writes straight into mapped pinned host memory --------
    def mapped() -> None:
        assert region is not None
        reg, n = region, big
        name = "sealed offload, kernel writes mapped host memory"
        if reg.device_ptr is None:
            rep.add(name, "n/a", "region not mapped (CC on or DEVICEMAP refused)")
            return
        bl = blocks(n)
        recs: list[SealRecord] = []
        be().seal_mode = "mapped"
        try:
            t_map = sealed_timed(bl, recs, reg, args.reps)
        finally:
            be().seal_mode = "dma"
        restore_checked(bl, recs, reg)  # what the kernel wrote over the bus opens
        r = gbps(n * BLOCK, t_map)
        vs = f"; {r / found['d2h_gbps']:.2f} x plaintext D2H" if "d2h_gbps" in found else ""
        rep.add(name, fmt_rate(r), f"{n} blocks, seal_mode=mapped, restore verified{vs}")

    interrupted: str | None = None
    try:
        if rep.section(f"setup (pool, {mib(big * BLOCK)} pinned host region)", setup):
            rep.section("kernels", kernels)
            rep.section(f"offload/restore, {big} blocks", offload_restore)
            for size in sizes:
                rep.section(f"latency, {size} block(s)", functools.partial(latency, size))
            rep.section("derived figures", derived, gpu=False)  # from what was measured
            rep.section("classic CC path", classic)
            rep.section("seal_mode=mapped", mapped)
        else:
            rep.stopped = rep.stopped or "setup failed"
    except (Interrupted, KeyboardInterrupt) as e:
        interrupted = str(e) or type(e).__name__
        rep.add("INTERRUPTED", interrupted, "rows above were measured before it")
        rep.stopped = rep.stopped or "interrupted"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        rep.print_table(label)
        # Cleanup only while the context is sound: after a sticky error every call
        # fails anyway, and a process exit releases everything.
        if backend is not None and rep.stopped in (None, "time budget spent"):
            try:
                if pool is not None:
                    pool.close()
                if region is not None:
                    region.close()
                for b in bases:
                    dev.free(b)
                backend.close()
            except Exception as e:  # the table is out; say so and keep the exit status
                print(f"bench_gpu: cleanup failed: {e}", file=sys.stderr)
    # Non-zero when anything did not run to the end (a MISS verdict is a result).
    incomplete = any(r[1].startswith(("FAILED", "SKIPPED", "INTERRUPTED")) for r in rep.rows)
    return 1 if incomplete or interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
