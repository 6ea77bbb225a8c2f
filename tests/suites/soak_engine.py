"""One engine process of the soak suite (``tests/suites/soak.py`` starts several).

It owns a :class:`SharedKVPool` (real POSIX shared memory), registers it through
:class:`EnginePool` (background registration, HoldPool: the daemon unregisters it
if this process dies) and drives mixed traffic until SIGTERM: offload of chain
segments with their parent, lookup, restore write-through and write-back (after a
lookup and blind), touch, drop (blocks and, rarely, a whole tenant), a share of
calls through the degrade-never-fail ``EnginePool`` methods, and every
``cycle_ops`` operations a fresh pool (close, new shared memory, register again).

The model: a block's bytes are a pure function of (tenant, hash)
(:func:`block_content`), so every engine, including a restarted one, knows what
any restore must deliver, and a block served to the wrong tenant is wrong bytes
too. Every page a successful restore wrote is compared byte for byte.

Counters go to ``--status`` as JSON (written atomically, about once a second,
immediately after a wrong byte, and on exit), which the driver reads; the file
is the only channel, so a SIGKILLed engine loses at most a second of counts.
Every restore call's latency goes to ``<status>.restores`` as it ends, one
line each (``end wall time, ms, outcome``: ``ok`` or ``CODE/REASON``), for the
driver's per-period percentiles.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, TextIO

STOP: list[bool] = []  # non-empty once SIGTERM/SIGINT arrived


def _stop(signum: int, frame: object) -> None:
    STOP.append(True)


if __name__ == "__main__":
    # Before the slow imports below: a SIGTERM that reaches an engine still
    # starting up (seconds on a loaded machine) must stop it cleanly too, not
    # kill it with the default action.
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)

from kvseal.client import (  # noqa: E402
    ClientConfig,
    EnginePool,
    KVSealClient,
    KVSealRpcError,
    tenant_digest,
)
from kvseal.client.shm import KVShape, SharedKVPool  # noqa: E402

FINGERPRINT = b"model:soak"
# 64 KiB blocks (2 layers, 8 KV heads, head dim 64, 16-token pages, bf16).
GEOMETRY = {"tokens_per_page": 16, "num_layers": 2, "num_kv_heads": 8, "head_dim": 64}
TENANTS = ("soak-a", "soak-b", "soak-c")
FAMILIES = 8  # prompt families per tenant (a shared trunk each)
TRUNK = 10  # trunk blocks per family
BRANCHES = 3  # branches per family, each forking off the trunk
MAX_CHAIN = 14  # longest path (blocks): the pool has this many pages
# Failures a healthy daemon under eviction pressure gives: another engine (or
# this one) evicted, released or dropped a block between lookup and restore, or
# every slot was momentarily pinned or pending. Anything else is unexpected.
EXPECTED = frozenset({"NOT_FOUND/BLOCK_NOT_PRESENT", "RESOURCE_EXHAUSTED/CAPACITY_EXHAUSTED"})
SLOW_S = 10.0  # a call this long is recorded (start, end, outcome) in ``slow``
STUCK_S = 20.0  # a call in flight this long is reported (``stuck``): the driver dumps stacks
MAX_RECORDS = 50
# The calls whose latency is recorded (``<status>.restores``): every restore, the
# engine API's included.
RESTORE_CALLS = frozenset({"restore", "restore_wb", "restore_blind", "api restore"})


def block_hash(family: int, branch: int, k: int) -> bytes:
    """Hashes are tenant-independent on purpose: tenants share hash values, and
    only the tenant digest keeps their blocks apart."""
    return hashlib.sha256(f"kvseal-soak/{family}/{branch}/{k}".encode()).digest()


def paths() -> list[list[bytes]]:
    """Every root-to-leaf path: the trunk of each family and its branches, which
    share the trunk's first ``fork`` blocks (a prefix tree, as prompts are)."""
    rnd = random.Random(12)  # the same tree in every process
    out = []
    for f in range(FAMILIES):
        trunk = [block_hash(f, 0, k) for k in range(TRUNK)]
        out.append(trunk)
        for b in range(1, BRANCHES + 1):
            fork = rnd.randint(1, TRUNK - 1)
            length = rnd.randint(fork + 1, MAX_CHAIN)
            out.append(trunk[:fork] + [block_hash(f, b, k) for k in range(fork, length)])
    return out


def block_content(tenant: bytes, h: bytes, size: int) -> bytes:
    return hashlib.shake_256(b"soak-content" + tenant + h).digest(size)


@dataclass
class Counts:
    ops: Counter[str] = field(default_factory=Counter)  # op -> calls made
    ok: Counter[str] = field(default_factory=Counter)  # op -> calls that succeeded
    errors: Counter[str] = field(default_factory=Counter)  # "CODE/REASON" -> n
    errors_by_op: Counter[str] = field(default_factory=Counter)  # "op CODE/REASON" -> n
    restores_verified: int = 0  # successful restores (engine API ones too), all pages checked
    restored_blocks_checked: int = 0
    wrong_bytes: int = 0  # blocks a successful restore delivered wrong
    wrong_examples: list[str] = field(default_factory=list)
    degraded: int = 0  # EnginePool calls that returned a miss / False
    no_handle: int = 0  # iterations skipped while (re)registering
    pool_cycles: int = 0
    # Calls over SLOW_S: {"call", "start", "end" (wall clock, s), "s", "outcome"}.
    slow: list[dict[str, Any]] = field(default_factory=list)
    stuck: int = 0  # calls that were still in flight after STUCK_S
    stuck_calls: list[dict[str, Any]] = field(default_factory=list)  # {"call", "start"}

    def to_json(self) -> dict[str, Any]:
        return {
            "ops": dict(self.ops),
            "ok": dict(self.ok),
            "errors": dict(self.errors),
            "errors_by_op": dict(self.errors_by_op),
            "restores_verified": self.restores_verified,
            "restored_blocks_checked": self.restored_blocks_checked,
            "wrong_bytes": self.wrong_bytes,
            "wrong_examples": self.wrong_examples[:5],
            "degraded": self.degraded,
            "no_handle": self.no_handle,
            "pool_cycles": self.pool_cycles,
            "slow": self.slow[:MAX_RECORDS],
            "stuck": self.stuck,
            "stuck_calls": self.stuck_calls[:MAX_RECORDS],
        }


class Engine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rnd = random.Random(args.seed)
        self.client = KVSealClient(
            ClientConfig(
                target=args.target,
                # A soak, not a latency test: the CPU is shared, so generous
                # deadlines keep a slow moment from reading as an error.
                timeout_s=10.0,
                lookup_timeout_s=10.0,
                transfer_timeout_s=60.0,
                tenant_key=None,
            )
        )
        self.tenants = [tenant_digest(TENANTS[i]) for i in args.tenants]
        self.paths = paths()
        self.counts = Counts()
        self.shape = KVShape(num_pages=MAX_CHAIN, **GEOMETRY)
        self.block = self.shape.block_bytes
        self.pool: SharedKVPool | None = None
        self.engine: EnginePool | None = None
        self._last_write = 0.0
        # Locality, as in serving: a skewed share of paths is hot, and restores
        # mostly revisit what was offloaded lately (a conversation's next turn).
        order = list(range(len(self.paths)))
        self.rnd.shuffle(order)
        self.hot = [self.paths[i] for i in order]
        self.hot_weights = [1.0 / (rank + 1) for rank in range(len(order))]
        self.recent: deque[tuple[bytes, list[bytes]]] = deque(maxlen=8)
        # The call in flight (name, wall start, monotonic start), read by the
        # watchdog thread; the status file is written under _status_lock.
        self.inflight: tuple[str, float, float] | None = None
        self._status_lock = threading.Lock()
        self._latencies: TextIO | None = None  # <status>.restores, opened by run()

    # ---------------------------------------------------------------- slow calls

    def timed(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, recorded in ``slow`` if it took over SLOW_S."""
        wall, mono = time.time(), time.monotonic()
        self.inflight = (name, wall, mono)
        outcome = "ok"
        try:
            return fn(*args, **kwargs)
        except KVSealRpcError as e:
            outcome = f"{e.code.name}/{e.reason or '-'}: {e}"
            raise
        finally:
            self.inflight = None
            took = time.monotonic() - mono
            if name in RESTORE_CALLS and self._latencies is not None:
                outcome_tag = "ok" if outcome == "ok" else outcome.split(":", 1)[0]
                self._latencies.write(f"{time.time():.3f} {took * 1000:.3f} {outcome_tag}\n")
            if took > SLOW_S:
                self.counts.slow.append(
                    {"call": name, "start": round(wall, 3), "end": round(time.time(), 3),
                     "s": round(took, 3), "outcome": outcome[:300]}
                )  # fmt: skip
                self.write_status(force=True)

    def watchdog(self) -> None:
        """Report a call in flight over STUCK_S once: count it in ``stuck`` (the
        driver then has the daemon dump its threads' stacks) and dump this
        process's own stacks to its log."""
        reported: tuple[str, float, float] | None = None
        while not STOP:
            time.sleep(1.0)
            cur = self.inflight
            if cur is None or cur is reported or time.monotonic() - cur[2] < STUCK_S:
                continue
            reported = cur
            self.counts.stuck += 1
            self.counts.stuck_calls.append({"call": cur[0], "start": round(cur[1], 3)})
            print(f"soak-engine {self.args.id}: {cur[0]} in flight for {STUCK_S:.0f} s "
                  f"(since {cur[1]:.3f}); stacks follow", file=sys.stderr, flush=True)  # fmt: skip
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            self.write_status(force=True)

    # ---------------------------------------------------------------- pools

    def open_pool(self) -> None:
        self.pool = SharedKVPool(self.shape, self.args.layout, name_prefix=self.args.shm_prefix)
        self.engine = EnginePool(
            self.client, f"soak-engine-{self.args.id}", FINGERPRINT, self.pool.geometry()
        )
        self.engine.wait_ready(10.0)

    def close_pool(self) -> None:
        if self.engine is not None:
            self.counts.degraded += self.engine.failures
            self.engine.close()  # unregisters: the daemon closes its fds of the pool
            self.engine = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    # ---------------------------------------------------------------- status

    def write_status(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_write < 1.0:
            return
        self._last_write = now
        with self._status_lock:  # the watchdog thread writes too
            c = self.counts.to_json()
            engine = self.engine
            if engine is not None:
                c["degraded"] += engine.failures
            tmp = self.args.status + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"pid": os.getpid(), **c}, f)
            os.replace(tmp, self.args.status)

    # ---------------------------------------------------------------- traffic

    def fail(self, op: str, e: KVSealRpcError) -> None:
        key = f"{e.code.name}/{e.reason or '-'}"
        self.counts.errors[key] += 1
        self.counts.errors_by_op[f"{op} {key}"] += 1

    def check_pages(self, tenant: bytes, chain: list[bytes], pages: list[int]) -> None:
        assert self.pool is not None
        self.counts.restores_verified += 1
        for h, p in zip(chain, pages, strict=True):
            self.counts.restored_blocks_checked += 1
            if self.pool.read_block(p) != block_content(tenant, h, self.block):
                self.counts.wrong_bytes += 1
                self.counts.wrong_examples.append(f"hash {h.hex()[:12]} page {p}")
                self.write_status(force=True)

    def step(self) -> None:
        assert self.pool is not None and self.engine is not None
        h = self.engine.handle
        if h is None:
            self.counts.no_handle += 1
            time.sleep(0.05)
            return
        rnd = self.rnd
        tenant = rnd.choice(self.tenants)
        path = rnd.choices(self.hot, weights=self.hot_weights)[0]
        pages = list(range(len(path)))
        rnd.shuffle(pages)  # blocks land on any page, as an engine's allocator places them
        op = rnd.choices(
            ["offload", "restore", "restore_wb", "restore_blind", "lookup", "touch", "drop",
             "drop_tenant", "pool_api"],
            weights=[36, 22, 8, 4, 12, 7, 6, 0.2, 5],
        )[0]  # fmt: skip
        self.counts.ops[op] += 1
        if op.startswith("restore") and self.recent and rnd.random() < 0.7:
            tenant, path = rnd.choice(self.recent)
            pages = list(range(len(path)))
            rnd.shuffle(pages)
        pid = h.pool_id
        c = self.client
        try:
            if op == "offload":
                # A segment of the path with its parent, as an engine offloads the
                # blocks a step completed (the prefix may or may not be cached).
                a = rnd.randrange(len(path))
                e = rnd.randint(a + 1, len(path))
                seg, dst = path[a:e], pages[a:e]
                for bh, p in zip(seg, dst, strict=True):
                    self.pool.write_block(p, block_content(tenant, bh, self.block))
                self.timed(
                    "offload", c.offload, pid, tenant, seg, dst,
                    parent_hash=path[a - 1] if a else None,
                )  # fmt: skip
                self.recent.append((tenant, path))
            elif op in ("restore", "restore_wb", "restore_blind"):
                n = (
                    rnd.randint(1, len(path))
                    if op == "restore_blind"
                    else self.timed("lookup", c.lookup, pid, tenant, path).hit_blocks
                )
                if n == 0:
                    self.counts.ok[op] += 1
                    return
                dst = pages[:n]
                for p in dst:
                    self.pool.fill_page(p, 0xA5)
                self.timed(op, c.restore, pid, tenant, path[:n], dst, release=op == "restore_wb")
                self.check_pages(tenant, path[:n], dst)
            elif op == "lookup":
                self.timed("lookup", c.lookup, pid, tenant, path)
            elif op == "touch":
                self.timed("touch", c.touch, pid, tenant, path[: rnd.randint(1, len(path))])
            elif op == "drop":
                a = rnd.randrange(len(path))
                self.timed("drop", c.drop, pid, tenant, path[a : rnd.randint(a + 1, len(path))])
            elif op == "drop_tenant":
                self.timed("drop_tenant", c.drop, pid, tenant, all_of_tenant=True)
            else:  # the engine hot-path API: never raises, a miss on any failure
                n = self.timed("api lookup", self.engine.lookup, tenant, path)
                if n:
                    dst = pages[:n]
                    for p in dst:
                        self.pool.fill_page(p, 0xA5)
                    if self.timed("api restore", self.engine.restore, tenant, path[:n], dst):
                        self.check_pages(tenant, path[:n], dst)
                else:
                    for bh, p in zip(path, pages, strict=True):
                        self.pool.write_block(p, block_content(tenant, bh, self.block))
                    self.timed("api offload", self.engine.offload, tenant, path, pages)
        except KVSealRpcError as e:
            self.fail(op, e)
            return
        self.counts.ok[op] += 1

    def run(self) -> None:
        # Line-buffered: a line is in the file once its restore ended, so a
        # SIGKILLed engine loses none.
        self._latencies = open(self.args.status + ".restores", "a", buffering=1)  # noqa: SIM115
        threading.Thread(target=self.watchdog, name="soak-watchdog", daemon=True).start()
        self.open_pool()
        ops_in_pool = 0
        pause = self.args.pause_ms / 1000.0
        while not STOP:
            self.step()
            ops_in_pool += 1
            if ops_in_pool >= self.args.cycle_ops:
                self.close_pool()
                self.open_pool()
                self.counts.pool_cycles += 1
                ops_in_pool = 0
            self.write_status()
            # A soak, not a stress test: jittered pauses keep the CPU load sane.
            time.sleep(pause * self.rnd.uniform(0.5, 1.5))
        self.close_pool()
        self.client.close()
        self.write_status(force=True)
        self._latencies.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--id", type=int, required=True)
    p.add_argument("--tenants", type=int, nargs="+", required=True, help="indices into TENANTS")
    p.add_argument("--layout", default="vllm_per_layer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pause-ms", type=float, default=30.0)
    p.add_argument("--cycle-ops", type=int, default=400, help="operations per pool registration")
    p.add_argument("--shm-prefix", required=True)
    p.add_argument("--status", required=True)
    args = p.parse_args(argv)
    Engine(args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
