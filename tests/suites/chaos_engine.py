"""One engine process of the chaos suite (``tests/suites/chaos.py`` starts and kills it).

A real engine as far as kvseal can tell: a :class:`SharedKVPool` in ``/dev/shm``,
registered and held by an :class:`EnginePool`, and worker threads that offload,
look up and restore blocks, through the ``EnginePool`` hot path (never raises)
and through ``KVSealClient`` directly with short random deadlines (raises).

What it checks, against a model it keeps of every page:

- every block has known content, a pure function of its hash (:func:`content`),
  so any engine can verify a block another one stored; a successful restore
  must put exactly that into every destination page ("wrong bytes" otherwise);
- the engine contract: the instant a call fails, its pages are overwritten
  with a fresh fill byte, and from then on the model expects that fill; every
  page is compared with the model before each use and in periodic sweeps, so
  a daemon that wrote a page after the call returned shows up as a "late
  write" (a failed offload that read a page late would publish the fill, which
  a later restore reports as wrong bytes);
- every call returns within its deadline (``timeout + transfer_grace_s`` for
  transfers, the lookup timeout for lookups) plus a slack.

Output (``--log``, appended with one ``write`` per line, so a SIGKILL never
tears a line): ``S <shm names...>`` at start; per call ``C <op> <via> <blocks>
<ok 0/1> <code> <elapsed ms> <bound ms>``; ``B <good> <bad>`` blocks
verified after a successful restore; ``K <n>`` pages of failed calls re-checked
untouched; ``V <kind> <detail>`` for each violation, the moment it is seen; ``P <n>`` when paused (``--pause-file``
exists: idle, every page swept) and ``U`` when resumed; ``X <code>`` on a clean
exit (SIGTERM: the pool is released and its shm objects unlinked); ``R`` once
the workers run (start-up is over); ``W <s> <workers>`` when a pause is still
not acknowledged after ``--stall-dump`` seconds, with every thread's stack
dumped to stderr at that moment (faulthandler) so the driver can say where the
engine was stuck. Each worker
flags ``1`` in its byte of ``--state-file`` while a large transfer is in
flight, so the driver can aim kills into transfers.

Run as a script: ``python chaos_engine.py --target unix:///... --log ...``.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import mmap
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc
from kvseal.client import ClientConfig, EnginePool, KVSealClient, KVSealRpcError, tenant_digest
from kvseal.client.shm import KVShape, SharedKVPool

FINGERPRINT = b"model:chaos/bf16"
TENANT = tenant_digest("chaos")
# 128 KiB blocks in 16 per-layer segments: a 32-block transfer moves 4 MiB.
SHAPE = {"tokens_per_page": 16, "num_layers": 8, "num_kv_heads": 4, "head_dim": 64}
BIG = 8  # a transfer of at least this many blocks raises the worker's state flag
DIRECT_TIMEOUTS_S = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.3, 1.0)


def universe_hash(i: int) -> bytes:
    """The i-th block hash every engine of a run draws from (shared namespace)."""
    return hashlib.sha256(b"kvseal-chaos-block/%d" % i).digest()


def content(block_hash: bytes, size: int) -> bytes:
    """The one correct plaintext of ``block_hash``: whoever stored it, whenever."""
    return random.Random(block_hash).randbytes(size)


class Log:
    """Append-only event log; one ``os.write`` per line (atomic for a SIGKILL)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._lock = threading.Lock()

    def line(self, *parts: object) -> None:
        data = (" ".join(str(p) for p in parts) + "\n").encode()
        with self._lock:
            os.write(self._fd, data)


class Worker:
    """One thread's share of the pool (pages ``lo..hi``) and its page model.

    ``expect[p]`` is what page ``p`` holds whenever no call of this worker is
    using it: ``("fill", byte)`` or ``("hash", block_hash)``."""

    def __init__(self, eng: Engine, idx: int, lo: int, hi: int, seed: int) -> None:
        self.eng = eng
        self.idx = idx
        self.pages = list(range(lo, hi))
        self.rng = random.Random(seed)
        self.expect: dict[int, tuple[str, Any]] = {}
        self.fill = 0
        for p in self.pages:
            self._fill(p)
        # Pages a failed call gave back, not yet re-checked; how many were since.
        self.given_back: set[int] = set()
        self.checked_after_failure = 0

    # ---------------------------------------------------------------- model

    def _fill(self, page: int) -> None:
        """The engine takes the page back: overwrite it with a fresh fill byte."""
        self.fill = self.fill % 251 + 1  # never 0 (a zeroed page is suspicious) nor poison
        self.eng.pool.fill_page(page, self.fill)
        self.expect[page] = ("fill", self.fill)

    def _expected(self, page: int) -> bytes:
        kind, val = self.expect[page]
        size = self.eng.pool.shape.block_bytes
        return bytes([val]) * size if kind == "fill" else content(val, size)

    def _give_back(self, pages: list[int]) -> None:
        """A call failed: the engine reuses its pages at once (contract)."""
        for p in pages:
            self._fill(p)
            self.given_back.add(p)

    def check_page(self, page: int, when: str) -> None:
        if self.eng.pool.read_block(page) != self._expected(page):
            kind, val = self.expect[page]
            detail = val.hex()[:16] if kind == "hash" else f"fill={val}"
            self.eng.log.line("V late_write", f"page={page}", f"expected={kind}:{detail}", when)
            self._fill(page)  # count each late write once
        elif page in self.given_back:
            self.checked_after_failure += 1
        self.given_back.discard(page)

    def sweep(self, when: str) -> None:
        for p in self.pages:
            self.check_page(p, when)
        if self.checked_after_failure:
            self.eng.log.line("K", self.checked_after_failure)
            self.checked_after_failure = 0

    # ---------------------------------------------------------------- ops

    def _timed(
        self, op: str, via: str, n: int, bound_s: float, fn: Callable[[], bool]
    ) -> tuple[bool, str]:
        big = n >= BIG
        if big:
            self.eng.state[self.idx] = 1
        t0 = time.monotonic()
        code = "OK"
        try:
            ok = fn()
            if not ok:
                code = "DEGRADED"
        except KVSealRpcError as e:
            ok, code = False, e.code.name
        finally:
            if big:
                self.eng.state[self.idx] = 0
        elapsed = time.monotonic() - t0
        self.eng.log.line(
            "C", op, via, n, int(ok), code, f"{elapsed * 1000:.1f}", f"{bound_s * 1000:.1f}"
        )
        return ok, code

    def _handle(self) -> str | None:
        h = self.eng.pool_handle.handle
        return h.pool_id if h is not None else None

    def offload(self) -> None:
        eng, rng = self.eng, self.rng
        n = rng.choice((1, 2, 4, 8, 16, 24)) if rng.random() < 0.4 else rng.randint(8, 24)
        hashes = [universe_hash(i) for i in rng.sample(range(eng.universe), n)]
        pages = rng.sample(self.pages, n)
        for p in pages:
            self.check_page(p, "before offload")
        size = eng.pool.shape.block_bytes
        for h, p in zip(hashes, pages, strict=True):
            eng.pool.write_block(p, content(h, size))
            self.expect[p] = ("hash", h)
        via, timeout = self._via()

        def run() -> bool:
            if via == "pool":
                return eng.pool_handle.offload(TENANT, hashes, pages)
            pid = self._handle()
            if pid is None:
                return False
            eng.client.offload(pid, TENANT, hashes, pages, timeout=timeout)
            return True

        ok, _ = self._timed("offload", via, n, timeout + eng.grace, run)
        if not ok:
            self._give_back(pages)

    def restore(self) -> None:
        eng, rng = self.eng, self.rng
        n = rng.randint(1, 24)
        hashes = [universe_hash(i) for i in rng.sample(range(eng.universe), n)]
        via, timeout = self._via()
        # Look up first (as an engine does); restore the hit prefix, or now and
        # then blocks that are probably absent (a refused restore writes nothing).
        if via == "pool":
            t0 = time.monotonic()
            hit = eng.pool_handle.lookup(TENANT, hashes)
            elapsed = time.monotonic() - t0
            eng.log.line(
                "C",
                "lookup",
                via,
                n,
                1,
                "OK",
                f"{elapsed * 1000:.1f}",
                f"{eng.lookup_s * 1000:.1f}",
            )
        else:
            pid = self._handle()
            hit = 0
            if pid is not None:
                t0 = time.monotonic()
                code = "OK"
                try:
                    hit = eng.client.lookup(pid, TENANT, hashes).hit_blocks
                except KVSealRpcError as e:
                    code = e.code.name
                elapsed = time.monotonic() - t0
                eng.log.line(
                    "C",
                    "lookup",
                    via,
                    n,
                    int(code == "OK"),
                    code,
                    f"{elapsed * 1000:.1f}",
                    f"{eng.lookup_s * 1000:.1f}",
                )
        if hit == 0 and rng.random() < 0.8:
            return
        hashes = hashes[: hit or n]
        pages = rng.sample(self.pages, len(hashes))
        for p in pages:
            self.check_page(p, "before restore")
            eng.pool.fill_page(p, 0)  # poison: a success must replace every byte
            self.expect[p] = ("fill", 0)
        release = rng.random() < 0.3

        def run() -> bool:
            if via == "pool":
                return eng.pool_handle.restore(TENANT, hashes, pages, release=release)
            pid = self._handle()
            if pid is None:
                return False
            eng.client.restore(pid, TENANT, hashes, pages, release=release, timeout=timeout)
            return True

        ok, _ = self._timed("restore", via, len(hashes), timeout + eng.grace, run)
        size = eng.pool.shape.block_bytes
        if ok:
            bad = 0
            for h, p in zip(hashes, pages, strict=True):
                if eng.pool.read_block(p) != content(h, size):
                    bad += 1
                    eng.log.line("V wrong_bytes", f"page={p}", f"hash={h.hex()[:16]}")
                    self._fill(p)
                else:
                    self.expect[p] = ("hash", h)
            eng.log.line("B", len(hashes) - bad, bad)
        else:
            self._give_back(pages)

    def _via(self) -> tuple[str, float]:
        """Which client path the next call takes (EnginePool or KVSealClient), and
        its transfer timeout (the EnginePool's is its config's)."""
        if self.rng.random() < 0.5:
            return "pool", self.eng.transfer_s
        return "direct", self.rng.choice(DIRECT_TIMEOUTS_S)

    def run(self) -> None:
        eng = self.eng
        it = 0
        while not eng.stop.is_set():
            episode = eng.pause_episode()
            if episode is not None:
                eng.ack_pause(self, episode)
                continue
            try:
                (self.offload if self.rng.random() < 0.5 else self.restore)()
            except Exception as e:  # a bug in the engine or the client: report, go on
                eng.log.line("V engine_exception", type(e).__name__, repr(str(e))[:200])
            it += 1
            if it % 16 == 0:
                self.sweep("periodic sweep")
            # A degraded engine returns at once; do not spin on 2 shared cores.
            time.sleep(self.rng.uniform(0.002, 0.02))


class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.log = Log(args.log)
        self.universe = args.universe
        self.transfer_s = args.transfer_timeout
        self.grace = args.grace
        self.lookup_s = 0.2
        self.pause_file = args.pause_file
        self.stop = threading.Event()
        shape = KVShape(num_pages=args.pages, dtype="bfloat16", **SHAPE)
        self.pool = SharedKVPool(shape, "vllm_per_layer", name_prefix=args.shm_prefix)
        self.log.line("S", *[b.name for b in self.pool.buffers])
        fd = os.open(args.state_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.ftruncate(fd, 64)
        self.state = mmap.mmap(fd, 64)
        os.close(fd)
        cfg = ClientConfig(
            target=args.target,
            transfer_timeout_s=self.transfer_s,
            transfer_grace_s=self.grace,
            lookup_timeout_s=self.lookup_s,
            backoff_initial_s=0.05,
            backoff_max_s=0.5,
        )
        self.client = KVSealClient(cfg)
        self.pool_handle = EnginePool(self.client, args.name, FINGERPRINT, self.pool.geometry())
        self.pool_handle.wait_ready(0)  # start registering in the background
        per = args.pages // args.threads
        self.workers = [
            Worker(self, i, i * per, (i + 1) * per, args.seed * 1000 + i)
            for i in range(args.threads)
        ]
        self._pause_lock = threading.Lock()
        self._pause_acks: set[int] = set()
        self._pause_gen = 0
        self._pause_episode: str | None = None
        self.stall_dump_s = args.stall_dump

    def watch_pauses(self) -> None:
        """Diagnostics only: when a pause stays unacknowledged for ``stall_dump_s``,
        log ``W`` and dump every thread's stack to stderr (once per pause)."""
        while not self.stop.is_set():
            if not self.paused():
                self.stop.wait(0.05)
                continue
            gen, t0 = self._pause_gen, time.monotonic()
            dumped = False
            while self.paused() and not self.stop.is_set() and self._pause_gen == gen:
                waited = time.monotonic() - t0
                if not dumped and waited > self.stall_dump_s:
                    with self._pause_lock:
                        missing = sorted({w.idx for w in self.workers} - self._pause_acks)
                    self.log.line("W", f"{waited:.1f}", *missing)
                    print(f"--- pause not acknowledged after {waited:.1f} s", file=sys.stderr)
                    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                    sys.stderr.flush()
                    dumped = True
                self.stop.wait(0.05)
            while self.paused() and not self.stop.is_set():
                self.stop.wait(0.05)

    def paused(self) -> bool:
        return os.path.exists(self.pause_file)

    def pause_episode(self) -> str | None:
        """The driver's current pause (the pause file's content, written whole by a
        rename), or None while not paused."""
        try:
            with open(self.pause_file) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def ack_pause(self, w: Worker, episode: str) -> None:
        """Idle while the driver restarts the daemon; the last worker to arrive
        reports the pause once every page of every worker was swept. A worker waits
        for the end of *this* pause: one that slept through an unpause (a starved
        process) sees the next pause as a new one and acknowledges it again."""
        w.sweep("pause sweep")
        with self._pause_lock:
            if self._pause_episode != episode:
                self._pause_episode = episode
                self._pause_acks.clear()
            self._pause_acks.add(w.idx)
            if len(self._pause_acks) == len(self.workers):
                self._pause_gen += 1
                self.log.line("P", self._pause_gen)
        while self.pause_episode() == episode and not self.stop.is_set():
            time.sleep(0.01)
        with self._pause_lock:
            if w.idx in self._pause_acks:
                self._pause_acks.discard(w.idx)
                if not self._pause_acks:
                    self.log.line("U")

    def run(self) -> int:
        threads = [
            threading.Thread(target=w.run, name=f"chaos-worker-{w.idx}", daemon=True)
            for w in self.workers
        ]
        for t in threads:
            t.start()
        threading.Thread(target=self.watch_pauses, name="chaos-pause-watch", daemon=True).start()
        self.log.line("R")
        self.stop.wait()
        for t in threads:
            t.join(60)
        code = 0
        if any(t.is_alive() for t in threads):
            self.log.line("V engine_hang", "a worker did not stop within 60 s")
            code = 1
        for w in self.workers:
            w.sweep("final sweep")
        self.pool_handle.close()
        self.client.close()
        self.pool.close()
        self.log.line("X", code)
        return code


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--pause-file", required=True)
    ap.add_argument("--state-file", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--shm-prefix", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pages", type=int, default=96)
    ap.add_argument("--universe", type=int, default=384)
    ap.add_argument("--transfer-timeout", type=float, default=2.0)
    ap.add_argument("--grace", type=float, default=0.3)
    ap.add_argument("--stall-dump", type=float, default=10.0, help="see the W line")
    args = ap.parse_args(argv)
    stop = threading.Event()
    # Before the pool exists: a SIGTERM during start-up still ends in a clean exit.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    eng = Engine(args)
    eng.stop = stop
    return eng.run()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except grpc.RpcError as e:  # pragma: no cover - reported to the driver by exit status
        print(f"chaos engine: unexpected gRPC error {e}", file=sys.stderr)
        sys.exit(3)
