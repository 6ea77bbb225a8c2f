"""Scheduler-side lookup cost: kvseal's manager next to vLLM's own
CPUOffloadingManager, in the same process, on the calling thread (where vLLM's
scheduler calls ``lookup``, once per block), plus one gRPC Lookup round trip per
block for scale. Real daemon, real blocks (stored through the real worker).

Then the same with many tenants (per-user ``cache_salt``; ``--tenants``, one
row per count): each tenant a request of its own with ``--tenant-blocks``
blocks stored (one Offload each), its lookups timed (hit and miss, per block),
and the memory the manager and its mirror allocated (tracemalloc, allocations
made by kvseal.vllm's code only) with the tenants active, then once they went
idle (their blocks dropped from the daemon, their requests finished, the
mirror's idle sweep run).

Then the scheduler's wait on the manager lock during a resync (``--resync-blocks``
tracked, 2^19 by default: the tier events' bound), with KV events on and a
daemon with a store tier: a thread takes the manager's lock as vLLM 0.33's
scheduler does (a step's region, draining the events inside it) and records
its longest wait while the mirror's thread applies, as it does for the
daemon's stream, a gap (the tier events' reset) and then one removal event
naming half the tracked blocks (a Drop of a tenant: the mirror's own apply,
the manager's and the tier events'). The blocks reach the mirror as stream
events, through the mirror's own code.

    make bench-vllm [ARGS="--blocks 4096 --rounds 5 --tenants 1,100,10000 --resync-blocks 524288"]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tenants", default="1,100,10000", help="tenant counts, one row each")
    ap.add_argument("--tenant-blocks", type=int, default=1, help="blocks stored per tenant")
    ap.add_argument("--resync-blocks", type=int, default=1 << 19, help="0: no resync row")
    args = ap.parse_args()
    counts = [int(x) for x in args.tenants.split(",") if x]

    from kvseal.client import ClientConfig, KVSealClient, tenant_digest
    from kvseal.vllm import keys
    from kvseal.vllm.spec import (
        KVSealLoadStoreSpec,
        KVSealOffloadingManager,
        KVSealOffloadingSpec,
        KVSealOffloadingWorker,
    )
    from vllm.v1.kv_offload.base import (
        GPULoadStoreSpec,
        LookupResult,
        OffloadKey,
        ReqContext,
    )
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from tests_vllm.daemon import Daemon
    from tests_vllm.helpers import offloading_config, shm_kv_caches, wait_for

    n = args.blocks
    with tempfile.TemporaryDirectory() as tmp:
        most = max(counts, default=0) * args.tenant_blocks * 2  # hits, and misses never stored
        d = Daemon(Path(tmp) / "d", host_bytes=f"{max(64, (n + most) * 8 // 1024)}MiB").start()
        try:
            socks = [d.target]
            spec = KVSealOffloadingSpec(offloading_config(socks, 0, events=False))
            mgr = spec.get_manager()
            assert isinstance(mgr, KVSealOffloadingManager)
            _buf, kv = shm_kv_caches(64)
            w = spec.get_worker(kv)
            assert isinstance(w, KVSealOffloadingWorker)
            hashes = [i.to_bytes(4, "big") * 8 for i in range(n)]
            okeys = [OffloadKey(keys.make_offload_key(h, 0)) for h in hashes]
            tenant = tenant_digest(None)
            # The mirror hears of a tenant's blocks once the daemon has that tenant
            # named on the mirror's pool (a request's first lookup does it): name
            # it before the stores, as an engine's first request does.
            ctx = ReqContext(req_id="bench")
            mgr.on_new_request(ctx)
            m = mgr.mirrors[0]
            if not wait_for(lambda: m.synced.is_set() and tenant in m.named, 60):
                raise SystemExit("the mirror never subscribed")
            job = 0
            for i in range(0, n, 63):  # pages 1..63, reused: the daemon copies them
                hs = hashes[i : i + 63]
                job += 1
                gpu = GPULoadStoreSpec(list(range(1, len(hs) + 1)), [len(hs)], [0])
                w.submit_store(job, gpu, KVSealLoadStoreSpec(tenant, hs))
            w.wait(set(range(1, job + 1)))
            if not wait_for(lambda: mgr.lookup(okeys[-1], ctx) is LookupResult.HIT, 60):
                raise SystemExit("the mirror did not see the stored blocks")

            vm = CPUOffloadingManager(num_chunks=n)
            vctx = ReqContext(req_id="bench")
            vm.on_new_request(vctx)
            out = vm.prepare_store(okeys, vctx)
            assert out is not None
            vm.complete_store(okeys, vctx)

            def bench(fn: object, keys_: list[OffloadKey], c: ReqContext) -> float:
                best = float("inf")
                for _ in range(args.rounds):
                    t0 = time.perf_counter()
                    for k in keys_:
                        fn(k, c)  # type: ignore[operator]
                    best = min(best, time.perf_counter() - t0)
                return best / len(keys_)

            miss = [
                OffloadKey(keys.make_offload_key(b"\xff" * 28 + i.to_bytes(4, "big"), 0))
                for i in range(n)
            ]
            rows = [
                ("kvseal manager, hits", bench(mgr.lookup, okeys, ctx)),
                ("kvseal manager, misses", bench(mgr.lookup, miss, ctx)),
                ("vLLM CPUOffloadingManager, hits", bench(vm.lookup, okeys, vctx)),
                ("vLLM CPUOffloadingManager, misses", bench(vm.lookup, miss, vctx)),
            ]
            assert all(mgr.lookup(k, ctx) is LookupResult.HIT for k in okeys)
            assert all(vm.lookup(k, vctx) is LookupResult.HIT for k in okeys)
            # One gRPC Lookup per block (what lookup would cost without the mirror).
            pool_id = mgr.mirrors[0].pool_id
            assert pool_id is not None
            with KVSealClient(ClientConfig(target=d.target)) as c:
                m = min(n, 500)
                t0 = time.perf_counter()
                for h in hashes[:m]:
                    c.lookup(pool_id, tenant, [h])
                rows.append(("gRPC Lookup RPC, 1 block per call", (time.perf_counter() - t0) / m))
            print(f"lookup cost on the calling thread, {n} blocks, best of {args.rounds} rounds")
            for name, s in rows:
                print(f"  {name:38s} {s * 1e6:9.2f} us/block  {1 / s:12,.0f} lookups/s")
            mgr.shutdown()
            print(
                f"many tenants ({args.tenant_blocks} block(s) each), lookup on the calling"
                f" thread (best of {args.rounds}); manager memory: tracemalloc of kvseal.vllm"
            )
            for t in counts:
                try:
                    r = tenants_row(spec, w, d.target, t, args.tenant_blocks, args.rounds)
                except SystemExit:
                    print(d.log(), d.proc.poll() if d.proc else None, file=sys.stderr)
                    raise
                print(
                    f"  tenants {t:6d}: hit {r['hit'] * 1e6:6.2f} us/block, miss"
                    f" {r['miss'] * 1e6:6.2f} us/block; manager memory active"
                    f" {r['active'] / 1024:9.1f} KiB, idle {r['idle'] / 1024:9.1f} KiB"
                    f" ({r['tenants_active']} -> {r['tenants_idle']} tenants remembered,"
                    f" {r['blocks']} blocks)"
                )
            w.shutdown()
        finally:
            d.stop()
        if args.resync_blocks:
            resync_rows(Path(tmp), args.resync_blocks)


def tenants_row(spec: Any, w: Any, target: str, t: int, per: int, rounds: int) -> dict[str, Any]:
    """One ``--tenants`` row (module doc), on a fresh manager: a first wave of
    ``t`` tenants is timed, then goes idle; a second wave of ``t`` new tenants
    runs under tracemalloc (so its figures are what the manager holds for ``t``
    tenants after ``t`` others came and went): memory with them active, then
    what is left once they went idle too."""
    from kvseal.client import ClientConfig, KVSealClient, tenant_digest
    from kvseal.vllm import keys
    from kvseal.vllm.spec import KVSealLoadStoreSpec, KVSealOffloadingManager, note_request_salt
    from vllm.v1.kv_offload.base import GPULoadStoreSpec, LookupResult, OffloadKey, ReqContext

    from tests_vllm.helpers import wait_for

    mgr = KVSealOffloadingManager(spec)  # a fresh one (the spec keeps its first)
    m = mgr.mirrors[0]
    if not wait_for(m.synced.is_set, 60):
        raise SystemExit("the mirror never subscribed")
    here = str(Path(keys.__file__).parent / "*")
    job = [10_000_000 * (1 + t)]

    def traced_bytes() -> int:
        snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, here)])
        return sum(st.size for st in snap.statistics("filename"))

    def wave(name: str) -> tuple[list[Any], list[Any], list[Any]]:
        """Each tenant's request stores its blocks as vLLM drives a job."""
        ctxs, hit, miss = [], [], []
        for i in range(t):
            salt = f"{name}-{t}-{i}"
            ctx = ReqContext(req_id=salt)
            note_request_salt(salt, salt)
            mgr.on_new_request(ctx)
            tag = (hash(name) & 0xFFFF).to_bytes(2, "big") + t.to_bytes(2, "big")
            hs = [(i * per + j).to_bytes(4, "big") * 7 + tag for j in range(per)]
            ks = [OffloadKey(keys.make_offload_key(h, 0)) for h in hs]
            out = mgr.prepare_store(ks, ctx)
            assert out is not None and isinstance(out.store_spec, KVSealLoadStoreSpec)
            job[0] += 1
            w.submit_store(job[0], GPULoadStoreSpec(list(range(1, per + 1)), [per], [0]),
                           out.store_spec)  # fmt: skip
            w.wait({job[0]})
            w.get_finished()
            mgr.complete_store(out.keys_to_store, ctx)  # as vLLM reports the job
            ctxs.append(ctx)
            hit += [(k, ctx) for k in ks]
            miss += [(OffloadKey(keys.make_offload_key(b"\xee" * 28 + h[-4:], 0)), ctx) for h in hs]
        if not wait_for(lambda: all(mgr.lookup(k, c) is LookupResult.HIT for k, c in hit), 120):
            raise SystemExit("stored blocks are not hits")
        if not wait_for(lambda: not m._unverified, 120):
            raise SystemExit("the mirror did not verify the stores")
        return ctxs, hit, miss

    def idle(name: str, ctxs: list[Any]) -> None:
        """Requests finished, blocks dropped from the daemon, the idle sweep run."""
        for c in ctxs:
            mgr.on_request_finished(c)
        pool_id = w.kv.pool.handle.pool_id
        with KVSealClient(ClientConfig(target=target)) as cl:
            for i in range(t):
                cl.drop(pool_id, tenant_digest(f"{name}-{t}-{i}"), all_of_tenant=True)
        m.tenant_idle_s = 0.0
        if not wait_for(lambda: m.blocks() == 0 and m.tenants() == 0, 120):
            raise SystemExit("the idle tenants were not forgotten")
        m.tenant_idle_s = 3600.0

    def bench(pairs: list[Any]) -> float:
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            for k, c in pairs:
                mgr.lookup(k, c)
            best = min(best, time.perf_counter() - t0)
        return best / len(pairs)

    m.tenant_idle_s = 3600.0
    ctxs, hit, miss = wave("a")
    row: dict[str, Any] = {"hit": bench(hit), "miss": bench(miss), "blocks": len(hit)}
    idle("a", ctxs)
    tracemalloc.start()
    ctxs, hit, miss = wave("b")
    row["active"] = traced_bytes()
    row["tenants_active"] = m.tenants()
    del hit, miss
    idle("b", ctxs)
    del ctxs
    row["idle"] = traced_bytes()
    row["tenants_idle"] = m.tenants()
    tracemalloc.stop()
    mgr.shutdown()
    return row


def resync_rows(tmp: Path, n: int) -> None:
    """The resync rows (module doc), on a daemon of their own with a store tier."""
    from kvseal.client import tenant_digest
    from kvseal.v1 import kvseal_pb2 as pb
    from kvseal.vllm.spec import KVSealOffloadingManager, KVSealOffloadingSpec

    from tests_vllm.daemon import Daemon
    from tests_vllm.helpers import offloading_config, wait_for

    key = tmp / "store-key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    d = Daemon(
        tmp / "store-d",
        extra=(
            "--store-dir", str(tmp / "store"), "--store-key", f"file:{key}",
            "--store-bytes", "64MiB", "--store-max-block-bytes", "1MiB",
        ),
    ).start()  # fmt: skip
    try:
        mgr = KVSealOffloadingSpec(offloading_config([d.target], 0, events=True)).get_manager()
        assert isinstance(mgr, KVSealOffloadingManager)
        m = mgr.mirrors[0]
        if not wait_for(lambda: m.synced.is_set() and bool(m.store_policy), 60):
            raise SystemExit("the mirror never subscribed to a daemon with a store")
        tenant = tenant_digest(None)
        hs = [i.to_bytes(4, "big") * 8 for i in range(n)]

        def ev(kind: int, hashes: list[bytes]) -> pb.BlockEvent:
            return pb.BlockEvent(
                kind=kind, medium="storage", locality="local", tenant=tenant, block_hashes=hashes
            )

        def settle() -> None:
            tiers = getattr(mgr, "_tiers", None) or getattr(mgr.groups[0], "tiers", None)
            wait = getattr(tiers, "wait_idle", None)
            if wait is not None and not wait(600):
                raise SystemExit("the tier events never drained")
            list(mgr.take_events())

        for i in range(0, n, 4096):  # the daemon's announcements, through the mirror
            m._set(tenant, hs[i : i + 4096], True, ev(pb.BLOCK_STORED, hs[i : i + 4096]))
            list(mgr.take_events())
        settle()

        def worst_wait(work: Any) -> tuple[float, float, int]:
            """The scheduler's longest wait for the lock while ``work`` runs on
            the mirror's side, how long the work took (until the tier events'
            queue drained) and how many times the scheduler took the lock."""
            stop = threading.Event()
            worst = [0.0]
            steps = [0]

            def scheduler() -> None:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    with mgr.lock:
                        worst[0] = max(worst[0], time.perf_counter() - t0)
                        steps[0] += 1
                        list(mgr.take_events())  # inside the region, as vLLM 0.33 does
                    time.sleep(0.001)

            t = threading.Thread(target=scheduler, daemon=True)
            t.start()
            time.sleep(0.05)
            t0 = time.perf_counter()
            work()
            settle()
            took = time.perf_counter() - t0
            stop.set()
            t.join(10)
            return worst[0], took, steps[0]

        def gap() -> None:
            with m._update_lock:  # the mirror's resync (a stream gap)
                m._on_tier(m.rank, None)

        half = hs[n // 2 :]
        gap_wait, gap_took, gap_steps = worst_wait(gap)
        for i in range(0, n, 4096):  # announced again after the gap
            m._set(tenant, hs[i : i + 4096], True, ev(pb.BLOCK_STORED, hs[i : i + 4096]))
        settle()
        rm_wait, rm_took, rm_steps = worst_wait(
            lambda: m._set(tenant, half, False, ev(pb.BLOCK_REMOVED, half))
        )
        print(f"scheduler's wait for the manager lock during a resync, {n} blocks tracked")
        print(
            f"  a gap (tier events reset)              worst wait {gap_wait * 1e3:9.1f} ms"
            f"  (its work: {gap_took:6.2f} s; {gap_steps} lock takes)"
        )
        print(
            f"  one removal event of {len(half):7d} blocks   worst wait {rm_wait * 1e3:9.1f} ms"
            f"  (its work: {rm_took:6.2f} s; {rm_steps} lock takes)"
        )
        mgr.shutdown()
    finally:
        d.stop()


if __name__ == "__main__":
    main()
