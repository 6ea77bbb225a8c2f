"""The daemon's per-pool tenant state follows the active tenants: a tenant no
request named for the idle period and with no block left is forgotten
(``SealedCache.sweep_tenants``), one with blocks or recently named is kept, and
a forgotten tenant named again is watched again. A real SealedCache over a real
CPU backend and shared-memory pool; thousands of tenants."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvseal.client import chain_block_hashes, tenant_digest
from kvseal.server.cache.cache import TENANT_IDLE_S
from kvseal.server.events import EventKind

from .test_crypto_erase import Rig


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    yield r
    r.close()


def test_idle_tenants_without_blocks_are_forgotten(rig: Rig) -> None:
    c = rig.cache
    many = [tenant_digest(f"user-{i}") for i in range(5000)]
    for t in many:
        c.lookup(rig.pool_id, t, [os.urandom(32)])  # each names its tenant, holds nothing
    keeper = tenant_digest("with-blocks")
    hashes = chain_block_hashes(list(range(2 * 16)), 16, cache_salt="with-blocks")
    c.note_tenant(rig.pool_id, keeper)  # as the gRPC edge does for every request
    c.offload(rig.pool_id, keeper, None, hashes, [0, 1])
    pool = c.pools.all()[0]
    assert len(pool.tenants) == 5001
    assert c.sweep_tenants() == 0  # nobody idle yet
    later = time.monotonic() + TENANT_IDLE_S
    fresh = many[7]
    c.lookup(rig.pool_id, fresh, [os.urandom(32)])  # named again just now...
    pool.tenants[fresh] = later - 1  # ...as if at the end of the idle period
    assert c.sweep_tenants(now=later) == 4999
    assert set(pool.tenants) == {keeper, fresh}
    # Its blocks gone, the tenant goes at the next sweep...
    c.drop(rig.pool_id, keeper, [], all_of_tenant=True)
    assert c.sweep_tenants(now=later) == 1 and set(pool.tenants) == {fresh}
    # ...and a request naming it again makes the pool's watchers see its events.
    _, sub = c.subscribe_events(rig.pool_id, b"")
    try:
        c.note_tenant(rig.pool_id, keeper)
        c.offload(rig.pool_id, keeper, None, hashes, [0, 1])
        ev = sub.queue.get(timeout=5)
        assert (ev.kind, ev.tenant, list(ev.block_hashes)) == (EventKind.STORED, keeper, hashes)
    finally:
        sub.close()
