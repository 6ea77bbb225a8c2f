"""Concurrency under load against a real daemon: several engine threads
offload, look up, restore (write-through and write-back), touch and drop
overlapping chains in a tier small enough to evict constantly. Bounded in
count and time. Every restore that succeeds must deliver exactly the bytes
that were offloaded under that hash; everything else must be a documented
miss; and the daemon must end consistent (nothing pinned or pending)."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable

import grpc
from kvseal.client import KVSealRpcError, tenant_digest
from kvseal.client.shm import SharedKVPool

from .conftest import DaemonProc

FP = b"model:stress"
THREADS = 4
OPS = 80
PAGES_PER_THREAD = 6


def test_concurrent_engines_never_get_wrong_bytes(
    daemon_factory: Callable[..., DaemonProc], pool_factory: Callable[..., SharedKVPool]
) -> None:
    geometry = {"tokens_per_page": 16, "num_layers": 2, "num_kv_heads": 8, "head_dim": 64}
    pool = pool_factory(num_pages=THREADS * PAGES_PER_THREAD, geometry=geometry)
    block = pool.shape.block_bytes
    assert block == 64 * 1024
    d = daemon_factory("--workers", "2", host_bytes="1MiB")  # 16 slots for 2 tenants x 20 hashes
    tenants = [tenant_digest(f"t{i % 2}") for i in range(THREADS)]  # two tenants share hashes
    # A universe of hashes with fixed contents: a hash always means the same bytes.
    universe = [os.urandom(32) for _ in range(20)]
    content = {h: os.urandom(block) for h in universe}
    errors: list[str] = []
    ok_restores = [0]
    lock = threading.Lock()

    with d.client(transfer_timeout_s=30.0) as c:
        pool_id = c.register_pool("engine", FP, pool.geometry()).pool_id

        def worker(t: int) -> None:
            rnd = random.Random(t)
            pages = list(range(t * PAGES_PER_THREAD, (t + 1) * PAGES_PER_THREAD))
            tenant = tenants[t]
            for _ in range(OPS):
                n = rnd.randint(1, 4)
                start = rnd.randrange(0, len(universe) - n)
                chain = universe[start : start + n]
                dst = pages[:n]
                op = rnd.choice(
                    ["offload", "offload", "restore", "restore_release", "lookup", "drop"]
                )
                try:
                    if op == "offload":
                        for h, p in zip(chain, dst, strict=True):
                            pool.write_block(p, content[h])
                        c.offload(pool_id, tenant, chain, dst)
                    elif op.startswith("restore"):
                        hit = c.lookup(pool_id, tenant, chain).hit_blocks
                        if hit == 0:
                            continue
                        for p in dst[:hit]:
                            pool.fill_page(p, 0xA5)
                        c.restore(
                            pool_id, tenant, chain[:hit], dst[:hit], release=op.endswith("release")
                        )
                        for h, p in zip(chain[:hit], dst[:hit], strict=True):
                            if pool.read_block(p) != content[h]:
                                with lock:
                                    errors.append(f"thread {t}: wrong bytes for {h.hex()[:8]}")
                        with lock:
                            ok_restores[0] += 1
                    elif op == "lookup":
                        c.lookup(pool_id, tenant, chain)
                    else:
                        c.drop(pool_id, tenant, chain[:1])
                except KVSealRpcError as e:
                    # Another thread evicted, released or dropped the block between
                    # lookup and restore, or the tier was momentarily all pinned.
                    if (e.code, e.reason) not in (
                        (grpc.StatusCode.NOT_FOUND, "BLOCK_NOT_PRESENT"),
                        (grpc.StatusCode.RESOURCE_EXHAUSTED, "CAPACITY_EXHAUSTED"),
                    ):
                        with lock:
                            errors.append(f"thread {t}: {op}: {e}")

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not any(th.is_alive() for th in threads)
        assert not errors, errors[:5]
        assert ok_restores[0] > 0
        st = c.stats()
        assert st.blocks_pinned == 0 and st.blocks_pending == 0
        assert st.integrity_failures == 0
        assert st.evicted_blocks > 0  # the tier really was under pressure
        assert st.host_bytes_used <= st.host_bytes_capacity
        assert c.health() == "SERVING"
