"""kvseal as SGLang's direct-L3 ``UnifiedCacheLinker`` (SGLang 0.5.23).

SGLang's ``UnifiedRadixCache`` drives the linker through its wrapper
(``sglang.srt.mem_cache.unified_cache.unified_cache_linker``): ``lookup`` in
``match_prefix`` (scheduler thread, per request), ``load`` when a hit is
admitted, ``start_layer_wise_loading``/``finish_layer_wise_loading`` around the
batch's forward, ``offload`` for each tree node written through (every inserted
page: the wrapper sets the write-through threshold to 1), and the two offload
counters once per step. How kvseal answers each (docs/sglang.md has the table):

- **lookup** never makes an RPC: it reads the scheduler's mirror of the daemon
  (:class:`kvseal.core.mirror.DaemonMirror`, fed by the daemon's event stream,
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
- **offload at eviction** (``offload_policy: "evict"``, :mod:`kvseal.sglang.evict`):
  nothing is offloaded on insert; a node's pages are copied into staging
  when SGLang evicts it (before it frees the slots) and sealed from there.
  Where the hooks do not fit this SGLang or this model, the linker logs why
  and runs write-through (``offload_mode`` says which runs). With
  ``write_back: true`` as well, each page is in one tier: a restore releases
  the pages' host copies, and the restored node, a device node like any
  other to SGLang's tree, is sealed again when it is next evicted.

Hybrid models: each component SGLang hands the linker (``kv``, and ``swa``
or ``mamba``; :mod:`kvseal.sglang.pools`) is its own kvseal pool
(:class:`~kvseal.sglang.tier.ComponentTier`). A prefix length is restorable
only when every component has what SGLang will load at that boundary (every
``kv`` page before it, the ``swa`` pages of the window ending there, the
``mamba`` state stored at it); an offload or load succeeds only when every
component's does, and a failed load writes only the request's private slots,
which SGLang frees and recomputes.

MLA under tensor parallelism: the latent is the same on every rank, so its
fingerprint binds no rank, and when the ranks share one daemon (``socket``
without ``{rank}``) only rank 0 offloads (SGLang's storage dedup, as its own
direct linkers do); every rank restores from that daemon itself. SGLang's
rank-0 load broadcast (``--enable-linker-mla-dedup``) is not used: it
delivers pages during the forward, where a failure can only abort the request
(HTTP 503), never recompute it.

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
from kvseal.sglang import evict, hooks, keys, pools
from kvseal.sglang.tier import ComponentTier

from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
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
    "offload_policy": '"write_through" (default: every inserted page) or "evict" '
    "(a page is sealed when SGLang evicts it)",
    "evict_wait_s": "how long an eviction waits for free staging blocks (default 1)",
    "write_back": "true: each page in one tier (a restore releases the host copy, the "
    'page is sealed again at its next eviction); needs offload_policy "evict" (default false)',
}
OFFLOAD_POLICIES = ("write_through", "evict")
REQ_TENANTS = 1 << 16  # requests whose tenant is remembered between match and load


class KVSealLinker(UnifiedCacheLinker):
    """SGLang's external cache linker backed by a kvseal daemon (module doc).

    Construction (SGLang's worker, at start-up) validates the config and the
    pools (ValueError naming what is unsupported), allocates each component's
    staging blocks, registers them with the daemon (waiting up to
    ``ready_wait_s``; a daemon that is down only means misses and dropped
    offloads until it is up) and starts the mirrors and the transfer threads.
    Every method SGLang calls returns a verdict and never raises for a daemon
    failure.
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
        self.load_mode = str(extra.get("load_mode", "verified"))
        if self.load_mode not in ("verified", "async"):
            raise ValueError(
                f'kvseal linker: load_mode must be "verified" or "async", not {self.load_mode!r}'
            )
        self.offload_policy = str(extra.get("offload_policy", "write_through"))
        if self.offload_policy not in OFFLOAD_POLICIES:
            raise ValueError(
                f"kvseal linker: offload_policy must be one of {list(OFFLOAD_POLICIES)}, "
                f"not {self.offload_policy!r}"
            )
        self._evict_wait = float(extra.get("evict_wait_s", 1.0))
        wb = extra.get("write_back", False)
        if not isinstance(wb, bool):
            raise ValueError(f"kvseal linker: write_back must be true or false, not {wb!r}")
        if wb and self.offload_policy != "evict":
            # SGLang offers a page on insert only: a page released at restore
            # would never be sealed again under write-through.
            raise ValueError(
                'kvseal linker: write_back needs offload_policy "evict" (under write-through '
                "a released page is never offered again)"
            )
        self.write_back = wb
        self.forward_stream = forward_stream
        self.page_size = int(params.page_size)
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        kinds = {getattr(c, "name", str(c)) for c in components}
        try:
            comps = pools.components(kvcache, params, kinds, self.page_size)
        except ValueError as e:
            raise ValueError(f"kvseal linker: {e}") from None
        self.swa_window_pages = 0
        if "SWA" in kinds:
            window = getattr(params, "swa_retain_window", None) or getattr(
                params, "sliding_window_size", None
            )
            if not window or int(window) <= 0:
                raise ValueError("kvseal linker: an SWA model without a sliding window size")
            self.swa_window_pages = -(-int(window) // self.page_size)
        tp_rank, tp_size = _tp(params)
        pp_rank = int(getattr(params, "pp_rank", 0) or 0)
        self.rank = tp_rank
        sock_template = str(extra.get("socket", DEFAULT_SOCKET))
        sock = sock_template.format(rank=tp_rank)
        self.target = sock if "://" in sock else socket_target(sock)
        self.client = KVSealClient(
            ClientConfig(
                target=self.target,
                transfer_timeout_s=float(extra.get("transfer_timeout_s", 10.0)),
            )
        )
        tag = str(extra.get("instance", "sglang"))
        self.tenants = keys.Tenants()
        model_path = str(getattr(server_args, "model_path", ""))
        model = model_path.rstrip("/").rsplit("/", 1)[-1]
        label = f"{extra.get('deployment_label') or model}/tp{tp_rank}of{tp_size}"
        self.stats = {"lookups": 0, "hit_pages": 0, "loads": 0, "load_failures": 0,
                      "offloads": 0, "offload_failures": 0, "skipped_pages": 0,
                      "staging_waits_expired": 0, "offloads_deduplicated": 0,
                      "released_pages": 0}  # fmt: skip
        staging_bytes = int(extra.get("staging_bytes", 256 << 20))
        self.tiers: dict[str, ComponentTier] = {}
        for c in comps:
            self.tiers[c.name] = ComponentTier(
                c,
                client=self.client,
                target=self.target,
                tag=tag,
                model=model_path,
                revision=getattr(server_args, "revision", None),
                tp=(tp_rank, tp_size),
                pp_rank=pp_rank,
                # the staging is shared out by block bytes, each component at least one block
                staging_bytes=staging_bytes
                * c.geometry.block_bytes
                // sum(x.geometry.block_bytes for x in comps),
                discovery=bool(extra.get("discovery", True)),
                identity=self.tenants.identity(
                    label if c.name == pools.KV else f"{label}/{c.name}"
                ),
                stats=self.stats,
            )
        kvt = self.tiers[pools.KV]
        # The KV component's parts, for the first version's callers and tests.
        self.geometry, self.copier, self.staging = kvt.geometry, kvt.copier, kvt.staging
        self.slots, self.kv, self.mirror = kvt.slots, kvt.kv, kvt.mirror
        self.device = kvt.device
        self.cuda = kvt.cuda
        # MLA's latent on a daemon all ranks share: rank 0 alone stores it.
        self.offload_owner = (
            not kvt.component.rank_replicated or tp_rank == 0 or "{rank}" in sock_template
        )
        if self.write_back and kvt.component.rank_replicated and "{rank}" not in sock_template:
            # Every rank restores rank 0's latent: the first restore's release
            # would take it from the others.
            raise ValueError(
                "kvseal linker: write_back with MLA on a daemon all ranks share is not "
                "supported (put {rank} in socket, or leave write_back off)"
            )
        self.pools: dict[PoolName, object] = {PoolName.KV: kvcache}
        if pools.SWA in self.tiers:
            self.pools[PoolName.SWA] = kvcache.swa_kv_pool
        if pools.MAMBA in self.tiers:
            self.pools[PoolName.MAMBA] = params.req_to_token_pool.mamba_pool
        ready_wait = float(extra.get("ready_wait_s", 10.0))
        for name, tier in self.tiers.items():
            if tier.kv.pool.wait_ready(ready_wait):
                log.info(
                    "kvseal linker: rank %d: %s: %d staging blocks of %d bytes on %s "
                    "registered with %s", tp_rank, name, tier.blocks, tier.geometry.block_bytes,
                    tier.device, self.target,
                )  # fmt: skip
            else:
                log.warning(
                    "kvseal linker: rank %d: %s pool not registered yet (%s): misses until it is",
                    tp_rank,
                    name,
                    tier.kv.pool.registration_error,
                )
        # A verified load waits on SGLang's scheduler thread: a hung daemon may
        # cost one such wait (then the pool backs off and loads fail at once).
        self._load_timeout = float(extra.get("load_timeout_s", 2.0))
        # Layer ids the forward may wait on: every component's layers.
        layers = max(
            int(getattr(kvcache, "layer_num", 0) or 0),
            sum(tier.geometry.num_layers for tier in self.tiers.values()),
        )
        self.layer_done_counter = LayerWiseLoadCounter(layers)
        if pools.MAMBA in self.tiers and hasattr(
            params.req_to_token_pool, "register_layer_transfer_counter"
        ):
            # Mamba state lives in the request pool: its layer waits are wired apart.
            params.req_to_token_pool.register_layer_transfer_counter(self.layer_done_counter)
        # rid -> tenant, set by the hooks in match_prefix (bounded, oldest out).
        self._req_tenant: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        # The tenant of the match or insert running now (scheduler thread).
        self.current_tenant = self.tenants.shared
        self._queued: dict[str, tuple[bytes, list[_Job]]] = {}
        self._offq: queue.Queue[Any] = queue.Queue()
        self._loadq: queue.Queue[Any] = queue.Queue()
        self._offload_results: queue.Queue[bool] = queue.Queue()
        self._threads = [
            threading.Thread(
                target=self._offload_run, name=f"kvseal-offload-{tp_rank}", daemon=True
            ),
            threading.Thread(target=self._load_run, name=f"kvseal-load-{tp_rank}", daemon=True),
        ]
        for t in self._threads:
            t.start()
        hooks.install()
        # What runs: "write_through" until attach_cache switches to "evict".
        self.offload_mode = "write_through"
        self.evict_sealer: evict.EvictSealer | None = None
        self.fallback_reason: str | None = None
        self._evict_hooked = False
        if self.offload_policy == "evict":
            reason = evict.install()
            if reason is None:
                self._evict_hooked = True
            else:
                self._fall_back(reason)

    # ------------------------------------------------------------ offload mode

    def _fall_back(self, reason: str) -> None:
        self.fallback_reason = reason
        log.warning(
            "kvseal linker: offload at eviction does not fit (%s): falling back to "
            "write-through (every inserted page is sealed)",
            reason,
        )

    def attach_cache(self, cache: Any) -> None:
        """SGLang's wrapper has attached this linker to ``cache`` (the evict
        hook calls this after ``UnifiedCacheLinkerWrapper.__init__``, which
        set the write-through threshold to 1). With ``offload_policy:
        "evict"`` and a cache that fits, raise the threshold out of reach (no
        offload on insert) and start the sealer; else leave write-through."""
        if not self._evict_hooked or self.evict_sealer is not None:
            return
        reason = evict.cache_misfit(cache)
        if reason is not None:
            self._fall_back(reason)
            return
        cache.write_through_threshold = evict.NEVER
        self.evict_sealer = evict.EvictSealer(
            self.tiers,
            self.tenants,
            forward_stream=self.forward_stream if self.cuda else None,
            wait_s=self._evict_wait,
            stats=self.stats,
            rank=self.rank,
            owner=self.offload_owner,
        )
        self.offload_mode = "evict"
        log.info(
            "kvseal linker: rank %d: offload at eviction%s: nothing is sealed on insert, "
            "a page is sealed when SGLang evicts it",
            self.rank,
            " with write-back (a restore releases the host copy)" if self.write_back else "",
        )

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
        for tier in self.tiers.values():
            tier.mirror.introduce(tenant)
        hashes = [keys.kvseal_hash(k) for k in kv.keys]
        kvt = self.tiers[pools.KV]
        n = len(hashes)
        for i, h in enumerate(hashes):
            if not kvt.present(tenant, h):
                n = i
                # The rest of the prompt is asked about in the same background
                # batch: a server restarted on a warm store (or a replica) would
                # otherwise learn one page per request.
                for later in hashes[i + 1 :]:
                    kvt.present(tenant, later)
                break
        ok = [True] * (n + 1)
        swa = self.tiers.get(pools.SWA)
        if swa is not None and n:
            # Length L needs the SWA pages of the window ending at L (SGLang
            # loads exactly those). Discovery asks only for the longest one's.
            w = self.swa_window_pages
            have = [swa.mirror.contains(tenant, h) for h in hashes[:n]]
            for i in range(max(0, n - w), n):
                if not have[i]:
                    swa.present(tenant, hashes[i])
            missing = [0] * (n + 1)  # missing[i]: absent SWA pages among the first i
            for i, present in enumerate(have):
                missing[i + 1] = missing[i] + (not present)
            for L in range(1, n + 1):
                ok[L] = ok[L] and missing[L] - missing[max(0, L - w)] == 0
        mamba = self.tiers.get(pools.MAMBA)
        if mamba is not None and n:
            # One state per hit, stored at a node's last page: length L needs it at L.
            for L in range(1, n + 1):
                ok[L] = ok[L] and mamba.mirror.contains(tenant, hashes[L - 1])
            if not ok[n]:
                mamba.present(tenant, hashes[n - 1])
        self.stats["lookups"] += 1
        out = [L for L in range(1, n + 1) if ok[L]]
        self.stats["hit_pages"] += out[-1] if out else 0
        return out

    # ------------------------------------------------------------ load

    def _jobs(self, transfers: list[PoolTransfer]) -> list[_Job] | None:
        """(tier, hashes, device indices) per transfer with keys; None when a
        transfer names a pool kvseal does not carry or its indices do not
        match its keys."""
        jobs: list[_Job] = []
        for t in transfers:
            if not t.keys:
                continue
            tier = self.tiers.get(str(getattr(t.name, "value", t.name)))
            idx = t.device_indices
            if tier is None or idx is None:
                return None
            if int(idx.numel()) != len(t.keys) * tier.geometry.ipp:
                log.warning(
                    "kvseal linker: %s transfer of %d pages into %d slots refused",
                    tier.name, len(t.keys), int(idx.numel()),
                )  # fmt: skip
                return None
            jobs.append((tier, [keys.kvseal_hash(k) for k in t.keys], idx))
        return jobs if jobs and jobs[0][0].name == pools.KV else None

    def load(self, rid: str, transfers: list[PoolTransfer]) -> bool:
        jobs = self._jobs(transfers)
        if jobs is None:
            return False
        tenant = self._tenant_of(rid)
        self.stats["loads"] += 1
        if self.load_mode == "verified":
            ok = self._restore(tenant, jobs)
            if ok:
                self._release([(tenant, jobs)], self._load_timeout)
            else:
                self.stats["load_failures"] += 1
            return ok
        if rid in self._queued:
            raise RuntimeError(f"kvseal linker: a load for {rid} is already queued")
        self._queued[rid] = (tenant, jobs)
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
                    ok = all([self._restore(tenant, jobs) for tenant, jobs in loads])
                    if ok:  # the batch fails whole: release only once all of it verified
                        self._release(loads, self.client.config.transfer_timeout_s)
                except Exception:  # a bug here must fail the batch, not hang it
                    log.exception("kvseal linker: load batch failed")
                    ok = False
                if ok:
                    for layer in range(self.layer_done_counter.num_layers):
                        self.layer_done_counter.complete(index, layer)
                else:
                    self.stats["load_failures"] += 1
                    self.layer_done_counter.fail(index, RuntimeError("kvseal restore failed"))
            finally:
                self._loadq.task_done()

    def _restore(self, tenant: bytes, jobs: list[_Job]) -> bool:
        """Every component's pages of one load, under one deadline: the
        verified load's ``load_timeout_s`` (SGLang's scheduler thread waits),
        or an async load's transfer timeout (a batch is not held forever
        either). False as soon as one component's restore fails: the pages
        are the request's private slots, SGLang frees them and recomputes.
        Releases nothing (write-back): see :meth:`_release`."""
        verified = self.load_mode == "verified"
        budget = self._load_timeout if verified else self.client.config.transfer_timeout_s
        deadline = time.monotonic() + budget
        return all(tier.restore(tenant, hashes, idx, deadline) for tier, hashes, idx in jobs)

    def _release(self, loads: list[tuple[bytes, list[_Job]]], timeout: float) -> None:
        """Write-back: release the host copies of ``loads``, every one of
        which verified (SGLang uses all of them). Never before: a load that
        fails (one chunk, one component, one request of an async batch) is
        recomputed whole, and its pages must still be in the tier for the
        next load. Only once eviction mode runs: after a fallback to
        write-through nothing would seal a released page again. A release
        that fails leaves the copies cached (costs memory, loses nothing)."""
        if not (self.write_back and self.offload_mode == "evict"):
            return
        for tenant, jobs in loads:
            for tier, hashes, _idx in jobs:
                tier.release(tenant, hashes, timeout)

    # ------------------------------------------------------------ offload

    def offload(self, transfers: list[PoolTransfer], session_id: str | None = None) -> bool:
        jobs = self._jobs(transfers)
        if jobs is None:
            return False
        if not self.offload_owner:
            # MLA on a shared daemon: rank 0 stores the latent every rank has.
            self.stats["offloads_deduplicated"] += 1
            self._offload_results.put(True)
            return True
        events = self.record_offload_ready() if self.cuda else []
        copied = [(tier, hashes, idx.clone()) for tier, hashes, idx in jobs]
        self._offq.put((self.current_tenant, copied, events, time.monotonic()))
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

    def _store(self, tenant: bytes, jobs: list[_Job], events: list[Any], since: float) -> bool:
        for ev in events:
            ev.synchronize()
        return all(tier.store(tenant, hashes, idx, since) for tier, hashes, idx in jobs)

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
        if self.evict_sealer is not None:
            self.evict_sealer.drain()
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
        if self.evict_sealer is not None:
            self.evict_sealer.close()
        for tier in self.tiers.values():
            tier.close()
        self.client.close()
        log.info("kvseal linker stats: %s", self.stats)


_Job = tuple[ComponentTier, list[bytes], Any]


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
