"""Offload at eviction on vLLM 0.32 (``"kvseal_offload": "eviction"`` in
``kv_connector_extra_config``): a block is sealed into the tier when vLLM's
prefix cache is about to evict it, not when it is computed. While the working
set fits the engine's KV cache nothing is sealed and no ``Offload`` is made.

What vLLM 0.32 offers, and what this module uses of it (scheduler process):

- vLLM's ``OffloadingConnectorScheduler`` still offers every computed block
  to the manager (``prepare_store``); in eviction mode the manager accepts
  none of them and only remembers, per block (its ``OffloadKey``), the
  tenant, the kvseal hash and the parent hash (:meth:`EvictionOffload.offered`;
  restored blocks are remembered at ``prepare_load``).
- The block pool's free queue (``BlockPool.free_block_queue``) is in eviction
  order: ``get_new_blocks`` pops from its head and drops the popped block's
  hash. Free blocks with a hash within the **horizon** of the head (H blocks,
  below) that the tier does not hold are stored (:meth:`EvictionOffload.scan`,
  after each step's scheduling and after each step's output, when requests'
  blocks were freed).
- The store is an ordinary store job of vLLM's offloading connector, added to
  the step's ``OffloadingConnectorMetadata.store_jobs`` (job ids from the
  connector's own counter): every rank's worker runs it
  (``KVSealOffloadingWorker.submit_store``: an ``Offload`` on its own thread,
  with the CUDA event of vLLM's stream on a GPU), the scheduler thread never
  waits. Its completion, reported by every worker, is taken out of
  ``completed_jobs`` before vLLM's scheduler reads them, and makes the blocks
  hits at once (the manager's ``complete_store``); while it runs they are
  pending hits.

**Ordering** (the copy of an evicted block finishes before the engine reuses
its memory). A block stays free while its store runs: nothing is pinned, the
engine's capacity and LRU order do not change. The pool's *reuse watcher*
(``BlockPool._reuse_watchers``, the hook ``unpin_blocks`` uses) fires on the
scheduler thread when ``get_new_blocks`` hands such a block out; its job is
then put in that step's ``jobs_to_flush``, vLLM's own fence for a store whose
source block was re-allocated (vLLM uses it for a finished request's stores):
before that step's forward pass the worker submits the job if it was not yet
and **waits for it** (``OffloadingConnectorWorker.handle_preemptions`` ->
``KVSealOffloadingWorker.wait``). The job ends only when the daemon's
``Offload`` returned, so the forward that writes the block runs after the
daemon read it:

- CPU backend: the daemon reads the pages from the shared-memory KV object
  while it serves the call; its reply comes after the read (and after a
  failed call the daemon never reads a page of it again: the engine
  contract), and the forward runs only after the reply;
- CUDA: the job carries an event recorded on vLLM's stream at submission
  (after every write of the page), the daemon polls it before it copies, and
  replies once its seal pipeline has completed; the forward that may write the
  page is queued on the stream only after ``wait`` returned.

vLLM keeps one watcher per block, and ``unpin_blocks`` overwrites it: another
user of it (vLLM's HiSparse coordinator) would take the fence off a block
whose store runs. At binding the pool's table is replaced by
:class:`~kvseal.vllm.fence.FencedWatchers`, which keeps the fence on the
block and chains the other user's watcher with it (both run, the fence
first); a finished store takes off only the fence.

**Horizon.** H = ceil(2.5 x cdiv(max_num_scheduled_tokens, block_size)): the
blocks vLLM can allocate in one step, for about 2.5 steps (LMCache's lazy
offload uses the same 2.5 steps), at most the pool's size;
``"kvseal_eviction_horizon_blocks"`` sets it. A block that moves from beyond
the horizon to allocated between two scans (a step allocating more than H
blocks) is evicted unsealed: it is recomputed when next needed, as without
kvseal. A horizon shorter than the time a seal takes makes the worker wait at
the fence (counted: ``flushed_jobs``), never a torn copy.

**Write-back** (``"kvseal_write_back": true`` as well): each block is in
one tier. The worker's restore releases the block's host copy (the daemon
frees it and announces the removal, which the mirrors apply), the block is
remembered at ``prepare_load`` and, being absent from the tier, is sealed
again when it next nears eviction; never recomputed to be stored. A block the
tier still holds when it nears eviction (stored within the horizon, then hit in
the GPU before its eviction) is not sealed again. So under many tenants the
tier's capacity adds to the engine's. Without eviction mode (or after its
fallback) write-back releases blocks that vLLM never offers again.

**Checked at start.** :meth:`EvictionOffload.bind` (the first request, or
the first step) finds vLLM's ``OffloadingConnectorScheduler`` (the caller of
the manager's ``on_new_request`` or ``on_schedule_end``), its connector and
the block pool the connector was bound
to (``bind_kv_cache_manager``), and checks every attribute and behaviour used
here; if anything does not fit (another vLLM, a model with several KV-cache
groups), it logs one WARNING saying why and the manager runs write-through.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol

from kvseal.vllm.fence import FencedWatchers

log = logging.getLogger("kvseal.vllm")

WRITE_THROUGH = "write-through"
EVICTION = "eviction"
MODES = (WRITE_THROUGH, EVICTION)
HORIZON_STEPS = 2.5  # steps of the largest allocation the horizon covers
REQ_ID = "kvseal-evict"  # the TransferJob's request (vLLM reads it only for loads)
_FRAMES = 8  # how far up the stack bind looks for the connector


def offload_mode(extra: Mapping[str, Any]) -> str:
    """``kvseal_offload`` of ``kv_connector_extra_config`` (default
    write-through); ValueError for an unknown mode (the engine's start fails
    with the reason, rather than silently running another mode)."""
    mode = str(extra.get("kvseal_offload", WRITE_THROUGH))
    if mode not in MODES:
        raise ValueError(f"kvseal_offload={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def horizon_blocks(
    extra: Mapping[str, Any], step_tokens: int | None, block_size: int, pool_blocks: int
) -> int:
    """The horizon H in blocks (module doc): ``kvseal_eviction_horizon_blocks``,
    else 2.5 steps of the largest allocation, within [1, pool_blocks]."""
    raw = extra.get("kvseal_eviction_horizon_blocks")
    if raw is not None:
        h = int(raw)
    else:
        per_step = -(-int(step_tokens or 2048) // max(1, block_size))
        h = math.ceil(HORIZON_STEPS * per_step)
    return max(1, min(h, pool_blocks))


class EvictManager(Protocol):
    """What eviction mode uses of :class:`kvseal.vllm.manager.KVSealOffloadingManager`."""

    groups: Sequence[Any]

    @property
    def lock(self) -> Any: ...

    def mark_storing(self, g: Any, tenant: bytes, hashes: Sequence[bytes]) -> None: ...

    def complete_store(self, keys_: Any, req_context: Any, success: bool = True) -> None: ...

    def store_spec(self, tenant: bytes, hashes: list[bytes], parent: bytes) -> Any: ...


@dataclass
class _Job:
    tenant: bytes
    keys: list[bytes]  # OffloadKeys
    hashes: list[bytes]
    block_ids: list[int]
    remaining: int  # workers yet to report it


def _chains(items: Sequence[tuple[Any, bytes, bytes, bytes]]) -> list[list[Any]]:
    """``items`` (block, key, hash, parent hash), split into chains in root to
    leaf order: the daemon takes a job's hashes as one chain (hashes[i-1] is
    the parent of hashes[i]); the free queue holds a request's blocks tail
    first, and blocks of other requests between them."""
    by_hash = {it[2]: it for it in items}
    children: dict[bytes, list[Any]] = {}
    roots = []
    for it in items:
        if it[3] in by_hash and it[3] != it[2]:
            children.setdefault(it[3], []).append(it)
        else:
            roots.append(it)
    out: list[list[Any]] = []
    stack = list(reversed(roots))
    while stack:
        seg = [stack.pop()]
        while kids := children.get(seg[-1][2]):
            stack.extend(kids[1:])  # a branch starts a chain of its own
            seg.append(kids[0])
        out.append(seg)
    return out


class EvictionOffload:
    """Eviction mode's state in the scheduler process (module doc). Every
    method runs on vLLM's scheduler thread except :attr:`busy`, which is read
    there too."""

    def __init__(self, manager: EvictManager, extra: Mapping[str, Any], step_tokens: int | None):
        self._m = manager
        self._extra = dict(extra)
        self._step_tokens = step_tokens
        self.state = "unbound"  # -> "active" or "write-through" at the first step
        self.reason = ""
        self.horizon = 0
        self._sched: Any = None
        self._pool: Any = None
        self._workers = 1
        self._watch: Callable[[Any], None] = self._on_reuse
        self._watchers: FencedWatchers | None = None  # the pool's table, once bound
        # OffloadKey -> (tenant, kvseal hash, parent hash), least recently offered first
        self._offers: OrderedDict[bytes, tuple[bytes, bytes, bytes]] = OrderedDict()
        self._cap = 1 << 16
        self._jobs: dict[int, _Job] = {}
        self._by_block: dict[int, int] = {}  # GPU block id -> its store job
        self._inflight: set[tuple[bytes, bytes]] = set()  # (tenant, hash)
        self._flush: set[int] = set()  # jobs whose block was handed out this step
        self._unsent: dict[int, Any] = {}  # jobs of the post-output scan: next meta
        # Write-back: a restore releases the host copy (the worker's Restore, release=True).
        self.write_back = bool(extra.get("kvseal_write_back", False))
        # (tenant, hash) of blocks restored under write-back, not yet stored again
        self._released: OrderedDict[tuple[bytes, bytes], None] = OrderedDict()
        self.stats = {"scans": 0, "jobs": 0, "blocks": 0, "flushed_jobs": 0, "done_jobs": 0}
        # resealed: blocks stored again after a write-back restore released them;
        # held: blocks found in the horizon that the tier held already (not
        # stored by this mode as they neared eviction: never sealed again),
        # once per GPU block and content (_seen: block id -> its hash then).
        self.stats.update(resealed=0, held=0)
        self._seen: dict[int, bytes] = {}
        self._stats_path = str(extra.get("kvseal_stats_path") or "")

    # ------------------------------------------------------------ state

    @property
    def active(self) -> bool:
        """Whether blocks are stored at eviction (bound and checked); False
        before the first step and after a fallback to write-through."""
        return self.state == "active"

    @property
    def busy(self) -> bool:
        """Store jobs not yet reported by every worker (vLLM keeps stepping)."""
        return bool(self._jobs or self._unsent)

    def offered(
        self, tenant: bytes, keys_: Sequence[bytes], hashes: Sequence[bytes], parent: bytes
    ) -> None:
        """vLLM offered (or restored) these blocks of one chain, in order, the
        first one's parent hash ``parent`` (b"": none known): remember them,
        so that each can be stored when it is about to be evicted."""
        offers = self._offers
        for k, h in zip(keys_, hashes, strict=True):
            if not parent and (old := offers.get(bytes(k))) is not None and old[:2] == (tenant, h):
                parent = old[2]  # a restore names no parent: keep the one offered with it
            offers[bytes(k)] = (tenant, h, parent)
            offers.move_to_end(bytes(k))
            parent = h
        while len(offers) > self._cap:
            offers.popitem(last=False)

    def restored(self, tenant: bytes, keys_: Sequence[bytes], hashes: Sequence[bytes]) -> None:
        """``prepare_load`` of these blocks of one chain, in order: remembered
        as offered (each is stored again at its next eviction unless the tier
        still holds it then). Write-back (``kvseal_write_back``): the worker's
        restore releases their host copies, so they are in the GPU alone from
        then on and sealed again when evicted (counted: ``resealed``)."""
        self.offered(tenant, keys_, hashes, b"")
        if self.write_back:
            rel = self._released
            for h in hashes:
                rel[(tenant, h)] = None
                rel.move_to_end((tenant, h))
            while len(rel) > self._cap:
                rel.popitem(last=False)

    def offered_by(
        self,
        req_context: Any,
        stored_at: dict[tuple[int, int], bytes],
        g: Any,
        tenant: bytes,
        keys_: Sequence[bytes],
        hashes: Sequence[bytes],
    ) -> None:
        """``prepare_store`` of one group's blocks of a request (in chain order):
        remembered with their parent (the request's block before the first,
        ``stored_at``: end token -> hash, which this keeps up to date)."""
        p = req_context.get_offload_key_position(keys_[0]) if keys_ else None
        parent = stored_at.get((g.index, p - g.tokens_per_block), b"") if p else b""
        for k, h in zip(keys_, hashes, strict=True):
            if (p := req_context.get_offload_key_position(k)) is not None:
                stored_at[(g.index, p)] = h
        self.offered(tenant, keys_, hashes, parent)

    # ------------------------------------------------------------ binding

    def bind(self, frame: FrameType | None) -> bool:
        """At the first request or step, from the frame of the manager's caller
        (``on_new_request``, ``on_schedule_end``): find vLLM's objects, check them and
        install the two step hooks; else log why and fall back to
        write-through. Returns whether eviction mode is active."""
        try:
            reason = self._bind(frame)
        except Exception as e:  # an unexpected shape is a misfit, not a crash
            reason = f"{type(e).__name__}: {e}"
        if reason is None:
            self.state = "active"
            log.info(
                "kvseal: offload at eviction%s: horizon %d blocks of %d, %d worker(s)",
                " with write-back (a restored block is sealed again at its next eviction)"
                if self.write_back
                else "",
                self.horizon,
                self._pool.num_gpu_blocks,
                self._workers,
            )
            self._dump()
            return True
        self.state, self.reason = WRITE_THROUGH, reason
        log.warning("kvseal: offload at eviction is off, kvseal runs write-through: %s", reason)
        self._dump()
        return False

    def _dump(self) -> None:
        """``kvseal_stats_path`` (a diagnostic): the mode's state and counts as
        JSON in ``<path>.evict``, replaced at binding and after each job."""
        if not self._stats_path:
            return
        path = f"{self._stats_path}.evict"
        doc = {"state": self.state, "reason": self.reason, "horizon": self.horizon, **self.stats}
        try:
            with open(f"{path}.tmp", "w") as f:
                json.dump(doc, f)
            os.replace(f"{path}.tmp", path)
        except OSError as e:
            log.warning("kvseal: writing %s failed: %s", path, e)

    def _bind(self, frame: FrameType | None) -> str | None:
        from kvseal.vllm import compat  # noqa: PLC0415 - vLLM's internals: one module

        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: PLC0415
            OffloadingConnectorMetadata,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (  # noqa: PLC0415
            OffloadingConnectorScheduler,
        )
        from vllm.v1.core.block_pool import BlockPool  # noqa: PLC0415

        if len(self._m.groups) != 1:
            return (
                f"the model has {len(self._m.groups)} offloaded KV-cache groups (one is supported)"
            )
        sched: Any = frame.f_locals.get("self") if frame is not None else None
        if not isinstance(sched, OffloadingConnectorScheduler) or sched.manager is not self._m:
            return "the manager was not called by vLLM's OffloadingConnectorScheduler"
        conn = compat.find_caller(
            frame.f_back if frame is not None else None,
            lambda o: getattr(o, "connector_scheduler", None) is sched,
            _FRAMES,
        )
        pool = compat.block_pool_of(conn)
        if not isinstance(pool, BlockPool):
            return "no block pool bound to the connector (bind_kv_cache_manager)"
        for obj, names in (
            (sched, ("build_connector_meta", "update_connector_output", "_generate_job_id")),
            (pool, ("get_new_blocks", "_notify_reuse")),
        ):
            missing = compat.missing_callables(obj, names)
            if missing:
                return f"{type(obj).__name__} has no {', '.join(missing)}"
        if not isinstance(compat.reuse_watchers(pool), dict):
            return "BlockPool has no _reuse_watchers dict (no reuse watchers in this vLLM)"
        q = pool.free_block_queue
        if compat.missing_attrs(q, ("fake_free_list_head", "fake_free_list_tail")):
            return "FreeKVCacheBlockQueue is not the linked list this mode walks"
        src = compat.source_of(type(pool).get_new_blocks)
        if "_notify_reuse" not in src or "popleft_n" not in src:
            return (
                "BlockPool.get_new_blocks does not pop the queue's head and notify reuse watchers"
            )
        fields = getattr(OffloadingConnectorMetadata, "__dataclass_fields__", {})
        if not {"store_jobs", "jobs_to_flush"} <= set(fields):
            return "OffloadingConnectorMetadata has no store_jobs / jobs_to_flush"
        workers = getattr(getattr(sched, "config", None), "num_workers", None)
        if not isinstance(workers, int) or workers < 1:
            return "the offloading scheduler's config has no num_workers"
        g = self._m.groups[0]
        self.horizon = horizon_blocks(
            self._extra, self._step_tokens, int(g.tokens_per_block), int(pool.num_gpu_blocks)
        )
        self._cap = 2 * int(pool.num_gpu_blocks) + 4096
        self._sched, self._pool, self._workers = sched, pool, workers
        # The fence's seat: the pool's watcher table, replaced by one that keeps
        # kvseal's fence on a block when another user (vLLM's unpin_blocks, used
        # by HiSparse) writes its watcher there, and chains the two (fence.py).
        table = compat.reuse_watchers(pool)
        if not isinstance(table, FencedWatchers) or table.fence is not self._watch:
            table = FencedWatchers(self._watch, table)
            compat.set_reuse_watchers(pool, table)
        self._watchers = table
        build, update = sched.build_connector_meta, sched.update_connector_output

        def build_connector_meta(scheduler_output: Any) -> Any:
            meta = build(scheduler_output)
            self._attach(meta)
            return meta

        def update_connector_output(connector_output: Any) -> None:
            self._take_completed(connector_output)
            update(connector_output)
            # Requests freed their blocks in this output: store those the next
            # step could hand out, with the next step's metadata.
            self._unsent.update(self._scan())

        # On the instance: vLLM's OffloadingConnector calls these two per step.
        sched.build_connector_meta = build_connector_meta
        sched.update_connector_output = update_connector_output
        return None

    # ------------------------------------------------------------ per step

    def _attach(self, meta: Any) -> None:
        jobs, self._unsent = self._unsent, {}
        jobs.update(self._scan())
        if jobs:
            meta.store_jobs.update(jobs)
        if self._flush:
            # vLLM's fence: the worker finishes these before the step's forward.
            meta.jobs_to_flush = set(meta.jobs_to_flush or ()) | self._flush
            self._flush = set()

    def _on_reuse(self, block: Any) -> None:
        """The pool hands out ``block`` (scheduler thread, inside scheduling):
        if its store has not been reported done, fence the job in this step."""
        jid = self._by_block.get(block.block_id)
        if jid is not None and jid in self._jobs:
            if jid not in self._flush:
                self.stats["flushed_jobs"] += 1
            self._flush.add(jid)

    def _scan(self) -> dict[int, Any]:
        """Store jobs for the free blocks within the horizon that have a hash,
        were offered, and are neither in the tier nor being stored."""
        from kvseal.vllm import compat  # noqa: PLC0415 - imports vLLM

        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: PLC0415
            TransferJob,
        )
        from vllm.v1.kv_offload.base import GPULoadStoreSpec  # noqa: PLC0415

        if self.state != "active":
            return {}
        self.stats["scans"] += 1
        pool, g = self._pool, self._m.groups[0]
        q = pool.free_block_queue
        tail, watchers = q.fake_free_list_tail, self._watchers
        if watchers is None:  # not bound (active implies bound)
            return {}
        offers, by_block, inflight = self._offers, self._by_block, self._inflight
        seen = self._seen
        picked: dict[bytes, list[tuple[Any, bytes, bytes, bytes]]] = {}
        with self._m.lock:  # the mirrors apply the daemon's changes under it
            b, n = q.fake_free_list_head.next_free_block, 0
            while b is not None and b is not tail and n < self.horizon:
                n += 1
                key = b.block_hash
                if key is not None and b.block_id not in by_block:
                    rec = offers.get(key)
                    if rec is not None:
                        tenant, h, parent = rec
                        if h in g.ready.get(tenant, ()):  # in the tier still: not sealed again
                            if seen.get(b.block_id) != key:
                                seen[b.block_id] = key
                                self.stats["held"] += 1
                        # A block with another user's reuse watcher is left alone.
                        elif (tenant, h) not in inflight and b.block_id not in watchers:
                            inflight.add((tenant, h))
                            seen[b.block_id] = key
                            picked.setdefault(tenant, []).append((b, bytes(key), h, parent))
                            if (tenant, h) in self._released:  # it changed tier
                                del self._released[(tenant, h)]
                                self.stats["resealed"] += 1
                b = b.next_free_block
            jobs: dict[int, Any] = {}
            for tenant, items in picked.items():
                for seg in _chains(items):
                    jid = compat.new_job_id(self._sched)
                    ids = [it[0].block_id for it in seg]
                    job = _Job(
                        tenant, [it[1] for it in seg], [it[2] for it in seg], ids, self._workers
                    )
                    self._jobs[jid] = job
                    for bid in ids:
                        by_block[bid] = jid
                        watchers[bid] = self._watch
                    self._m.mark_storing(g, tenant, job.hashes)
                    jobs[jid] = TransferJob(
                        req_id=REQ_ID,
                        src_spec=GPULoadStoreSpec(ids, group_sizes=[len(ids)], block_indices=[0]),
                        dst_spec=self._m.store_spec(tenant, job.hashes, seg[0][3]),
                    )
                    self.stats["jobs"] += 1
                    self.stats["blocks"] += len(ids)
        return jobs

    def _take_completed(self, connector_output: Any) -> None:
        """Take this mode's jobs out of the workers' ``completed_jobs`` (vLLM's
        scheduler knows only its own) and finish those every worker reported."""
        done = getattr(connector_output.kv_connector_worker_meta, "completed_jobs", None)
        if not done:
            return
        for jid in [j for j in done if j in self._jobs]:
            job = self._jobs[jid]
            job.remaining -= int(done.pop(jid))
            if job.remaining > 0:
                continue
            del self._jobs[jid]
            for bid in job.block_ids:
                if self._by_block.get(bid) == jid:
                    del self._by_block[bid]
            if self._watchers is not None:  # the fence off; another user's watcher stays
                self._watchers.release(job.block_ids)
            for h in job.hashes:
                self._inflight.discard((job.tenant, h))
            with self._m.lock:
                # A hit at once on every rank, verified by the mirrors meanwhile
                # (a store the worker dropped is found absent and forgotten).
                self._m.complete_store(job.keys, None)
            self.stats["done_jobs"] += 1
            self._dump()


def new_eviction(
    manager: EvictManager, extra: Mapping[str, Any], step_tokens: int | None
) -> EvictionOffload | None:
    """An :class:`EvictionOffload` for ``manager`` when ``kvseal_offload`` is
    ``eviction``, else None (write-through)."""
    return EvictionOffload(manager, extra, step_tokens) if offload_mode(extra) == EVICTION else None
