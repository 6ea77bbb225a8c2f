"""kvseal's vLLM spec, manager and worker on a hybrid model's KV-cache groups
(issue 27), against a real daemon, real shared memory and vLLM 0.32's own
KV-cache spec classes, without an engine (the engine-level runs are in
test_families.py):

- each group is its own pool and namespace, with its real bytes (a
  sliding-window group and a full-attention group sharing one tensor, as
  vLLM's hybrid allocator lays them out; MLA and Mamba groups described);
- a job spanning both groups stores and restores each group's pages byte for
  byte, and a hit is per group;
- the host swapping a block across groups is caught like any other swap;
- a hybrid restore in which one group's block fails is a failed job whole:
  reported as a failed receive (never as block ids, which vLLM refuses for
  hybrid models), and the intact group's blocks stay hits after the re-check;
- layouts kvseal cannot carry are refused at start with the reason.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvseal.client import tenant_digest
from kvseal.vllm import keys, manager, spec
from kvseal.vllm.groups import FULL, MAMBA, MLA, SLIDING_WINDOW, describe_groups
from kvseal.vllm.spec import (
    KVSealOffloadingManager,
    KVSealOffloadingSpec,
    KVSealOffloadingWorker,
    note_request_salt,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    OffloadKey,
    ReqContext,
)
from vllm.v1.kv_offload.config import OffloadingGroupConfig

from tests_vllm.daemon import Daemon
from tests_vllm.helpers import offloading_config, wait_for

TOKENS = 32
HEADS, DIM = 2, 32
PAGE = TOKENS * 2 * HEADS * DIM * 2  # one layer's K and V of one block, bf16: 8192
NUM_BLOCKS = 16
FULL_G, SWA_G = 0, 1


def _attn(window: int | None = None) -> Any:
    kw = dict(block_size=TOKENS, num_kv_heads=HEADS, head_size=DIM, dtype=torch.bfloat16)
    return SlidingWindowSpec(sliding_window=window, **kw) if window else FullAttentionSpec(**kw)


def _hybrid_configs(sockets: list[str], **extra: Any) -> tuple[Any, Any]:
    """vLLM's OffloadingConfig and KVCacheConfig of a Gemma-3-like model: one
    full-attention layer and one sliding-window layer (64 tokens), each its
    own group, sharing one KV tensor."""
    names = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
    base = offloading_config(sockets)
    groups = (
        OffloadingGroupConfig(tokens_per_block=TOKENS, layer_names=(names[1],), group_id=FULL_G),
        OffloadingGroupConfig(tokens_per_block=TOKENS, layer_names=(names[0],), group_id=SWA_G),
    )
    cfg = type(base)(
        **{
            **base.__dict__,
            "groups": groups,
            "worker_kv_bytes_per_block": PAGE,
            "extra_config": {**base.extra_config, **extra},
        }
    )
    kv = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(
                size=NUM_BLOCKS * PAGE, layers=list(names), layer_stride=0, block_stride=PAGE
            )
        ],
        kv_cache_groups=[
            KVCacheGroupSpec([names[1]], _attn()),
            KVCacheGroupSpec([names[0]], _attn(window=64)),
        ],
    )
    return cfg, kv


def _spec(cfg: Any, kv: Any) -> KVSealOffloadingSpec:
    spec._current_kv_cache_config = kv
    try:
        return KVSealOffloadingSpec(cfg)
    finally:
        spec._current_kv_cache_config = None


class Hybrid:
    """One rank: the spec, a worker over one shared-memory tensor that both
    groups' blocks live in (vLLM's hybrid layout), and the scheduler's manager."""

    def __init__(self, daemon: Daemon, **extra: Any) -> None:
        from kvseal.core import shm_kv

        cfg, kv = _hybrid_configs([daemon.target], **extra)
        self.spec = _spec(cfg, kv)
        with shm_kv.shm_kv_allocation():
            self.buf = torch.zeros(NUM_BLOCKS * PAGE, dtype=torch.int8)
        view = self.buf.view(NUM_BLOCKS, PAGE)
        caches = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(tensor=view, page_size_bytes=PAGE)],
            group_data_refs=[
                [CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=PAGE)],
                [CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=PAGE)],
            ],
        )
        w = self.spec.get_worker(caches)
        assert isinstance(w, KVSealOffloadingWorker)
        self.worker = w
        m = self.spec.get_manager()
        assert isinstance(m, KVSealOffloadingManager)
        self.mgr = m
        self.jobs = 0
        assert wait_for(lambda: all(x.synced.is_set() for x in m.mirrors) and len(w.pools) == 2)

    def page(self, block: int) -> bytes:
        return bytes(self.buf[block * PAGE : (block + 1) * PAGE].numpy().tobytes())

    def fill(self, block: int, seed: int) -> bytes:
        g = torch.Generator().manual_seed(seed)
        self.buf[block * PAGE : (block + 1) * PAGE] = torch.randint(
            -128, 127, (PAGE,), dtype=torch.int8, generator=g
        )
        return self.page(block)

    def job(
        self, store: bool, req: ReqContext, okeys: list[OffloadKey], blocks: list[list[int]]
    ) -> int:
        """One store or load job over both groups: ``blocks[i]`` are group i's
        GPU blocks, matching ``okeys`` in group order (as vLLM's scheduler builds
        them)."""
        self.jobs += 1
        gpu = GPULoadStoreSpec(
            [b for bs in blocks for b in bs],
            group_sizes=[len(bs) for bs in blocks],
            block_indices=[0] * len(blocks),
        )
        with self.mgr.lock:
            if store:
                out = self.mgr.prepare_store(okeys, req)
                assert out is not None and out.keys_to_store == okeys
                self.worker.submit_store(self.jobs, gpu, out.store_spec)
            else:
                self.worker.submit_load(self.jobs, self.mgr.prepare_load(okeys, req), gpu)
        self.worker.wait({self.jobs})
        done = self.worker.get_finished()
        assert [r.job_id for r in done] == [self.jobs] and done[0].success
        if store:
            with self.mgr.lock:
                self.mgr.complete_store(okeys, req)
        return self.jobs

    def close(self) -> None:
        self.mgr.shutdown()
        self.worker.shutdown()


@pytest.fixture
def hybrid(tmp_path: Path) -> Iterator[tuple[Daemon, Hybrid]]:
    d = Daemon(tmp_path / "d", extra=("--on-integrity-failure", "drop")).start()
    h = Hybrid(d)
    try:
        yield d, h
    finally:
        h.close()
        d.stop()


def _okey(vh: bytes, group: int) -> OffloadKey:
    return OffloadKey(keys.make_offload_key(vh, group))


def _req(name: str, salt: str | None = None) -> ReqContext:
    note_request_salt(name, salt)
    return ReqContext(req_id=name)


def test_each_group_is_its_own_pool_and_namespace_with_its_real_bytes(tmp_path: Path) -> None:
    cfg, kv = _hybrid_configs(["unix:///nonexistent.sock"])
    layouts = describe_groups(cfg, kv)
    assert [(g.group_id, g.kind, g.block_bytes, g.window) for g in layouts] == [
        (FULL_G, FULL, PAGE, 0),
        (SWA_G, SLIDING_WINDOW, PAGE, 64),
    ]
    s = _spec(cfg, kv)
    fps = {s.fingerprint(0, g) for g in (FULL_G, SWA_G)}
    assert len(fps) == 2  # another group, another namespace: a cross-group swap fails
    geo = {g: s.geometry_template(g) for g in (FULL_G, SWA_G)}
    assert [sum(x.bytes for x in geo[g].segments) for g in (FULL_G, SWA_G)] == [PAGE, PAGE]
    assert geo[SWA_G].layout.endswith(":sliding_window") and ":" not in geo[FULL_G].layout[11:]
    # The capacity a block takes in the tier is its group's bytes: a row for
    # every group (vLLM's CPU offload, vllm#56871) would be 2 x PAGE here.
    assert s.config.worker_kv_bytes_per_block == PAGE


def test_mla_mamba_and_quantized_groups_are_described(tmp_path: Path) -> None:
    base = offloading_config(["unix:///nonexistent.sock"])
    names = ("model.layers.0.attn", "model.layers.1.mixer")
    groups = (
        OffloadingGroupConfig(tokens_per_block=TOKENS, layer_names=(names[0],), group_id=0),
        OffloadingGroupConfig(tokens_per_block=TOKENS, layer_names=(names[1],), group_id=1),
    )
    cfg = type(base)(**{**base.__dict__, "groups": groups})
    mla = MLAAttentionSpec(block_size=TOKENS, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    mamba = MambaSpec(
        block_size=TOKENS,
        shapes=((4, 64), (2, 32, 32)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode="align",
    )
    kv = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([names[0]], mla), KVCacheGroupSpec([names[1]], mamba)],
    )
    layouts = describe_groups(cfg, kv)
    assert [(g.kind, g.heads, g.head_dim) for g in layouts] == [(MLA, 1, 576), (MAMBA, 0, 0)]
    assert layouts[0].block_bytes == TOKENS * 576 * 2  # one latent per token: no V
    assert layouts[1].block_bytes == 4 * 64 * 2 + 2 * 32 * 32 * 4  # the state, unpadded
    assert layouts[0].fingerprint_tag and layouts[1].fingerprint_tag
    # Mamba state in another cache mode: refused, with vLLM's reason.
    none_mode = MambaSpec(
        block_size=TOKENS, shapes=((4, 64),), dtypes=(torch.bfloat16,), mamba_cache_mode="all"
    )
    kv2 = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([names[0]], mla),
            KVCacheGroupSpec([names[1]], none_mode),
        ],
    )
    with pytest.raises(ValueError, match=r"group 1.*mamba-cache-mode align"):
        describe_groups(cfg, kv2)
    # Several groups without the KVCacheConfig (the spec named on vLLM's own
    # OffloadingConnector): their bytes are unknown, so the start fails.
    with pytest.raises(ValueError, match=r"2 KV-cache groups.*KVSealOffloadingConnector"):
        KVSealOffloadingSpec(cfg)
    # fp8 KV: the quantization mode is bound into the fingerprint.
    fp8 = FullAttentionSpec(
        block_size=TOKENS, num_kv_heads=HEADS, head_size=DIM, dtype=torch.uint8,
        kv_quant_mode=type(mla.kv_quant_mode).FP8_PER_TENSOR,
    )  # fmt: skip
    one = type(base)(**{**base.__dict__, "groups": groups[:1]})
    kv3 = KVCacheConfig(
        num_blocks=4, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec([names[0]], fp8)]
    )
    (q,) = describe_groups(one, kv3)
    assert q.quant == "FP8_PER_TENSOR" and "quant=FP8_PER_TENSOR" in q.fingerprint_tag


def test_a_job_over_two_groups_restores_each_groups_pages(
    hybrid: tuple[Daemon, Hybrid],
) -> None:
    _d, h = hybrid
    req = _req("r1", "tenant-1")
    h.mgr.on_new_request(req)
    vh = [bytes([i]) * 32 for i in (1, 2)]
    okeys = [_okey(vh[0], FULL_G), _okey(vh[1], FULL_G), _okey(vh[1], SWA_G)]
    want = {b: h.fill(b, seed=b) for b in (0, 1, 2)}
    h.job(True, req, okeys, [[0, 1], [2]])
    with h.mgr.lock:
        assert [h.mgr.lookup(k, req) for k in okeys] == [LookupResult.HIT] * 3
        # Same token hash, the other group: not stored, so not a hit.
        assert h.mgr.lookup(_okey(vh[0], SWA_G), req) == LookupResult.MISS
    for b in (5, 6, 7):
        h.buf[b * PAGE : (b + 1) * PAGE] = 0
    h.job(False, req, okeys, [[5, 6], [7]])
    assert [h.page(b) for b in (5, 6, 7)] == [want[0], want[1], want[2]]
    gs = h.worker.group_stats
    assert gs[FULL_G]["restored"] == 2 and gs[SWA_G]["restored"] == 1
    # Another tenant never sees them, in any group.
    other = _req("r2", "tenant-2")
    h.mgr.on_new_request(other)
    with h.mgr.lock:
        assert {h.mgr.lookup(k, other) for k in okeys} == {LookupResult.MISS}


def _slot_of(region: Path, before: bytes) -> int:
    """Where the one block sealed since ``before`` was read lies in the region
    (the host's view: the bytes that changed)."""
    after = region.read_bytes()
    diff = [i for i in range(len(after)) if i >= len(before) or after[i] != before[i]]
    assert diff and diff[-1] - diff[0] < PAGE, (diff[:1], diff[-1:])
    return diff[0]


def test_a_block_swapped_across_groups_fails_and_a_hybrid_load_fails_whole(
    hybrid: tuple[Daemon, Hybrid],
) -> None:
    d, h = hybrid
    req = _req("r3", "tenant-3")
    h.mgr.on_new_request(req)
    vh = bytes([9]) * 32
    kf, ks = _okey(vh, FULL_G), _okey(vh, SWA_G)  # the same tokens in both groups
    h.fill(0, seed=10)
    h.fill(1, seed=11)
    r0 = d.region.read_bytes()
    h.job(True, req, [kf], [[0], []])
    off_f = _slot_of(d.region, r0)
    r1 = d.region.read_bytes()
    h.job(True, req, [ks], [[], [1]])
    off_s = _slot_of(d.region, r1)
    # The host swaps the two groups' ciphertexts (same size, same block hash).
    region = bytearray(d.region.read_bytes())
    a, b = bytes(region[off_f : off_f + PAGE]), bytes(region[off_s : off_s + PAGE])
    with open(d.region, "r+b") as f:
        f.seek(off_f)
        f.write(b)
        f.seek(off_s)
        f.write(a)
    for blk in (4, 5):
        h.buf[blk * PAGE : (blk + 1) * PAGE] = 0
    before = d.stats()["integrity_failures"]
    job = h.job(False, req, [kf, ks], [[4], [5]])
    assert d.stats()["integrity_failures"] > before
    assert h.page(4) == bytes(PAGE) and h.page(5) == bytes(PAGE)  # nothing written
    # A hybrid model's failed load is the job, never block ids (vLLM raises on
    # block-level errors when a model has several groups).
    assert h.worker.take_failed_block_ids() == set()
    assert h.worker.take_failed_load_jobs() == {job}


def test_one_groups_block_failing_fails_the_hybrid_restore_and_the_rest_comes_back(
    hybrid: tuple[Daemon, Hybrid],
) -> None:
    d, h = hybrid
    req = _req("r4", "tenant-4")
    h.mgr.on_new_request(req)
    vh = [bytes([20 + i]) * 32 for i in range(2)]
    full = [_okey(x, FULL_G) for x in vh]
    swa = _okey(vh[1], SWA_G)
    for blk in (0, 1, 2):
        h.fill(blk, seed=30 + blk)
    h.job(True, req, full, [[0, 1], []])
    r0 = d.region.read_bytes()
    h.job(True, req, [swa], [[], [2]])
    off = _slot_of(d.region, r0)
    cur = d.region.read_bytes()
    with open(d.region, "r+b") as f:  # the host flips one byte of the SWA block
        f.seek(off + 100)
        f.write(bytes([cur[off + 100] ^ 0xFF]))
    job = h.job(False, req, [*full, swa], [[8, 9], [10]])
    assert h.worker.take_failed_load_jobs() == {job}
    assert h.page(10) == bytes(PAGE)  # the failed group's page was never written
    tenant = tenant_digest("tenant-4", key=manager.TENANT_KEY)
    # The failed group's block is gone; the full-attention blocks, intact, come
    # back after the background re-check (vLLM would not offer them again).
    with h.mgr.lock:
        h.mgr.load_failed([*full, swa], req)
    assert wait_for(
        lambda: all(
            m.contains(tenant, keys.kvseal_hash(x)) for x in vh for m in h.mgr.groups[0].mirrors
        )
    )
    with h.mgr.lock:
        assert [h.mgr.lookup(k, req) for k in full] == [LookupResult.HIT] * 2
        assert h.mgr.lookup(swa, req) == LookupResult.MISS


def test_write_back_releases_a_hybrid_load_only_once_every_group_verified(
    tmp_path: Path,
) -> None:
    """Write-back, a hybrid load whose sliding-window part fails (its block
    tampered): the full-attention part verified, but its host copies are not
    released, so they are still in the tier and a later load restores them.
    That load, every part of which verifies, releases them (one tier)."""
    d = Daemon(tmp_path / "d", extra=("--on-integrity-failure", "drop")).start()
    h = Hybrid(d, kvseal_write_back=True)
    try:
        assert h.worker.write_back
        req = _req("r5", "tenant-5")
        h.mgr.on_new_request(req)
        vh = [bytes([40 + i]) * 32 for i in range(2)]
        full = [_okey(x, FULL_G) for x in vh]
        swa = _okey(vh[1], SWA_G)
        want = [h.fill(blk, seed=50 + blk) for blk in (0, 1, 2)]
        h.job(True, req, full, [[0, 1], []])
        r0 = d.region.read_bytes()
        h.job(True, req, [swa], [[], [2]])
        off = _slot_of(d.region, r0)
        cur = d.region.read_bytes()
        with open(d.region, "r+b") as f:  # the host flips one byte of the SWA block
            f.seek(off + 100)
            f.write(bytes([cur[off + 100] ^ 0xFF]))
        tenant = tenant_digest("tenant-5", key=manager.TENANT_KEY)
        hashes = [keys.kvseal_hash(x) for x in vh]
        kv = h.worker.pools[0]
        job = h.job(False, req, [*full, swa], [[8, 9], [10]])
        assert h.worker.take_failed_load_jobs() == {job}
        assert kv.pool.lookup(tenant, hashes) == 2  # not released: the load failed
        with h.mgr.lock:
            h.mgr.load_failed([*full, swa], req)
        for blk in (11, 12):
            h.buf[blk * PAGE : (blk + 1) * PAGE] = 0
        h.job(False, req, full, [[11, 12], []])
        assert h.worker.take_failed_load_jobs() == set()
        assert [h.page(11), h.page(12)] == want[:2]
        assert kv.pool.lookup(tenant, hashes) == 0  # verified whole: released
    finally:
        h.close()
        d.stop()
