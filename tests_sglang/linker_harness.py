"""kvseal's SGLang linker driven in this process, one level below a server.

:func:`make_linker` constructs :class:`kvseal.sglang.linker.KVSealLinker` the
way SGLang's worker does (``linker_factory.create_unified_cache_linker``:
``Linker(server_args, params, components=..., extra_config=...)``), over a KV
pool built from SGLang's own pool classes on the CPU and against a real
daemon. The tests then call the linker's ABC methods with SGLang's own
``PoolTransfer`` objects, as ``UnifiedCacheLinkerWrapper`` would.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

PAGE = 16


def mha_pool(pages: int = 16, *, dtype: torch.dtype = torch.bfloat16, layers: int = 2) -> Any:
    """SGLang's own MHA pool on the CPU (``pages`` pages of ``PAGE`` tokens)."""
    return MHATokenToKVPool(
        size=pages * PAGE, page_size=PAGE, dtype=dtype, head_num=2, head_dim=8,
        layer_num=layers, device="cpu", enable_memory_saver=False,
    )  # fmt: skip


def make_linker(
    kvcache: Any,
    socket: str,
    *,
    components: set[Any] | None = None,
    model: str = "tiny",
    req_to_token_pool: Any = None,
    server_args: Any = None,
    swa_window: int | None = None,
    **extra: Any,
) -> Any:
    from kvseal.sglang.linker import KVSealLinker

    params = SimpleNamespace(
        page_size=PAGE,
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: kvcache),
        req_to_token_pool=req_to_token_pool,
        pp_rank=0,
        pp_size=1,
        attn_tp_cache_group=None,
        tp_cache_group=None,
        sliding_window_size=swa_window,
        swa_retain_window=swa_window,
    )
    args = server_args or SimpleNamespace(model_path=model, revision=None)
    return KVSealLinker(
        args,
        params,
        components=components or {ComponentType.FULL},
        extra_config={"socket": socket, "ready_wait_s": 20, **extra},
    )


def page_keys(seed: int, n: int) -> list[str]:
    """``n`` distinct 64-hex-digit storage keys fixed by ``seed``."""
    import hashlib

    return [hashlib.sha256(f"{seed}/{i}".encode()).hexdigest() for i in range(n)]


def slots(pages: list[int]) -> torch.Tensor:
    """The token slots of device ``pages`` (page-aligned, in page order)."""
    return torch.tensor([p * PAGE + j for p in pages for j in range(PAGE)], dtype=torch.int64)


def kv(keys: list[str], pages: list[int] | None = None) -> PoolTransfer:
    return PoolTransfer(
        name=PoolName.KV, keys=list(keys), device_indices=None if pages is None else slots(pages)
    )


def components(cache: Any, kinds: list[Any], *, swa_window: int = 0) -> list[Any]:
    """SGLang's own tree components (``FullComponent``, ``SWAComponent``,
    ``MambaComponent``) over ``cache`` (the attributes their linker-transfer
    builders read: page size, allocators), without a radix tree: the tests
    get the transfers exactly as ``UnifiedCacheLinkerWrapper`` does."""
    from sglang.srt.mem_cache.unified_cache.components.full import FullComponent
    from sglang.srt.mem_cache.unified_cache.components.mamba import MambaComponent
    from sglang.srt.mem_cache.unified_cache.components.swa import SWAComponent

    out = []
    for kind in kinds:
        cls: Any = {
            ComponentType.FULL: FullComponent,
            ComponentType.SWA: SWAComponent,
            ComponentType.MAMBA: MambaComponent,
        }[kind]
        c = object.__new__(cls)
        c.cache = cache
        c.component_type = kind
        if kind == ComponentType.SWA:
            c.sliding_window_size = swa_window
        out.append(c)
    return out


def build(
    comps: list[Any], phase: str, keys: list[str] | None = None, node: Any = None
) -> list[Any]:
    """Each component's transfer for ``phase`` (``LOOKUP``, ``LOAD``,
    ``OFFLOAD``) as the wrapper builds them (an offload skips a component
    with nothing to store, as the tree core does)."""
    from sglang.srt.mem_cache.unified_cache.components import LinkerTransferPhase

    ph = LinkerTransferPhase[phase]
    out = [c.build_external_linker_transfer(ph, node, keys) for c in comps]
    if ph == LinkerTransferPhase.OFFLOAD:
        return [t for t in out if t is not None]
    assert all(t is not None for t in out), out
    return out


def offload_and_wait(linker: Any, transfers: list[PoolTransfer], timeout: float = 60.0) -> bool:
    """``offload`` then the offload's verdict, as SGLang's step loop pops it."""
    assert linker.offload(transfers)
    deadline = time.monotonic() + timeout
    while linker.num_completed_offloads() == 0:
        assert time.monotonic() < deadline, "the offload never completed"
        time.sleep(0.02)
    return bool(linker.pop_completed_offload())
