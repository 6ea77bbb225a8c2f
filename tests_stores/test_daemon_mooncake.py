"""``kvseal-server --store mooncake://...`` end to end: real daemon processes
sharing a real Mooncake Store master (netns.sh's private network namespace),
a real engine-side pool. What the daemon stores is announced as medium
``"storage"`` with locality ``remote`` by default (llm-d's router scores a
shared tier so); a replica reads it; tampered objects are never written into
the pool; a master that goes down costs misses, and the daemon finds a new
one by itself.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path

import pytest
from kvseal.client import KVSealRpcError, tenant_digest
from kvseal.client.shm import SharedKVPool
from kvseal.v1 import kvseal_pb2 as pb

from tests.conftest import (  # noqa: F401 - fixtures
    DaemonProc,
    daemon_factory,
    fill_random,
    is_poisoned,
    poison,
    pool_factory,
    until,
)
from tests.store_helpers import FP, MAX_BLOCK, STORE_BYTES, chain, key_file
from tests.test_store_tiers import _blocks, _watching

from .conftest import MooncakeHost, new_master

Factory = Callable[..., DaemonProc]


def test_a_daemon_on_mooncake_announces_remote_storage_and_survives_the_master(
    tmp_path: Path,
    daemon_factory: Factory,  # noqa: F811
    pool_factory: Callable[..., SharedKVPool],  # noqa: F811
) -> None:
    master = new_master(tmp_path, 50081)
    master.start()
    try:
        prefix = f"d-{secrets.token_hex(6)}/"
        key = f"file:{key_file(tmp_path / 'key')}"
        common = ("--store-bytes", STORE_BYTES, "--store-max-block-bytes", MAX_BLOCK)
        common += ("--store-key", key)
        pool = pool_factory(num_pages=8)
        data = fill_random(pool)
        tenant = tenant_digest("user-a")
        hashes = chain(4, pool.shape.tokens_per_page, b"user-a")
        # A holds the memory (its segment); B, a replica, mounts none.
        a = daemon_factory("--store", master.url(prefix, timeout="1", backoff="1"), *common)
        b = daemon_factory(
            "--store", master.url(prefix, segment="0", timeout="1", backoff="1"), *common,
            "--on-integrity-failure", "drop",
        )  # fmt: skip
        host = MooncakeHost(master, prefix)
        try:
            with a.client() as c:
                h = c.register_pool("engine", FP, pool.geometry())
                c.lookup(h.pool_id, tenant, hashes[:1])  # names the tenant for the watcher
                with _watching(c, h.pool_id) as take:
                    assert c.offload(h.pool_id, tenant, hashes, [0, 1, 2, 3]).stored_blocks == 4
                    ev = take(lambda e: len(_blocks(e, "storage", pb.BLOCK_STORED)) == 4)
                assert _blocks(ev, "storage", pb.BLOCK_STORED, locality="remote") == set(hashes)
                assert not _blocks(ev, "storage", pb.BLOCK_STORED, locality="local")
                assert c.stats(h.pool_id).store_locality == "remote"
            objects = [k for k in master.held_keys() if len(k) == len(prefix) + 64]
            assert len(objects) == 4

            with b.client() as c:
                h = c.register_pool("engine", FP, pool.geometry())
                assert c.lookup(h.pool_id, tenant, hashes).hit_blocks == 4, "a replica finds them"
                poison(pool, [0, 1])
                c.restore(h.pool_id, tenant, hashes[:2], [0, 1])
                assert [pool.read_block(p) for p in (0, 1)] == [data[0], data[1]]

                # The host rewrites every object: none is ever written into the pool.
                for k in objects:
                    body = host.get(k[len(prefix) :])
                    assert body is not None
                    host.put(k[len(prefix) :], body[:100] + bytes([body[100] ^ 1]) + body[101:])
                poison(pool, [2, 3])
                with pytest.raises(KVSealRpcError):
                    c.restore(h.pool_id, tenant, hashes[2:], [2, 3])
                assert is_poisoned(pool, 2) and is_poisoned(pool, 3)

                master.stop()  # the master goes away: misses, not a hang or a crash
                assert c.lookup(h.pool_id, tenant, hashes[2:]).hit_blocks == 0
            master.start()  # a new master (empty): A stores again, B finds it
            with a.client() as ca, b.client() as cb:
                ha = ca.register_pool("engine2", FP, pool.geometry())
                hb = cb.register_pool("engine2", FP, pool.geometry())
                tries = iter(range(1000))

                def found_again() -> bool:
                    # A fresh chain each try: a spill that failed is not retried.
                    more = chain(2, pool.shape.tokens_per_page, b"after%d" % next(tries))
                    ca.offload(ha.pool_id, tenant, more, [4, 5])
                    return cb.lookup(hb.pool_id, tenant, more).hit_blocks == 2

                until(found_again, "the daemons find the new master by themselves", 90)
        finally:
            host.close()
        assert a.stop() == 0 and b.stop() == 0
    finally:
        master.stop()
