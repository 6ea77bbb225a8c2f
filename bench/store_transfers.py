"""``make bench``'s store rows: the sealed store tier's spill and restore of
real-sized blocks against a plain file copy of the same bytes, in the same
run, on the same filesystem.

- *sealed spill*: ``FsStore.put`` of each block (derive the record key, seal
  with AES-256-GCM, write a temporary file, fsync it, rename it over the
  keyed name) -- what the daemon's spill thread does after it has opened the
  host tier's copy;
- *plain copy, write*: the same bytes written the same way (a temporary file,
  fsync, rename), no sealing;
- *store restore*: ``FsStore.get`` of each block (read the whole record into
  the thread's reused private buffer, parse, authenticate, decrypt into a
  reused buffer, as the daemon's promotions do);
- *plain copy, read*: the same files read back into a private buffer.

Both go through the page cache (docs/store.md says why the store does not use
``O_DIRECT``). The restore is measured twice: right after the writes (the
pages are cached in both columns, so the plain read is a memory copy and the
ratio is the cost of authenticating and decrypting against ``memcpy``), and
after both columns' files were dropped from the page cache
(``POSIX_FADV_DONTNEED``): the reads then come from the device, as a store
tier's hits do when the store is larger than memory, the case it exists for.
Each repetition runs the six in turn on fresh names; the table gives medians
of the per-repetition GB/s (1e9 bytes of plaintext per second) and ratios.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvseal.server.store.fsstore import FsStore, StoreConfig
from kvseal.server.store.keysource import LocalKeySource


@dataclass(frozen=True)
class StoreRow:
    label: str
    sealed_gbs: float
    plain_gbs: float
    ratios: list[float]


def _plain_write(root: Path, name: str, data: bytes) -> None:
    tmp = root / f".tmp-{name}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, root / name)


def _plain_read(root: Path, name: str, out: bytearray) -> None:
    with open(root / name, "rb", buffering=0) as f:
        view = memoryview(out)
        while view:
            n = f.readinto(view)
            if not n:
                raise OSError(f"short read of {name}")
            view = view[n:]


def measure(
    block_bytes: int, blocks: int, reps: int, say: Callable[[str], None]
) -> tuple[str, list[StoreRow]]:
    """Run the four measurements ``reps`` times on ``blocks`` random blocks;
    returns the filesystem's description and the two rows."""
    data = [os.urandom(block_bytes) for _ in range(blocks)]
    ns, tenant = os.urandom(32), os.urandom(32)
    out, plain_out = bytearray(block_bytes), bytearray(block_bytes)
    total = blocks * block_bytes
    spill: list[tuple[float, float]] = []
    restore: list[tuple[float, float]] = []
    cold: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(prefix="kvseal-bench-store-") as tmp:
        root = Path(tmp)
        fs = _filesystem(root)
        plain = root / "plain"
        plain.mkdir()
        cfg = StoreConfig(
            str(root / "store"),
            capacity_bytes=(reps + 1) * total * 2 + 64 * block_bytes,
            max_object_bytes=block_bytes,
        )
        with FsStore(cfg, LocalKeySource().load()) as store:
            for rep in range(reps):
                hashes = [os.urandom(32) for _ in range(blocks)]
                t0 = time.perf_counter()
                for h, d in zip(hashes, data, strict=True):
                    store.put(ns, tenant, h, d)
                t1 = time.perf_counter()
                for i, d in enumerate(data):
                    _plain_write(plain, f"{rep}-{i}", d)
                t2 = time.perf_counter()
                for h, d in zip(hashes, data, strict=True):
                    # Into a reused buffer, as the daemon's promotions do.
                    got = store.get(ns, tenant, h, plain_out)
                    assert got is not None and got == d
                t3 = time.perf_counter()
                for i, d in enumerate(data):
                    _plain_read(plain, f"{rep}-{i}", out)
                    assert out == d
                t4 = time.perf_counter()
                _drop_cache(root)  # both columns' files leave the page cache
                t5 = time.perf_counter()
                store.prefetch(ns, tenant, hashes)  # as a promotion does
                for h, d in zip(hashes, data, strict=True):
                    got = store.get(ns, tenant, h, plain_out)
                    assert got is not None and got == d
                t6 = time.perf_counter()
                _advise(plain, [f"{rep}-{i}" for i in range(len(data))])  # the same read-ahead
                for i, d in enumerate(data):
                    _plain_read(plain, f"{rep}-{i}", out)
                    assert out == d
                t7 = time.perf_counter()
                spill.append((total / (t1 - t0) / 1e9, total / (t2 - t1) / 1e9))
                restore.append((total / (t3 - t2) / 1e9, total / (t4 - t3) / 1e9))
                cold.append((total / (t6 - t5) / 1e9, total / (t7 - t6) / 1e9))
                say(
                    f"store rep {rep + 1}/{reps}: spill {spill[-1][0]:.2f} vs {spill[-1][1]:.2f}"
                    f" GB/s, restore {restore[-1][0]:.2f} vs {restore[-1][1]:.2f} GB/s"
                    f", cold {cold[-1][0]:.2f} vs {cold[-1][1]:.2f} GB/s"
                )
    rows = [
        _row("sealed spill (put: seal, write, fsync, rename) vs plain write", spill),
        _row("store restore from the page cache vs plain read (a memory copy)", restore),
        _row("store restore from the device (cache dropped) vs plain read", cold),
    ]
    return fs, rows


def _drop_cache(root: Path) -> None:
    """Evict every file under ``root`` from the page cache (they are clean:
    written with fsync), so the next reads come from the device."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _advise(root: Path, names: list[str]) -> None:
    """``POSIX_FADV_WILLNEED`` on each file: the plain column's version of
    ``FsStore.prefetch`` (both columns start every read at once)."""
    for name in names:
        fd = os.open(root / name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)


def _row(label: str, pairs: list[tuple[float, float]]) -> StoreRow:
    return StoreRow(
        label,
        statistics.median(s for s, _ in pairs),
        statistics.median(p for _, p in pairs),
        [s / p for s, p in pairs],
    )


def _filesystem(path: Path) -> str:
    """The type of the filesystem holding ``path`` (from /proc/mounts)."""
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                mnt = fields[1]
                if str(path).startswith(mnt) and len(mnt) > len(best):
                    best, kind = mnt, fields[2]
    except OSError:
        pass
    return kind


def table(fs: str, block_bytes: int, blocks: int, reps: int, rows: list[StoreRow]) -> list[str]:
    """The store rows as a markdown table."""
    lines = [
        f"Store tier: {blocks} blocks of {block_bytes // (1024 * 1024)} MiB per repetition on "
        f"{fs} (page cache, fsync before rename in both columns); median of {reps}; "
        "ratio = sealed / plain per repetition, median (min-max); goal >= 0.8",
        "",
        "| store row | sealed GB/s | plain file copy GB/s | ratio |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        cell = f"{statistics.median(r.ratios):.2f} ({min(r.ratios):.2f}-{max(r.ratios):.2f})"
        lines.append(f"| {r.label} | {r.sealed_gbs:.2f} | {r.plain_gbs:.2f} | {cell} |")
    return lines
