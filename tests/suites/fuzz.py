"""Structure-aware fuzzer for kvseal over the real Unix socket (issue 12).

``python -m tests.suites.fuzz [--requests N] [--seed S]`` (``make fuzz``)
starts a real daemon process (``tests.conftest.start_daemon``: CPU backend, a
1 MiB sealed tier, so evictions never stop), registers five pools in shared
memory (three layouts of one model, which share one cache namespace; a second
model with larger blocks; a scratch pool) and drives N requests (100,000 by
default) from several client threads, each request sent as raw bytes through
a generic gRPC call so that byte-level mutations reach the daemon:

- *valid* calls: lookup, touch, offload, restore (write-through and
  write-back), drop, stats, health, a brief WatchEvents, pool lifecycles with
  HoldPool (register, hold, a competing registration, replace or cancel);
- *invalid* calls: one known defect each (wrong lengths, duplicates,
  out-of-range pages, unknown enums, oversized fields, NUL and non-UTF-8
  strings, truncated bodies, bad geometries), each with the exact status and
  reason the README's table promises;
- *mutated* calls: valid messages mutated at the wire level
  (``tests.suites.protowire``). The real protobuf parser decides what the
  daemon owes: a body that does not parse must get INVALID_ARGUMENT /
  BAD_REQUEST; one that parses may get any status but INTERNAL or UNKNOWN.

The reference model: a block's bytes are a function of its hash
(``content``), so every successful restore must deliver exactly those bytes,
and a failed one may leave each page as it was or holding its verified block,
nothing else. Each thread owns its pages and checks that no request wrote
them behind its back. At the end (quiescent): daemon alive, health SERVING,
nothing pending or pinned, every cached reference block restores byte-exact,
a drop of each reference tenant removes exactly the blocks lookup reported,
the tier's byte count matches its block count, Stats counters equal the sums
of what the replies reported, no traceback in the daemon log, and SIGTERM
exits 0. Prints an RPC x status table, the checks, and ``N passed, M failed``;
exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from kvseal.client.shm import KVShape, SharedKVPool
from kvseal.v1 import kvseal_pb2 as pb

from ..conftest import DaemonProc, start_daemon
from . import protowire as pw

SERVICE = "/kvseal.v1.KVSeal/"
HEALTH = "/grpc.health.v1.Health/Check"
UNARY = ("RegisterPool", "UnregisterPool", "Lookup", "Touch", "Offload", "Restore", "Drop", "Stats")
STREAMS = ("HoldPool", "WatchEvents")
RPCS = (*UNARY, *STREAMS, "Health")
REQUEST_TYPES: dict[str, type[Message]] = {
    m.name: getattr(pb, m.input_type.name) for m in pb.DESCRIPTOR.services_by_name["KVSeal"].methods
}
REPLY_TYPES: dict[str, type[Message]] = {
    m.name: getattr(pb, m.output_type.name)
    for m in pb.DESCRIPTOR.services_by_name["KVSeal"].methods
}
Code = grpc.StatusCode
OK = Code.OK
INVALID = (Code.INVALID_ARGUMENT, "BAD_REQUEST")
BAD_PAGE = (Code.INVALID_ARGUMENT, "PAGE_OUT_OF_RANGE")
NO_POOL = (Code.NOT_FOUND, "UNKNOWN_POOL")
NO_BLOCK = (Code.NOT_FOUND, "BLOCK_NOT_PRESENT")
FULL = (Code.RESOURCE_EXHAUSTED, "CAPACITY_EXHAUSTED")
UNUSABLE = (Code.FAILED_PRECONDITION, "HANDLE_UNUSABLE")
MISMATCH = (Code.FAILED_PRECONDITION, "BACKEND_MISMATCH")
TAKEN = (Code.ALREADY_EXISTS, "POOL_NAME_TAKEN")
# A valid Offload that raced a Drop of its tenant (docs/engine-contract.md).
DROPPED = (Code.ABORTED, "TENANT_DROPPED")
OK_ = (OK, "")
# Statuses only the daemon itself sends: each carries its reason.
DAEMON_CODES = frozenset(
    {
        Code.INVALID_ARGUMENT,
        Code.NOT_FOUND,
        Code.FAILED_PRECONDITION,
        Code.ALREADY_EXISTS,
        Code.ABORTED,
    }
)
REASONS = frozenset(pb.ErrorReason.keys()) - {"ERROR_REASON_UNSPECIFIED"}
# A status and reason a request may get; reason "*" matches any.
Expect = frozenset[tuple[Code, str]] | None  # None: any status but INTERNAL / UNKNOWN

HOST_BYTES = "1MiB"
MAX_BATCH = 64
PAGES_PER_THREAD = 8
CHAINS, CHAIN_LEN, TENANTS = 6, 12, 3
POISON = 0xA5
TIMEOUT = 60.0  # generous: a lost reply would blur the counter checks; every
# call and every stream that must end by itself waits this long, so a loaded
# machine (CI beside other jobs) is not taken for a daemon that never answered
SMALL = {"tokens_per_page": 4, "num_layers": 2, "num_kv_heads": 2, "head_dim": 16}  # 1 KiB
LARGE = {"tokens_per_page": 16, "num_layers": 4, "num_kv_heads": 2, "head_dim": 16}  # 8 KiB


def content(h: bytes, size: int) -> bytes:
    """The reference bytes of the block with hash ``h``: a hash always means one content."""
    return hashlib.shake_256(b"kvseal-fuzz" + h).digest(size)


def ser(msg: Message) -> bytes:
    return msg.SerializeToString()


@dataclass
class Tracked:
    """A registered pool whose cached blocks and pages the fuzzer checks."""

    key: str
    ns_key: str
    pool: SharedKVPool
    pool_id: str = ""
    namespace: bytes = b""

    @property
    def block_bytes(self) -> int:
        return self.pool.shape.block_bytes

    @property
    def num_pages(self) -> int:
        return self.pool.shape.num_pages


@dataclass
class Result:
    code: Code
    reason: str
    reply: bytes | None
    details: str = ""


@dataclass
class Check:
    name: str
    passed: int = 0
    failed: int = 0
    examples: list[str] = field(default_factory=list)


class Fuzzer:
    """Owns the daemon, the pools, the counters and the checks. Thread-safe
    where workers share it (one lock guards counters and checks)."""

    def __init__(
        self, workdir: Path, requests: int, seed: int, threads: int, log: Callable[[str], None]
    ) -> None:
        self.workdir = workdir
        self.requests = requests
        self.seed = seed
        self.threads = threads
        self.log = log
        self.lock = threading.Lock()
        self.sent = 0
        self.codes: Counter[tuple[str, str]] = Counter()
        self.classes: Counter[tuple[str, str]] = Counter()
        self.totals: Counter[str] = Counter()
        self.checks: dict[str, Check] = {}
        self.lost_replies = 0
        self.stop = threading.Event()
        self.daemon: DaemonProc | None = None
        self.tracked: dict[str, Tracked] = {}
        self.scratch: Tracked | None = None
        self.regpool: SharedKVPool | None = None
        self.extra_pools: list[SharedKVPool] = []
        rnd = random.Random(seed)
        self.tenants = [rnd.randbytes(32) for _ in range(TENANTS)]
        self.universe: dict[str, list[list[list[bytes]]]] = {
            ns: [
                [[rnd.randbytes(32) for _ in range(CHAIN_LEN)] for _ in range(CHAINS)]
                for _ in range(TENANTS)
            ]
            for ns in ("A", "C")
        }
        self.known: dict[str, dict[tuple[bytes, bytes], None]] = {"A": {}, "C": {}}
        for ns, per_tenant in self.universe.items():
            for t, chains in enumerate(per_tenant):
                for chain in chains:
                    for h in chain:
                        self.known[ns][(self.tenants[t], h)] = None
        self.scratch_tenants = [self.tenants[0], rnd.randbytes(32)]
        self.scratch_hashes = [rnd.randbytes(32) for _ in range(24)]
        self.protected_ids: set[str] = set()
        self.protected_names: set[str] = set()
        self.stored_ok: set[tuple[str, bytes, bytes]] = set()

    # ------------------------------------------------------------ bookkeeping

    def check(self, name: str, ok: bool, example: str = "") -> bool:
        with self.lock:
            c = self.checks.setdefault(name, Check(name))
            if ok:
                c.passed += 1
            else:
                c.failed += 1
                if len(c.examples) < 5:
                    c.examples.append(example[:300])
        return ok

    def budget_left(self) -> bool:
        return self.sent < self.requests and not self.stop.is_set()

    def _record(self, rpc: str, cls: str, res: Result, expect: Expect, label: str) -> None:
        with self.lock:
            self.sent += 1
            self.codes[(rpc, res.code.name)] += 1
        what = f"{cls} {rpc} [{label}]: got {res.code.name}/{res.reason or '-'} {res.details[:120]}"
        self.check("no INTERNAL status", res.code is not Code.INTERNAL, what)
        self.check("no UNKNOWN status (unhandled exception)", res.code is not Code.UNKNOWN, what)
        if res.code in DAEMON_CODES or res.reason:
            self.check(
                "errors carry a known kvseal-error reason",
                res.reason in REASONS,
                what,
            )
            self.check(
                "error messages are bounded printable ASCII (<= 1024 chars)",
                len(res.details) <= 1024 and all(" " <= ch <= "~" for ch in res.details),
                f"{cls} {rpc} [{label}]: {len(res.details)} chars {res.details[:80]!r}",
            )
        if expect is None:
            ok = res.code not in (Code.INTERNAL, Code.UNKNOWN)
        else:
            ok = any(c is res.code and r in ("*", res.reason) for c, r in expect)
        with self.lock:
            self.classes[(cls, "ok" if ok else "unexpected")] += 1
        if expect is not None:
            want = ", ".join(sorted(f"{c.name}/{r or '-'}" for c, r in expect))
            self.check(f"{cls} calls get their documented status", ok, f"{what}; want {want}")
        if res.code in (Code.DEADLINE_EXCEEDED, Code.CANCELLED, Code.UNAVAILABLE) and (
            not res.reason and rpc in UNARY
        ):
            with self.lock:
                self.lost_replies += 1

    def _tally(self, rpc: str, reply: bytes) -> None:
        try:
            msg: Any = REPLY_TYPES[rpc].FromString(reply)
        except DecodeError:
            self.check("replies parse", False, f"{rpc} reply does not parse")
            return
        with self.lock:
            t = self.totals
            if rpc == "Offload":
                t["offloaded_blocks"] += msg.stored_blocks
                t["offloaded_bytes"] += msg.stored_bytes
                t["evicted_blocks"] += msg.evicted_blocks
            elif rpc == "Restore":
                t["restored_blocks"] += msg.restored_blocks
                t["restored_bytes"] += msg.restored_bytes
            elif rpc == "Drop":
                t["dropped_blocks"] += msg.dropped_blocks
            elif rpc == "Lookup":
                t["lookups"] += 1
                t["lookup_hit_blocks"] += msg.hit_blocks

    # ------------------------------------------------------------ transport

    def connect(self) -> None:
        assert self.daemon is not None
        self.channel = grpc.insecure_channel(
            self.daemon.target,
            options=[
                ("grpc.max_receive_message_length", 128 << 20),
                ("grpc.max_send_message_length", 128 << 20),
            ],
        )
        self.unary = {m: self.channel.unary_unary(SERVICE + m) for m in UNARY}
        self.unary["Health"] = self.channel.unary_unary(HEALTH)
        self.streams = {m: self.channel.unary_stream(SERVICE + m) for m in STREAMS}

    @staticmethod
    def _error(e: grpc.RpcError) -> Result:
        call: Any = e
        reason = ""
        try:
            for k, v in call.trailing_metadata() or ():
                if k == "kvseal-error":
                    reason = str(v)
        except Exception:
            pass
        return Result(call.code(), reason, None, call.details() or "")

    def call(
        self,
        rpc: str,
        payload: bytes,
        cls: str,
        expect: Expect,
        label: str = "",
        timeout: float = TIMEOUT,
    ) -> Result:
        """One unary call with raw bytes; records its status and checks it."""
        try:
            reply = self.unary[rpc](payload, timeout=timeout)
            res = Result(OK, "", reply)
        except grpc.RpcError as e:
            res = self._error(e)
        self._record(rpc, cls, res, expect, label or rpc)
        if res.code is OK and res.reply is not None and rpc != "Health":
            self._tally(rpc, res.reply)
        return res

    def stream(
        self,
        rpc: str,
        payload: bytes,
        cls: str,
        expect: Expect,
        label: str,
        timeout: float,
        max_msgs: int = 10_000,
    ) -> tuple[Result, list[bytes]]:
        """A server-streaming call read until it ends, ``timeout`` or ``max_msgs``."""
        msgs: list[bytes] = []
        call: Any = self.streams[rpc](payload, timeout=timeout)
        try:
            for m in call:
                msgs.append(m)
                if len(msgs) >= max_msgs:
                    call.cancel()
                    break
            res = Result(OK, "", None)
        except grpc.RpcError as e:
            res = self._error(e)
        self._record(rpc, cls, res, expect, label)
        return res, msgs

    def health(self, cls: str = "check") -> bool:
        res = self.call("Health", b"", cls, frozenset({OK_}), "health")
        return res.code is OK and res.reply == pw.field(1, pw.VARINT, b"\x01")

    def stats(self, cls: str = "check") -> Any:
        res = self.call("Stats", b"", cls, frozenset({OK_}))
        return pb.StatsReply.FromString(res.reply) if res.reply is not None else None

    # ------------------------------------------------------------ setup

    def setup(self) -> None:
        self.daemon = start_daemon(
            self.workdir / "daemon",
            "--max-batch-blocks",
            str(MAX_BATCH),
            "--workers",
            "2",
            host_bytes=HOST_BYTES,
        )
        self.connect()
        pages = self.threads * PAGES_PER_THREAD
        specs = [
            ("A", "A", "vllm_per_layer", SMALL, b"fz-model-a"),
            ("B", "A", "vllm_cross_layer", SMALL, b"fz-model-a"),
            ("D", "A", "sglang_per_layer", SMALL, b"fz-model-a"),
            ("C", "C", "sglang_per_layer", LARGE, b"fz-model-c"),
        ]
        for key, ns_key, layout, geo, fp in specs:
            shape = KVShape(num_pages=pages, dtype="bfloat16", **geo)
            t = Tracked(key, ns_key, SharedKVPool(shape, layout, name_prefix="kvseal-fuzz"))
            self._register_tracked(t, f"fz-tracked-{key}", fp)
            self.tracked[key] = t
        shape = KVShape(num_pages=16, dtype="bfloat16", **SMALL)
        self.scratch = Tracked("S", "S", SharedKVPool(shape, "vllm_per_layer", "kvseal-fuzz"))
        self._register_tracked(self.scratch, "fz-scratch", b"fz-model-scratch")
        for p in range(16):
            self.scratch.pool.write_block(p, os.urandom(self.scratch.block_bytes))
        self.regpool = SharedKVPool(KVShape(num_pages=4, **SMALL), "vllm_per_layer", "kvseal-fuzz")
        nss = {t.ns_key: t.namespace for t in self.tracked.values()}
        self.check(
            "pools of one model share a namespace across layouts",
            all(t.namespace == nss[t.ns_key] for t in self.tracked.values()) and len(nss) == 2,
            f"namespaces {[t.namespace.hex()[:8] for t in self.tracked.values()]}",
        )
        self.expect: dict[tuple[str, int], bytes | None] = {}
        for t in self.tracked.values():
            for p in range(t.num_pages):
                t.pool.fill_page(p, 0)
                self.expect[(t.key, p)] = bytes(t.block_bytes)

    def _register_tracked(self, t: Tracked, name: str, fp: bytes) -> None:
        req = pb.RegisterPoolRequest(
            name=name, model_fingerprint=fp, geometry=t.pool.geometry(), backend=pb.BACKEND_CPU
        )
        res = self.call("RegisterPool", ser(req), "valid", frozenset({OK_}), "setup")
        if res.reply is None:
            raise RuntimeError(f"cannot register {name}: {res.code.name} {res.details}")
        rep = pb.RegisterPoolReply.FromString(res.reply)
        t.pool_id, t.namespace = rep.pool_id, rep.namespace
        self.protected_ids.add(rep.pool_id)
        self.protected_names.add(name)

    def close(self) -> None:
        if hasattr(self, "channel"):
            self.channel.close()
        if self.daemon is not None:
            self.daemon.stop()
        for t in [*self.tracked.values(), self.scratch]:
            if t is not None:
                t.pool.close()
        if self.regpool is not None:
            self.regpool.close()
        for p in self.extra_pools:
            p.close()

    # ------------------------------------------------------------ run

    def run(self) -> float:
        t0 = time.monotonic()
        if self.requests >= 50_000:
            self.oversized()
        workers = [Worker(self, i) for i in range(self.threads)]
        threads = [threading.Thread(target=w.run, name=f"fuzz-{w.t}") for w in workers]
        for th in threads:
            th.start()
        last: Any = None
        next_report = 10_000
        while any(th.is_alive() for th in threads):
            time.sleep(0.5)
            assert self.daemon is not None
            alive = self.daemon.proc.poll() is None
            self.check("daemon alive (periodic)", alive, f"exit {self.daemon.proc.returncode}")
            if not alive:
                self.stop.set()
                break
            self.check("health SERVING (periodic)", self.health())
            s = self.stats()
            if s is not None:
                self.check(
                    "Stats: used <= capacity (periodic)",
                    s.host_bytes_used <= s.host_bytes_capacity,
                    f"used {s.host_bytes_used} > {s.host_bytes_capacity}",
                )
                if last is not None:
                    names = ("lookups", "offloaded_blocks", "restored_blocks", "evicted_blocks")
                    bad = [
                        n for n in (*names, "dropped_blocks") if getattr(s, n) < getattr(last, n)
                    ]
                    self.check("Stats counters never decrease (periodic)", not bad, f"{bad}")
                last = s
            if self.sent >= next_report:
                rate = self.sent / max(1e-9, time.monotonic() - t0)
                self.log(f"  {self.sent:,} requests ({rate:,.0f}/s)")
                next_report += 10_000
        for th in threads:
            th.join()
        return time.monotonic() - t0

    def oversized(self) -> None:
        """A request over gRPC's 64 MiB receive limit: refused before kvseal sees it."""
        assert self.scratch is not None
        req = pb.LookupRequest(
            pool_id=self.scratch.pool_id, tenant=self.tenants[0], block_hashes=[bytes(32)]
        )
        big = ser(req) + pw.field(99, pw.LEN, bytes(65 << 20))
        self.call("Lookup", big, "invalid", frozenset({(Code.RESOURCE_EXHAUSTED, "")}), "65MiB")

    # ------------------------------------------------------------ final checks

    def final(self) -> None:
        assert self.daemon is not None and self.scratch is not None
        alive = self.daemon.proc.poll() is None
        self.check("daemon alive at the end", alive, f"exit {self.daemon.proc.returncode}")
        if not alive:
            return
        self.check("health SERVING at the end", self.health())
        s = self.stats()
        if s is None:
            self.check("Stats answers at the end", False)
            return
        self.check("Stats: nothing pending at rest", s.blocks_pending == 0, f"{s.blocks_pending}")
        self.check("Stats: nothing pinned at rest", s.blocks_pinned == 0, f"{s.blocks_pinned}")
        self.check(
            "Stats: no integrity failure", s.integrity_failures == 0, f"{s.integrity_failures}"
        )
        self.check("Stats: no hold left open", s.pool_holds == 0, f"{s.pool_holds}")
        self.check("Stats: only the fuzzer's 5 pools left", s.pools == 5, f"{s.pools} pools")
        ready_before = s.blocks_ready
        # Every reference block the daemon reports READY restores byte-exact.
        found = 0
        for ns_key, t in (("A", self.tracked["A"]), ("C", self.tracked["C"])):
            for ti, chains in enumerate(self.universe[ns_key]):
                tenant = self.tenants[ti]
                ready: list[bytes] = []
                for chain in chains:
                    res = self.call(
                        "Lookup",
                        ser(pb.LookupRequest(pool_id=t.pool_id, tenant=tenant, block_hashes=chain)),
                        "final",
                        frozenset({OK_}),
                    )
                    if res.reply is not None:
                        rep = pb.LookupReply.FromString(res.reply)
                        ready += [
                            h
                            for h, st in zip(chain, rep.states, strict=True)
                            if st == pb.BLOCK_READY
                        ]
                found += len(ready)
                for i in range(0, len(ready), t.num_pages):
                    batch = ready[i : i + t.num_pages]
                    self._verify_restore(t, tenant, batch)
                res = self.call(
                    "Drop",
                    ser(pb.DropRequest(pool_id=t.pool_id, tenant=tenant, all_of_tenant=True)),
                    "final",
                    frozenset({OK_}),
                )
                if res.reply is not None:
                    n = pb.DropReply.FromString(res.reply).dropped_blocks
                    self.check(
                        "drop of a reference tenant removes exactly the blocks lookup reported",
                        n == len(ready),
                        f"ns {ns_key} tenant {ti}: dropped {n}, lookup said {len(ready)} READY",
                    )
        self.check(
            "Stats: blocks_ready covers every READY reference block",
            found <= ready_before,
            f"{found} READY reference blocks, blocks_ready {ready_before}",
        )
        self.reference_found = found
        s = self.stats("final")
        if s is not None:
            slot = self.scratch.block_bytes  # what is left is scratch blocks, 1 KiB slots
            self.check(
                "Stats: host bytes used == blocks_ready x slot size (only scratch left)",
                s.host_bytes_used == s.blocks_ready * slot,
                f"used {s.host_bytes_used}, ready {s.blocks_ready} x {slot}",
            )
            exact = self.lost_replies == 0
            for name, total in sorted(self.totals.items()):
                got = getattr(s, name)
                self.check(
                    f"Stats.{name} == sum over replies" + ("" if exact else " (>=, replies lost)"),
                    got == total if exact else got >= total,
                    f"Stats.{name}={got}, replies summed to {total}",
                )
        log = self.daemon.log()
        for word in ("Traceback", "internal error"):
            self.check(f"daemon log has no {word!r}", word not in log, _excerpt(log, word))
        self.channel.close()
        rc = self.daemon.stop()
        self.check("SIGTERM: daemon exits 0", rc == 0, f"exit status {rc}")

    def _verify_restore(self, t: Tracked, tenant: bytes, hashes: list[bytes]) -> None:
        pages = list(range(len(hashes)))
        for p in pages:
            t.pool.fill_page(p, POISON)
        req = pb.RestoreRequest(
            pool_id=t.pool_id, tenant=tenant, block_hashes=hashes, page_ids=pages, grace_ms=1000
        )
        res = self.call("Restore", ser(req), "final", frozenset({OK_}), "reference")
        if res.code is not OK:
            return
        for h, p in zip(hashes, pages, strict=True):
            self.check(
                "every READY reference block restores byte-exact",
                t.pool.read_block(p) == content(h, t.block_bytes),
                f"pool {t.key} page {p} hash {h.hex()[:16]}",
            )

    # ------------------------------------------------------------ report

    def report(self, elapsed: float) -> tuple[int, int]:
        out = self.log
        rate = self.sent / max(elapsed, 1e-9)
        out(
            f"\nkvseal fuzz: {self.sent:,} requests in {elapsed:.1f} s ({rate:,.0f}/s), "
            f"seed {self.seed}, {self.threads} client threads"
        )
        codes = sorted({c for _, c in self.codes}, key=lambda c: (c != "OK", c))
        short = {c: c.replace("_", " ").title().replace(" ", "")[:12] for c in codes}
        head = f"{'RPC':<15}" + "".join(f"{short[c]:>13}" for c in codes) + f"{'total':>9}"
        out("\n" + head)
        out("-" * len(head))
        for rpc in RPCS:
            row = [self.codes.get((rpc, c), 0) for c in codes]
            if sum(row):
                out(f"{rpc:<15}" + "".join(f"{n:>13,}" for n in row) + f"{sum(row):>9,}")
        col = [sum(self.codes.get((r, c), 0) for r in RPCS) for c in codes]
        out(f"{'all':<15}" + "".join(f"{n:>13,}" for n in col) + f"{sum(col):>9,}")
        out("\n" + f"{'class':<10}{'requests':>10}{'unexpected':>12}")
        for cls in ("valid", "invalid", "mutated", "check", "final"):
            ok, bad = self.classes.get((cls, "ok"), 0), self.classes.get((cls, "unexpected"), 0)
            if ok + bad:
                out(f"{cls:<10}{ok + bad:>10,}{bad:>12,}")
        found = getattr(self, "reference_found", 0)
        out(
            f"\nreference blocks READY at the end and verified: {found}; "
            f"offloaded blocks: {self.totals['offloaded_blocks']:,}, "
            f"restored: {self.totals['restored_blocks']:,}, "
            f"evicted: {self.totals['evicted_blocks']:,}, "
            f"dropped: {self.totals['dropped_blocks']:,}"
        )
        out("\n" + f"{'check':<72}{'result':>7}{'ok':>10}{'failed':>8}")
        for c in self.checks.values():
            verdict = "FAIL" if c.failed else "PASS"
            out(f"{c.name[:72]:<72}{verdict:>7}{c.passed:>10,}{c.failed:>8,}")
            for ex in c.examples:
                out(f"    e.g. {ex}")
        passed = sum(1 for c in self.checks.values() if not c.failed)
        failed = sum(1 for c in self.checks.values() if c.failed)
        # Failures again, last: CI keeps only the tail of a long log, and the
        # table above can be cut off before the failing row.
        for c in self.checks.values():
            if c.failed:
                out(f"FAILED: {c.name} ({c.failed:,} of {c.passed + c.failed:,})")
                for ex in c.examples[:3]:
                    out(f"    e.g. {ex}")
        out(f"\n{passed} passed, {failed} failed")
        return passed, failed


def _excerpt(text: str, word: str) -> str:
    i = text.find(word)
    return "" if i < 0 else text[max(0, i - 200) : i + 400]


class Worker:
    """One client thread: its own seeded generator and its own pages."""

    def __init__(self, fz: Fuzzer, t: int) -> None:
        self.fz = fz
        self.t = t
        self.rnd = random.Random(fz.seed * 1000 + t)
        self.pages = list(range(t * PAGES_PER_THREAD, (t + 1) * PAGES_PER_THREAD))
        # This thread's own pool for pool lifecycles (no other thread writes it).
        self.life = SharedKVPool(KVShape(num_pages=4, **SMALL), "vllm_per_layer", "kvseal-fuzz")
        fz.extra_pools.append(self.life)
        self.k = 0
        self.ops: list[tuple[Callable[[], None], float]] = [
            (self.op_lookup, 12),
            (self.op_touch, 4),
            (self.op_offload, 16),
            (self.op_restore, 14),
            (self.op_drop, 3),
            (self.op_stats, 1.5),
            (self.op_health, 0.5),
            (self.op_watch, 0.6),
            (self.op_lifecycle, 0.25),
            (self.op_invalid, 20),
            (self.op_mutated, 28),
        ]

    def run(self) -> None:
        fns, weights = zip(*self.ops, strict=True)
        n = 0
        try:
            while self.fz.budget_left():
                self.rnd.choices(fns, weights)[0]()
                n += 1
                if n % 40 == 0:
                    self.verify_pages()
            self.verify_pages()
        except Exception as e:  # a fuzzer bug must not pass as a clean run
            self.fz.check("fuzzer threads run to the end", False, f"thread {self.t}: {e!r}")
            raise

    # ------------------------------------------------------------ helpers

    def pick(self) -> tuple[Tracked, bytes, list[bytes]]:
        t = self.rnd.choice(list(self.fz.tracked.values()))
        ti = self.rnd.randrange(TENANTS)
        chain = self.rnd.choice(self.fz.universe[t.ns_key][ti])
        return t, self.fz.tenants[ti], chain

    def segment(self, chain: list[bytes], most: int = 4) -> tuple[int, list[bytes]]:
        n = self.rnd.randint(1, most)
        i = self.rnd.randrange(0, len(chain) - n + 1)
        return i, chain[i : i + n]

    def my_pages(self, n: int) -> list[int]:
        return self.rnd.sample(self.pages, n)

    def verify_pages(self) -> None:
        """No request of any thread wrote this thread's pages behind its back."""
        for t in self.fz.tracked.values():
            for p in self.pages:
                want = self.fz.expect[(t.key, p)]
                if want is not None:
                    self.fz.check(
                        "no page written except by its own successful restore",
                        t.pool.read_block(p) == want,
                        f"pool {t.key} page {p} (thread {self.t})",
                    )

    # ------------------------------------------------------------ valid calls

    def op_lookup(self) -> None:
        t, tenant, chain = self.pick()
        _, hashes = self.segment(chain, len(chain))
        if self.rnd.random() < 0.5:
            hashes = chain[: len(hashes)]
        req = pb.LookupRequest(pool_id=t.pool_id, tenant=tenant, block_hashes=hashes)
        res = self.fz.call("Lookup", ser(req), "valid", frozenset({OK_}))
        if res.reply is not None:
            rep = pb.LookupReply.FromString(res.reply)
            st = list(rep.states)
            h = rep.hit_blocks
            ok = (
                len(st) == len(hashes)
                and all(s == pb.BLOCK_READY for s in st[:h])
                and (h == len(st) or st[h] != pb.BLOCK_READY)
                and all(s in (pb.BLOCK_ABSENT, pb.BLOCK_PENDING, pb.BLOCK_READY) for s in st)
            )
            self.fz.check("Lookup replies are consistent (hit prefix, states)", ok, f"{h} {st}")

    def op_touch(self) -> None:
        t, tenant, chain = self.pick()
        _, hashes = self.segment(chain)
        req = pb.TouchRequest(pool_id=t.pool_id, tenant=tenant, block_hashes=hashes)
        res = self.fz.call("Touch", ser(req), "valid", frozenset({OK_}))
        if res.reply is not None:
            n = pb.TouchReply.FromString(res.reply).touched
            self.fz.check("Touch replies are consistent", n <= len(hashes), f"{n}/{len(hashes)}")

    def op_offload(self) -> None:
        t, tenant, chain = self.pick()
        i, hashes = self.segment(chain)
        pages = self.my_pages(len(hashes))
        for h, p in zip(hashes, pages, strict=True):
            data = content(h, t.block_bytes)
            t.pool.write_block(p, data)
            self.fz.expect[(t.key, p)] = data
        parent = chain[i - 1] if i > 0 and self.rnd.random() < 0.9 else b""
        if self.rnd.random() < 0.1:
            # Chains that lie: a parent from elsewhere in the chain, even a block
            # of this batch or the block itself (no cycle may come of it).
            parent = self.rnd.choice(chain)
        req = pb.OffloadRequest(
            pool_id=t.pool_id,
            tenant=tenant,
            parent_hash=parent,
            block_hashes=hashes,
            page_ids=pages,
            grace_ms=1000,
            budget_us=30_000_000,
        )
        res = self.fz.call("Offload", ser(req), "valid", frozenset({OK_, FULL, DROPPED}))
        if res.reply is not None:
            rep = pb.OffloadReply.FromString(res.reply)
            outs = list(rep.outcomes)
            stored = outs.count(pb.OFFLOAD_STORED)
            self.fz.check(
                "Offload replies are consistent (one outcome per hash, counts)",
                len(outs) == len(hashes)
                and stored == rep.stored_blocks
                and rep.stored_bytes == stored * t.block_bytes,
                f"{outs} stored={rep.stored_blocks} bytes={rep.stored_bytes}",
            )

    def op_restore(self) -> None:
        t, tenant, chain = self.pick()
        if self.rnd.random() < 0.6:
            req = pb.LookupRequest(pool_id=t.pool_id, tenant=tenant, block_hashes=chain)
            res = self.fz.call("Lookup", ser(req), "valid", frozenset({OK_}))
            if res.reply is None:
                return
            hit = pb.LookupReply.FromString(res.reply).hit_blocks
            if hit == 0:
                return
            start = self.rnd.randrange(hit)
            hashes = chain[start : min(hit, start + PAGES_PER_THREAD)]
        else:
            _, hashes = self.segment(chain)
        pages = self.my_pages(len(hashes))
        for p in pages:
            t.pool.fill_page(p, POISON)
        release = self.rnd.random() < 0.3
        req2 = pb.RestoreRequest(
            pool_id=t.pool_id,
            tenant=tenant,
            block_hashes=hashes,
            page_ids=pages,
            release=release,
            grace_ms=1000,
            budget_us=30_000_000,
        )
        res = self.fz.call("Restore", ser(req2), "valid", frozenset({OK_, NO_BLOCK}))
        poison = bytes([POISON]) * t.block_bytes
        for h, p in zip(hashes, pages, strict=True):
            got = t.pool.read_block(p)
            self.fz.expect[(t.key, p)] = got
            want = content(h, t.block_bytes)
            if res.code is OK:
                self.fz.check(
                    "successful restores deliver byte-exact blocks",
                    got == want,
                    f"pool {t.key} page {p} hash {h.hex()[:16]}",
                )
            else:
                self.fz.check(
                    "failed restores leave pages as they were or holding their verified block",
                    got in (poison, want),
                    f"pool {t.key} page {p} after {res.code.name}",
                )
        if res.reply is not None:
            rep = pb.RestoreReply.FromString(res.reply)
            self.fz.check(
                "Restore replies are consistent",
                rep.restored_blocks == len(hashes)
                and rep.restored_bytes == len(hashes) * t.block_bytes,
                f"{rep.restored_blocks}/{len(hashes)}",
            )

    def op_drop(self) -> None:
        t, tenant, chain = self.pick()
        if self.rnd.random() < 0.03:
            req = pb.DropRequest(pool_id=t.pool_id, tenant=tenant, all_of_tenant=True)
        else:
            _, hashes = self.segment(chain, 2)
            req = pb.DropRequest(pool_id=t.pool_id, tenant=tenant, block_hashes=hashes)
        self.fz.call("Drop", ser(req), "valid", frozenset({OK_}))

    def op_stats(self) -> None:
        s = self.fz.stats("valid")
        if s is not None:
            self.fz.check(
                "Stats: used <= capacity",
                s.host_bytes_used <= s.host_bytes_capacity,
                f"{s.host_bytes_used} > {s.host_bytes_capacity}",
            )

    def op_health(self) -> None:
        self.fz.check("health SERVING", self.fz.health("valid"))

    def op_watch(self) -> None:
        t, tenant, _ = self.pick()
        only = tenant if self.rnd.random() < 0.5 else b""
        req = pb.WatchEventsRequest(pool_id=t.pool_id, tenant=only)
        _, msgs = self.fz.stream(
            "WatchEvents",
            ser(req),
            "valid",
            frozenset({(Code.DEADLINE_EXCEEDED, ""), FULL}),
            "brief watch",
            timeout=self.rnd.uniform(0.1, 0.4),
        )
        known = self.fz.known[t.ns_key]
        for seq, raw in enumerate(msgs, 1):
            ev = pb.BlockEvent.FromString(raw)
            ok = (
                ev.sequence == seq
                and ev.namespace == t.namespace
                and (not only or ev.tenant == only)
                and ev.kind in (pb.BLOCK_STORED, pb.BLOCK_REMOVED)
                and len(ev.block_hashes) > 0
                and all((ev.tenant, h) in known for h in ev.block_hashes)
            )
            self.fz.check(
                "WatchEvents: in sequence, in scope, only reference blocks",
                ok,
                f"seq {ev.sequence} (want {seq}) ns {ev.namespace.hex()[:8]} kind {ev.kind}",
            )

    def _register(
        self,
        name: str,
        token: bytes = b"",
        fp: bytes = b"fz-life",
        pool: SharedKVPool | None = None,
    ) -> pb.RegisterPoolRequest:
        pool = pool if pool is not None else self.fz.regpool
        assert pool is not None
        return pb.RegisterPoolRequest(
            name=name,
            model_fingerprint=fp,
            geometry=pool.geometry(),
            backend=pb.BACKEND_CPU,
            owner_token=token,
        )

    def op_lifecycle(self) -> None:
        """A pool's whole life on this thread's own small pool: register, move
        blocks through it, hold it, a competing registration (refused), a
        watcher; then either the owner replaces it (the hold ends OK, the
        watcher ends NOT_FOUND) or the holder leaves while a transfer runs on
        it (the daemon unregisters the pool)."""
        fz = self.fz
        self.k += 1
        name = f"fz-life-{self.t}-{self.k}"
        reg = ser(self._register(name, pool=self.life))
        res = fz.call("RegisterPool", reg, "valid", frozenset({OK_, FULL}))
        if res.reply is None:
            return
        rep = pb.RegisterPoolReply.FromString(res.reply)
        pid = rep.pool_id
        unregister = ser(pb.UnregisterPoolRequest(pool_id=pid))
        self._life_transfer(pid, frozenset({OK_, FULL}))
        call: Any = fz.streams["HoldPool"](ser(pb.HoldPoolRequest(pool_id=pid)), timeout=TIMEOUT)
        try:
            first = next(call)
            fz.check(
                "HoldPool: first reply names the pool",
                pb.HoldPoolReply.FromString(first).pool_id == pid,
            )
        except grpc.RpcError as e:
            fz._record("HoldPool", "valid", fz._error(e), frozenset({FULL}), "hold")
            fz.call("UnregisterPool", unregister, "valid", frozenset({OK_}))
            return
        fz.call("RegisterPool", reg, "valid", frozenset({TAKEN}), "taken")
        lookup = ser(pb.LookupRequest(pool_id=pid, tenant=fz.tenants[0], block_hashes=[bytes(32)]))
        if self.rnd.random() < 0.5:
            watch: Any = fz.streams["WatchEvents"](
                ser(pb.WatchEventsRequest(pool_id=pid)), timeout=TIMEOUT
            )
            token = rep.owner_token
            res2 = fz.call(
                "RegisterPool",
                ser(self._register(name, token, pool=self.life)),
                "valid",
                frozenset({OK_}),
                "owner",
            )
            try:
                extra = list(call)
                hold_res = Result(OK, "", None)
                fz.check("HoldPool: no second reply", not extra)
            except grpc.RpcError as e:
                hold_res = fz._error(e)
            fz._record("HoldPool", "valid", hold_res, frozenset({OK_}), "hold ends when replaced")
            try:
                list(watch)
                watch_res = Result(OK, "", None)
            except grpc.RpcError as e:
                watch_res = fz._error(e)
            fz._record(
                "WatchEvents", "valid", watch_res, frozenset({NO_POOL, FULL}), "pool replaced"
            )
            fz.call("Lookup", lookup, "valid", frozenset({NO_POOL}), "replaced pool")
            if res2.reply is not None:
                rep2 = pb.RegisterPoolReply.FromString(res2.reply)
                fz.check("RegisterPool: the same owner keeps its token", rep2.owner_token == token)
                self._life_transfer(rep2.pool_id, frozenset({OK_, FULL}))
                req = ser(pb.UnregisterPoolRequest(pool_id=rep2.pool_id))
                fz.call("UnregisterPool", req, "valid", frozenset({OK_}))
            return
        # The holder leaves while a transfer runs on the pool.
        racing = threading.Thread(
            target=self._life_transfer, args=(pid, frozenset({OK_, FULL, NO_POOL, NO_BLOCK}))
        )
        racing.start()
        call.cancel()
        fz._record(
            "HoldPool",
            "valid",
            Result(Code.CANCELLED, "", None),
            frozenset({(Code.CANCELLED, "")}),
            "hold",
        )
        racing.join()
        deadline = time.monotonic() + 5
        gone = False
        while time.monotonic() < deadline:
            r = fz.call("Lookup", lookup, "valid", frozenset({OK_, NO_POOL}), "pool after hold")
            if r.code is Code.NOT_FOUND:
                gone = True
                break
            time.sleep(0.02)
        fz.check("HoldPool: the pool is unregistered once its holder leaves", gone, name)

    def _life_transfer(self, pool_id: str, expect: frozenset[tuple[Code, str]]) -> None:
        """Offload two fresh blocks from pages 0-1 of this thread's own pool and
        restore them into pages 2-3."""
        fz, life = self.fz, self.life
        hashes = [self.rnd.randbytes(32) for _ in range(2)]
        for h, p in zip(hashes, (0, 1), strict=True):
            life.write_block(p, content(h, life.shape.block_bytes))
        tenant = fz.tenants[1]
        off = pb.OffloadRequest(
            pool_id=pool_id, tenant=tenant, block_hashes=hashes, page_ids=[0, 1], grace_ms=1000
        )
        res = fz.call("Offload", ser(off), "valid", expect, "new pool")
        if res.code is not OK:
            return
        for p in (2, 3):
            life.fill_page(p, POISON)
        rst = pb.RestoreRequest(
            pool_id=pool_id, tenant=tenant, block_hashes=hashes, page_ids=[2, 3], grace_ms=1000
        )
        res = fz.call("Restore", ser(rst), "valid", expect | {NO_BLOCK}, "new pool")
        poison = bytes([POISON]) * life.shape.block_bytes
        for h, p in zip(hashes, (2, 3), strict=True):
            want, got = content(h, life.shape.block_bytes), life.read_block(p)
            if res.code is OK:
                fz.check("successful restores deliver byte-exact blocks", got == want, "life")
            else:
                fz.check(
                    "failed restores leave pages as they were or holding their verified block",
                    got in (poison, want),
                    "life",
                )

    # ------------------------------------------------------------ invalid calls

    def op_invalid(self) -> None:
        rpc = self.rnd.choices(
            ("Lookup", "Touch", "Offload", "Restore", "Drop", "RegisterPool", "Other"),
            (3, 1, 3, 3, 2, 3, 1),
        )[0]
        if rpc == "RegisterPool":
            self.invalid_register()
        elif rpc == "Other":
            self.invalid_other()
        else:
            self.invalid_block(rpc)

    def _block_request(self, rpc: str, t: Tracked, tenant: bytes, hashes: list[bytes]) -> Any:
        cls = REQUEST_TYPES[rpc]
        msg: Any = cls(pool_id=t.pool_id, tenant=tenant, block_hashes=hashes)
        if rpc in ("Offload", "Restore"):
            msg.page_ids.extend(self.my_pages(len(hashes)))
            msg.grace_ms = 1000
        return msg

    def invalid_block(self, rpc: str) -> None:
        """One defect in an otherwise valid block request, with its exact status."""
        t, tenant, chain = self.pick()
        _, hashes = self.segment(chain)
        msg = self._block_request(rpc, t, tenant, list(hashes))
        kinds = ["pool", "tenant", "empty", "hash_len", "dup_hash", "too_many", "utf8", "cut"]
        kinds += ["unknown_field"]
        if rpc in ("Offload", "Restore"):
            kinds += ["page_count", "page_range", "dup_page", "cuda_event", "grace"]
        if rpc == "Offload":
            kinds += ["parent"]
        if rpc == "Drop":
            kinds += ["both"]
        kind = self.rnd.choice(kinds)
        expect: frozenset[tuple[Code, str]] = frozenset({INVALID})
        raw: bytes | None = None
        if kind == "pool":
            msg.pool_id = self.rnd.choice(
                (
                    "",
                    "nope",
                    t.pool_id + "x",
                    t.pool_id[:-1],
                    "пул#1",
                    t.pool_id + "\n",
                    "x" * self.rnd.choice((200, 100_000)),
                    t.pool_id.upper(),
                    "\x00",
                )
            )
            expect = frozenset({NO_POOL})
        elif kind == "tenant":
            msg.tenant = self.rnd.randbytes(self.rnd.choice((0, 1, 31, 33, 64, 10_000)))
        elif kind == "empty":
            del msg.block_hashes[:]
            if rpc in ("Offload", "Restore"):
                del msg.page_ids[:]
        elif kind == "hash_len":
            msg.block_hashes[self.rnd.randrange(len(msg.block_hashes))] = self.rnd.randbytes(
                self.rnd.choice((0, 1, 31, 33, 1000))
            )
        elif kind == "dup_hash":
            msg.block_hashes.append(msg.block_hashes[0])
            if rpc in ("Offload", "Restore"):
                spare = [p for p in self.pages if p not in msg.page_ids]
                msg.page_ids.append(spare[0])
        elif kind == "too_many":
            n = MAX_BATCH + self.rnd.choice((1, 2, 100, 5000))
            del msg.block_hashes[:]
            msg.block_hashes.extend(self.rnd.randbytes(32) for _ in range(n))
            if rpc in ("Offload", "Restore"):
                del msg.page_ids[:]
                msg.page_ids.extend(range(n))
        elif kind == "utf8":
            # pool_id (field 1) as bytes that are not UTF-8: the body does not parse.
            msg.pool_id = ""
            bad = self.rnd.choice((b"\xff", b"\xc3\x28", b"ok\xed\xa0\x80", b"\xfe\xfe\xff"))
            raw = pw.field(1, pw.LEN, bad) + ser(msg)
        elif kind == "cut":
            data = ser(msg)
            fields = pw.split(data) or []
            cuts: list[int] = []
            pos = 0
            for f in fields:
                enc = f.encode()
                if f.wire == pw.LEN and len(f.body) > 1:
                    cuts.append(pos + len(enc) - self.rnd.randint(1, len(f.body) - 1))
                pos += len(enc)
            raw = data[: self.rnd.choice(cuts)]
        elif kind == "unknown_field":
            raw = ser(msg) + pw.field(self.rnd.choice((20, 999, 2**29 - 1)), pw.LEN, b"extra")
            expect = self._valid_expect(rpc)
            if rpc == "Offload":
                for h, p in zip(msg.block_hashes, msg.page_ids, strict=True):
                    data = content(h, t.block_bytes)
                    t.pool.write_block(p, data)
                    self.fz.expect[(t.key, p)] = data
        elif kind == "page_count":
            if len(msg.page_ids) > 1 and self.rnd.random() < 0.5:
                del msg.page_ids[-1]
            else:
                spare = [p for p in self.pages if p not in msg.page_ids]
                msg.page_ids.append(spare[0])
        elif kind == "page_range":
            msg.page_ids[self.rnd.randrange(len(msg.page_ids))] = self.rnd.choice(
                (t.num_pages, t.num_pages + 1, 2**31, 2**32 - 1)
            )
            expect = frozenset({BAD_PAGE})
        elif kind == "dup_page":
            if len(msg.page_ids) < 2:
                msg.block_hashes.append(self.rnd.randbytes(32))
                msg.page_ids.append(msg.page_ids[0])
            else:
                msg.page_ids[-1] = msg.page_ids[0]
        elif kind == "cuda_event":
            msg.cuda_event_ipc_handle = self.rnd.randbytes(self.rnd.choice((1, 63, 64, 65)))
        elif kind == "grace":
            msg.grace_ms = self.rnd.choice((60_001, 2**31, 2**32 - 1))
        elif kind == "parent":
            msg.parent_hash = self.rnd.randbytes(self.rnd.choice((1, 31, 33, 64)))
        elif kind == "both":
            msg.all_of_tenant = True
        payload = raw if raw is not None else ser(msg)
        res = self.fz.call(rpc, payload, "invalid", expect, kind)
        if rpc == "Restore":
            # If a defective restore were accepted it would have written pages.
            for p in msg.page_ids:
                if (t.key, p) in self.fz.expect and p in self.pages:
                    self.fz.expect[(t.key, p)] = t.pool.read_block(p)
        if res.code is OK and rpc == "RegisterPool":
            self._unregister_reply(res)

    def _valid_expect(self, rpc: str) -> frozenset[tuple[Code, str]]:
        return {
            "Offload": frozenset({OK_, FULL, DROPPED}),
            "Restore": frozenset({OK_, NO_BLOCK}),
        }.get(rpc, frozenset({OK_}))

    def _unregister_reply(self, res: Result) -> None:
        assert res.reply is not None
        pid = pb.RegisterPoolReply.FromString(res.reply).pool_id
        req = ser(pb.UnregisterPoolRequest(pool_id=pid))
        self.fz.call("UnregisterPool", req, "valid", frozenset({OK_, NO_POOL}), "cleanup")

    def invalid_register(self) -> None:
        """One defect in an otherwise valid registration, with its exact status."""
        fz = self.fz
        assert fz.regpool is not None
        self.k += 1
        msg = self._register(f"fz-bad-{self.t}-{self.k}", fp=b"fz-bad")
        g = msg.geometry
        kinds = [
            "name",
            "name_utf8",
            "fingerprint",
            "backend_enum",
            "backend_cuda",
            "cuda_on_cpu",
            "shm_name",
            "shm_missing",
            "buf_big",
            "buf_offset",
            "buf_zero",
            "pages0",
            "pages_over",
            "no_buffers",
            "no_segments",
            "seg_buffer",
            "seg_bytes0",
            "seg_stride",
            "seg_offset",
            "seg_dup",
            "same_object",
            "dtype",
            "layout",
            "token",
            "many_buffers",
        ]
        kind = self.rnd.choice(kinds)
        expect: frozenset[tuple[Code, str]] = frozenset({INVALID})
        raw: bytes | None = None
        if kind == "name":
            msg.name = self.rnd.choice(
                ("", "a" * 129, "bad/name", "x\n", "x\x00y", "-x", " x", "ü", "x y", "a" * 10_000)
            )
        elif kind == "name_utf8":
            msg.name = ""
            raw = pw.field(1, pw.LEN, b"fz\xff\xfe") + ser(msg)
        elif kind == "fingerprint":
            msg.model_fingerprint = self.rnd.randbytes(self.rnd.choice((0, 257, 100_000)))
        elif kind == "backend_enum":
            msg.backend = self.rnd.choice((3, 99, -1, 2**31 - 1))  # type: ignore[assignment]
        elif kind == "backend_cuda":
            msg.backend = pb.BACKEND_CUDA
            for b in g.buffers:
                b.cuda_ipc_handle = self.rnd.randbytes(64)
            expect = frozenset({MISMATCH})
        elif kind == "cuda_on_cpu":
            g.buffers[0].cuda_ipc_handle = self.rnd.randbytes(64)
        elif kind == "shm_name":
            g.buffers[0].shm_name = self.rnd.choice(
                ("", "../etc", "a/b", ".hidden", "x\n", "x\x00", "a" * 252, "/leading")
            )
        elif kind == "shm_missing":
            g.buffers[0].shm_name = f"kvseal-fuzz-missing-{self.rnd.getrandbits(32):x}"
            expect = frozenset({UNUSABLE})
        elif kind == "buf_big":
            g.buffers[0].size += self.rnd.choice((1, 4096, 2**40))
            expect = frozenset({UNUSABLE})
        elif kind == "buf_offset":
            g.buffers[0].offset = self.rnd.choice((1, 4096, 2**40, 2**63, 2**64 - 1))
            expect = frozenset({UNUSABLE})
        elif kind == "buf_zero":
            g.buffers[0].size = 0
        elif kind == "pages0":
            g.num_pages = 0
        elif kind == "pages_over":
            g.num_pages = self.rnd.choice((g.num_pages + 1, 2**31 - 1, 2**32 - 1))
        elif kind == "no_buffers":
            del g.buffers[:]
        elif kind == "no_segments":
            del g.segments[:]
        elif kind == "seg_buffer":
            g.segments[0].buffer = self.rnd.choice((len(g.buffers), 2**32 - 1))
        elif kind == "seg_bytes0":
            g.segments[0].bytes = 0
        elif kind == "seg_stride":
            g.segments[0].page_stride = g.segments[0].bytes - 1
        elif kind == "seg_offset":
            g.segments[0].offset = self.rnd.choice((1, 2**40, 2**64 - 1))
        elif kind == "seg_dup":
            g.segments.append(g.segments[0])
        elif kind == "same_object":
            g.buffers.append(g.buffers[0])
            s = g.segments.add()
            s.CopyFrom(g.segments[0])
            s.buffer = len(g.buffers) - 1
        elif kind == "dtype":
            g.dtype = self.rnd.choice(("", "x" * 65, "bf\x01", "bf16\n", "é"))
        elif kind == "layout":
            g.layout = self.rnd.choice(("x" * 65, "l\x7f", "l\n"))
        elif kind == "token":
            msg.owner_token = self.rnd.randbytes(self.rnd.choice((65, 1000)))
        elif kind == "many_buffers":
            del g.buffers[:]
            g.buffers.extend(pb.BufferHandle(shm_name=f"b{i}", size=1) for i in range(4097))
        payload = raw if raw is not None else ser(msg)
        res = fz.call("RegisterPool", payload, "invalid", expect, kind)
        if res.code is OK:
            self._unregister_reply(res)

    def invalid_other(self) -> None:
        fz = self.fz
        t, tenant, _ = self.pick()
        kind = self.rnd.choice(
            (
                "unregister",
                "unregister_utf8",
                "hold",
                "hold_utf8",
                "watch_nopool",
                "watch_tenant",
                "watch_unknown",
                "stats_cut",
            )
        )
        fake = f"fz-gone#{self.rnd.getrandbits(48):012x}"
        if kind == "unregister":
            fz.call(
                "UnregisterPool",
                ser(pb.UnregisterPoolRequest(pool_id=fake)),
                "invalid",
                frozenset({NO_POOL}),
                kind,
            )
        elif kind == "unregister_utf8":
            fz.call(
                "UnregisterPool",
                pw.field(1, pw.LEN, b"\xff" + fake.encode()),
                "invalid",
                frozenset({INVALID}),
                kind,
            )
        elif kind in ("hold", "hold_utf8"):
            payload = (
                ser(pb.HoldPoolRequest(pool_id=fake))
                if kind == "hold"
                else pw.field(1, pw.LEN, fake.encode() + b"\xc3\x28")
            )
            want = NO_POOL if kind == "hold" else INVALID
            fz.stream("HoldPool", payload, "invalid", frozenset({want}), kind, timeout=TIMEOUT)
        elif kind == "watch_nopool":
            fz.stream(
                "WatchEvents",
                ser(pb.WatchEventsRequest(tenant=tenant)),
                "invalid",
                frozenset({INVALID}),
                kind,
                timeout=TIMEOUT,
            )
        elif kind == "watch_tenant":
            req = pb.WatchEventsRequest(
                pool_id=t.pool_id, tenant=self.rnd.randbytes(self.rnd.choice((1, 31, 33, 1000)))
            )
            fz.stream(
                "WatchEvents", ser(req), "invalid", frozenset({INVALID}), kind, timeout=TIMEOUT
            )
        elif kind == "watch_unknown":
            fz.stream(
                "WatchEvents",
                ser(pb.WatchEventsRequest(pool_id=fake)),
                "invalid",
                frozenset({NO_POOL}),
                kind,
                timeout=TIMEOUT,
            )
        else:
            fz.call(
                "Stats", pw.field(1, pw.LEN, b"abc")[:-1], "invalid", frozenset({INVALID}), kind
            )

    # ------------------------------------------------------------ mutated calls

    def op_mutated(self) -> None:
        """A valid message mutated at the wire level. Whether it parses (the
        same protobuf parser as the daemon's) decides the status owed."""
        fz = self.fz
        rpc = self.rnd.choices(
            (
                "Lookup",
                "Touch",
                "Offload",
                "Restore",
                "Drop",
                "RegisterPool",
                "UnregisterPool",
                "HoldPool",
                "WatchEvents",
                "Stats",
            ),
            (3, 1, 4, 4, 2, 3, 1, 1, 1, 1),
        )[0]
        base = self._mutation_base(rpc)
        for _ in range(10):
            data, names = pw.mutate(self.rnd, base)
            if len(data) > 4 << 20:
                continue
            try:
                parsed: Any = REQUEST_TYPES[rpc].FromString(data)
            except DecodeError:
                parsed = None
            if parsed is not None and not self._safe(rpc, parsed):
                continue
            break
        else:
            return
        label = "+".join(names)
        expect: Expect = frozenset({INVALID}) if parsed is None else None
        if rpc in STREAMS:
            # A body that parses may open a live stream: read briefly. One that
            # does not must be refused, so wait for the refusal (a loaded
            # machine can take longer than a brief read).
            wait = 0.3 if parsed is not None else TIMEOUT
            fz.stream(rpc, data, "mutated", expect, label, timeout=wait, max_msgs=1)
            return
        res = fz.call(rpc, data, "mutated", expect, label)
        if res.code is OK and rpc == "RegisterPool":
            self._unregister_reply(res)

    def _safe(self, rpc: str, msg: Any) -> bool:
        """Whether a mutated message that parses may be sent: it must not move
        bytes in a reference pool, unregister or hold (and so, on cancel,
        unregister) a pool of the fuzzer's, or replace one by name."""
        fz = self.fz
        assert fz.scratch is not None
        if rpc in ("Offload", "Restore"):
            return msg.pool_id not in fz.protected_ids or msg.pool_id == fz.scratch.pool_id
        if rpc in ("UnregisterPool", "HoldPool"):
            return msg.pool_id not in fz.protected_ids and not msg.pool_id.startswith("fz-life")
        if rpc == "RegisterPool":
            return msg.name not in fz.protected_names and not msg.name.startswith("fz-life")
        return True

    def _mutation_base(self, rpc: str) -> bytes:
        fz = self.fz
        assert fz.scratch is not None
        rnd = self.rnd
        if rpc in ("Offload", "Restore"):
            n = rnd.randint(1, 4)
            msg: Any = REQUEST_TYPES[rpc](
                pool_id=fz.scratch.pool_id,
                tenant=rnd.choice(fz.scratch_tenants),
                block_hashes=rnd.sample(fz.scratch_hashes, n),
                page_ids=rnd.sample(range(fz.scratch.num_pages), n),
                grace_ms=1000,
                budget_us=30_000_000,
            )
            if rpc == "Restore":
                msg.release = rnd.random() < 0.3
            elif rnd.random() < 0.5:
                msg.parent_hash = rnd.choice(fz.scratch_hashes)
            return ser(msg)
        if rpc in ("Lookup", "Touch", "Drop"):
            if rnd.random() < 0.5:
                pid, tenant = fz.scratch.pool_id, rnd.choice(fz.scratch_tenants)
                hashes = rnd.sample(fz.scratch_hashes, rnd.randint(1, 6))
            else:
                t, tenant, chain = self.pick()
                pid, hashes = t.pool_id, self.segment(chain)[1]
            return ser(REQUEST_TYPES[rpc](pool_id=pid, tenant=tenant, block_hashes=hashes))
        if rpc == "RegisterPool":
            self.k += 1
            return ser(self._register(f"fz-mutated-{self.t}-{self.k}", fp=b"fz-mut"))
        if rpc in ("UnregisterPool", "HoldPool"):
            fake = f"fz-gone#{rnd.getrandbits(48):012x}"
            return ser(REQUEST_TYPES[rpc](pool_id=fake))
        if rpc == "WatchEvents":
            t, tenant, _ = self.pick()
            return ser(pb.WatchEventsRequest(pool_id=t.pool_id, tenant=tenant))
        return b""


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.suites.fuzz", description=__doc__)
    ap.add_argument("--requests", type=int, default=int(os.environ.get("FUZZ_N", "100000")))
    ap.add_argument("--seed", type=int, default=int(os.environ.get("FUZZ_SEED", "1")))
    ap.add_argument("--threads", type=int, default=int(os.environ.get("FUZZ_THREADS", "4")))
    ap.add_argument("--keep", action="store_true", help="keep the work directory (daemon log)")
    args = ap.parse_args(list(argv) if argv is not None else None)
    passed, failed = run_fuzz(args.requests, args.seed, args.threads, keep=args.keep)
    return 1 if failed or not passed else 0


def run_fuzz(
    requests: int,
    seed: int,
    threads: int = 4,
    *,
    workdir: Path | None = None,
    keep: bool = False,
    log: Callable[[str], None] = print,
) -> tuple[int, int]:
    """Run the whole fuzz suite; returns (checks passed, checks failed)."""
    own = workdir is None
    wd = Path(tempfile.mkdtemp(prefix="kvseal-fuzz-")) if workdir is None else workdir
    log(f"kvseal fuzz: {requests:,} requests, seed {seed}, {threads} threads, work dir {wd}")
    fz = Fuzzer(wd, requests, seed, threads, log)
    elapsed = 0.0
    try:
        fz.setup()
        elapsed = fz.run()
        fz.final()
    except Exception as e:
        fz.check("fuzzer runs to the end", False, repr(e))
        if fz.daemon is not None:
            log(fz.daemon.log()[-4000:])
    finally:
        fz.close()
    result = fz.report(elapsed)
    if own and not keep and not result[1]:
        shutil.rmtree(wd, ignore_errors=True)
    return result


if __name__ == "__main__":
    sys.exit(main())
