"""Building kvseal's vLLM spec, manager and worker without an engine: the
OffloadingConfig vLLM would pass, and a KV cache in shared memory laid out as
vLLM's canonical per-layer block tensors. Used by test_adapter.py and
bench_lookup.py (real daemons, real shared memory, real gRPC; no model)."""

from __future__ import annotations

from typing import Any

import torch
from kvseal.core import shm_kv
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

TOKENS = 32
LAYERS = 2
PAGE = 2048  # bytes per layer per block


def offloading_config(
    sockets: list[str], rank: int = 0, model: str = "tiny", events: bool = True
) -> OffloadingConfig:
    world = len(sockets)
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                tokens_per_block=TOKENS,
                layer_names=tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)),
                group_id=0,
            ),
        ),
        worker_kv_bytes_per_block=LAYERS * PAGE,
        enable_kv_cache_events=events,
        extra_config={"kvseal_sockets": sockets},
        engine_id="engine-test",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=world,
            tp_size=world,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def shm_kv_caches(num_blocks: int) -> tuple[torch.Tensor, CanonicalKVCaches]:
    """A KV buffer allocated the way the connector makes vLLM allocate it, and
    its per-layer ``(num_blocks, PAGE)`` int8 views (layer-major, as vLLM's
    LBHNC layout is)."""
    with shm_kv.shm_kv_allocation():
        buf = torch.zeros(LAYERS * num_blocks * PAGE, dtype=torch.int8)
    views = [
        buf[i * num_blocks * PAGE : (i + 1) * num_blocks * PAGE].view(num_blocks, PAGE)
        for i in range(LAYERS)
    ]
    kv = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=v, page_size_bytes=PAGE) for v in views],
        group_data_refs=[
            [CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE) for i in range(LAYERS)]
        ],
    )
    return buf, kv


def block_bytes(buf: torch.Tensor, num_blocks: int, block: int) -> bytes:
    return b"".join(
        bytes(
            buf[i * num_blocks * PAGE + block * PAGE : i * num_blocks * PAGE + (block + 1) * PAGE]
            .numpy()
            .tobytes()
        )
        for i in range(LAYERS)
    )


def wait_for(cond: Any, timeout: float = 20.0) -> bool:
    """Poll ``cond()`` until true or ``timeout`` (a liveness bound, not a timing
    assertion)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())
