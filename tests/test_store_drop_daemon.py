"""Drops with a store tier in a real daemon process (a real client pool, a
real directory): ``Drop(block_hashes)`` removes the named blocks' objects, so
neither the dropping daemon nor a restarted one finds them in the store, and
the blocks before them still restore. The races around drops are forced in
process (``test_store_drop.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from kvseal.client import KVSealRpcError, tenant_digest
from kvseal.client.shm import SharedKVPool

from .conftest import DaemonProc, fill_random, poison
from .store_helpers import FP, chain, key_file, objects, store_flags, wait_objects

Factory = Callable[..., DaemonProc]


def test_drop_of_block_hashes_reaches_the_store(
    tmp_path: Path, daemon_factory: Factory, pool_factory: Callable[..., SharedKVPool]
) -> None:
    store, key = tmp_path / "store", key_file(tmp_path / "key")
    flags = store_flags(store, f"file:{key}")
    pool = pool_factory(num_pages=8)
    data = fill_random(pool)
    tenant = tenant_digest("user-a")
    hashes = chain(4, pool.shape.tokens_per_page, b"user-a")
    a = daemon_factory(*flags)
    with a.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        c.offload(h.pool_id, tenant, hashes, [0, 1, 2, 3])
        wait_objects(store, 4)
        assert c.drop(h.pool_id, tenant, [hashes[2]]) == 2  # the block and its descendant
        assert len(objects(store)) == 3, "the named block's object is gone"
        assert c.lookup(h.pool_id, tenant, hashes).hit_blocks == 2
        with pytest.raises(KVSealRpcError):
            c.restore(h.pool_id, tenant, hashes[:3], [4, 5, 6])
    assert a.stop() == 0
    b = daemon_factory(*flags)  # an empty host tier, the same store
    with b.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        assert c.lookup(h.pool_id, tenant, hashes[:3]).hit_blocks == 2
        with pytest.raises(KVSealRpcError):
            c.restore(h.pool_id, tenant, hashes[:3], [4, 5, 6])
        poison(pool, [0, 1])
        c.restore(h.pool_id, tenant, hashes[:2], [0, 1])
        assert [pool.read_block(p) for p in (0, 1)] == [data[0], data[1]]
