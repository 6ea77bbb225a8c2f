"""Benchmark-only plaintext offload anchor (never part of the product).

``PlainOffloadingSpec`` is vLLM 0.32's own ``CPUOffloadingManager`` (LRU, its
chunk pool and store policy) with a plain copy worker: a block is copied, in
the clear, between the engine's KV cache and a host buffer in POSIX shared
memory (``/dev/shm``). vLLM's ``CPUOffloadingSpec`` refuses the CPU platform
(its worker needs CUDA/XPU streams), hence this worker. It is what an
offload tier costs with no sealing, no daemon and no RPC: the upper bound
kvseal is compared with in ``make bench-serving``.

Enabled with vLLM's own connector::

    {"kv_connector":"OffloadingConnector","kv_role":"kv_both",
     "kv_connector_extra_config":{"spec_name":"PlainOffloadingSpec",
       "spec_module_path":"bench.serving.anchor","cpu_bytes_to_use":N}}

Copies run synchronously in ``submit_store``/``submit_load``: vLLM submits a
store after the step that computed its blocks and a load before the step
that reads them, and on the CPU platform there is no stream to overlap with.
"""

from __future__ import annotations

import mmap
import os
import sys
import time
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec


class PlainCopyWorker(OffloadingWorker):
    """Copies whole blocks (every layer's page of the offloaded group) between
    the KV cache and ``num_chunks`` host slots in one shared-memory object."""

    def __init__(self, kv_caches: CanonicalKVCaches, num_chunks: int) -> None:
        self.views: list[torch.Tensor] = []  # per layer: [num_pages, page_bytes] uint8
        for ref in kv_caches.group_data_refs[0]:
            t = kv_caches.tensors[ref.tensor_idx].tensor
            stride = t.stride(0) * t.element_size()
            # Byte view of page p of this layer: the same bytes kvseal's worker
            # names by (offset, page_stride, bytes) in its pool geometry.
            base = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
            raw = torch.as_strided(
                base, (t.shape[0], ref.page_size_bytes), (stride, 1),
                t.storage_offset() * t.element_size(),
            )  # fmt: skip
            self.views.append(raw)
        self.block_bytes = sum(v.shape[1] for v in self.views)
        size = max(1, num_chunks) * self.block_bytes
        self.shm_path = f"/dev/shm/kvseal-bench-anchor-{os.getpid()}"
        fd = os.open(self.shm_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        host = torch.frombuffer(self._mm, dtype=torch.uint8).view(max(1, num_chunks), -1)
        self.host_views: list[torch.Tensor] = []
        off = 0
        for v in self.views:
            self.host_views.append(host[:, off : off + v.shape[1]])
            off += v.shape[1]
        self._done: list[TransferResult] = []

    def _copy(self, job_id: int, store: bool, pages: list[int], chunks: list[int]) -> bool:
        t0 = time.monotonic()
        p = torch.tensor(pages, dtype=torch.long)
        c = torch.tensor(chunks, dtype=torch.long)
        for v, h in zip(self.views, self.host_views, strict=True):
            if store:
                h.index_copy_(0, c, v.index_select(0, p))
            else:
                v.index_copy_(0, p, h.index_select(0, c))
        self._done.append(
            TransferResult(job_id, True, len(pages) * self.block_bytes, time.monotonic() - t0)
        )
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        assert isinstance(dst_spec, CPULoadStoreSpec)
        return self._copy(job_id, True, [int(b) for b in src_spec.block_ids],
                          [int(b) for b in dst_spec.block_ids])  # fmt: skip

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, CPULoadStoreSpec)
        return self._copy(job_id, False, [int(b) for b in dst_spec.block_ids],
                          [int(b) for b in src_spec.block_ids])  # fmt: skip

    def get_finished(self) -> list[TransferResult]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every job finished inside its submit call

    def shutdown(self) -> None:
        try:
            os.unlink(self.shm_path)
        except FileNotFoundError:
            pass


class PlainOffloadingSpec(OffloadingSpec):
    """vLLM's CPUOffloadingManager over ``cpu_bytes_to_use`` bytes of plain
    shared memory (``kv_connector_extra_config``), one vLLM block per chunk."""

    # The manager reports vLLM's CPU-offload metrics: declare the same ones.
    build_metric_definitions = CPUOffloadingSpec.build_metric_definitions

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        total = int(self.extra_config.get("cpu_bytes_to_use", 0))
        per = config.worker_kv_bytes_per_block * max(1, self.blocks_per_chunk)
        self.num_chunks = total // per if per else 0
        # The tier's capacity for make bench-serving's tokens per tier byte
        # (arms.Arm.tier_summary reads it from the server's log).
        print(f"kvseal-bench-anchor: chunks={self.num_chunks} chunk_bytes={per}",
              file=sys.stderr, flush=True)  # fmt: skip
        self._manager: OffloadingManager | None = None
        self._worker: PlainCopyWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = CPUOffloadingManager(
                num_chunks=self.num_chunks,
                enable_events=self.kv_events_config.enable_kv_cache_events,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = PlainCopyWorker(kv_caches, self.num_chunks)
        return self._worker


def describe() -> dict[str, Any]:
    return {"spec": "PlainOffloadingSpec", "manager": "vllm CPUOffloadingManager (lru)"}
