"""kvseal's SGLang linker over each pool kind SGLang 0.5.23 hands it, built
from SGLang's own pool classes on the CPU, against a real daemon
(tests_sglang.linker_harness): MLA, quantized pools with their scales, the
SWA and Mamba components of hybrid models. One level below a server, for
the families SGLang's CPU engine cannot run here (docs/sglang.md, "Model
families"); the SWA hybrid also runs in a real server
(test_sglang_families.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kvseal.sglang import keys, pools
from kvseal.sglang.layout import byte_rows
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.memory_pool import (
    HybridLinearKVPool,
    MambaPool,
    MHATokenToKVPool,
    MHATokenToKVPoolFP4,
    MHATokenToKVPoolMXFP8,
    MLATokenToKVPool,
)
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

from tests_sglang.linker_harness import (
    PAGE,
    build,
    components,
    kv,
    make_linker,
    offload_and_wait,
    page_keys,
)
from tests_vllm.daemon import Daemon

FULL, SWA, MAMBA = ComponentType.FULL, ComponentType.SWA, ComponentType.MAMBA


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(
        tmp_path_factory.mktemp("daemon"),
        extra=("--on-integrity-failure", "drop"),
        host_bytes="16MiB",
    ).start()
    yield d
    d.stop()


def _fill(tensors: list[Any], seed: int) -> None:
    """Random bytes into every tensor (fp8 and scale dtypes alike)."""
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        b = byte_rows(t)
        b.copy_(torch.randint(0, 256, b.shape, generator=g, dtype=torch.uint8))


def _rows(t: Any, first: int, n: int) -> bytes:
    return bytes(byte_rows(t)[first : first + n].flatten().numpy())


def _same_pages(tensors: list[Any], src: list[int], dst: list[int], rpp: int = PAGE) -> bool:
    return all(
        _rows(t, s * rpp, rpp) == _rows(t, d * rpp, rpp)
        for t in tensors
        for s, d in zip(src, dst, strict=True)
    )


def test_mla_latent_pages_round_trip(daemon: Daemon) -> None:
    """An MLA pool: one latent row per token and layer (kv_lora_rank + rope),
    its real bytes per page, restored byte for byte; its fingerprint binds
    no TP rank (the latent is the same on every rank)."""
    pool = MLATokenToKVPool(
        size=256, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=64,
        qk_rope_head_dim=16, layer_num=2, device="cpu", enable_memory_saver=False,
    )  # fmt: skip
    _fill(pool.kv_buffer, 1)
    linker = make_linker(pool, daemon.socket)
    try:
        tier = linker.tiers["kv"]
        assert tier.geometry.kind == "mla" and tier.component.rank_replicated
        assert tier.geometry.block_bytes == 2 * PAGE * 80 * 2  # layers x tokens x latent x bf16
        k = page_keys(10, 3)
        assert offload_and_wait(linker, [kv(k, [1, 2, 3])])
        assert linker.lookup("r", [kv(k)]) == [1, 2, 3]
        assert linker.load("r", [kv(k, [7, 8, 9])])
        assert _same_pages(pool.kv_buffer, [1, 2, 3], [7, 8, 9])
    finally:
        linker.close()


@pytest.mark.parametrize("kind", ["fp8", "fp4", "mxfp8"])
def test_quantized_pools_carry_their_scales(daemon: Daemon, kind: str) -> None:
    """fp8 KV (no scale buffers: fp8 bytes named by their dtype), FP4 and
    MXFP8 pools (per-token scale buffers): the scales are segments of the
    same sealed block and come back with their pages."""
    cls: Any = {"fp8": MHATokenToKVPool, "fp4": MHATokenToKVPoolFP4}.get(
        kind, MHATokenToKVPoolMXFP8
    )
    dtype = torch.uint8 if kind == "fp4" else torch.float8_e4m3fn
    pool = cls(
        size=256, page_size=PAGE, dtype=dtype, head_num=2, head_dim=32, layer_num=2,
        device="cpu", enable_memory_saver=False,
    )  # fmt: skip
    data = [*pool.k_buffer, *pool.v_buffer]
    scales = [*(pool.k_scale_buffer or []), *(pool.v_scale_buffer or [])]
    assert bool(scales) == (kind != "fp8")
    _fill(data + scales, 2)
    linker = make_linker(pool, daemon.socket)
    try:
        g = linker.tiers["kv"].geometry
        assert g.scaled == (kind != "fp8")
        if kind != "fp4":
            assert g.dtype == "float8_e4m3fn"  # not its uint8 storage
        k = page_keys(20 + len(kind), 2)
        assert offload_and_wait(linker, [kv(k, [1, 2])])
        assert linker.load("r", [kv(k, [5, 6])])
        assert _same_pages(data + scales, [1, 2], [5, 6])
    finally:
        linker.close()


def _same(tensors: list[Any], src: Any, dst: Any) -> bool:
    """The rows ``src`` and ``dst`` (device indices) of every tensor hold the same bytes."""
    return all(
        torch.equal(byte_rows(t).index_select(0, src), byte_rows(t).index_select(0, dst))
        for t in tensors
    )


def test_swa_window_lookup_load_and_a_tampered_swa_block(daemon: Daemon) -> None:
    """A hybrid SWA pool (1 full layer, 3 sliding-window layers, window 32
    tokens = 2 pages), its transfers built by SGLang's own Full and SWA
    components over its real allocator: two kvseal pools of their own sizes.
    A length is restorable only with the SWA pages of the window ending
    there; a load restores both; a tampered SWA block fails the load
    (recompute) although the KV pages verified."""
    pool = SWAKVPool(
        size=256, size_swa=128, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=8,
        swa_attention_layer_ids=[0, 1, 2], full_attention_layer_ids=[3], device="cpu",
    )  # fmt: skip
    alloc = SWATokenToKVPoolAllocator(
        size=256, size_swa=128, page_size=PAGE, dtype=torch.bfloat16, device="cpu",
        kvcache=pool, need_sort=False,
    )  # fmt: skip
    cache = SimpleNamespace(
        page_size=PAGE, token_to_kv_pool_allocator=alloc, is_swa_enabled=True,
        evict=lambda params: None,
    )  # fmt: skip
    comps = components(cache, [FULL, SWA], swa_window=32)
    full = [*pool.full_kv_pool.k_buffer, *pool.full_kv_pool.v_buffer]
    swa = [*pool.swa_kv_pool.k_buffer, *pool.swa_kv_pool.v_buffer]
    _fill(full + swa, 3)
    linker = make_linker(pool, daemon.socket, components={FULL, SWA}, swa_window=32)
    try:
        assert set(linker.tiers) == {"kv", "swa"} and PoolName.SWA in linker.pools
        kvt, swt = linker.tiers["kv"], linker.tiers["swa"]
        assert kvt.geometry.block_bytes == 1 * 2 * PAGE * 2 * 8 * 2  # 1 full layer
        assert swt.geometry.block_bytes == 3 * 2 * PAGE * 2 * 8 * 2  # 3 window layers
        assert kvt.fingerprint != swt.fingerprint
        k = page_keys(30, 4)
        # A node of 4 pages whose SWA value kept only its last 2 pages.
        node = SimpleNamespace(
            hash_value=k,
            component_data={
                FULL: SimpleNamespace(value=alloc.full_attn_allocator.alloc(4 * PAGE)),
                SWA: SimpleNamespace(value=alloc.swa_attn_allocator.alloc(2 * PAGE)),
            },
        )
        off = build(comps, "OFFLOAD", node=node)
        assert [t.name for t in off] == [PoolName.KV, PoolName.SWA] and off[1].keys == k[2:]
        assert offload_and_wait(linker, off)
        # L=4 has its window (pages 2, 3); shorter lengths lack SWA pages.
        assert linker.lookup("r", build(comps, "LOOKUP", k)) == [4]
        load = build(comps, "LOAD", k)  # SGLang's allocators give the slots
        assert linker.load("r", load)
        assert _same(full, node.component_data[FULL].value, load[0].device_indices)
        assert _same(swa, node.component_data[SWA].value, load[1].device_indices)

        # One component's block fails: SWA sealed, the host flips it, then KV sealed.
        j = page_keys(31, 2)
        tenant = linker.tenants.shared
        hs = [keys.kvseal_hash(x) for x in j]
        assert swt.store(tenant, hs, alloc.swa_attn_allocator.alloc(2 * PAGE), time.monotonic())
        before = daemon.stats()["integrity_failures"]
        assert daemon.tamper() > 0
        assert offload_and_wait(linker, [kv(j, [9, 10])])
        assert linker.lookup("r2", build(comps, "LOOKUP", j)) == [1, 2]
        assert not linker.load("r2", build(comps, "LOAD", j))
        assert daemon.stats()["integrity_failures"] > before
        assert linker.stats["load_failures"] == 1
    finally:
        linker.close()


def _mamba_pools() -> tuple[Any, Any]:
    shape = Mamba2StateShape.create(
        tp_world_size=1, intermediate_size=64, n_groups=1, num_heads=4, head_dim=16,
        state_size=8, conv_kernel=4,
    )  # fmt: skip
    mp = MambaPool(
        size=8, spec_state_size=0, cache_params=Mamba2CacheParams(shape=shape, layers=[0, 2]),
        mamba_layer_ids=[0, 2], device="cpu",
    )  # fmt: skip
    kvc = HybridLinearKVPool(
        size=256, dtype=torch.bfloat16, page_size=PAGE, head_num=2, head_dim=8,
        full_attention_layer_ids=[1, 3], device="cpu", mamba_pool=mp,
    )  # fmt: skip
    req = SimpleNamespace(
        mamba_pool=mp, mamba_ckpt_pool=None, mamba_allocator=MambaSlotAllocator(8, "cpu"),
        short_conv_pool=SimpleNamespace(enabled=False), ngram_pool=SimpleNamespace(enabled=False),
    )  # fmt: skip
    return kvc, req


def test_mamba_state_one_per_hit_and_a_tampered_state(daemon: Daemon) -> None:
    """A Mamba hybrid (HybridLinearKVPool + SGLang's MambaPool), its transfers
    built by SGLang's own Full and Mamba components: one state per node,
    stored at its last page; a length is restorable only where a state is;
    the state comes back byte for byte (temporal and conv, every layer); a
    tampered state fails the load although its KV verified."""
    kvc, req = _mamba_pools()
    mp = req.mamba_pool
    states = [mp.mamba_cache.temporal, *mp.mamba_cache.conv]
    full = [*kvc.full_kv_pool.k_buffer, *kvc.full_kv_pool.v_buffer]
    _fill(states + full, 4)
    alloc = PagedTokenToKVPoolAllocator(
        size=256, page_size=PAGE, dtype=torch.bfloat16, device="cpu", kvcache=kvc,
        need_sort=False,
    )  # fmt: skip
    cache = SimpleNamespace(
        page_size=PAGE, token_to_kv_pool_allocator=alloc, is_swa_enabled=False,
        req_to_token_pool=req, evict=lambda params: None,
    )  # fmt: skip
    comps = components(cache, [FULL, MAMBA])
    linker = make_linker(kvc, daemon.socket, components={FULL, MAMBA}, req_to_token_pool=req)
    try:
        mt = linker.tiers["mamba"]
        per_state = sum(s[0, 0].numel() * s.element_size() for s in states)
        assert mt.geometry.block_bytes == 2 * per_state  # 2 Mamba layers, one state
        k = page_keys(40, 3)
        node = SimpleNamespace(
            hash_value=k,
            component_data={
                FULL: SimpleNamespace(value=alloc.alloc(3 * PAGE)),
                MAMBA: SimpleNamespace(value=req.mamba_allocator.alloc(1)),
            },
        )
        off = build(comps, "OFFLOAD", node=node)
        assert off[1].name == PoolName.MAMBA and off[1].keys == k[-1:]
        assert offload_and_wait(linker, off)
        more = [*k, *page_keys(41, 1)]
        assert linker.lookup("r", build(comps, "LOOKUP", more)) == [3]
        load = build(comps, "LOAD", k)
        assert linker.load("r", load)
        assert _same(full, node.component_data[FULL].value, load[0].device_indices)
        src, dst = int(node.component_data[MAMBA].value[0]), int(load[1].device_indices[0])
        assert src != dst
        for s in states:
            assert torch.equal(s[:, src].view(torch.uint8), s[:, dst].view(torch.uint8))

        j = page_keys(42, 2)
        tenant = linker.tenants.shared
        st = req.mamba_allocator.alloc(1)
        assert mt.store(tenant, [keys.kvseal_hash(j[-1])], st, time.monotonic())
        assert daemon.tamper() > 0
        assert offload_and_wait(linker, [kv(j, [9, 10])])
        assert linker.lookup("r2", build(comps, "LOOKUP", j)) == [2]
        assert not linker.load("r2", build(comps, "LOAD", j))
    finally:
        linker.close()


def test_mla_offload_stored_once_on_a_daemon_the_ranks_share(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TP rank 1 of 2 with MLA: on a daemon all ranks share (no ``{rank}``
    in the socket) it stores nothing (rank 0 stores the latent every rank
    has) and reports success; with one daemon per rank it stores its own."""
    from kvseal.sglang import linker as linker_mod

    monkeypatch.setattr(linker_mod, "_tp", lambda params: (1, 2))

    def mla() -> Any:
        return MLATokenToKVPool(
            size=64, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=64,
            qk_rope_head_dim=16, layer_num=1, device="cpu", enable_memory_saver=False,
        )  # fmt: skip

    shared = make_linker(mla(), daemon.socket)
    try:
        before = daemon.stats()["offloaded_blocks"]
        assert offload_and_wait(shared, [kv(page_keys(50, 2), [1, 2])])
        assert shared.stats["offloads_deduplicated"] == 1
        assert daemon.stats()["offloaded_blocks"] == before
    finally:
        shared.close()
    # "{rank}" in the socket: one daemon per rank (here the same one, as rank 1's).
    own = make_linker(
        mla(), daemon.socket.replace("kvseal.sock", "kvseal{rank}.sock"), ready_wait_s=0.1
    )
    try:
        assert own.offload_owner
    finally:
        own.close()


def test_what_kvseal_cannot_carry_is_refused_with_the_reason() -> None:
    mha = MHATokenToKVPool(
        size=64, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=8, layer_num=1,
        device="cpu", enable_memory_saver=False,
    )  # fmt: skip
    none = SimpleNamespace()
    with pytest.raises(ValueError, match="Full, SWA and Mamba"):
        pools.components(mha, none, {"FULL", "C128"}, PAGE)
    with pytest.raises(ValueError, match="DeepSeek-V4"):
        pools.components(SimpleNamespace(c4_kv_pool=1), none, {"FULL", "SWA"}, PAGE)
    with pytest.raises(ValueError, match="draft KV"):
        pools.components(mha, SimpleNamespace(mtp_draft_device_pools=(mha,)), {"FULL"}, PAGE)
    mha.kv_cache_layout = "vectorized_5d"
    with pytest.raises(ValueError, match="vectorized_5d"):
        pools.components(mha, none, {"FULL"}, PAGE)
    kvc, req = _mamba_pools()
    req.mamba_ckpt_pool = object()
    with pytest.raises(ValueError, match=r"side states.*int8"):
        pools.components(kvc, SimpleNamespace(req_to_token_pool=req), {"FULL", "MAMBA"}, PAGE)
    with pytest.raises(ValueError, match="page size"):
        pools.components(kvc, SimpleNamespace(req_to_token_pool=req), {"FULL"}, 32)


def test_fingerprints_bind_component_dtype_and_rank() -> None:
    base: dict[str, Any] = dict(
        model="m", revision=None, dtype="bfloat16", page_size=16, num_layers=2, start_layer=0,
        heads=2, head_dim=32, v_head_dim=32, block_bytes=8192, tp_rank=0, tp_size=2, pp_rank=0,
    )  # fmt: skip
    fp = keys.model_fingerprint(**base)
    assert keys.model_fingerprint(**{**base, "component": "swa"}) != fp
    assert keys.model_fingerprint(**{**base, "dtype": "float8_e5m2"}) != keys.model_fingerprint(
        **{**base, "dtype": "float8_e4m3fn"}
    )
    rep = {**base, "kind": "mla", "layout": "sglang-mla:v1", "rank_replicated": True}
    assert keys.model_fingerprint(**rep) == keys.model_fingerprint(**{**rep, "tp_rank": 1})
    assert keys.model_fingerprint(**base) != keys.model_fingerprint(**{**base, "tp_rank": 1})


def test_async_load_of_a_hybrid_completes_every_layer(daemon: Daemon) -> None:
    """``load_mode: async`` with a Full and an SWA component: the load is
    queued, restored on the load thread, and every model layer (full and
    window layers, 4 here) completes, so the forward's layer waits all
    return; the pages land byte for byte."""
    pool = SWAKVPool(
        size=256, size_swa=128, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=8,
        swa_attention_layer_ids=[0, 1, 2], full_attention_layer_ids=[3], device="cpu",
    )  # fmt: skip
    alloc = SWATokenToKVPoolAllocator(
        size=256, size_swa=128, page_size=PAGE, dtype=torch.bfloat16, device="cpu",
        kvcache=pool, need_sort=False,
    )  # fmt: skip
    cache = SimpleNamespace(
        page_size=PAGE, token_to_kv_pool_allocator=alloc, is_swa_enabled=True,
        evict=lambda params: None,
    )  # fmt: skip
    comps = components(cache, [FULL, SWA], swa_window=32)
    full = [*pool.full_kv_pool.k_buffer, *pool.full_kv_pool.v_buffer]
    swa = [*pool.swa_kv_pool.k_buffer, *pool.swa_kv_pool.v_buffer]
    _fill(full + swa, 5)
    linker = make_linker(
        pool, daemon.socket, components={FULL, SWA}, swa_window=32, load_mode="async"
    )
    try:
        assert linker.layer_done_counter.num_layers == 4
        k = page_keys(60, 2)
        node = SimpleNamespace(
            hash_value=k,
            component_data={
                FULL: SimpleNamespace(value=alloc.full_attn_allocator.alloc(2 * PAGE)),
                SWA: SimpleNamespace(value=alloc.swa_attn_allocator.alloc(2 * PAGE)),
            },
        )
        assert offload_and_wait(linker, build(comps, "OFFLOAD", node=node))
        load = build(comps, "LOAD", k)
        assert linker.load("r", load)
        index = linker.start_layer_wise_loading()
        assert index >= 0
        linker.layer_done_counter.set_consumer(index)
        for layer in range(4):
            linker.layer_done_counter.wait_until(layer)
        assert linker.finish_layer_wise_loading(index)
        assert _same(full, node.component_data[FULL].value, load[0].device_indices)
        assert _same(swa, node.component_data[SWA].value, load[1].device_indices)
    finally:
        linker.close()
