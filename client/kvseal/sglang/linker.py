"""kvseal as SGLang's direct-L3 ``UnifiedCacheLinker`` (SGLang 0.5.23).

SGLang's ``UnifiedRadixCache`` drives the linker through its wrapper
(``sglang.srt.mem_cache.unified_cache.unified_cache_linker``): ``lookup`` in
``match_prefix`` (scheduler thread, per request), ``load`` when a hit is
admitted, ``start_layer_wise_loading``/``finish_layer_wise_loading`` around the
batch's forward, ``offload`` for each tree node written through (every inserted
page: the wrapper sets the write-through threshold to 1), and the two offload
counters once per step. How kvseal answers each (docs/sglang.md has the table):

- **lookup** never makes an RPC: it reads the scheduler's mirror of the daemon
  (:class:`kvseal.vllm.mirror.DaemonMirror`, fed by the daemon's event stream,
  this engine's own completed offloads and, for blocks it has no word of, a
  background discovery lookup).
- **load** (default ``load_mode: "verified"``) restores the pages into the
  linker's staging blocks and copies them into SGLang's pages *before it
  returns*, so a failed restore (tampered, evicted, daemon gone) returns
  False and SGLang recomputes the prefix, with nothing written into its pool.
  That is one restore RPC per admitted request on the scheduler thread (never
  one per page). ``load_mode: "async"`` instead runs the restore during the
  forward, on the linker's load thread; SGLang 0.5.23 then *aborts* a request
  whose load failed (HTTP 503, ``finish_external_linker_loads``) instead of
  recomputing it, which is why it is not the default.
- **offload** queues the pages for the offload thread, which copies them into
  staging and seals them through the daemon; a page already held is only
  touched. Results are reported in order through the counters.

Tenants: SGLang's ABC does not pass ``cache_salt`` to the linker; the
namespace hooks (:mod:`kvseal.sglang.hooks`, installed on import) tell it
around each ``match_prefix`` and ``insert``.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any

import torch
from kvseal.client import ClientConfig, KVSealClient
from kvseal.client.config import socket_target
from kvseal.sglang import hooks, keys
from kvseal.sglang.layout import PageCopier, geometry_of
from kvseal.sglang.staging import Slots, new_staging, pool_inputs
from kvseal.v1 import kvseal_pb2 as pb
from kvseal.vllm.kv_pool import KVPool
from kvseal.vllm.mirror import DaemonMirror

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    LayerWiseLoadCounter,
    UnifiedCacheLinker,
)

log = logging.getLogger("kvseal.sglang")

DEFAULT_SOCKET = "/run/kvseal/kvseal.sock"
OPTIONS = {
    "socket": "the daemon's socket (a path or unix:// target; {rank} is the TP rank)",
    "load_mode": '"verified" (default: a failed restore is recomputed) or "async"',
    "staging_bytes": "bytes of staging blocks (default 256 MiB, at least one block)",
    "transfer_timeout_s": "bound of one offload RPC, and of an async restore (default 10)",
    "load_timeout_s": "bound of a verified restore, on the scheduler thread (default 2)",
    "ready_wait_s": "how long start-up waits for the pool's registration (default 10)",
    "discovery": "look up blocks the mirror has no word of, in the background (default true)",
    "instance": "a name for this engine in pool names and logs (default sglang)",
    "deployment_label": "this deployment's name in the store's replica records "
    "(default: the model path's last component)",
}
REQ_TENANTS = 1 << 16  # requests whose tenant is remembered between match and load


class KVSealLinker(UnifiedCacheLinker):
    """SGLang's external cache linker backed by a kvseal daemon (module doc).

    Construction (SGLang's worker, at start-up) validates the config and the
    KV pool (ValueError naming what is unsupported), allocates the staging
    blocks, registers them with the daemon (waiting up to ``ready_wait_s``; a
    daemon that is down only means misses and dropped offloads until it is
    up) and starts the mirror and the transfer threads. Every method SGLang
    calls returns a verdict and never raises for a daemon failure.
    """

    def __init__(
        self,
        server_args: Any,
        params: Any,
        *,
        components: set[Any],
        extra_config: dict[str, Any] | None = None,
        forward_stream: Any = None,
    ) -> None:
        extra = dict(extra_config or {})
        unknown = sorted(set(extra) - set(OPTIONS))
        if unknown:
            raise ValueError(
                f"kvseal linker: unknown option(s) {unknown}; known: {sorted(OPTIONS)}"
            )
        others = sorted(c.name for c in components if c != ComponentType.FULL)
        if others:
            raise ValueError(
                f"kvseal linker stores full-attention KV only; this model also has {others} "
                "(SWA and Mamba state are not supported)"
            )
        self.load_mode = str(extra.get("load_mode", "verified"))
        if self.load_mode not in ("verified", "async"):
            raise ValueError(
                f'kvseal linker: load_mode must be "verified" or "async", not {self.load_mode!r}'
            )
        self.forward_stream = forward_stream
        self.page_size = int(params.page_size)
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        self.pools: dict[PoolName, object] = {PoolName.KV: kvcache}
        self.geometry = g = geometry_of(kvcache, self.page_size)
        self.copier = PageCopier(kvcache.k_buffer, kvcache.v_buffer, g)
        self.device = kvcache.k_buffer[0].device
        self.cuda = self.device.type == "cuda"
        tp_rank, tp_size = _tp(params)
        pp_rank = int(getattr(params, "pp_rank", 0) or 0)
        self.rank = tp_rank
        staging_bytes = int(extra.get("staging_bytes", 256 << 20))
        blocks = max(1, min(1 << 16, staging_bytes // g.block_bytes))
        self.staging = new_staging(blocks, g.block_bytes, self.device)
        self.slots = Slots(blocks)
        # An offload takes at most half the blocks at a time, so a load (on the
        # scheduler thread in "verified" mode) never waits for a whole offload.
        self._offload_chunk = max(1, blocks // 2)
        fingerprint = keys.model_fingerprint(
            model=str(getattr(server_args, "model_path", "")),
            revision=getattr(server_args, "revision", None),
            dtype=g.dtype,
            page_size=g.page_size,
            num_layers=g.num_layers,
            start_layer=int(getattr(kvcache, "start_layer", 0) or 0),
            heads=g.heads,
            head_dim=g.head_dim,
            v_head_dim=g.v_head_dim,
            block_bytes=g.block_bytes,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
        )
        template = pb.PoolGeometry(
            num_pages=1,
            tokens_per_page=g.page_size,
            num_layers=g.num_layers,
            num_kv_heads=g.heads,
            head_dim=g.head_dim,
            dtype=g.dtype,
            layout="sglang-page:v1",
            segments=[
                pb.Segment(buffer=0, offset=0, page_stride=g.block_bytes, bytes=g.block_bytes)
            ],
        )
        sock = str(extra.get("socket", DEFAULT_SOCKET)).format(rank=tp_rank)
        self.target = sock if "://" in sock else socket_target(sock)
        self.client = KVSealClient(
            ClientConfig(
                target=self.target,
                transfer_timeout_s=float(extra.get("transfer_timeout_s", 10.0)),
            )
        )
        tag = str(extra.get("instance", "sglang"))
        tensors, refs = pool_inputs(self.staging)
        self.kv = KVPool(
            self.client,
            keys.pool_name(tag, tp_rank, pp_rank, "kv"),
            fingerprint,
            template,
            tensors,
            refs,
        )
        self.tenants = keys.Tenants()
        model = str(getattr(server_args, "model_path", "")).rstrip("/").rsplit("/", 1)[-1]
        label = f"{extra.get('deployment_label') or model}/tp{tp_rank}of{tp_size}"
        self.mirror = DaemonMirror(
            tp_rank,
            self.target,
            keys.pool_name(tag, tp_rank, pp_rank, "probe"),
            fingerprint,
            template,
            _ignore_change,
            discovery=bool(extra.get("discovery", True)),
            identity=self.tenants.identity(label),
        )
        if self.kv.pool.wait_ready(float(extra.get("ready_wait_s", 10.0))):
            log.info(
                "kvseal linker: rank %d: %d staging blocks of %d bytes on %s registered with %s",
                tp_rank, blocks, g.block_bytes, self.device, self.target,
            )  # fmt: skip
        else:
            log.warning(
                "kvseal linker: rank %d: pool not registered yet (%s): misses until it is",
                tp_rank,
                self.kv.pool.registration_error,
            )
        # A verified load waits on SGLang's scheduler thread: a hung daemon may
        # cost one such wait (then the pool backs off and loads fail at once).
        self._load_timeout = float(extra.get("load_timeout_s", 2.0))
        self.layer_done_counter = LayerWiseLoadCounter(g.num_layers)
        # rid -> tenant, set by the hooks in match_prefix (bounded, oldest out).
        self._req_tenant: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        # The tenant of the match or insert running now (scheduler thread).
        self.current_tenant = self.tenants.shared
        self._queued: dict[str, tuple[bytes, list[bytes], Any]] = {}
        self._offq: queue.Queue[Any] = queue.Queue()
        self._loadq: queue.Queue[Any] = queue.Queue()
        self._offload_results: queue.Queue[bool] = queue.Queue()
        self.stats = {"lookups": 0, "hit_pages": 0, "loads": 0, "load_failures": 0,
                      "offloads": 0, "offload_failures": 0, "skipped_pages": 0,
                      "staging_waits_expired": 0}  # fmt: skip
        self._threads = [
            threading.Thread(
                target=self._offload_run, name=f"kvseal-offload-{tp_rank}", daemon=True
            ),
            threading.Thread(target=self._load_run, name=f"kvseal-load-{tp_rank}", daemon=True),
        ]
        for t in self._threads:
            t.start()
        hooks.install()

    # ------------------------------------------------------------ tenants

    def note_request(self, rid: str, cache_salt: str | None) -> None:
        """The hooks: request ``rid`` is being matched with ``cache_salt``."""
        tenant = self.tenants.of(cache_salt)
        self.current_tenant = tenant
        self._req_tenant[rid] = tenant
        self._req_tenant.move_to_end(rid)
        if len(self._req_tenant) > REQ_TENANTS:
            self._req_tenant.popitem(last=False)

    def _tenant_of(self, rid: str) -> bytes:
        return self._req_tenant.get(rid, self.tenants.shared)

    # ------------------------------------------------------------ lookup

    def lookup(self, rid: str, transfers: list[PoolTransfer]) -> list[int]:
        kv = _kv(transfers)
        if kv is None or not kv.keys:
            return []
        tenant = self._tenant_of(rid)
        m = self.mirror
        m.introduce(tenant)
        n = 0
        for key in kv.keys:
            h = keys.kvseal_hash(key)
            if m.contains(tenant, h):
                n += 1
                continue
            if not m.discovery.known_absent(tenant, h):
                m.discovery.discover(tenant, h)
            break
        self.stats["lookups"] += 1
        self.stats["hit_pages"] += n
        # Every prefix of a contiguous run is restorable (the KV pool has no window).
        return list(range(1, n + 1))

    # ------------------------------------------------------------ load

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        kv = _kv(transfers)
        if kv is None or not kv.keys or kv.device_indices is None:
            return False
        hashes = [keys.kvseal_hash(k) for k in kv.keys]
        idx = kv.device_indices
        if int(idx.numel()) != len(hashes) * self.page_size:
            log.warning(
                "kvseal linker: load of %d pages into %d slots refused",
                len(hashes),
                int(idx.numel()),
            )
            return False
        tenant = self._tenant_of(rid)
        self.stats["loads"] += 1
        if self.load_mode == "verified":
            ok = self._restore(tenant, hashes, idx)
            if not ok:
                self.stats["load_failures"] += 1
            return ok
        if rid in self._queued:
            raise RuntimeError(f"kvseal linker: a load for {rid} is already queued")
        self._queued[rid] = (tenant, hashes, idx)
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        return self._queued.pop(rid, None) is not None

    def start_layer_wise_loading(self) -> int:
        pending, self._queued = self._queued, {}
        if not pending:
            # Nothing to wait for ("verified" loads are done, or no load): -1 makes
            # the forward's per-layer waits no-ops and finish() True. A counter
            # index per batch would leak: SGLang finishes only batches with loads.
            return -1
        index = int(self.layer_done_counter.update_producer())
        ready = None
        if self.cuda:
            cuda: Any = torch.cuda  # Event is untyped in torch's stubs
            ready = cuda.Event()
            ready.record()
        self._loadq.put((index, list(pending.values()), ready))
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return bool(self.layer_done_counter.finish(counter_index))

    def _load_run(self) -> None:
        while True:
            task = self._loadq.get()
            try:
                if task is None:
                    return
                index, loads, ready = task
                try:
                    if ready is not None:
                        ready.synchronize()
                    ok = all([self._restore(t, hs, idx) for t, hs, idx in loads])
                except Exception:  # a bug here must fail the batch, not hang it
                    log.exception("kvseal linker: load batch failed")
                    ok = False
                if ok:
                    for layer in range(self.geometry.num_layers):
                        self.layer_done_counter.complete(index, layer)
                else:
                    self.stats["load_failures"] += 1
                    self.layer_done_counter.fail(index, RuntimeError("kvseal restore failed"))
            finally:
                self._loadq.task_done()

    def _restore(self, tenant: bytes, hashes: list[bytes], idx: Any) -> bool:
        """Restore ``hashes`` into SGLang's pages ``idx`` through staging, in
        chunks of the free staging blocks. True: every page holds its verified
        block. False: a chunk failed; pages of earlier chunks hold verified
        blocks, the failed chunk's pages were not written, and the request
        recomputes all of them (its slots are private to it)."""
        ps = self.page_size
        pos = 0
        # One deadline for the whole load, staging waits included: an offload
        # may hold every block for a whole offload RPC, and a verified load
        # waits on SGLang's scheduler thread (async: on the load thread, bounded
        # like an RPC so a batch is not held forever either).
        verified = self.load_mode == "verified"
        budget = self._load_timeout if verified else self.client.config.transfer_timeout_s
        deadline = time.monotonic() + budget
        while pos < len(hashes):
            slots = self.slots.take(len(hashes) - pos, max(0.0, deadline - time.monotonic()))
            if not slots:
                self.stats["staging_waits_expired"] += 1
                return False
            n = len(slots)
            try:
                left = deadline - time.monotonic()
                if left <= 0:  # spent waiting for staging: nothing was asked of the daemon
                    self.stats["staging_waits_expired"] += 1
                    return False
                ok = self.kv.restore(
                    tenant,
                    hashes[pos : pos + n],
                    slots,
                    event=self.kv.engine_event(),
                    timeout=left,
                )
                if not ok:
                    self.mirror.forget(tenant, hashes[pos:])
                    return False
                st = torch.tensor(slots, dtype=torch.int64, device=self.device)
                self.copier.scatter(self.staging, st, idx[pos * ps : (pos + n) * ps])
                if self.cuda:  # the blocks are free again only once the copy read them
                    torch.cuda.current_stream(self.device).synchronize()
            finally:
                self.slots.give(slots)
            pos += n
        return True

    # ------------------------------------------------------------ offload

    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        kv = _kv(transfers)
        if kv is None or not kv.keys or kv.device_indices is None:
            return False
        hashes = [keys.kvseal_hash(k) for k in kv.keys]
        idx = kv.device_indices
        if int(idx.numel()) != len(hashes) * self.page_size:
            return False
        events = self.record_offload_ready() if self.cuda else []
        self._offq.put((self.current_tenant, hashes, idx.clone(), events, time.monotonic()))
        return True

    def _offload_run(self) -> None:
        while True:
            task = self._offq.get()
            try:
                if task is None:
                    return
                try:
                    ok = self._store(*task)
                except Exception:
                    log.exception("kvseal linker: offload failed")
                    ok = False
                self.stats["offloads" if ok else "offload_failures"] += 1
                self._offload_results.put(ok)
            finally:
                self._offq.task_done()

    def _store(
        self, tenant: bytes, hashes: list[bytes], idx: Any, events: list[Any], since: float
    ) -> bool:
        for ev in events:
            ev.synchronize()
        m = self.mirror
        held = [i for i, h in enumerate(hashes) if m.contains(tenant, h)]
        if held:
            self.stats["skipped_pages"] += len(held)
            m.touch(tenant, [hashes[i] for i in held])
            if len(held) == len(hashes):
                return True
            keep = sorted(set(range(len(hashes))) - set(held))
            ps = self.page_size
            hashes = [hashes[i] for i in keep]
            pos = torch.tensor([i * ps + j for i in keep for j in range(ps)], dtype=torch.int64)
            idx = idx.index_select(0, pos.to(idx.device))
        ps = self.page_size
        done = 0
        while done < len(hashes):
            slots = self.slots.take(min(len(hashes) - done, self._offload_chunk))
            if not slots:
                return False
            n = len(slots)
            try:
                st = torch.tensor(slots, dtype=torch.int64, device=self.device)
                self.copier.gather(idx[done * ps : (done + n) * ps], self.staging, st)
                ok = self.kv.offload(
                    tenant, hashes[done : done + n], slots, event=self.kv.engine_event()
                )
            finally:
                self.slots.give(slots)
            if not ok:
                return False
            m.stored(tenant, hashes[done : done + n], since)
            done += n
        return True

    def num_completed_offloads(self) -> int:
        return self._offload_results.qsize()

    def pop_completed_offload(self) -> bool:
        return self._offload_results.get_nowait()

    # ------------------------------------------------------------ lifecycle

    def reset(self) -> None:
        """SGLang's cache flush: quiesce the transfers and forget what is
        queued. The daemon's blocks stay (a flush empties SGLang's cache, not
        kvseal's tier: the next requests restore from it)."""
        self._queued.clear()
        self._loadq.join()
        self._offq.join()
        while True:
            try:
                self._offload_results.get_nowait()
            except queue.Empty:
                break
        self.layer_done_counter.reset()

    def close(self) -> None:
        self.reset()
        self._offq.put(None)
        self._loadq.put(None)
        for t in self._threads:
            t.join(timeout=30)
        self.slots.close()
        self.mirror.close()
        self.kv.close()
        self.client.close()
        log.info("kvseal linker stats: %s", self.stats)


def _kv(transfers: list[PoolTransfer]) -> PoolTransfer | None:
    for t in transfers:
        if t.name == PoolName.KV:
            return t
    return None


def _tp(params: Any) -> tuple[int, int]:
    group = getattr(params, "attn_tp_cache_group", None) or getattr(params, "tp_cache_group", None)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(group=group), torch.distributed.get_world_size(
            group=group
        )
    return 0, 1


def _ignore_change(rank: int, tenant: bytes, h: bytes, present: bool) -> None:
    """The mirror's change callback: the linker reads the mirror directly."""
