"""kvseal.vllm.fence on vLLM 0.32's real ``BlockPool`` (no engine): the
eviction fence installed the way eviction mode installs it
(``compat.set_reuse_watchers``) survives ``unpin_blocks`` of another user
(vLLM's HiSparse coordinator's call), runs before that user's watcher when
``get_new_blocks`` or a prefix-cache reset hands the block out, and, taken off
once the store finished, leaves the other user's watcher in place. The whole
path through eviction mode, with a store in flight against a real daemon, is
``tests_vllm/v033/test_evict_fence_chain.py``."""

from __future__ import annotations

from typing import Any

import pytest
from kvseal.vllm import compat
from kvseal.vllm.fence import FencedWatchers
from vllm.v1.core.block_pool import BlockPool


def _pool() -> tuple[BlockPool, FencedWatchers, list[tuple[str, int]]]:
    calls: list[tuple[str, int]] = []

    def fence(block: Any) -> None:
        calls.append(("fence", block.block_id))

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    table = FencedWatchers(fence, compat.reuse_watchers(pool))
    compat.set_reuse_watchers(pool, table)
    assert pool._reuse_watchers is table
    return pool, table, calls


def _other(calls: list[tuple[str, int]], name: str) -> Any:
    def watcher(block: Any) -> None:
        calls.append((name, block.block_id))

    return watcher


def _hand_out_all(pool: BlockPool) -> list[Any]:
    got = pool.get_new_blocks(pool.get_num_free_blocks())
    pool.free_blocks(got)
    return got


def test_unpin_over_the_fence_chains_both_fence_first() -> None:
    pool, table, calls = _pool()
    b = pool.blocks[3]
    table[3] = table.fence  # eviction mode's store job on block 3
    pool.touch([b])
    pool.unpin_blocks([b], _other(calls, "hisparse"))
    assert table.fenced(3) and table.chained == 1
    # A second unpin replaces the other user's watcher (vLLM's rule), not the fence.
    pool.touch([b])
    pool.unpin_blocks([b], _other(calls, "hisparse2"))
    assert table.fenced(3)
    _hand_out_all(pool)
    assert calls == [("fence", 3), ("hisparse2", 3)]
    assert 3 not in pool._reuse_watchers


def test_the_fence_over_another_users_watcher_chains_too() -> None:
    pool, table, calls = _pool()
    b = pool.blocks[2]
    pool.touch([b])
    pool.unpin_blocks([b], _other(calls, "hisparse"))
    table[2] = table.fence
    assert table.fenced(2)
    assert pool.reset_prefix_cache()  # notifies every watched block
    assert calls == [("fence", 2), ("hisparse", 2)]


def test_a_finished_store_leaves_the_other_users_watcher() -> None:
    pool, table, calls = _pool()
    b = pool.blocks[5]
    table[5] = table.fence
    table[6] = table.fence
    pool.touch([b])
    pool.unpin_blocks([b], _other(calls, "hisparse"))
    table.release([5, 6])  # the store job finished
    assert not table.fenced(5) and 6 not in table
    _hand_out_all(pool)
    assert calls == [("hisparse", 5)]


def test_every_way_of_writing_keeps_the_fence() -> None:
    pool, table, calls = _pool()
    for bid in (1, 2, 3):
        table[bid] = table.fence
    table.update({1: _other(calls, "u")})
    table.setdefault(2, _other(calls, "s"))  # present: nothing written
    table |= {3: _other(calls, "i")}
    assert all(table.fenced(b) for b in (1, 2, 3))
    for bid in (1, 2, 3):
        table.pop(bid)(pool.blocks[bid])
    assert calls == [("fence", 1), ("u", 1), ("fence", 2), ("fence", 3), ("i", 3)]


def test_the_other_users_watcher_runs_when_the_fence_raises() -> None:
    pool, _table, calls = _pool()

    def broken(block: Any) -> None:
        raise RuntimeError("fence")

    table = FencedWatchers(broken)
    compat.set_reuse_watchers(pool, table)
    table[4] = broken
    b = pool.blocks[4]
    pool.touch([b])
    pool.unpin_blocks([b], _other(calls, "hisparse"))
    with pytest.raises(RuntimeError, match="fence"):  # raised to vLLM, as before
        _hand_out_all(pool)
    assert calls == [("hisparse", 4)]
