"""kvseal as a vLLM ``OffloadingSpec``: the sealed host tier behind vLLM's
OffloadingConnector.

Enable it with :mod:`kvseal.vllm.connector` (one ``--kv-transfer-config``
line, see docs/vllm.md); the spec can also be named on vLLM's own
``OffloadingConnector`` (``spec_name``/``spec_module_path``), but then the
KV cache is not in shared memory (CPU platform), ``cache_salt`` is not known
(every request is the shared tenant; vLLM's salted hashes still never match
across salts) and a failed restore cannot be reported as a recompute.

- :class:`KVSealOffloadingManager` (scheduler process) answers ``lookup`` from
  :class:`~kvseal.vllm.mirror.DaemonMirror`\\ s, one per rank: a block is a hit
  only when every rank's daemon holds it. It makes no RPC on the scheduler
  thread. ``prepare_store``/``prepare_load`` only describe the blocks (tenant,
  32-byte hashes); capacity and eviction are the daemon's, whose evictions and
  integrity drops come back through the mirrors as removals. A block whose
  store is in flight is a pending hit (``HIT_PENDING``: vLLM defers the
  request a step instead of recomputing the block), as in vLLM's own CPU
  manager, for a bounded time (the transfer timeout); a store that ended is a
  hit at once, verified by the mirrors in the background.
- :class:`KVSealOffloadingWorker` (worker process) registers this rank's KV
  pool with its daemon and turns ``submit_store``/``submit_load`` into
  ``Offload``/``Restore`` calls on its own threads (stores, loads, and vLLM
  0.33's expedited loads each on one of their own); ``get_finished`` reports
  each job. A failed restore wrote nothing into the KV cache (the daemon verifies
  every block before it writes any, and after a failed call touches nothing);
  its destination blocks are reported through
  :meth:`KVSealOffloadingWorker.take_failed_block_ids`, which the connector
  hands to vLLM as load errors, so vLLM recomputes them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvseal.client import ClientConfig, KVSealClient
from kvseal.client.config import socket_target
from kvseal.v1 import kvseal_pb2 as pb
from kvseal.vllm import keys
from kvseal.vllm.kv_pool import EngineEvent, KVPool
from kvseal.vllm.manager import (  # re-exported: the spec's public names
    CONFIG_INFO_KEYS,
    LOAD_FAILED_BLOCKS,
    SHARED_TENANT,
    TIER_BLOCKS,
    KVSealLoadStoreSpec,
    KVSealOffloadingManager,
    config_info_keys,
    metric_definitions,
    note_request_salt,
)

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

log = logging.getLogger("kvseal.vllm")

__all__ = [
    "CONFIG_INFO_KEYS",
    "LOAD_FAILED_BLOCKS",
    "SHARED_TENANT",
    "TIER_BLOCKS",
    "KVSealLoadStoreSpec",
    "KVSealOffloadingManager",
    "KVSealOffloadingSpec",
    "KVSealOffloadingWorker",
    "iter_workers",
    "note_request_salt",
    "socket_for_rank",
]

DEFAULT_SOCKET = "unix:///run/kvseal/kvseal.sock"

# Filled in by KVSealOffloadingConnector before vLLM builds the spec: the
# engine's VllmConfig (head geometry, revision, hash algorithm) and the
# request -> cache_salt map (vLLM's ReqContext carries no salt).
_current_vllm_config: Any = None


def socket_for_rank(extra: dict[str, Any], rank: int) -> str:
    """The daemon of ``rank``: ``kvseal_sockets`` (a list, one per rank) or
    ``kvseal_socket`` (may contain ``{rank}``; one daemon per GPU)."""
    socks = extra.get("kvseal_sockets")
    if socks:
        s = str(socks[rank])
    else:
        s = str(extra.get("kvseal_socket", DEFAULT_SOCKET)).format(rank=rank)
    return s if "://" in s else socket_target(s)


@dataclass
class _Job:
    job_id: int
    store: bool
    spec: KVSealLoadStoreSpec
    pages: list[int]
    expedited: bool = False  # vLLM 0.33: waited on within the step
    # CUDA: recorded on vLLM's stream when the job was submitted (kept alive
    # until the transfer returned; see KVPool.engine_event).
    event: EngineEvent | None = None


class KVSealOffloadingWorker(OffloadingWorker):
    """Worker side (see module doc). Three transfer threads per worker, for
    stores, loads and expedited loads: each kind runs in submission order, off
    vLLM's thread; a load never waits behind stores, and an expedited load
    (vLLM 0.33: its request already runs in this step, and vLLM waits for
    it before the forward pass) behind neither stores nor regular loads. The
    daemon batches each job's blocks. ``wait`` waits for the given jobs only,
    each bounded by the transfer timeout (``kvseal_transfer_timeout_s``): a
    stalled daemon delays that step, then the load fails and vLLM recomputes.

    The KV cache is this rank's :class:`~kvseal.vllm.kv_pool.KVPool`: on vLLM's CPU
    platform a shared-memory pool (CPU backend); on a GPU the KV tensors exported
    with CUDA IPC (CUDA backend), each job carrying a CUDA event that vLLM's
    stream recorded when it submitted the job, which the daemon waits for before
    it reads (store) or writes (load) the pages. A KV cache that can be neither
    disables offloading (logged; vLLM runs as without kvseal)."""

    def __init__(self, spec: KVSealOffloadingSpec, kv_caches: CanonicalKVCaches) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.block_bytes = 0
        self.kv: KVPool | None = None
        # Loads and stores on threads of their own: a request waits for its load,
        # while a store only delays a later hit, so a load never queues behind
        # the stores of other requests' new blocks (which would add their
        # transfer time to every restore's TTFT).
        self._loads: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._stores: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        # vLLM 0.33's expedited loads: the engine's step waits for each, so one
        # must not queue behind regular loads, whose requests wait anyway.
        self._expedited: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._done: list[TransferResult] = []
        self._failed_blocks: set[int] = set()  # of failed loads get_finished reported
        self._failed_jobs: dict[int, list[int]] = {}  # failed loads not reported yet
        self._pending: set[int] = set()
        self._cv = threading.Condition()
        self.stats = {
            "stores": 0,
            "loads": 0,
            "expedited_loads": 0,  # of the loads
            "failed_loads": 0,
            "partial_loads": 0,  # failed loads whose leading blocks were restored
            "dropped_stores": 0,
        }
        # Write-back: a restored block's host copy is released (the engine holds
        # it again; the daemon frees its slot). Default write-through: it stays.
        self.write_back = bool(spec.extra_config.get("kvseal_write_back", False))
        if self.write_back and self.rank == 0:
            # vLLM 0.32 offers a block for store only when it is computed, and tells a
            # connector nothing when its own cache evicts one: a block released here
            # is not written back, and once the engine evicts it, it is recomputed
            # (docs/serving.md, "write-back").
            log.warning(
                "kvseal: write-back releases a restored block's host copy, and vLLM "
                "cannot write it back when it evicts the block: expect less cached "
                "than with write-through (the default)"
            )
        # A stalled daemon delays only this rank's transfer threads (and the
        # requests waiting for a load), never the engine: bounded by this.
        timeout = float(spec.extra_config.get("kvseal_transfer_timeout_s", 10.0))
        self.client = KVSealClient(
            ClientConfig(target=spec.socket(self.rank), transfer_timeout_s=timeout)
        )
        try:
            self.kv = KVPool(
                self.client,
                keys.pool_name(spec.engine_id, spec.dp_index, self.rank, "kv"),
                spec.fingerprint(self.rank),
                spec.geometry_template(),
                kv_caches.tensors,
                kv_caches.group_data_refs[0],
            )
        except (ValueError, RuntimeError) as e:  # RuntimeError: torch refused the export
            log.error("kvseal: %s: offloading disabled", e)
        if self.kv is not None:
            pool = self.kv.pool
            self.block_bytes = self.kv.block_bytes
            expected = sum(s.bytes for s in spec.geometry_template().segments)
            if expected != self.block_bytes:
                # The scheduler's observer pool states the template's block bytes:
                # in another namespace it would never hear of this pool's blocks.
                log.error(
                    "kvseal: rank %d blocks are %d bytes, vLLM reports %d per block: the "
                    "scheduler will not see the stored blocks",
                    self.rank,
                    self.block_bytes,
                    expected,
                )
            # Registration runs in the background; at engine start-up (never on
            # the engine's hot path) wait for it a little, so the first stores
            # are not dropped. A daemon that is down costs this wait once.
            if pool.wait_ready(float(spec.extra_config.get("kvseal_ready_wait_s", 10.0))):
                log.info("kvseal: rank %d pool registered", self.rank)
            else:
                log.warning(
                    "kvseal: rank %d pool not registered yet (%s); stores are dropped until it is",
                    self.rank,
                    pool.registration_error,
                )
        self._threads = [
            threading.Thread(target=self._run, args=(q,), name=name, daemon=True)
            for q, name in (
                (self._loads, "kvseal-loads"),
                (self._stores, "kvseal-stores"),
                (self._expedited, "kvseal-expedited"),
            )
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------ vLLM API

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        assert isinstance(dst_spec, KVSealLoadStoreSpec)
        return self._submit(_Job(job_id, True, dst_spec, [int(b) for b in src_spec.block_ids]))

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        """Queue a restore; never blocks. ``expedited`` (vLLM >= 0.33 passes it for
        a load its request needs in the current step, then waits for it) runs
        on its own thread, ahead of every regular load and store."""
        assert isinstance(src_spec, KVSealLoadStoreSpec)
        pages = [int(b) for b in dst_spec.block_ids]
        return self._submit(_Job(job_id, False, src_spec, pages, expedited=bool(expedited)))

    def _submit(self, job: _Job) -> bool:
        # On vLLM's thread, whose current stream issued the KV writes (store) and
        # the last reads of the destination blocks (load): the daemon waits for it.
        if self.kv is not None and self.kv.cuda and job.pages:
            try:
                job.event = self.kv.engine_event()
            except (RuntimeError, ValueError) as e:
                # Without the event the daemon could race the engine's stream: the
                # job fails (a dropped store, a recomputed load) instead (_transfer).
                log.error("kvseal: recording the job's CUDA event failed: %s", e)
        with self._cv:
            self._pending.add(job.job_id)
        q = self._stores if job.store else self._expedited if job.expedited else self._loads
        q.put(job)
        return True

    def get_finished(self) -> list[TransferResult]:
        with self._cv:
            done, self._done = self._done, []
            # A failed load's blocks are reported (take_failed_block_ids) in the same
            # engine step as the job itself: vLLM requires that, and the scheduler
            # side maps them back to the job's blocks (connector).
            for r in done:
                pages = self._failed_jobs.pop(r.job_id, None)
                if pages is not None:
                    self._failed_blocks.update(pages)
        return done

    def take_failed_block_ids(self) -> set[int]:
        """KV-cache blocks whose restore failed since the last call: nothing was
        written into them; vLLM must recompute them."""
        with self._cv:
            out, self._failed_blocks = self._failed_blocks, set()
        return out

    def wait(self, job_ids: set[int]) -> None:
        """Block until every job in ``job_ids`` has ended (not any other: vLLM 0.33
        waits for its expedited loads in the step while stores and regular loads
        go on). Each ends within the transfer timeout, failed or not; unknown ids
        do not wait."""
        with self._cv:
            self._cv.wait_for(lambda: not (self._pending & job_ids))

    def shutdown(self) -> None:
        for q in (self._loads, self._stores, self._expedited):
            q.put(None)
        for t in self._threads:
            t.join(5.0)
        if self.kv is not None:
            self.kv.close()
        self.client.close()

    # ------------------------------------------------------------ thread

    def _run(self, jobs: queue.SimpleQueue[_Job | None]) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            t0 = time.monotonic()
            failed = job.pages
            try:
                failed = self._transfer(job)
            except Exception:  # never let a transfer kill the thread (vLLM would hang)
                log.exception("kvseal: transfer job %d failed", job.job_id)
            dt = time.monotonic() - t0
            with self._cv:
                if job.store:
                    self.stats["stores"] += 1
                    self.stats["dropped_stores"] += bool(failed)
                else:
                    self.stats["loads"] += 1
                    self.stats["expedited_loads"] += job.expedited
                    if failed:
                        self.stats["failed_loads"] += 1
                        self.stats["partial_loads"] += len(failed) < len(job.pages)
                        self._failed_jobs[job.job_id] = failed
                # vLLM 0.32's OffloadingConnector asserts success: a dropped store is
                # just a later miss, and a failed load is reported as load errors.
                self._done.append(
                    TransferResult(job.job_id, True, len(job.pages) * self.block_bytes, dt)
                )
                self._pending.discard(job.job_id)
                self._cv.notify_all()

    def _transfer(self, job: _Job) -> list[int]:
        """Run one job; returns the pages it failed (all of a dropped store; of
        a load, those vLLM must recompute)."""
        if not job.pages:
            return []
        if self.kv is None or len(job.pages) != len(job.spec.hashes):
            return job.pages
        if self.kv.cuda and job.event is None:
            return job.pages  # never without the engine's event (see _submit)
        sp = job.spec
        if job.store:
            ok = self.kv.offload(
                sp.tenant, sp.hashes, job.pages, sp.parent_hash or None, event=job.event
            )
            return [] if ok else job.pages
        if self.kv.restore(
            sp.tenant, sp.hashes, job.pages, release=self.write_back, event=job.event
        ):
            return []
        # A restore is all or nothing, so one block the daemon evicted since the
        # scheduler's lookup (a busy tier evicts while restores queue) failed the
        # whole job. The blocks before the first one missing are still worth a
        # restore: vLLM recomputes from the first failed block on, so those it
        # keeps. One Lookup (here, never on the scheduler thread) and one more
        # Restore of that prefix; it, too, writes nothing if it fails.
        n = self.kv.pool.lookup(sp.tenant, sp.hashes) if len(job.pages) > 1 else 0
        if 0 < n < len(job.pages) and self.kv.restore(
            sp.tenant, sp.hashes[:n], job.pages[:n], release=self.write_back, event=job.event
        ):
            return job.pages[n:]
        return job.pages


class KVSealOffloadingSpec(OffloadingSpec):
    """The kvseal tier as a vLLM offloading spec.

    ``kv_connector_extra_config`` keys: ``kvseal_socket`` (the daemon's socket;
    ``{rank}`` is replaced by the worker's rank: one daemon per GPU) or
    ``kvseal_sockets`` (a list, one per rank); ``kvseal_transfer_timeout_s``
    (default 10: the deadline of one Offload/Restore); ``kvseal_write_back``
    (default false: write-through, a restored block stays in the tier; true: its
    host copy is released once restored); ``kvseal_lookup_discovery``
    (default false: also find blocks the daemon held before this engine
    subscribed, at the price of deferring a request with unknown blocks by a
    scheduler step while one batched Lookup runs in the background). Supported: one offloaded
    full-attention KV-cache group, one vLLM block per offloaded chunk (the
    defaults); anything else is refused at start with a clear error.
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """The metrics kvseal adds to vLLM's /metrics (``vllm:kvseal_*``)."""
        return metric_definitions()

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """vLLM >= 0.33: the labels of kvseal's ``vllm:kv_offload_config_info``
        series, which the manager's ``config_info`` fills (:data:`CONFIG_INFO_KEYS`)."""
        return config_info_keys()

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        if len(config.groups) != 1:
            raise ValueError(
                f"kvseal offloads one KV-cache group; this model has {len(config.groups)}"
            )
        if self.blocks_per_chunk != 1 or self.tokens_per_hash != self.tokens_per_block[0]:
            raise ValueError(
                "kvseal needs one vLLM block per offloaded chunk and hash "
                f"(blocks_per_chunk={self.blocks_per_chunk}, tokens_per_hash="
                f"{self.tokens_per_hash}, block_size={self.tokens_per_block[0]})"
            )
        self.group = config.groups[0].group_id
        self.discovery = bool(self.extra_config.get("kvseal_lookup_discovery", False))
        self.engine_id = config.engine_id
        self.dp_index = config.parallel.data_parallel_index
        self.rank = config.parallel.rank
        self.world_size = config.parallel.world_size
        vc = _current_vllm_config
        self.revision: str | None = None
        self.hash_algo = "sha256"
        self.heads, self.head_dim = 0, 0
        if vc is not None:
            mc = vc.model_config
            self.revision = mc.revision
            self.hash_algo = str(vc.cache_config.prefix_caching_hash_algo)
            self.heads = mc.get_num_kv_heads(vc.parallel_config)
            self.head_dim = mc.get_head_size()
        self._manager: KVSealOffloadingManager | None = None
        self._worker: KVSealOffloadingWorker | None = None

    def socket(self, rank: int) -> str:
        return socket_for_rank(dict(self.extra_config), rank)

    def fingerprint(self, rank: int) -> bytes:
        c = self.config
        g = c.groups[0]
        return keys.model_fingerprint(
            model=c.model.name,
            revision=self.revision,
            kv_dtype=c.model.dtype,
            tokens_per_block=g.tokens_per_block,
            layer_names=g.layer_names,
            bytes_per_block=c.worker_kv_bytes_per_block,
            kv_cache_layout=c.kv_cache_layout,
            hash_algo=self.hash_algo,
            group=self.group,
            tp_rank=rank,
            tp_size=c.parallel.tp_size,
        )

    def identity(self, rank: int, tenant_key: bytes | None) -> pb.DeploymentIdentity:
        """What this rank's replicas must agree on (docs/store.md, "Replicas"):
        labelled by ``kvseal_deployment_label`` (default: the model's last path
        component) and the TP rank."""
        c = self.config
        name = str(self.extra_config.get("kvseal_deployment_label") or "")
        name = name or str(c.model.name).rstrip("/").rsplit("/", 1)[-1]
        label = f"{name}/tp{rank}of{c.parallel.tp_size}"
        return keys.deployment_identity(label, self.hash_algo, tenant_key)

    def geometry_template(self) -> pb.PoolGeometry:
        """The pool geometry without buffers: what the namespace depends on.
        Block bytes are vLLM's page bytes of every layer (``layout`` says so:
        they are in vLLM's in-page order, not kvseal's canonical L,KV,T,H,D)."""
        c = self.config
        g = c.groups[0]
        n = len(g.layer_names)
        per_layer = c.worker_kv_bytes_per_block // max(1, n)
        return pb.PoolGeometry(
            num_pages=1,
            tokens_per_page=g.tokens_per_block,
            num_layers=n,
            num_kv_heads=self.heads,
            head_dim=self.head_dim,
            dtype=str(c.model.dtype).removeprefix("torch."),
            layout=f"vllm-page:{c.kv_cache_layout or 'default'}"[:64],
            segments=[
                pb.Segment(
                    buffer=0,
                    offset=0,
                    page_stride=c.worker_kv_bytes_per_block,
                    bytes=c.worker_kv_bytes_per_block,
                )
            ]
            if per_layer
            else [],
        )

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KVSealOffloadingManager(self)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = KVSealOffloadingWorker(self, kv_caches)
        return self._worker


def iter_workers(spec: OffloadingSpec) -> Iterator[KVSealOffloadingWorker]:
    w = getattr(spec, "_worker", None)
    if isinstance(w, KVSealOffloadingWorker):
        yield w
