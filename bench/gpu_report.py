"""What ``bench/bench_gpu.py`` measures with and reports through: its key source,
CUDA-event timer, formatting helpers and the row table with its failure rules.

Nothing here issues GPU work of its own except :class:`Timer`'s events. A
:class:`Report` section that raises becomes a ``FAILED`` row; after a sticky
CUDA error (the context is lost) or a spent budget, later GPU sections become
``SKIPPED`` rows, so the table is always printed, last.
"""

from __future__ import annotations

import ctypes
import secrets
import statistics
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from kvseal.server.backends.cuda import probe
from kvseal.server.backends.cuda.device import CudaDevice, CudaError, Device
from kvseal.server.sealing import SealingError

# CUresult values after which the context is unusable (the backend's list, repeated
# here so that the benchmark does not lean on a private name): illegal address,
# launch timeout/failure, traps, ECC, unknown.
STICKY_CODES = frozenset({214, 700, 702, 709, 710, 714, 715, 716, 717, 718, 719, 999})


class BenchKeys:
    """A DeviceKeySource for the benchmark: one random key, a nonce counter."""

    def __init__(self) -> None:
        self._key = (ctypes.c_char * 32)()
        ctypes.memmove(self._key, secrets.token_bytes(32), 32)
        self._prefix = secrets.token_bytes(4)
        self._counter = 0
        self._lock = threading.Lock()

    def allocate_for_device(
        self, n: int, scope: tuple[bytes, bytes] = (b"", b"")
    ) -> tuple[int, list[bytes]]:
        with self._lock:
            c, self._counter = self._counter, self._counter + n
        return 0, [self._prefix + struct.pack(">Q", c + i) for i in range(n)]

    def export_key_to(self, epoch: int, dst: ctypes.Array[ctypes.c_char]) -> None:
        if epoch != 0:
            raise SealingError("no such epoch")
        ctypes.memmove(dst, self._key, 32)

    def live_epoch_ids(self) -> frozenset[int]:
        return frozenset({0})

    def require_live(self, epoch_ids: Iterable[int]) -> None:
        if any(e != 0 for e in epoch_ids):
            raise SealingError("no such epoch")

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
            # A CudaError with the code, so that a sticky error here stops the run too.
            raise CudaError(f"CUDA event call failed: {err!r}", int(err))
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


def fmt_rate(gb_s: float) -> str:
    return f"{gb_s:.1f} GB/s" if gb_s >= 1 else f"{gb_s:.3g} GB/s"  # emulator: tiny


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:g} KiB"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def is_sticky(e: BaseException) -> bool:
    """A CUDA error after which the context is gone: nothing more may be issued."""
    if isinstance(e, CudaError) and e.code in STICKY_CODES:
        return True
    return "restart kvseal-server" in str(e)


class Interrupted(BaseException):
    """SIGTERM (the device check's time limit): stop and print what there is."""


def on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(f"signal {signum}")


@dataclass
class Report:
    """The rows measured so far, and whether more GPU work may be issued."""

    rows: list[tuple[str, str, str, str, str]] = field(default_factory=list)
    stopped: str | None = None  # why no more GPU work is issued (sticky error, budget)
    deadline: float = float("inf")  # time.monotonic() after which sections are skipped

    def add(self, name: str, result: str, notes: str = "", goal: str = "", ok: str = "") -> None:
        self.rows.append((name, result, goal, ok, notes))
        tail = f" [{goal}: {ok}]" if goal else ""
        print(f"# {name}: {result}{tail} {notes}".rstrip(), file=sys.stderr, flush=True)

    def section(self, name: str, fn: Callable[[], None], *, gpu: bool = True) -> bool:
        """Run one section; a failure becomes a FAILED row. False if it did not run
        to completion. ``gpu=False``: it issues no GPU work, so it runs even after a
        sticky error or a spent budget."""
        if gpu and self.stopped is None and time.monotonic() > self.deadline:
            self.stopped = "time budget spent"
        if gpu and self.stopped is not None:
            self.add(name, "SKIPPED", self.stopped)
            return False
        try:
            fn()
            return True
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0][:300]
            self.add(name, f"FAILED: {type(e).__name__}: {first}")
            traceback.print_exc(file=sys.stderr)
            if is_sticky(e):
                self.stopped = f"no GPU work after the sticky CUDA error in {name!r}"
            return False

    def print_table(self, label: str) -> None:
        print(flush=True)
        print(f"## kvseal GPU benchmark: {label}")
        print()
        print(
            "GB/s = 1e9 B/s of plaintext, medians after a warm-up; verdicts compare "
            "with the goals and are never asserted."
        )
        print()
        print("| measurement | result | goal | verdict | notes |")
        print("|---|---|---|---|---|")
        for name, result, goal, ok, notes in self.rows:
            print(f"| {name} | {result} | {goal} | {ok} | {notes} |")
        sys.stdout.flush()
