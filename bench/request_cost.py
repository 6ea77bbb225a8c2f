"""The fixed cost of a request through the daemon, next to raw AES-GCM (used by
``bench_cpu.py``, which owns the daemon, the pools and the printing).

For each batch size (default 1, 8, 64 and 256 blocks), repetition by
repetition, each right after the other:

- raw single-thread ``AESGCM.encrypt_into`` / ``decrypt_into`` of the batch's
  bytes (``cpu_transfers.Raw``: 4 MiB per call, contiguous private memory);
- ``Offload`` of fresh hashes and write-through ``Restore`` of a stored set
  through the daemon over gRPC, on the benchmark's Qwen3-32B pool (4 MiB
  blocks of 128 per-layer segments);
- the same two requests, the same number of blocks, pages and segments, on a
  *twin* pool registered with the same daemon whose blocks are 4 KiB (one
  token per page, one KV head, head dim 16: 32 bytes per segment, still 128
  segments and 128 ``preadv``/``pwritev`` per block).

The twin's time is the request's **fixed cost**: everything a request pays
that does not grow with its bytes (gRPC on both sides, validation, the
index, the pool lease, thread hand-offs, staging, cipher set-up, the
per-segment system calls), measured rather than fitted. What the full-size
request takes beyond it is the price of its bytes (the AES and the copies).
The ratio to raw AES is raw time / daemon time per repetition (= sealed GB/s
over raw GB/s), as in the throughput table.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cpu_transfers import Raw, ThroughDaemon
from kvseal.client import KVSealClient
from kvseal.client.shm import KVShape, SharedKVPool

KINDS = ("raw_enc", "offload", "offload_twin", "raw_dec", "restore", "restore_twin")
# The twin pool's geometry: Qwen3-32B's 64 layers (so 128 segments per block),
# one token of one 16-wide KV head per page: 4 KiB blocks.
TWIN = {"tokens_per_page": 1, "num_layers": 64, "num_kv_heads": 1, "head_dim": 16}


def twin_shape(shape: KVShape) -> KVShape:
    """The 4 KiB-block twin of ``shape`` (as many pages, 64 layers)."""
    return KVShape(num_pages=shape.num_pages, dtype=shape.dtype, **TWIN)


def reps_for(blocks: int, reps: int, most: int = 40) -> int:
    """Small requests are cheap and noisy: more repetitions (up to ``most``)
    the smaller the batch, never fewer than ``reps``."""
    return max(reps, min(most, 1024 // blocks))


@dataclass
class CostRow:
    """Seconds per repetition of each kind, for one batch size."""

    blocks: int
    nbytes: int
    twin_nbytes: int
    times: dict[str, list[float]] = field(default_factory=lambda: {k: [] for k in KINDS})

    def ms(self, kind: str) -> float:
        return statistics.median(self.times[kind]) * 1e3

    def ratios(self, sealed: str, raw: str) -> list[float]:
        return [r / s for r, s in zip(self.times[raw], self.times[sealed], strict=True)]

    def share(self, twin: str, full: str) -> float:
        """The fixed cost's share of the full-size request (medians)."""
        return self.ms(twin) / self.ms(full)


def measure(
    client: KVSealClient,
    pool: SharedKVPool,
    pool_id: str,
    twin: SharedKVPool,
    twin_id: str,
    batches: list[int],
    reps: int,
    progress: Callable[[str], None],
    most_reps: int = 40,
) -> list[CostRow]:
    """Every batch size, ``reps_for(n, reps, most_reps)`` interleaved
    repetitions after one warm-up; ``twin`` is ``pool``'s 4 KiB-block twin in
    the same daemon."""
    raw = Raw(pool, max(batches))
    full, small = ThroughDaemon(client, pool_id), ThroughDaemon(client, twin_id)
    out = []
    try:
        for n in batches:
            row = CostRow(n, n * pool.shape.block_bytes, n * twin.shape.block_bytes)
            raw.use(n)
            full.use(n)
            small.use(n)
            for rep in range(reps_for(n, reps, most_reps) + 1):
                for kind in KINDS:
                    cleanup: Callable[[], None] | None = None
                    t0 = time.perf_counter()
                    if kind == "raw_enc":
                        raw.encrypt()
                    elif kind == "raw_dec":
                        raw.decrypt()
                    elif kind == "offload":
                        cleanup = full.offload()
                    elif kind == "offload_twin":
                        cleanup = small.offload()
                    elif kind == "restore":
                        full.restore()
                    else:
                        small.restore()
                    dt = time.perf_counter() - t0
                    if cleanup is not None:
                        cleanup()
                    if rep:  # the first round warms caches, staging and the region
                        row.times[kind].append(dt)
            progress(
                f"  {n} blocks: offload {row.ms('offload'):.2f} ms (fixed "
                f"{row.ms('offload_twin'):.2f}, raw enc {row.ms('raw_enc'):.2f}), restore "
                f"{row.ms('restore'):.2f} ms (fixed {row.ms('restore_twin'):.2f}, raw dec "
                f"{row.ms('raw_dec'):.2f})"
            )
            out.append(row)
    finally:
        full.close()
        small.close()
    return out


def _ratio(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(rows: list[CostRow]) -> list[str]:
    """The markdown table (one row per batch size) and the one-block line."""
    lines = [
        "| batch | offload ms | raw enc ms | offload / raw enc | fixed offload ms "
        "| fixed share | restore ms | raw dec ms | restore / raw dec | fixed restore ms "
        "| fixed share |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        label = f"{r.blocks} x {r.nbytes // r.blocks // (1024 * 1024)} MiB"
        cells = [
            label,
            f"{r.ms('offload'):.2f}",
            f"{r.ms('raw_enc'):.2f}",
            _ratio(r.ratios("offload", "raw_enc")),
            f"{r.ms('offload_twin'):.2f}",
            f"{100 * r.share('offload_twin', 'offload'):.0f} %",
            f"{r.ms('restore'):.2f}",
            f"{r.ms('raw_dec'):.2f}",
            _ratio(r.ratios("restore", "raw_dec")),
            f"{r.ms('restore_twin'):.2f}",
            f"{100 * r.share('restore_twin', 'restore'):.0f} %",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    one = next((r for r in rows if r.blocks == 1), None)
    if one is not None:
        lines += [
            "",
            f"One-block request, fixed cost (the 4 KiB twin): offload "
            f"{one.ms('offload_twin'):.2f} ms, restore {one.ms('restore_twin'):.2f} ms "
            "(goal: restore <= 1 ms)",
        ]
    return lines
