"""Scheduler-side lookup cost: kvseal's manager next to vLLM's own
CPUOffloadingManager, in the same process, on the calling thread (where vLLM's
scheduler calls ``lookup``, once per block), plus one gRPC Lookup round trip per
block for scale. Real daemon, real blocks (stored through the real worker).

    make bench-vllm [ARGS="--blocks 4096 --rounds 5"]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

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
        d = Daemon(Path(tmp) / "d", host_bytes=f"{max(64, n * 8 // 1024)}MiB").start()
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
            w.shutdown()
        finally:
            d.stop()


if __name__ == "__main__":
    main()
