"""The Release RPC: write-back's release of blocks restored with
``release=false``, once the whole load they belong to verified (an engine
restores one load in several Restores: chunks, groups, requests of a batch,
and a failure of a later one must leave the earlier blocks in the host tier).
Against a real daemon, over real shared memory."""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
import pytest
from kvseal.client import KVSealRpcError, chain_block_hashes, tenant_digest
from kvseal.client.shm import SharedKVPool
from kvseal.v1 import kvseal_pb2 as pb

from .conftest import DaemonProc, fill_random, poison

FP = b"model:release-test/tp0"


def _chain(n: int, tokens_per_page: int, salt: bytes) -> list[bytes]:
    ids = list(range(n * tokens_per_page))
    return chain_block_hashes(ids, tokens_per_page, cache_salt=salt)


def test_release_leaves_what_a_release_restore_leaves(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    """Restored without release, the blocks stay; Release then takes them
    out of the tier as a release restore would (their descendants stay and
    still restore), announced REMOVED_RELEASED. Released again, absent or
    unknown blocks are skipped, not an error."""
    pool = pool_factory(num_pages=4)
    data = fill_random(pool)
    tenant = tenant_digest("rel")
    chain = _chain(4, pool.shape.tokens_per_page, b"rel")
    with daemon.client() as c:
        h = c.register_pool("r", FP, pool.geometry())
        c.offload(h.pool_id, tenant, chain, [0, 1, 2, 3])
        stream = c.watch_events(h.pool_id, tenant=tenant, timeout=20)
        removed: list[pb.BlockEvent] = []
        got = threading.Event()

        def watch() -> None:
            try:
                for ev in stream:
                    if ev.kind == pb.BLOCK_REMOVED:
                        removed.append(ev)
                        break
            finally:
                got.set()

        t = threading.Thread(target=watch)
        t.start()
        poison(pool, [0, 1])
        c.restore(h.pool_id, tenant, chain[:2], [0, 1], release=False)
        assert pool.read_block(0) == data[0] and pool.read_block(1) == data[1]
        assert c.lookup(h.pool_id, tenant, chain).hit_blocks == 4  # restored, still cached
        used = c.stats(h.pool_id).host_bytes_used
        assert c.release(h.pool_id, tenant, chain[:2]) == 2
        got.wait(20)
        t.join(10)
        r = c.lookup(h.pool_id, tenant, chain)
        assert r.states == [pb.BLOCK_ABSENT] * 2 + [pb.BLOCK_READY] * 2
        assert c.stats(h.pool_id).host_bytes_used < used
        assert [e.reason for e in removed] == [pb.REMOVED_RELEASED]
        assert list(removed[0].block_hashes) == chain[:2]
        # Released, not dropped: the descendants are still a usable continuation.
        poison(pool, [2, 3])
        c.restore(h.pool_id, tenant, chain[2:], [2, 3])
        assert pool.read_block(2) == data[2] and pool.read_block(3) == data[3]
        # Gone already, or never there: skipped.
        assert c.release(h.pool_id, tenant, chain[:2]) == 0
        assert c.release(h.pool_id, tenant, [b"\x07" * 32]) == 0
        # Another tenant's release reaches nothing of this one's.
        assert c.release(h.pool_id, tenant_digest("other"), chain[2:]) == 0
        assert c.lookup(h.pool_id, tenant, chain[2:]).hit_blocks == 2
        with pytest.raises(KVSealRpcError) as e:
            c.restore(h.pool_id, tenant, chain[:1], [0])
        assert e.value.reason == "BLOCK_NOT_PRESENT"


def test_release_refuses_bad_input(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    pool = pool_factory(num_pages=1)
    with daemon.client() as c:
        h = c.register_pool("r", FP, pool.geometry())
        for tenant, hashes in ((b"short", [b"\x01" * 32]), (tenant_digest(None), [b"\x01" * 5])):
            with pytest.raises(KVSealRpcError) as e:
                c.release(h.pool_id, tenant, hashes)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(KVSealRpcError) as e:
            c.release("no-such-pool", tenant_digest(None), [b"\x01" * 32])
        assert e.value.reason == "UNKNOWN_POOL"
