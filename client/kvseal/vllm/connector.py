"""``KVSealOffloadingConnector``: vLLM's OffloadingConnector with the kvseal spec.

One config line enables it (docs/vllm.md)::

    --kv-transfer-config '{"kv_connector":"KVSealOffloadingConnector",
      "kv_connector_module_path":"kvseal.vllm.connector","kv_role":"kv_both",
      "kv_load_failure_policy":"recompute",
      "kv_connector_extra_config":{"kvseal_socket":"/run/kvseal/kvseal.sock"}}'

What it adds to vLLM's own OffloadingConnector, and why:

- the spec defaults to :class:`~kvseal.vllm.spec.KVSealOffloadingSpec`;
- on the CPU platform the KV cache is allocated in a named POSIX shared-memory
  object (``get_mem_pool_context``), which the daemon's CPU backend opens;
- each request's ``cache_salt`` is handed to the manager (vLLM's ``ReqContext``
  has none) and becomes the kvseal tenant; the salt stays in this process;
- a restore that failed is reported as load errors of its blocks
  (``get_block_ids_with_load_errors``): with ``kv_load_failure_policy`` set to
  ``recompute`` vLLM recomputes them. A model with several KV-cache groups
  (hybrid sliding-window or Mamba models) reports the request instead, as a
  failed receive (``get_transfer_results``), which vLLM recomputes whole;
- prefill/decode disaggregation (:mod:`kvseal.vllm.pd`, docs/pd.md): a
  request with ``do_remote_decode`` finishes with the decode's
  ``kv_transfer_params`` (counts only); a request carrying them waits, with
  a bound, for the prefill's blocks to reach the shared sealed store;
- vLLM's ``KVCacheConfig`` is handed to the spec, which offloads every group
  vLLM's offloading config selects, each with its real bytes. vLLM's OffloadingConnector itself
  supports no failed job; the connector forces ``recompute`` (and says so) when
  the policy is left at vLLM's default ``fail``.

Works with vLLM 0.32, 0.33 and 0.34 (docs/vllm.md, support matrix). 0.33 adds
expedited loads (see the spec's worker), the manager's ``lock`` and
``on_reset_flushed`` (see the manager) and ``vllm:kv_offload_config_info``
(the spec's ``config_info_keys``, the manager's ``config_info``). 0.34 reports
failed loads itself (the worker's ``TransferResult``; the load errors and
failed receives above are 0.32/0.33's), hands the worker device pointers and
runs no expedited load with kvseal; every difference lives in
:mod:`kvseal.vllm.compat`.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any

from kvseal.core import shm_kv
from kvseal.vllm import compat, logs, orphan, pd, spec

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

log = logging.getLogger("kvseal.vllm")
# vLLM imports this module in every process it runs kvseal in (API server, engine
# core, worker): kvseal's log lines there get vLLM's format (kvseal.vllm.logs).
logs.use_vllm_handlers()
# The orphan watcher, armed at import: the earliest point kvseal runs in an engine
# process (vLLM 0.32's engine core imports this module to resolve the KV cache
# layout, after the model loaded and before any connector or spec is built). It
# decides from the kernel's parent whenever it is armed, so an engine whose API
# server was killed while it loaded still stops (kvseal.vllm.orphan); a no-op
# outside multiprocessing children.
orphan.stop_when_orphaned()


def _name_the_spec(extra: dict[str, Any]) -> None:
    extra.setdefault("spec_name", "KVSealOffloadingSpec")
    extra.setdefault("spec_module_path", "kvseal.vllm.spec")


class KVSealOffloadingConnector(OffloadingConnector):
    """See module doc."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        _name_the_spec(ktc.kv_connector_extra_config)
        if ktc.kv_load_failure_policy != "recompute":
            log.warning(
                "kvseal: kv_load_failure_policy=%r -> 'recompute' (a block that fails "
                "verification or was evicted must be recomputed, not fail the request)",
                ktc.kv_load_failure_policy,
            )
            ktc.kv_load_failure_policy = "recompute"
        spec._current_vllm_config = vllm_config
        spec._current_kv_cache_config = kv_cache_config
        self._block_size = int(vllm_config.cache_config.block_size)
        self._pd_wait_s = pd.wait_s(ktc.kv_connector_extra_config)
        self._handoffs = pd.DecodeOutcomes()
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            spec._current_vllm_config = None
            spec._current_kv_cache_config = None

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, *args: Any, **kw: Any) -> Any:
        # Called in the API server's process, where no connector was built: name
        # the spec there too, or vLLM would register the CPU spec's metrics and
        # reject kvseal's counters when the scheduler's stats arrive.
        ktc = vllm_config.kv_transfer_config
        if ktc is not None:
            _name_the_spec(ktc.kv_connector_extra_config)
        return super().build_prom_metrics(vllm_config, *args, **kw)

    def get_mem_pool_context(self) -> AbstractContextManager[Any] | None:
        if current_platform.is_cpu():
            return shm_kv.shm_kv_allocation()
        return None

    def on_new_request(self, request: Request) -> None:
        spec.note_request_salt(request.request_id, request.cache_salt)
        self._handoffs.arrived(request.request_id, request.kv_transfer_params)
        super().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int, *args: Any, **kw: Any
    ) -> tuple[int | None, bool]:
        n, is_async = super().get_num_new_matched_tokens(request, num_computed_tokens, *args, **kw)
        if n is not None:  # a final answer (None: vLLM asks again next step)
            self._handoffs.answered(
                request.request_id,
                request.num_prompt_tokens,
                self._block_size,
                num_computed_tokens + n,
                self._pd_wait_s,
            )
        return n, is_async

    def request_finished(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, block_ids)
        return delay, self._handoff(request, params)

    def request_finished_all_groups(
        self, request: Request, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished_all_groups(request, block_ids)
        return delay, self._handoff(request, params)

    def _handoff(self, request: Request, params: dict[str, Any] | None) -> dict[str, Any] | None:
        # Prefill side: the decode's params (kvseal.vllm.pd); the request's prompt
        # blocks were offloaded, and its last ones are stored at the next step.
        self._handoffs.finished(request.request_id)
        return pd.finished_params(
            request.kv_transfer_params, request.num_prompt_tokens, self._block_size, params
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        # Scheduler side: a step that reports load errors also reports the failed
        # jobs as completed (the worker aligns the two). Tell the manager which
        # blocks could not be restored before vLLM retires the jobs, so that the
        # recomputed request does not find them again and fail again.
        sched = self.connector_scheduler
        meta = connector_output.kv_connector_worker_meta
        mgr = sched.manager if sched is not None else None
        failed = connector_output.invalid_block_ids
        failed_reqs = connector_output.failed_recving
        if compat.NATIVE_FAILURES:
            # vLLM 0.34 reports the failed jobs itself (and recomputes their
            # requests): forget exactly those loads' blocks.
            failed, failed_reqs = set(), set()
            bad = compat.failed_jobs(meta)
            if sched is not None and bad and isinstance(mgr, spec.KVSealOffloadingManager):
                with mgr.lock:
                    for job_id in bad:
                        job = compat.scheduler_job(sched, job_id)
                        if job is not None and not job.is_store:
                            mgr.note_load_errors(len(job.keys))
                            mgr.load_failed(job.keys, job.req_context)
        if sched is not None and failed_reqs and isinstance(mgr, spec.KVSealOffloadingManager):
            # A hybrid model's failed load: the request as a whole (see
            # get_transfer_results). Its load jobs' blocks are forgotten.
            with mgr.lock:
                for job_id in getattr(meta, "completed_jobs", {}):
                    job = compat.scheduler_job(sched, job_id)
                    if job is None or job.is_store or job.req_id not in failed_reqs:
                        continue
                    mgr.note_load_errors(len(job.keys))
                    mgr.load_failed(job.keys, job.req_context)
        if sched is not None and failed and isinstance(mgr, spec.KVSealOffloadingManager):
            # vLLM 0.33's protocol: every manager call under the manager's lock
            # (taken here and released before vLLM's own code takes it again).
            with mgr.lock:
                mgr.note_load_errors(len(failed))  # vllm:kvseal_load_failed_blocks
                # vLLM's job and request tables (compat.scheduler_job). Every load
                # job completed in this step is taken as failed: the GPU block ids of
                # the errors cannot be mapped to jobs here, and a block wrongly
                # forgotten only costs one recompute.
                for job_id in getattr(meta, "completed_jobs", {}):  # meta may be None
                    job = compat.scheduler_job(sched, job_id)
                    if job is not None and not job.is_store:
                        mgr.load_failed(job.keys, job.req_context)
        super().update_connector_output(connector_output)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM's transfer results, plus (a model with several KV-cache groups)
        the requests whose load failed as failed receives: vLLM refuses
        block-level load errors for such models, and recomputes a failed
        receive from its first token, so no request runs on a prefix one of
        whose groups is missing (a sliding window, a Mamba state)."""
        cw = self.connector_worker
        jobs = compat.worker_load_jobs(cw)
        res = super().get_transfer_results(finished_req_ids)
        w = cw.worker if cw is not None else None
        # vLLM 0.34 reports failed receives itself (the worker's TransferResult).
        native = compat.NATIVE_FAILURES
        if isinstance(w, spec.KVSealOffloadingWorker) and w.multi_group and not native:
            for job_id in w.take_failed_load_jobs():
                req_id = jobs.get(job_id)
                if req_id is not None:
                    res.failed_recving.add(req_id)
                log.info(
                    "kvseal: restore job %d (request %s) failed in part: vLLM recomputes "
                    "the request",
                    job_id,
                    req_id,
                )
        return res

    def get_block_ids_with_load_errors(self) -> set[int]:
        w = self.connector_worker.worker if self.connector_worker is not None else None
        if isinstance(w, spec.KVSealOffloadingWorker):
            return w.take_failed_block_ids()
        return set()
