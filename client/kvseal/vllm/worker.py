"""The worker side of kvseal's vLLM spec (:mod:`kvseal.vllm.spec`, which
re-exports it): :class:`KVSealOffloadingWorker` registers this rank's KV
cache with its daemon, one pool per offloaded KV-cache group, and turns
vLLM's ``submit_store``/``submit_load`` into ``Offload``/``Restore`` calls on
its own threads.

A job may span several groups (a hybrid model: full attention, sliding
window, MLA, Mamba state): vLLM orders its GPU blocks by group
(``GPULoadStoreSpec.group_sizes``), and the manager orders the spec's hashes
the same way (:class:`~kvseal.vllm.manager.KVSealLoadStoreSpec`). Each
group's part goes to that group's pool, sealed under that group's namespace.
A load of several groups is all or nothing: if any group's part fails, the
whole job has failed, and the connector reports the request as a failed
receive, so vLLM recomputes it from scratch (vLLM's block-level load errors
are refused for models with several groups, and a request must never run on
a prefix whose sliding-window or Mamba part is missing).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from kvseal.client import ClientConfig, KVSealClient
from kvseal.core.kv_pool import EngineEvent, KVPool
from kvseal.v1 import kvseal_pb2 as pb
from kvseal.vllm import compat, keys
from kvseal.vllm.groups import GroupLayout
from kvseal.vllm.manager import KVSealLoadStoreSpec
from kvseal.vllm.pointers import PointerError

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

log = logging.getLogger("kvseal.vllm")


class WorkerSpec(Protocol):
    """What the worker reads of its spec (:class:`kvseal.vllm.spec.KVSealOffloadingSpec`)."""

    rank: int
    engine_id: str
    dp_index: int
    extra_config: Any
    layouts: list[GroupLayout]

    def socket(self, rank: int) -> str: ...

    def fingerprint(self, rank: int, group: int | None = None) -> bytes: ...

    def geometry_template(self, group: int | None = None) -> pb.PoolGeometry: ...


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
    # GPU blocks per offloaded group, in the config's group order (vLLM's
    # GPULoadStoreSpec.group_sizes); None: one group.
    group_sizes: list[int] | None = None
    # Why vLLM's description of the GPU side was refused (vLLM 0.34: a device
    # pointer outside a registered pool, kvseal.vllm.pointers): the job fails
    # whole and no page is touched. "": accepted.
    invalid: str = ""


@dataclass
class _Part:
    """One group's share of a job."""

    index: int  # the group's position in the config
    pool: KVPool
    hashes: list[bytes]
    pages: list[int]
    parent: bytes


class KVSealOffloadingWorker(OffloadingWorker):
    """Worker side (see module doc). Three transfer threads per worker, for
    stores, loads and expedited loads: each kind runs in submission order, off
    vLLM's thread; a load never waits behind stores, and an expedited load
    (vLLM 0.33: its request already runs in this step, and vLLM waits for
    it before the forward pass) behind neither stores nor regular loads. The
    daemon batches each job's blocks. ``wait`` waits for the given jobs only,
    each bounded by the transfer timeout (``kvseal_transfer_timeout_s``): a
    stalled daemon delays that step, then the load fails and vLLM recomputes.

    The KV cache is this rank's :class:`~kvseal.core.kv_pool.KVPool` per
    group: on vLLM's CPU platform a shared-memory pool (CPU backend); on a GPU
    the KV tensors exported with CUDA IPC (CUDA backend), each job carrying a
    CUDA event that vLLM's stream recorded when it submitted the job, which the
    daemon waits for before it reads (store) or writes (load) the pages. A KV
    cache that can be neither, or a group whose pages are not the bytes the
    scheduler expects, disables offloading (logged; vLLM runs as without
    kvseal)."""

    def __init__(self, spec: WorkerSpec, kv_caches: CanonicalKVCaches) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.layouts = list(spec.layouts)
        self.multi_group = len(self.layouts) > 1
        self.block_bytes = 0  # of all groups' blocks together (stats)
        self.pools: list[KVPool] = []  # one per group, in config order; [] = disabled
        self._loads: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._stores: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._expedited: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._done: list[TransferResult] = []
        self._failed_blocks: set[int] = set()  # of failed loads get_finished reported
        self._failed_jobs: dict[int, list[int]] = {}  # failed loads not reported yet
        self._failed_load_jobs: set[int] = set()  # multi-group: reported, for the connector
        self._pending: set[int] = set()
        self._cv = threading.Condition()
        # A hybrid job's groups go to their pools at once, not one after another:
        # a load waits for one round trip to the daemon, not one per group. One
        # executor for loads, one for stores, so a load's groups never wait
        # behind a store's (the threads below keep loads apart from stores too).
        n = len(self.layouts) - 1
        self._load_parts = ThreadPoolExecutor(n, "kvseal-load-part") if n > 0 else None
        self._store_parts = ThreadPoolExecutor(n, "kvseal-store-part") if n > 0 else None
        self.stats = {
            "stores": 0,
            "loads": 0,
            "expedited_loads": 0,  # of the loads
            "failed_loads": 0,
            "partial_loads": 0,  # failed loads whose leading blocks were restored
            "dropped_stores": 0,
        }
        # Per group (its id): blocks stored, restored and failed to restore.
        self.group_stats: dict[int, dict[str, int]] = {
            g.group_id: {"stored": 0, "restored": 0, "failed": 0, "dropped": 0}
            for g in self.layouts
        }
        self._stats_path = str(spec.extra_config.get("kvseal_stats_path") or "")
        self.write_back = bool(spec.extra_config.get("kvseal_write_back", False))
        if self.write_back and self.rank == 0:
            if spec.extra_config.get("kvseal_offload", "write-through") == "eviction":
                # Write-back over offload at eviction (kvseal.vllm.evict): a released
                # block is sealed again at its next eviction, unless the eviction hook
                # does not fit this vLLM (the scheduler logs that), and then as below.
                log.info(
                    "kvseal: write-back: a restored block's host copy is released and the "
                    "block is sealed again at its next eviction (offload at eviction)"
                )
            else:
                # Write-through stores: vLLM offers a block for store only when it is
                # computed, so a block released here is not written back, and once the
                # engine evicts it, it is recomputed (docs/serving.md, "write-back").
                log.warning(
                    'kvseal: write-back without "kvseal_offload": "eviction" releases a '
                    "restored block's host copy that nothing writes back when vLLM evicts "
                    "the block: expect less cached than with write-through (the default)"
                )
        timeout = float(spec.extra_config.get("kvseal_transfer_timeout_s", 10.0))
        self.client = KVSealClient(
            ClientConfig(target=spec.socket(self.rank), transfer_timeout_s=timeout)
        )
        self._register(kv_caches)
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

    @property
    def kv(self) -> KVPool | None:
        """The first group's pool (a single-group model's only one); None when
        offloading is disabled."""
        return self.pools[0] if self.pools else None

    def _register(self, kv_caches: CanonicalKVCaches) -> None:
        spec = self.spec
        if len(kv_caches.group_data_refs) != len(self.layouts):
            log.error(
                "kvseal: vLLM gave %d KV-cache groups to the worker, the config names %d: "
                "offloading disabled",
                len(kv_caches.group_data_refs),
                len(self.layouts),
            )
            return
        pools: list[KVPool] = []
        try:
            for g, refs in zip(self.layouts, kv_caches.group_data_refs, strict=True):
                role = "kv" if not self.multi_group else f"kv{g.group_id}"
                pool = KVPool(
                    self.client,
                    keys.pool_name(spec.engine_id, spec.dp_index, self.rank, role),
                    spec.fingerprint(self.rank, g.group_id),
                    spec.geometry_template(g.group_id),
                    kv_caches.tensors,
                    refs,
                )
                pools.append(pool)
                expected = sum(s.bytes for s in spec.geometry_template(g.group_id).segments)
                if expected != pool.block_bytes:
                    # The scheduler's observer pool states the template's block
                    # bytes: in another namespace it would never hear of this
                    # pool's blocks, so offloading them would only fill the tier.
                    raise ValueError(
                        f"rank {self.rank} group {g.group_id} blocks are {pool.block_bytes} "
                        f"bytes, the scheduler expects {expected}"
                    )
        except (ValueError, RuntimeError) as e:  # RuntimeError: torch refused the export
            log.error("kvseal: %s: offloading disabled", e)
            for p in pools:
                p.close()
            return
        self.pools = pools
        self.block_bytes = sum(p.block_bytes for p in pools)
        # Registration runs in the background; at engine start-up (never on
        # the engine's hot path) wait for it a little, so the first stores
        # are not dropped. A daemon that is down costs this wait once.
        wait_s = float(spec.extra_config.get("kvseal_ready_wait_s", 10.0))
        deadline = time.monotonic() + wait_s
        for g, p in zip(self.layouts, pools, strict=True):
            if p.pool.wait_ready(max(0.0, deadline - time.monotonic())):
                log.info("kvseal: rank %d group %d pool registered", self.rank, g.group_id)
            else:
                log.warning(
                    "kvseal: rank %d group %d pool not registered yet (%s); stores are "
                    "dropped until it is",
                    self.rank,
                    g.group_id,
                    p.pool.registration_error,
                )

    # ------------------------------------------------------------ vLLM API

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: LoadStoreSpec) -> bool:
        """Queue an offload; never blocks. ``src_spec``: the GPU side, vLLM
        0.32/0.33's ``GPULoadStoreSpec`` or 0.34's ``DevicePointers``
        (:func:`kvseal.vllm.compat.job_pages`)."""
        assert isinstance(dst_spec, KVSealLoadStoreSpec)
        return self._submit(self._job(job_id, True, dst_spec, src_spec, False))

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: Any,
        expedited: bool = False,
    ) -> bool:
        """Queue a restore; never blocks. ``dst_spec``: the GPU side (as in
        :meth:`submit_store`). ``expedited`` (vLLM 0.33 passes it for a load its
        request needs in the current step, then waits for it) runs on its own
        thread, ahead of every regular load and store. kvseal turns such loads
        off on vLLM 0.34, where a failed one crashes the engine
        (:data:`kvseal.vllm.compat.EXPEDITED_LOADS`)."""
        assert isinstance(src_spec, KVSealLoadStoreSpec)
        return self._submit(self._job(job_id, False, src_spec, dst_spec, bool(expedited)))

    def _job(
        self, job_id: int, store: bool, spec: KVSealLoadStoreSpec, gpu: Any, expedited: bool
    ) -> _Job:
        try:
            pages, sizes = compat.job_pages(gpu, self.pools)
        except PointerError as e:
            log.error("kvseal: job %d refused, nothing transferred: %s", job_id, e)
            return _Job(job_id, store, spec, [], expedited, invalid=str(e))
        return _Job(job_id, store, spec, pages, expedited, group_sizes=sizes)

    def _submit(self, job: _Job) -> bool:
        # On vLLM's thread, whose current stream issued the KV writes (store) and
        # the last reads of the destination blocks (load): the daemon waits for it.
        kv = self.kv
        if kv is not None and kv.cuda and job.pages:
            try:
                job.event = kv.engine_event()
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
            # side maps them back to the job's blocks (connector). A model with
            # several groups reports the job instead (take_failed_load_jobs).
            for r in done:
                pages = self._failed_jobs.pop(r.job_id, None)
                if pages is None:
                    continue
                if self.multi_group:
                    self._failed_load_jobs.add(r.job_id)
                else:
                    self._failed_blocks.update(pages)
        return done

    def take_failed_block_ids(self) -> set[int]:
        """KV-cache blocks whose restore failed since the last call (a model with
        one KV-cache group): nothing was written into them; vLLM must recompute
        them."""
        with self._cv:
            out, self._failed_blocks = self._failed_blocks, set()
        return out

    def take_failed_load_jobs(self) -> set[int]:
        """Load jobs that failed since the last call (a model with several
        KV-cache groups; reported by ``get_finished`` in the same step): their
        requests must be recomputed whole (the connector reports them to vLLM
        as failed receives)."""
        with self._cv:
            out, self._failed_load_jobs = self._failed_load_jobs, set()
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
        for ex in (self._load_parts, self._store_parts):
            if ex is not None:
                ex.shutdown(wait=False, cancel_futures=True)
        for p in self.pools:
            p.close()
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
            bad = bool(failed) or bool(job.invalid)
            with self._cv:
                if job.store:
                    self.stats["stores"] += 1
                    self.stats["dropped_stores"] += bad
                else:
                    self.stats["loads"] += 1
                    self.stats["expedited_loads"] += job.expedited
                    if bad:
                        self.stats["failed_loads"] += 1
                        self.stats["partial_loads"] += 0 < len(failed) < len(job.pages)
                        if not compat.NATIVE_FAILURES:
                            self._failed_jobs[job.job_id] = failed
                # vLLM 0.32/0.33's OffloadingConnector asserts success: a dropped
                # store is just a later miss, and a failed load is reported as load
                # errors (one group) or a failed receive (several). vLLM 0.34 takes
                # the failure itself: a failed receive, recomputed (compat doc).
                ok = not bad or not compat.NATIVE_FAILURES
                self._done.append(
                    TransferResult(job.job_id, ok, len(job.pages) * self.block_bytes, dt)
                )
                self._pending.discard(job.job_id)
                self._cv.notify_all()
            if self._stats_path:
                self._write_stats()

    def _parts(self, job: _Job) -> list[_Part] | None:
        """The job split by group; None when the spec's hashes and vLLM's block
        ids do not line up (then the job fails whole)."""
        sp = job.spec
        n = len(self.layouts)
        sizes = job.group_sizes if job.group_sizes is not None else [len(job.pages)]
        hsizes = list(sp.group_sizes) if sp.group_sizes else [len(sp.hashes)]
        if len(sizes) != n or hsizes != sizes or sum(sizes) != len(job.pages):
            log.error(
                "kvseal: job %d: blocks per group %s, hashes per group %s: not transferred",
                job.job_id,
                sizes,
                hsizes,
            )
            return None
        parents = list(sp.parents) if sp.parents else [sp.parent_hash]
        parts: list[_Part] = []
        at = 0
        for i, k in enumerate(sizes):
            if k:
                parent = parents[i] if i < len(parents) else b""
                parts.append(
                    _Part(i, self.pools[i], sp.hashes[at : at + k], job.pages[at : at + k], parent)
                )
            at += k
        return parts

    def _transfer(self, job: _Job) -> list[int]:
        """Run one job; returns the pages it failed (all of a dropped store; of
        a load, those vLLM must recompute: all of them for a model with several
        groups)."""
        if not job.pages:
            return []
        if not self.pools or len(job.pages) != len(job.spec.hashes):
            return job.pages
        kv = self.pools[0]
        if kv.cuda and job.event is None:
            return job.pages  # never without the engine's event (see _submit)
        parts = self._parts(job)
        if parts is None:
            return job.pages
        sp = job.spec
        if job.store:

            def store(p: _Part) -> bool:
                ok = p.pool.offload(sp.tenant, p.hashes, p.pages, p.parent or None, event=job.event)
                self._count(self.layouts[p.index].group_id, "stored" if ok else "dropped",
                            len(p.pages))  # fmt: skip
                return ok

            done = _each(self._store_parts, store, parts)
            return [page for p, ok in zip(parts, done, strict=True) if not ok for page in p.pages]
        if self.multi_group:
            return self._load_groups(job, parts)
        p = parts[0]
        gid = self.layouts[0].group_id
        if kv.restore(sp.tenant, p.hashes, p.pages, release=self.write_back, event=job.event):
            self._count(gid, "restored", len(p.pages))
            return []
        # A restore is all or nothing, so one block the daemon evicted since the
        # scheduler's lookup (a busy tier evicts while restores queue) failed the
        # whole job. The blocks before the first one missing are still worth a
        # restore: vLLM recomputes from the first failed block on, so those it
        # keeps. One Lookup (here, never on the scheduler thread) and one more
        # Restore of that prefix; it, too, writes nothing if it fails.
        n = kv.pool.lookup(sp.tenant, sp.hashes) if len(job.pages) > 1 else 0
        if 0 < n < len(job.pages) and kv.restore(
            sp.tenant, sp.hashes[:n], job.pages[:n], release=self.write_back, event=job.event
        ):
            self._count(gid, "restored", n)
            self._count(gid, "failed", len(job.pages) - n)
            return job.pages[n:]
        self._count(gid, "failed", len(job.pages))
        return job.pages

    def _load_groups(self, job: _Job, parts: Sequence[_Part]) -> list[int]:
        """A hybrid load: every group's part, or the job has failed. The parts
        run at once, each an all-or-nothing ``Restore`` of its own group (a
        failed part writes none of its pages); the parts that verified are
        written even when another failed, but vLLM frees the request's blocks
        uncached when its receive failed, so nothing of it is ever used.
        Write-back: the parts restore without release and the host copies
        are released (one Release per part) only once every part verified, so
        a failed job leaves every group's blocks in the host tier for a later
        load. A Release that fails leaves a copy cached: host memory, not data."""
        sp = job.spec

        def load(p: _Part) -> bool:
            ok = p.pool.restore(sp.tenant, p.hashes, p.pages, release=False, event=job.event)
            self._count(self.layouts[p.index].group_id, "restored" if ok else "failed",
                        len(p.pages))  # fmt: skip
            return ok

        if not all(_each(self._load_parts, load, parts)):
            return job.pages
        if self.write_back:
            _each(self._load_parts, lambda p: p.pool.release(sp.tenant, p.hashes), parts)
        return []

    def _count(self, gid: int, what: str, n: int) -> None:
        with self._cv:
            self.group_stats[gid][what] += n

    def _write_stats(self) -> None:
        """``kvseal_stats_path`` (a diagnostic): this rank's per-group counts as
        JSON in ``<path>.rank<r>``, replaced atomically after every job."""
        path = f"{self._stats_path}.rank{self.rank}"
        with self._cv:
            doc = {
                "rank": self.rank,
                "jobs": dict(self.stats),
                "groups": {
                    str(g.group_id): {"kind": g.kind, **self.group_stats[g.group_id]}
                    for g in self.layouts
                },
            }
        try:
            tmp = f"{path}.{threading.get_ident()}.tmp"
            with open(tmp, "w") as f:
                json.dump(doc, f)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("kvseal: writing %s failed: %s", path, e)


def _each(
    pool: ThreadPoolExecutor | None, fn: Callable[[_Part], bool], parts: Sequence[_Part]
) -> list[bool]:
    """``fn`` of every part, in order: the first on the calling thread, the
    others on ``pool`` at the same time (all on the calling thread without
    one). ``fn`` never raises (``EnginePool`` calls return False on failure);
    if it did, the part counts as failed."""
    if pool is None or len(parts) < 2:
        return [fn(p) for p in parts]
    futures = [pool.submit(fn, p) for p in parts[1:]]
    out = [fn(parts[0])]
    for f in futures:
        try:
            out.append(f.result())
        except Exception:  # a part that raised has failed; the job reports it
            log.exception("kvseal: a group's transfer raised")
            out.append(False)
    return out
