"""Sealed offload/restore next to raw AES-GCM, measured back to back (used by
``bench_cpu.py``, which owns the daemon, the pool and the printing).

Per batch size and per repetition, in one loop, each one right after the
other on the same bytes:

- raw single-thread ``AESGCM.encrypt_into`` / ``decrypt_into``, 4 MiB per
  call, over contiguous private memory (the reference);
- the CPU backend in this process (``CpuBackend`` over a memfd
  ``HostRegion``, the daemon's own classes and thread count): ``seal_blocks``
  and ``open_blocks`` of the pool's pages;
- the same through the daemon over gRPC (``Offload`` of fresh hashes, then
  ``Drop``, untimed; write-through ``Restore`` of one stored set).

Ratios are taken per repetition (sealed time against the raw time measured
next to it), so a neighbour's load that slows both cancels out; the table
gives their median and range. Also the two kernel copies the CPU backend
cannot avoid (``preadv`` from and ``pwritev`` to the engine's shared memory,
one thread), for reading the ratios.
"""

from __future__ import annotations

import os
import secrets
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cpu_floor import FLOOR_KINDS, Floor
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from kvseal.client import KVSealClient
from kvseal.client.shm import SharedKVPool
from kvseal.server import convert
from kvseal.server.backends.base import BlockIO
from kvseal.server.backends.cpu.backend import CpuBackend
from kvseal.server.backends.cpu.shmpool import CpuMappedPool
from kvseal.server.backends.cpu.staging import PrivateBuffer
from kvseal.server.hostregion import Extent, HostRegion, align_up
from kvseal.server.sealing import BlockAD, BlockSealer, SealRecord
from kvseal.v1 import kvseal_pb2 as pb

KINDS = (
    "raw_enc",
    "offload",
    "daemon_offload",
    "raw_dec",
    "restore",
    "daemon_restore",
    *FLOOR_KINDS,
)
TIMEOUT_S = 600.0


@dataclass
class Series:
    """Seconds per repetition of each measurement, for one batch size."""

    blocks: int
    nbytes: int
    times: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})
    gather_s: float = 0.0
    scatter_s: float = 0.0

    def gbps(self, kind: str) -> float:
        return self.nbytes / statistics.median(self.times[kind]) / 1e9

    def ratios(self, sealed: str, raw: str) -> list[float]:
        """raw time / sealed time, per repetition (= sealed GB/s / raw GB/s)."""
        return [r / s for r, s in zip(self.times[raw], self.times[sealed], strict=True)]


class InProcess:
    """The CPU backend in this process, on the benchmark's pool."""

    def __init__(self, pool: SharedKVPool, workers: int, blocks: int) -> None:
        self.sealer = BlockSealer()
        self.backend = CpuBackend(self.sealer, workers)
        self.size = pool.shape.block_bytes
        self.region: HostRegion = self.backend.make_region(blocks * align_up(self.size), None)
        req = pb.RegisterPoolRequest(
            name="bench-inproc", model_fingerprint=b"bench", geometry=pool.geometry()
        )
        self.pool = self.backend.map_pool(convert.pool_spec(req, "cpu"))
        self.records: list[SealRecord] = []
        self.blocks: list[BlockIO] = []

    def use(self, n: int) -> None:
        """Blocks 0..n-1 from pages 0..n-1, fresh hashes."""
        slot = align_up(self.size)
        self.blocks = [
            BlockIO(
                i,
                Extent(i * slot, slot),
                BlockAD(b"n" * 32, b"t" * 32, secrets.token_bytes(32), 0),
                self.size,
            )
            for i in range(n)
        ]
        self._forget()

    def offload(self) -> None:
        records = self.backend.seal_blocks(self.pool, self.blocks, self.region)
        self._forget()
        self.records = records

    def restore(self) -> None:
        if self.backend.open_blocks(self.pool, self.blocks, self.records, self.region):
            raise SystemExit("in-process restore failed authentication")

    def _forget(self) -> None:
        for r in self.records:
            self.sealer.forget(r.epoch)
        self.records = []

    def close(self) -> None:
        self.pool.close()
        self.backend.close()
        self.region.close()


class Raw:
    """Raw AES-256-GCM over contiguous private memory, one thread."""

    def __init__(self, pool: SharedKVPool, blocks: int) -> None:
        self.bb = pool.shape.block_bytes
        self.n = blocks
        self.plain = bytearray(blocks * self.bb)
        for i in range(blocks):  # the pool's bytes (AES speed does not depend on them)
            self.plain[i * self.bb : (i + 1) * self.bb] = pool.read_block(i)
        self.sealed = bytearray(blocks * (self.bb + 16))
        self.aead = AESGCM(AESGCM.generate_key(bit_length=256))
        self.nonce, self.aad = bytes(12), bytes(112)  # one throwaway key: reuse is moot

    def use(self, n: int) -> None:
        self.n = n

    def encrypt(self) -> None:
        src, dst, bb = memoryview(self.plain), memoryview(self.sealed), self.bb
        for i in range(self.n):
            self.aead.encrypt_into(
                self.nonce, src[i * bb : (i + 1) * bb], self.aad, dst[i * (bb + 16) :][: bb + 16]
            )

    def decrypt(self) -> None:
        # Into the plaintext buffer again: the bytes written are the bytes there.
        src, dst, bb = memoryview(self.sealed), memoryview(self.plain), self.bb
        for i in range(self.n):
            self.aead.decrypt_into(
                self.nonce, src[i * (bb + 16) :][: bb + 16], self.aad, dst[i * bb : (i + 1) * bb]
            )


class ThroughDaemon:
    """Offload and write-through restore of pages 0..n-1 over gRPC."""

    def __init__(self, client: KVSealClient, pool_id: str) -> None:
        self.client, self.pool_id = client, pool_id
        self.tenant = secrets.token_bytes(32)
        self.stored: list[bytes] = []
        self.pages: list[int] = []

    def use(self, n: int) -> None:
        if self.stored:
            self.client.drop(self.pool_id, self.tenant, self.stored)
        self.pages = list(range(n))
        self.stored = [secrets.token_bytes(32) for _ in self.pages]
        self._offload(self.stored)

    def offload(self) -> Callable[[], None]:
        """The timed offload of fresh hashes; returns the untimed drop."""
        hashes = [secrets.token_bytes(32) for _ in self.pages]
        self._offload(hashes)
        return lambda: self.client.drop(self.pool_id, self.tenant, hashes)

    def restore(self) -> None:
        r = self.client.restore(
            self.pool_id, self.tenant, self.stored, self.pages, release=False, timeout=TIMEOUT_S
        )
        if r.restored_blocks != len(self.pages):
            raise SystemExit(f"restore restored {r.restored_blocks} of {len(self.pages)} blocks")

    def _offload(self, hashes: list[bytes]) -> None:
        r = self.client.offload(self.pool_id, self.tenant, hashes, self.pages, timeout=TIMEOUT_S)
        if r.stored_blocks != len(hashes):
            raise SystemExit(f"offload stored {r.stored_blocks} of {len(hashes)} blocks")

    def close(self) -> None:
        if self.stored:
            self.client.drop(self.pool_id, self.tenant, self.stored)


def kernel_copies(pool: CpuMappedPool, n: int) -> tuple[float, float]:
    """Seconds for one thread to ``preadv`` pages 0..n-1 into private memory
    and ``pwritev`` them back (the CPU backend's own calls, whole blocks),
    best of 3."""
    size = pool.block_bytes
    buf = PrivateBuffer(n * size)
    try:
        pages, starts = list(range(n)), [i * size for i in range(n)]
        into = [pool.bound(size, buf.view[p * size : (p + 1) * size])[0] for p in pages]

        def gather() -> None:
            for p in pages:
                pool.read_chunk(p, into[p])

        def scatter() -> None:
            pool.write_pages(pages, buf.view, starts, lambda: None)

        out = []
        for fn in (gather, scatter):
            fn()
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t0)
            out.append(best)
        return out[0], out[1]
    finally:
        buf.close()


def measure(
    pool: SharedKVPool,
    client: KVSealClient,
    pool_id: str,
    batches: list[int],
    reps: int,
    workers: int,
    progress: Callable[[str], None],
) -> list[Series]:
    """Every batch size, ``reps`` interleaved repetitions (after one warm-up)."""
    top = max(batches)
    inproc = InProcess(pool, workers, top)
    raw = Raw(pool, top)
    daemon = ThroughDaemon(client, pool_id)
    floor = Floor(pool, inproc.pool, inproc.region, workers)
    out = []
    try:
        for b in batches:
            series = Series(b, b * pool.shape.block_bytes)
            for part in (inproc, raw, daemon, floor):
                part.use(b)
            for rep in range(reps + 1):
                for kind in KINDS:
                    cleanup: Callable[[], None] | None = None
                    t0 = time.perf_counter()
                    if kind == "raw_enc":
                        raw.encrypt()
                    elif kind == "raw_dec":
                        raw.decrypt()
                    elif kind == "offload":
                        inproc.offload()
                    elif kind == "restore":
                        inproc.restore()
                    elif kind == "daemon_offload":
                        cleanup = daemon.offload()
                    elif kind == "daemon_restore":
                        daemon.restore()
                    else:
                        floor.run(kind)
                    dt = time.perf_counter() - t0
                    if cleanup is not None:
                        cleanup()
                    if rep:  # the first round warms caches, staging and the region
                        series.times[kind].append(dt)
            series.gather_s, series.scatter_s = kernel_copies(inproc.pool, b)
            progress(
                f"  {b} blocks: raw enc {series.gbps('raw_enc'):.2f} / dec "
                f"{series.gbps('raw_dec'):.2f} GB/s; offload {series.gbps('offload'):.2f} "
                f"(daemon {series.gbps('daemon_offload'):.2f}), restore "
                f"{series.gbps('restore'):.2f} (daemon {series.gbps('daemon_restore'):.2f}) GB/s"
            )
            out.append(series)
    finally:
        daemon.close()
        floor.close()
        inproc.close()
    return out


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(rows: list[Series]) -> list[str]:
    """The markdown tables: throughput and ratios, then the kernel copies."""
    mib = 1024 * 1024
    lines = [
        "| batch | bytes | sealed offload GB/s | sealed restore GB/s "
        "| in-process offload GB/s | in-process restore GB/s "
        "| raw enc GB/s (1 thread) | raw dec GB/s (1 thread) "
        "| offload / raw enc | restore / raw dec "
        "| in-process offload / raw enc | in-process restore / raw dec |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [f"{r.blocks} blocks", f"{r.nbytes // mib} MiB"]
        kinds = ("daemon_offload", "daemon_restore", "offload", "restore", "raw_enc", "raw_dec")
        cells += [f"{r.gbps(k):.2f}" for k in kinds]
        cells += [
            _cell(r.ratios("daemon_offload", "raw_enc")),
            _cell(r.ratios("daemon_restore", "raw_dec")),
            _cell(r.ratios("offload", "raw_enc")),
            _cell(r.ratios("restore", "raw_dec")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| batch | preadv from the pool GB/s (1 thread) | pwritev to the pool GB/s (1 thread) |",
        "|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.blocks} blocks | {r.nbytes / r.gather_s / 1e9:.2f} "
            f"| {r.nbytes / r.scatter_s / 1e9:.2f} |"
        )
    lines += [
        "",
        "Copies alone, no AES (cpu_floor.py), same threads: raw time / copy time, an upper "
        "bound on sealed / raw for that design",
        "",
        "| batch | offload copies, as the backend makes them (preadv + memmove) "
        "| offload copies, mapped pool (memmove only) "
        "| restore copies, as the backend makes them (memmove + pwritev) "
        "| restore copies, mapped pool (memmove only) "
        "| restore copies, mapped, per-block commit (not the contract) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = [
            _cell(r.ratios("floor_offload_kernel", "raw_enc")),
            _cell(r.ratios("floor_offload_mapped", "raw_enc")),
            _cell(r.ratios("floor_restore_kernel", "raw_dec")),
            _cell(r.ratios("floor_restore_mapped", "raw_dec")),
            _cell(r.ratios("floor_restore_per_block", "raw_dec")),
        ]
        lines.append(f"| {r.blocks} blocks | " + " | ".join(cells) + " |")
    return lines


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())
