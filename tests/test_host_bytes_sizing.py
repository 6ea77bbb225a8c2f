"""How to size ``--host-bytes``, checked against a real daemon.

The rule the docs give (docs/operating.md, docs/vllm.md, the daemon's
``--host-bytes`` help): a sealed block takes its plaintext bytes in the host
tier, rounded up to a multiple of 256 (slot alignment; the nonce and tag live
in the daemon's private index, not in the tier), so ``N`` blocks of ``B``
bytes need ``N * roundup(B, 256)`` bytes: for every real KV block (a multiple
of 256 bytes) exactly ``N * B``. Here the tier is 1 MiB: exactly that many
blocks are stored without an eviction, and one more evicts one.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from kvseal.client import tenant_digest
from kvseal.client.shm import KVShape, SharedKVPool

from .conftest import DaemonProc

TIER = 1 << 20  # --host-bytes 1MiB, the smallest the daemon accepts


def _hash(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


@pytest.mark.parametrize(
    ("tokens", "heads", "head_dim", "slot"),
    [
        (16, 8, 64, 32 * 1024),  # 32 KiB blocks: a multiple of 256, no overhead at all
        (3, 1, 40, 512),  # 480-byte blocks: each takes a 512-byte slot
    ],
)
def test_n_blocks_fit_in_n_slots(
    daemon_factory: Callable[..., DaemonProc], tokens: int, heads: int, head_dim: int, slot: int
) -> None:
    d = daemon_factory(host_bytes="1MiB")
    fits = TIER // slot
    shape = KVShape(fits + 1, tokens, 1, heads, head_dim)
    assert -(-shape.block_bytes // 256) * 256 == slot
    tenant = tenant_digest(None)
    with SharedKVPool(shape, "vllm_cross_layer") as pool, d.client() as c:
        h = c.register_pool("sizing", b"model:sizing", pool.geometry())
        stored = evicted = 0
        for first in range(0, fits, 1024):  # below the daemon's batch limit
            n = min(1024, fits - first)
            r = c.offload(h.pool_id, tenant, [_hash(i) for i in range(first, first + n)],
                          list(range(first, first + n)))  # fmt: skip
            stored += r.stored_blocks
            evicted += r.evicted_blocks
        assert (stored, evicted) == (fits, 0)
        s = c.stats()
        assert s.blocks_ready == fits and s.host_bytes_used == fits * slot == TIER
        r = c.offload(h.pool_id, tenant, [_hash(fits)], [fits])
        assert (r.stored_blocks, r.evicted_blocks) == (1, 1)
