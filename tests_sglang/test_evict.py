"""Offload at eviction (``offload_policy: "evict"``) on SGLang 0.5.23.

Two levels, each against a real daemon:

- **SGLang's own radix cache** in this process: a ``UnifiedRadixCache`` with
  the tree core SGLang picks here (its Rust core), SGLang's MHA pool and
  paged allocator on the CPU, and kvseal's linker attached through
  ``init_cache_linker`` (so SGLang's ``UnifiedCacheLinkerWrapper`` is the one
  built, and kvseal's hooks run inside SGLang's own ``evict``). Matches go
  through the tree core's ``match_prefix`` and the wrapper's ``match``,
  which is ``UnifiedRadixCache._match_tree`` without the disaggregation
  check that needs a published server config.
- **A real ``sglang.launch_server``** (tiny Llama on the CPU): the working set
  that fits (nothing sealed, no RPC on repeated requests) and a workload
  3.75x SGLang's KV pool (pages sealed at eviction, restored, identical greedy
  tokens against SGLang alone).
"""

from __future__ import annotations

import array
import itertools
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kvseal.sglang.keys import kvseal_hash
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from tests_sglang.linker_harness import PAGE, make_linker, mha_pool
from tests_sglang.server import Server, prompt
from tests_vllm.daemon import Daemon
from tests_vllm.tiny_model import make_tiny_llama

BLOCK = 2 * 2 * (PAGE * 2 * 8 * 2)  # mha_pool's page: layers x (K, V) x bytes


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("daemon"), host_bytes="64MiB").start()
    yield d
    d.stop()


class Tree:
    """SGLang's radix cache over its own CPU pool, with kvseal's linker."""

    def __init__(self, socket: str, pages: int = 8, **extra: Any) -> None:
        self.pool = mha_pool(pages)
        g = torch.Generator().manual_seed(pages)
        for t in self.tensors:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        self.alloc = PagedTokenToKVPoolAllocator(
            pages * PAGE, PAGE, torch.bfloat16, "cpu", self.pool, need_sort=False
        )
        self.cache = UnifiedRadixCache(
            CacheInitParams(
                disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.alloc,
                page_size=PAGE, tree_components=(ComponentType.FULL,),
            )
        )  # fmt: skip
        extra.setdefault("staging_bytes", 64 * BLOCK)
        self.linker = make_linker(self.pool, socket, **extra)
        self.cache.init_cache_linker(self.linker)

    @property
    def tensors(self) -> list[Any]:
        return [*self.pool.k_buffer, *self.pool.v_buffer]

    def insert(self, ids: list[int], salt: str | None = None, value: Any = None) -> Any:
        """Insert ``ids`` with freshly allocated slots (or ``value``), as a
        finished request does; returns the slots."""
        v = self.alloc.alloc(len(ids)) if value is None else value
        self.cache.insert(
            InsertParams(key=RadixKey(array.array("q", ids), cache_salt=salt), value=v)
        )
        return v

    def match(self, ids: list[int], rid: str, salt: str | None = None) -> tuple[int, list[str]]:
        """(tokens restorable from kvseal, their page keys) for ``ids``. The
        salt reaches the linker as kvseal's match hook passes it."""
        self.linker.note_request(rid, salt)
        key = RadixKey(array.array("q", ids), cache_salt=salt)
        req = SimpleNamespace(rid=rid, session=None)
        res = self.cache.linker.match(  # type: ignore[union-attr]
            key, req, self.cache.tree_core.match_prefix(MatchPrefixParams(key=key, req=req))
        )
        hit = self.cache.linker.hit_markers.pop(rid, None)  # type: ignore[union-attr]
        return res.host_hit_length, (hit.tail_hashes if hit else [])

    def load(self, rid: str, page_keys: list[str]) -> tuple[bool, Any]:
        slots = self.alloc.alloc(len(page_keys) * PAGE)
        t = PoolTransfer(name=PoolName.KV, keys=page_keys, device_indices=slots)
        return self.linker.load(rid, [t]), slots

    def settle_offloads(self, n: int, timeout: float = 60.0) -> None:
        """Wait for ``n`` write-through offloads and commit them, as SGLang's step does."""
        deadline = time.monotonic() + timeout
        while self.linker.num_completed_offloads() < n:
            assert time.monotonic() < deadline, "the offloads never completed"
            time.sleep(0.02)
        self.cache.check_hicache_events()

    def close(self) -> None:
        self.linker.close()


def _eventually(cond: Any, timeout: float = 60.0) -> bool:
    """``cond()`` became true within ``timeout`` (the mirror claims a sealed
    page at once when subscribed, else after its background Lookup: after a
    stopped daemon it may be resubscribing). A wait, not a timing assertion."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _stopped(d: Daemon) -> Any:
    assert d.proc is not None
    pid = d.proc.pid

    class _Ctx:
        def __enter__(self) -> None:
            os.kill(pid, signal.SIGSTOP)

        def __exit__(self, *a: Any) -> None:
            os.kill(pid, signal.SIGCONT)

    return _Ctx()


def test_evicted_pages_are_sealed_and_reused_memory_does_not_reach_them(daemon: Daemon) -> None:
    """Insert: nothing sealed. SGLang evicts the node, the allocator hands
    its slots out at once and they are overwritten, all while the daemon is
    stopped (no seal can have run yet): the restore brings back the bytes the
    pages held at eviction. Evicted again after the restore, the pages are
    only touched (the tier holds them), not sealed again."""
    tree = Tree(daemon.socket, offload_policy="evict")
    try:
        assert tree.linker.offload_mode == "evict" and tree.linker.fallback_reason is None
        ids = prompt(1, 3 * PAGE)
        before = daemon.stats()["offloaded_blocks"]
        slots = tree.insert(ids)
        tree.cache.check_hicache_events()
        assert tree.linker.num_completed_offloads() == 0
        want = [t[slots].clone() for t in tree.tensors]
        with _stopped(daemon):
            assert tree.cache.evict(EvictParams(num_tokens=3 * PAGE)).num_tokens_evicted == 3 * PAGE
            reused = tree.alloc.alloc(8 * PAGE)  # the whole pool: the evicted slots too
            assert set(slots.tolist()) <= set(reused.tolist())
            for t in tree.tensors:
                t[reused] = 7
        tree.linker.evict_sealer.drain()  # type: ignore[union-attr]
        tree.alloc.free(reused)
        assert daemon.stats()["offloaded_blocks"] == before + 3
        assert tree.linker.stats["evict_sealed_pages"] == 3
        assert _eventually(lambda: tree.match([*ids, 5], "r0")[0] == 3 * PAGE)
        hit, keys = tree.match([*ids, 5], "r1")
        assert hit == 3 * PAGE and len(keys) == 3
        ok, back = tree.load("r1", keys)
        assert ok
        for t, w in zip(tree.tensors, want, strict=True):
            assert torch.equal(t[back], w)
        # The restored tail is inserted like computed KV; evicted again, the
        # tier already holds it: touched, not sealed twice.
        tree.insert(ids, value=back)
        tree.cache.evict(EvictParams(num_tokens=3 * PAGE))
        tree.linker.evict_sealer.drain()  # type: ignore[union-attr]
        assert tree.linker.stats["evict_held_pages"] == 3
        assert daemon.stats()["offloaded_blocks"] == before + 3
    finally:
        tree.close()


def test_write_back_keeps_each_page_in_one_tier(daemon: Daemon) -> None:
    """``write_back: true``: the restore releases the pages' host copies (the
    daemon frees them, the mirror drops them at once), so the tier no longer
    offers them; the restored node is in SGLang's pool alone, and its next
    eviction seals it again (it changed tier), with the same bytes."""
    tree = Tree(daemon.socket, offload_policy="evict", write_back=True)
    try:
        assert tree.linker.offload_mode == "evict" and tree.linker.write_back
        ids = prompt(7, 3 * PAGE)
        before = daemon.stats()
        slots = tree.insert(ids)
        want = [t[slots].clone() for t in tree.tensors]
        tree.cache.evict(EvictParams(num_tokens=3 * PAGE))
        tree.linker.evict_sealer.drain()  # type: ignore[union-attr]
        assert daemon.stats()["offloaded_blocks"] == before["offloaded_blocks"] + 3
        assert _eventually(lambda: tree.match([*ids, 5], "w0")[0] == 3 * PAGE)
        mirror = tree.linker.tiers["kv"].mirror
        assert _eventually(lambda: not any(mirror._unverified.values()))  # the seals verified
        _, keys = tree.match([*ids, 5], "w1")
        lookups = daemon.stats()["lookups"]
        ok, back = tree.load("w1", keys)
        assert ok and tree.linker.stats["released_pages"] == 3
        # Released, not forgotten: the daemon said it freed them, so the mirror
        # asks nothing back (a forgotten block gets a background re-check Lookup).
        assert not any(mirror._unverified.values())
        for t, w in zip(tree.tensors, want, strict=True):
            assert torch.equal(t[back], w)
        st = daemon.stats()
        assert st["blocks_ready"] == before["blocks_ready"]  # the 3 are gone from the tier
        assert tree.match([*ids, 5], "w2")[0] == 0  # one tier: SGLang's pool alone
        assert daemon.stats()["lookups"] == lookups
        # In SGLang's pool again (inserted like computed KV); its eviction seals it again.
        tree.insert(ids, value=back)
        tree.cache.evict(EvictParams(num_tokens=3 * PAGE))
        tree.linker.evict_sealer.drain()  # type: ignore[union-attr]
        assert tree.linker.stats["evict_sealed_pages"] == 6
        assert tree.linker.stats["evict_held_pages"] == 0
        assert daemon.stats()["offloaded_blocks"] == before["offloaded_blocks"] + 6
        assert _eventually(lambda: tree.match([*ids, 5], "w3")[0] == 3 * PAGE)
        _, keys = tree.match([*ids, 5], "w4")
        ok, again = tree.load("w4", keys)
        assert ok
        for t, w in zip(tree.tensors, want, strict=True):
            assert torch.equal(t[again], w)
    finally:
        tree.close()


def _sealed(tree: Tree, prompts: list[list[int]]) -> list[tuple[list[str], list[Any]]]:
    """Insert ``prompts`` and evict them all (sealed at eviction); for each,
    once the tier offers it whole: its page keys and the bytes its pages held
    (one tensor per pool tensor)."""
    wants = []
    for ids in prompts:
        slots = tree.insert(ids)
        wants.append([t[slots].clone() for t in tree.tensors])
    n = sum(len(ids) for ids in prompts)
    assert tree.cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted == n
    tree.linker.evict_sealer.drain()  # type: ignore[union-attr]
    assert tree.linker.stats["evict_sealed_pages"] == n // PAGE
    out = []
    for i, (ids, want) in enumerate(zip(prompts, wants, strict=True)):
        assert _eventually(lambda ids=ids: tree.match([*ids, 5], "m")[0] == len(ids))
        out.append((tree.match([*ids, 5], f"k{i}")[1], want))
    return out


def _drop(tree: Tree, page_keys: list[str]) -> None:
    """The tier loses these blocks after SGLang's match (its LRU may evict
    them while a load waits): a Drop on the linker's own pool."""
    h = tree.linker.tiers["kv"].kv.pool.handle
    assert h is not None
    hashes = [kvseal_hash(k) for k in page_keys]
    assert tree.linker.client.drop(h.pool_id, tree.linker.tenants.shared, hashes) == len(hashes)


def _held(tree: Tree, page_keys: list[str]) -> int:
    """The daemon's own Lookup (not the mirror): leading blocks it holds."""
    hashes = [kvseal_hash(k) for k in page_keys]
    return int(tree.linker.tiers["kv"].kv.pool.lookup(tree.linker.tenants.shared, hashes))


def _same(tree: Tree, slots: Any, want: list[Any]) -> bool:
    return all(torch.equal(t[slots], w) for t, w in zip(tree.tensors, want, strict=True))


def test_write_back_chunked_load_releases_only_once_it_all_verified(daemon: Daemon) -> None:
    """Write-back, a load restored in chunks of the free staging blocks (2)
    whose second chunk fails (its blocks left the tier after the match): the
    load fails and SGLang recomputes it, and the first chunk's blocks, which
    verified, are still in the tier: a later load restores them (the same
    bytes) and, verified whole, releases them."""
    tree = Tree(daemon.socket, offload_policy="evict", write_back=True,
                staging_bytes=2 * BLOCK, evict_wait_s=60)  # fmt: skip
    try:
        assert tree.linker.tiers["kv"].blocks == 2
        ((keys, want),) = _sealed(tree, [prompt(40, 4 * PAGE)])
        _drop(tree, keys[2:])
        ok, _ = tree.load("c1", keys)
        assert not ok and tree.linker.stats["released_pages"] == 0
        assert _held(tree, keys) == 2  # the first chunk's host copies are still there
        ok, back = tree.load("c2", keys[:2])
        assert ok and tree.linker.stats["released_pages"] == 2
        assert _same(tree, back, [w[: 2 * PAGE] for w in want])
        assert _held(tree, keys) == 0  # verified whole: one tier again
    finally:
        tree.close()


def test_write_back_async_batch_with_a_failed_request_releases_nothing(daemon: Daemon) -> None:
    """Write-back, ``load_mode: async``: a batch of two loads, the second of
    which fails (a block left the tier after the match). SGLang fails the
    batch whole and recomputes both requests, so the first request's blocks,
    which verified, stay in the tier; a later batch of that request alone
    restores them and releases them."""
    tree = Tree(daemon.socket, offload_policy="evict", write_back=True, load_mode="async",
                evict_wait_s=60)  # fmt: skip
    try:
        (ka, want_a), (kb, _) = _sealed(tree, [prompt(41, 2 * PAGE), prompt(42, 2 * PAGE)])
        _drop(tree, kb[1:])
        assert tree.load("a1", ka)[0] and tree.load("b1", kb)[0]  # queued
        index = tree.linker.start_layer_wise_loading()
        assert not tree.linker.finish_layer_wise_loading(index)
        assert tree.linker.stats["released_pages"] == 0
        assert _held(tree, ka) == 2  # request a verified, but its batch failed: kept
        ok, back = tree.load("a2", ka)
        index = tree.linker.start_layer_wise_loading()
        assert ok and tree.linker.finish_layer_wise_loading(index)
        assert _same(tree, back, want_a)
        assert tree.linker.stats["released_pages"] == 2 and _held(tree, ka) == 0
    finally:
        tree.close()


def test_write_back_needs_offload_at_eviction(daemon: Daemon) -> None:
    with pytest.raises(ValueError, match='write_back needs offload_policy "evict"'):
        make_linker(mha_pool(), daemon.socket, write_back=True)
    with pytest.raises(ValueError, match="write_back must be true or false"):
        make_linker(mha_pool(), daemon.socket, offload_policy="evict", write_back="yes")


def test_evicted_pages_keep_their_tenant(daemon: Daemon) -> None:
    """A node inserted under ``cache_salt`` is sealed as that tenant's at
    eviction: that salt finds it, another does not."""
    tree = Tree(daemon.socket, offload_policy="evict")
    try:
        ids = prompt(2, 2 * PAGE)
        tree.insert(ids, salt="alice")
        tree.cache.evict(EvictParams(num_tokens=2 * PAGE))
        tree.linker.evict_sealer.drain()  # type: ignore[union-attr]
        assert _eventually(lambda: tree.match([*ids, 5], "a0", salt="alice")[0] == 2 * PAGE)
        hit, keys = tree.match([*ids, 5], "a", salt="alice")
        assert hit == 2 * PAGE and tree.load("a", keys)[0]
        assert tree.match([*ids, 5], "b", salt="bob")[0] == 0
        assert tree.match([*ids, 5], "s")[0] == 0  # nor the shared tenant's
    finally:
        tree.close()


def test_no_staging_block_drops_the_tail_and_stops_waiting(daemon: Daemon) -> None:
    """One staging block, held by a seal whose RPC hangs (daemon stopped): an
    evicted 3-page node gets its first page copied, its other two are
    dropped after ``evict_wait_s``; the next eviction drops all of its pages
    without waiting again. Once the daemon runs, the sealed page is a
    one-page hit (a prefix: the dropped ones were the tail)."""
    tree = Tree(daemon.socket, offload_policy="evict", staging_bytes=BLOCK, evict_wait_s=0.2,
                transfer_timeout_s=120)  # fmt: skip
    try:
        assert tree.linker.tiers["kv"].blocks == 1
        a, b = prompt(3, 3 * PAGE), prompt(4, 2 * PAGE)
        with _stopped(daemon):
            tree.insert(a)
            tree.cache.evict(EvictParams(num_tokens=3 * PAGE))
            tree.insert(b)
            tree.cache.evict(EvictParams(num_tokens=2 * PAGE))
            assert tree.linker.stats["evict_dropped_pages"] == 2 + 2
        tree.linker.evict_sealer.drain()  # type: ignore[union-attr]
        assert tree.linker.stats["evict_sealed_pages"] == 1
        assert _eventually(lambda: tree.match([*a, 5], "r")[0] == PAGE)
        assert tree.match([*a, 5], "r")[0] == PAGE  # the dropped tail stays a miss
        assert tree.match([*b, 5], "s")[0] == 0
    finally:
        tree.close()


def _expired_waits(slots: Any) -> list[float]:
    """Spy on a tier's real :class:`~kvseal.sglang.staging.Slots`: the list
    fills with the timeout of every ``take`` that waited (timeout > 0) and
    got no block, i.e. every wait of the scheduler thread that ran out."""
    expired: list[float] = []
    take = slots.take

    def _take(n: int, timeout: float | None = None) -> list[int]:
        got: list[int] = take(n, timeout)
        if not got and timeout:
            expired.append(timeout)
        return got

    slots.take = _take
    return expired


def test_failed_seals_do_not_end_the_starvation(daemon: Daemon) -> None:
    """A hung daemon (stopped): every seal's RPC runs out and fails. The
    first eviction waits ``evict_wait_s`` for a staging block once, in vain;
    the seals that fail after it free their block but do not end the
    starvation, so the next evictions take the free block without waiting
    (one wait in all, docs/sglang.md). Once the daemon runs again and a seal
    succeeds, an eviction short of blocks waits again."""
    tree = Tree(daemon.socket, offload_policy="evict", staging_bytes=BLOCK, evict_wait_s=0.2,
                transfer_timeout_s=0.5)  # fmt: skip
    try:
        sealer = tree.linker.evict_sealer
        assert sealer is not None and tree.linker.tiers["kv"].blocks == 1
        expired = _expired_waits(tree.linker.tiers["kv"].slots)
        pool = tree.linker.tiers["kv"].kv.pool
        with _stopped(daemon):
            for seed in range(20, 24):
                # Past the pool's back-off, so that this eviction's seal reaches
                # the stopped daemon and hangs (evictions seconds apart, as served).
                assert _eventually(lambda: time.monotonic() >= pool._down_until)
                tree.insert(prompt(seed, 3 * PAGE))
                tree.cache.evict(EvictParams(num_tokens=3 * PAGE))
                sealer.drain()  # its seal failed: the RPC ran out on the stopped daemon
            assert len(expired) == 1 and tree.linker.stats["evict_waits_expired"] == 1
            # Each eviction sealed its first page, in vain; the rest were dropped.
            assert tree.linker.stats["evict_seal_failures"] == 4
            assert tree.linker.stats["evict_dropped_pages"] == 4 * 2
        # The daemon runs again: evictions seal their first page until one
        # seal succeeded (past the pool's back-off, the first one does)...
        assert _eventually(lambda: time.monotonic() >= pool._down_until)
        seeds = itertools.count(30)

        def _sealed_one() -> bool:
            tree.insert(prompt(next(seeds), 3 * PAGE))
            tree.cache.evict(EvictParams(num_tokens=3 * PAGE))
            sealer.drain()
            return bool(tree.linker.stats["evict_sealed_pages"])

        assert _eventually(_sealed_one)
        assert len(expired) == 1  # ...and none of them waited
        # ... after which an eviction short of blocks waits for them again
        # (the daemon stopped once more, so the seal holding the block hangs).
        with _stopped(daemon):
            tree.insert(prompt(99, 3 * PAGE))
            tree.cache.evict(EvictParams(num_tokens=3 * PAGE))
            sealer.drain()
        assert len(expired) == 2 and tree.linker.stats["evict_waits_expired"] == 2
    finally:
        tree.close()


def test_hook_that_does_not_fit_falls_back_to_write_through(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An SGLang whose ``_evict_device_leaf`` is not ``(self, node_id,
    tracker)``: the linker logs why and runs write-through (the insert
    offloads every page, as SGLang's write-through chain asks)."""
    current = UnifiedRadixCache.__dict__["_evict_device_leaf"]

    def _evict_device_leaf(self: Any, node: Any, tracker: Any) -> Any:
        return current(self, node, tracker)

    monkeypatch.setattr(UnifiedRadixCache, "_evict_device_leaf", _evict_device_leaf)
    with caplog.at_level(logging.WARNING, logger="kvseal.sglang"):
        tree = Tree(daemon.socket, offload_policy="evict")
    try:
        assert tree.linker.offload_mode == "write_through"
        assert tree.linker.evict_sealer is None
        assert "_evict_device_leaf is not (self, node_id, tracker)" in str(
            tree.linker.fallback_reason
        )
        assert "falling back to write-through" in caplog.text
        assert "_evict_device_leaf" in caplog.text
        assert tree.cache.write_through_threshold == 1  # SGLang's, untouched
        before = daemon.stats()["offloaded_blocks"]
        tree.insert(prompt(5, 2 * PAGE))
        tree.settle_offloads(1)
        assert daemon.stats()["offloaded_blocks"] == before + 2
    finally:
        tree.close()
    # write_back with the fallback: write-through never offers a page again,
    # so a restore must not release it.
    tree = Tree(daemon.socket, offload_policy="evict", write_back=True)
    try:
        assert tree.linker.offload_mode == "write_through"
        ids = prompt(6, 2 * PAGE)
        tree.insert(ids)
        tree.settle_offloads(1)
        tree.cache.evict(EvictParams(num_tokens=2 * PAGE))  # the tier alone holds it
        assert _eventually(lambda: tree.match([*ids, 5], "f0")[0] == 2 * PAGE)
        _, keys = tree.match([*ids, 5], "f1")
        ok, _ = tree.load("f1", keys)
        assert ok and tree.linker.stats["released_pages"] == 0
        assert tree.match([*ids, 5], "f2")[0] == 2 * PAGE  # still in the tier
    finally:
        tree.close()


def test_a_hybrid_tree_falls_back_to_write_through(
    daemon: Daemon, caplog: pytest.LogCaptureFixture
) -> None:
    """A tree with an SWA component (its window state is evicted apart from
    the Full leaf): the linker keeps SGLang's write-through and says why."""
    linker = make_linker(mha_pool(), daemon.socket, offload_policy="evict")
    try:
        cache = SimpleNamespace(
            tree_components=(ComponentType.FULL, ComponentType.SWA), write_through_threshold=1
        )
        with caplog.at_level(logging.WARNING, logger="kvseal.sglang"):
            linker.attach_cache(cache)
        assert linker.offload_mode == "write_through" and cache.write_through_threshold == 1
        assert "SWA" in str(linker.fallback_reason) and "falling back" in caplog.text
    finally:
        linker.close()


def test_unknown_offload_policy_is_refused(daemon: Daemon) -> None:
    with pytest.raises(ValueError, match="offload_policy must be one of"):
        make_linker(mha_pool(), daemon.socket, offload_policy="write_back")


# ---------------------------------------------------------------- a real server

KV_TOKENS = 512  # 32 pages
FITS = [prompt(500 + i, 96) for i in range(3)]  # 3 x (6 + 1) pages: fits
WORKLOAD = [prompt(100 + i, 160) for i in range(12)]  # 1920 tokens: 3.75x the pool
ROUNDS = 3
MAX_NEW = 6


def _cacheable(n: int) -> int:
    return (n - 1) // PAGE * PAGE


def _phases(srv: Server, daemon: Daemon | None = None) -> dict[str, Any]:
    fits = [srv.generate(p, max_new=MAX_NEW) for p in FITS]
    mid = daemon.stats() if daemon else None
    fits += [srv.generate(p, max_new=MAX_NEW) for _ in range(ROUNDS - 1) for p in FITS]
    after_fits = daemon.stats() if daemon else None
    work = [srv.generate(p, max_new=MAX_NEW) for _ in range(ROUNDS) for p in WORKLOAD]
    return {"fits": fits, "work": work, "mid": mid, "after_fits": after_fits,
            "end": daemon.stats() if daemon else None}  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def baseline(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    srv = Server(model, tmp_path_factory.mktemp("alone"), kv_tokens=KV_TOKENS, page_size=PAGE)
    srv.start()
    try:
        return _phases(srv)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def evict_run(
    model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[dict[str, Any], Server]]:
    d = Daemon(tmp_path_factory.mktemp("daemon-srv"), host_bytes="64MiB").start()
    srv = Server(
        model, tmp_path_factory.mktemp("sglang-evict"), kv_tokens=KV_TOKENS, page_size=PAGE,
        kvseal_socket=d.socket,
        linker={"offload_policy": "evict", "staging_bytes": 4 << 20, "transfer_timeout_s": 5},
    )  # fmt: skip
    srv.start()
    try:
        start = d.stats()
        out = _phases(srv, d)
        out["start"] = start
        yield out, srv
    finally:
        srv.stop()
        d.stop()


def test_server_working_set_fits_nothing_sealed_no_rpc_on_repeats(
    baseline: dict[str, Any], evict_run: tuple[dict[str, Any], Server]
) -> None:
    """Prompts that fit SGLang's KV pool, three rounds: identical tokens,
    nothing sealed or restored, and the repeated rounds (device hits) ask the
    daemon nothing (the first round's misses cost one background discovery
    lookup per new prefix: what the mirror needs)."""
    run, srv = evict_run
    assert [r["ids"] for r in run["fits"]] == [r["ids"] for r in baseline["fits"]]
    assert all(r["cached"] == _cacheable(96) for r in run["fits"][len(FITS) :])
    for k in ("offloaded_blocks", "restored_blocks"):
        assert run["after_fits"][k] == run["start"][k] == 0, k
    assert run["after_fits"]["lookups"] == run["mid"]["lookups"]
    assert "offload at eviction: nothing is sealed on insert" in srv.log_path.read_text()


def test_server_overflow_seals_at_eviction_and_restores_identically(
    baseline: dict[str, Any], evict_run: tuple[dict[str, Any], Server]
) -> None:
    """A workload 3.75x the KV pool, cyclic (SGLang alone's LRU keeps none of
    it): pages are sealed when SGLang evicts them and restored, every greedy
    token identical to SGLang alone's, and each page sealed at most once."""
    run, _ = evict_run
    assert all(r["status"] == 200 for r in run["work"])
    assert [r["ids"] for r in run["work"]] == [r["ids"] for r in baseline["work"]]
    end, fits = run["end"], run["after_fits"]
    assert end["offloaded_blocks"] > 0 and end["restored_blocks"] > 0
    assert end["integrity_failures"] == 0
    pages = len(WORKLOAD) * -(-(160 + MAX_NEW) // PAGE) + len(FITS) * -(-(96 + MAX_NEW) // PAGE)
    assert end["offloaded_blocks"] - fits["offloaded_blocks"] <= pages
    later = slice(len(WORKLOAD), None)
    kv_cached = sum(r["cached"] for r in run["work"][later])
    assert kv_cached > sum(r["cached"] for r in baseline["work"][later])
    assert kv_cached >= (ROUNDS - 1) * len(WORKLOAD) * _cacheable(160) // 2


@pytest.fixture(scope="module")
def write_back_run(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = Daemon(tmp_path_factory.mktemp("daemon-wb"), host_bytes="64MiB").start()
    srv = Server(
        model, tmp_path_factory.mktemp("sglang-wb"), kv_tokens=KV_TOKENS, page_size=PAGE,
        kvseal_socket=d.socket,
        linker={"offload_policy": "evict", "write_back": True, "staging_bytes": 4 << 20,
                "transfer_timeout_s": 5},
    )  # fmt: skip
    srv.start()
    try:
        out = _phases(srv, d)
        out["log"] = srv.log_path.read_text()
        return out
    finally:
        srv.stop()
        d.stop()


def test_server_write_back_one_tier_per_page_identical_tokens(
    baseline: dict[str, Any],
    evict_run: tuple[dict[str, Any], Server],
    write_back_run: dict[str, Any],
) -> None:
    """``write_back: true`` on the real server, same workload: every greedy
    token identical to SGLang alone's; a restored page leaves the tier (the
    daemon ends holding fewer blocks than offload at eviction alone, which
    keeps a restored page in both tiers) and is sealed again at its next
    eviction (more seals than pages), and it caches as much as eviction
    alone's bound."""
    wb = write_back_run
    assert "with write-back (a restore releases the host copy)" in wb["log"]
    assert [r["ids"] for r in wb["fits"]] == [r["ids"] for r in baseline["fits"]]
    assert all(r["status"] == 200 for r in wb["work"])
    assert [r["ids"] for r in wb["work"]] == [r["ids"] for r in baseline["work"]]
    end, fits = wb["end"], wb["after_fits"]
    assert fits["offloaded_blocks"] == 0 and end["integrity_failures"] == 0
    assert end["restored_blocks"] > 0
    pages = len(WORKLOAD) * -(-(160 + MAX_NEW) // PAGE) + len(FITS) * -(-(96 + MAX_NEW) // PAGE)
    assert end["offloaded_blocks"] > pages  # sealed again after a release
    ev_end = evict_run[0]["end"]
    assert end["blocks_ready"] < ev_end["blocks_ready"]
    later = slice(len(WORKLOAD), None)
    kv_cached = sum(r["cached"] for r in wb["work"][later])
    assert kv_cached >= (ROUNDS - 1) * len(WORKLOAD) * _cacheable(160) // 2
