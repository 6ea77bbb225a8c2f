"""The one place where kvseal meets what differs between vLLM versions (0.32,
0.33, 0.34), and every reach into vLLM internals (private tables, the block
pool's reuse watchers, frames up the stack). The rest of the adapter calls
the functions here; nothing else in :mod:`kvseal.vllm` probes vLLM's version,
reads a private vLLM attribute or walks the stack.

:data:`NAMES` lists every vLLM name kvseal relies on, per version, with the
parameters it expects: ``tests_vllm/test_compat.py`` (0.32) and
``tests_vllm/v033/test_compat.py`` (0.33, 0.34) import each supported
version's classes and fail when one is missing or its signature changed, so
the table (and docs/vllm.md's list, which is written from it) cannot drift.

What differs (docs/vllm.md, "vLLM versions"):

- 0.34 hands the worker raw device pointers (``DevicePointers``) instead of
  GPU block ids: :func:`job_pages` maps them back to pool pages
  (:mod:`kvseal.vllm.pointers`; anything that does not map fails the job).
- 0.34 reports failed jobs natively (:data:`NATIVE_FAILURES`): a failed load
  is a ``TransferResult`` with ``success=False``, which vLLM turns into a
  failed receive (recomputed) and ``OffloadingWorkerMetadata.failed_jobs``;
  0.32/0.33 accept only successes, so kvseal reports load errors itself.
- 0.34 raises ``RuntimeError`` in its worker for a failed *sync* (expedited)
  load: :data:`EXPEDITED_LOADS` is False there, and the spec turns vLLM's
  ``sync_load_budget_bytes`` off (logged), so no load vLLM relies on within
  the step can fail.
- ``OffloadingManager.touch`` exists before 0.34 only (kvseal's no-op stays
  for those).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

from kvseal.vllm.pointers import PageRegion, map_pointers

import vllm
from vllm.v1.kv_offload import base as _base

__all__ = [
    "EXPEDITED_LOADS",
    "NAMES",
    "NATIVE_FAILURES",
    "VERSION",
    "Name",
    "block_pool_of",
    "caller_frame",
    "failed_jobs",
    "find_caller",
    "missing_attrs",
    "missing_callables",
    "job_pages",
    "new_job_id",
    "reuse_watchers",
    "scheduler_job",
    "set_reuse_watchers",
    "worker_load_jobs",
]


def _version(s: str) -> tuple[int, int]:
    parts = [*s.split("+", 1)[0].split("."), "0", "0"][:2]
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


VERSION: tuple[int, int] = _version(vllm.__version__)
# Whether the worker is handed DevicePointers (0.34) instead of GPU block ids.
DEVICE_POINTERS: bool = hasattr(_base, "DevicePointers")
# 0.34: a TransferResult's success is honoured (failed receive, failed_jobs).
NATIVE_FAILURES: bool = DEVICE_POINTERS
# Whether kvseal lets vLLM run sync (expedited) loads: not where a failed one
# raises RuntimeError in vLLM's worker (0.34).
EXPEDITED_LOADS: bool = not NATIVE_FAILURES


@dataclass(frozen=True)
class Name:
    """One vLLM name kvseal relies on. ``attr``: a dotted path below the module
    (``Class.method``); ``kind``: ``callable`` (``params`` are its parameter
    names, in order, or None: any), ``field`` (a dataclass field), ``init``
    (an attribute ``__init__`` sets: ``self.<last part>``), ``property`` or
    ``absent`` (must not exist: kvseal relies on its absence). ``since`` /
    ``until``: the versions it applies to (``until`` exclusive)."""

    module: str
    attr: str
    kind: str = "callable"
    params: tuple[str, ...] | None = None
    since: tuple[int, int] = (0, 32)
    until: tuple[int, int] = (99, 0)
    private: bool = False
    used_by: str = ""

    def applies(self, version: tuple[int, int]) -> bool:
        return self.since <= version < self.until


_BASE = "vllm.v1.kv_offload.base"
_SCHED = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler"
_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker"
_COMMON = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common"
_POOL = "vllm.v1.core.block_pool"
_KVBASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
_V34 = (0, 34)
_MGR = ("self", "keys", "req_context")

NAMES: tuple[Name, ...] = (
    # The offloading API kvseal implements (public).
    Name(
        _BASE,
        "OffloadingWorker.submit_store",
        params=("self", "job_id", "src_spec", "dst_spec"),
        until=_V34,
        used_by="worker",
    ),
    Name(
        _BASE,
        "OffloadingWorker.submit_store",
        params=("self", "job_id", "device_ptrs", "dst_spec"),
        since=_V34,
        used_by="worker",
    ),
    Name(
        _BASE,
        "OffloadingWorker.submit_load",
        params=("self", "job_id", "src_spec", "dst_spec"),
        until=(0, 33),
        used_by="worker",
    ),
    Name(
        _BASE,
        "OffloadingWorker.submit_load",
        params=("self", "job_id", "src_spec", "dst_spec", "expedited"),
        since=(0, 33),
        until=_V34,
        used_by="worker",
    ),
    Name(
        _BASE,
        "OffloadingWorker.submit_load",
        params=("self", "job_id", "src_spec", "device_ptrs", "expedited"),
        since=_V34,
        used_by="worker",
    ),
    Name(_BASE, "OffloadingWorker.wait", params=("self", "job_ids"), used_by="worker"),
    Name(_BASE, "OffloadingWorker.get_finished", params=("self",), used_by="worker"),
    Name(_BASE, "TransferResult.success", kind="field", used_by="worker"),
    Name(_BASE, "DevicePointers.ptrs", kind="field", since=_V34, used_by="compat.job_pages"),
    Name(_BASE, "DevicePointers.sizes", kind="field", since=_V34, used_by="compat.job_pages"),
    Name(
        _BASE,
        "DevicePointers.group_block_counts",
        kind="field",
        since=_V34,
        used_by="compat.job_pages",
    ),
    Name(
        _BASE,
        "DevicePointers.group_data_ref_counts",
        kind="field",
        since=_V34,
        used_by="compat.job_pages",
    ),
    Name(
        _BASE,
        "GPULoadStoreSpec.__init__",
        params=("self", "block_ids", "group_sizes", "block_indices"),
        used_by="worker, evict",
    ),
    Name(
        _BASE, "OffloadingManager.lookup", params=("self", "key", "req_context"), used_by="manager"
    ),
    Name(_BASE, "OffloadingManager.prepare_load", params=_MGR, used_by="manager"),
    Name(_BASE, "OffloadingManager.prepare_store", params=_MGR, used_by="manager"),
    Name(_BASE, "OffloadingManager.complete_store", params=(*_MGR, "success"), used_by="manager"),
    Name(
        _BASE, "OffloadingManager.on_new_request", params=("self", "req_context"), used_by="manager"
    ),
    Name(_BASE, "OffloadingManager.on_schedule_end", params=("self", "context"), used_by="manager"),
    Name(_BASE, "OffloadingManager.touch", params=_MGR, until=_V34, used_by="manager"),
    Name(_BASE, "OffloadingManager.touch", kind="absent", since=_V34, used_by="manager"),
    Name(_BASE, "OffloadingManager.lock", kind="property", since=(0, 33), used_by="manager"),
    Name(
        _BASE,
        "OffloadingManager.on_reset_flushed",
        params=("self",),
        since=(0, 33),
        used_by="manager",
    ),
    Name(_BASE, "OffloadingSpec.get_worker", params=("self", "kv_caches"), used_by="spec"),
    Name(_COMMON, "OffloadingConnectorMetadata.store_jobs", kind="field", used_by="evict"),
    Name(_COMMON, "OffloadingConnectorMetadata.jobs_to_flush", kind="field", used_by="evict"),
    Name(
        _COMMON, "OffloadingWorkerMetadata.completed_jobs", kind="field", used_by="connector, evict"
    ),
    Name(
        _COMMON,
        "OffloadingWorkerMetadata.failed_jobs",
        kind="field",
        since=_V34,
        used_by="connector",
    ),
    Name(_COMMON, "TransferJob.src_spec", kind="field", used_by="evict"),
    # vLLM internals (private names, or public attributes of private machinery).
    Name(
        _SCHED,
        "OffloadingConnectorScheduler._jobs",
        kind="init",
        private=True,
        used_by="compat.scheduler_job (connector)",
    ),
    Name(
        _SCHED,
        "OffloadingConnectorScheduler._req_status",
        kind="init",
        private=True,
        used_by="compat.scheduler_job (connector)",
    ),
    Name(
        _SCHED,
        "OffloadingConnectorScheduler._generate_job_id",
        params=("self",),
        private=True,
        used_by="compat.new_job_id (evict)",
    ),
    Name(_SCHED, "TransferJobStatus.keys", kind="field", used_by="compat.scheduler_job"),
    Name(_SCHED, "TransferJobStatus.is_store", kind="field", used_by="compat.scheduler_job"),
    Name(_SCHED, "RequestOffloadState.req_context", kind="field", used_by="compat.scheduler_job"),
    Name(
        _WORKER,
        "OffloadingConnectorWorker._load_jobs",
        kind="init",
        private=True,
        used_by="compat.worker_load_jobs (connector, 0.32/0.33)",
    ),
    Name(
        _KVBASE,
        "KVConnectorBase_V1._kv_cache_manager",
        kind="init",
        private=True,
        used_by="compat.block_pool_of (evict)",
    ),
    Name(
        _POOL,
        "BlockPool._reuse_watchers",
        kind="init",
        private=True,
        used_by="compat.reuse_watchers, compat.set_reuse_watchers (evict)",
    ),
    Name(_POOL, "BlockPool._notify_reuse", private=True, used_by="evict (bind check)"),
    Name(_POOL, "BlockPool.get_new_blocks", params=("self", "num_blocks"), used_by="evict"),
)


# ---------------------------------------------------------------- worker


def job_pages(spec: Any, pools: Sequence[Any]) -> tuple[list[int], list[int] | None]:
    """``(pages, group_sizes)`` of the GPU side of a job: vLLM 0.32/0.33's
    ``GPULoadStoreSpec`` (its block ids; ``group_sizes`` None for one group
    without sizes), or 0.34's ``DevicePointers``, mapped to the pages of
    ``pools`` (:class:`~kvseal.core.kv_pool.KVPool`, one per offloaded group,
    in config order) by :func:`kvseal.vllm.pointers.map_pointers`.
    :class:`~kvseal.vllm.pointers.PointerError` when a pointer does not map:
    the job must fail, untouched."""
    if hasattr(spec, "block_ids"):
        sizes = getattr(spec, "group_sizes", None)
        return [int(b) for b in spec.block_ids], (
            [int(s) for s in sizes] if sizes is not None else None
        )
    regions = [[PageRegion(*r) for r in p.page_regions()] for p in pools]
    return map_pointers(
        spec.ptrs, spec.sizes, spec.group_block_counts, spec.group_data_ref_counts, regions
    )


# ---------------------------------------------------------------- connector


@dataclass(frozen=True)
class SchedJob:
    """A transfer job as vLLM's offloading scheduler tracks it."""

    req_id: str
    keys: Any
    is_store: bool
    req_context: Any


def scheduler_job(sched: Any, job_id: int) -> SchedJob | None:
    """Job ``job_id`` of vLLM's ``OffloadingConnectorScheduler`` (its private
    ``_jobs`` and ``_req_status`` tables, 0.32-0.34); None when unknown."""
    job = sched._jobs.get(job_id)
    st = sched._req_status.get(job.req_id) if job is not None else None
    if job is None or st is None:
        return None
    return SchedJob(job.req_id, job.keys, bool(job.is_store), st.req_context)


def worker_load_jobs(connector_worker: Any) -> dict[int, Any]:
    """A copy of vLLM's worker-side load table (job id -> request id; private
    ``_load_jobs``), {} without one."""
    return dict(getattr(connector_worker, "_load_jobs", {}) or {})


def failed_jobs(worker_meta: Any) -> set[int]:
    """The jobs a worker reported failed (0.34's ``failed_jobs``; empty before)."""
    return set(getattr(worker_meta, "failed_jobs", ()) or ())


# ---------------------------------------------------------------- eviction mode


def caller_frame(depth: int = 1) -> FrameType | None:
    """The frame ``depth`` levels above the caller of this function (1: the
    caller's caller). Eviction mode finds vLLM's scheduler objects there."""
    try:
        return sys._getframe(depth + 1)
    except ValueError:
        return None


def find_caller(frame: FrameType | None, match: Any, depth: int) -> Any:
    """The ``self`` of the first of ``depth`` frames from ``frame`` up for
    which ``match(self)`` holds (eviction mode: vLLM's connector above its
    offloading scheduler); None when none does."""
    for _ in range(depth):
        if frame is None:
            return None
        o = frame.f_locals.get("self")
        if match(o):
            return o
        frame = frame.f_back
    return None


def block_pool_of(connector: Any) -> Any:
    """The block pool vLLM bound to ``connector`` (``bind_kv_cache_manager``:
    the private ``_kv_cache_manager``), None without one."""
    return getattr(getattr(connector, "_kv_cache_manager", None), "block_pool", None)


def reuse_watchers(pool: Any) -> Any:
    """The block pool's private ``_reuse_watchers`` (block id -> callback fired
    when ``get_new_blocks`` hands the block out), None without one."""
    return getattr(pool, "_reuse_watchers", None)


def set_reuse_watchers(pool: Any, table: dict[int, Any]) -> None:
    """Replace the block pool's private ``_reuse_watchers`` with ``table`` (a
    ``dict`` holding the same entries: eviction mode's
    :class:`~kvseal.vllm.fence.FencedWatchers`). vLLM 0.32-0.34 only index,
    ``pop`` and iterate the attribute, and never assign it again after
    ``__init__``."""
    pool._reuse_watchers = table


def missing_callables(obj: Any, names: Sequence[str]) -> list[str]:
    """Which of ``names`` are not methods of ``obj`` (eviction mode's bind
    check of vLLM's scheduler and block pool)."""
    return [n for n in names if not callable(getattr(obj, n, None))]


def missing_attrs(obj: Any, names: Sequence[str]) -> list[str]:
    """Which of ``names`` ``obj`` does not have (the free queue's ends)."""
    return [n for n in names if not hasattr(obj, n)]


def new_job_id(sched: Any) -> int:
    """A job id from vLLM's offloading scheduler's own counter (private)."""
    return int(sched._generate_job_id())


def source_of(fn: Any) -> str:
    """``fn``'s source ("" when unavailable): eviction mode's bind check reads
    what ``BlockPool.get_new_blocks`` does."""
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""
