"""Offload at eviction on SGLang 0.5.23 (``offload_policy: "evict"``).

SGLang's direct-L3 linker path offers a linker pages only on insert
(write-through: ``UnifiedCacheLinkerWrapper`` sets the write-through
threshold to 1, every inserted node becomes a ``BackupKV``). At eviction a
node without a host copy is simply deleted: ``UnifiedRadixCache._evict_components``
calls ``self._evict_device_leaf(node_id, tracker)``, whose tree-core step
(``evict_device_leaf``, Python or Rust core) deletes the leaf and whose
``_apply_eviction_result`` hands its device slots back to the allocator, where
the allocation that caused the eviction takes them at once. HiCache's own
``write_back`` policy (``is_write_back``) backs a leaf up *into the host
pool* through the cache controller, which the linker path never builds, so
it cannot drive kvseal's tier.

So kvseal hooks that one call (:func:`install`, checked against the
installed signatures and source at start-up, as the salt hooks are):

- ``UnifiedRadixCache._evict_device_leaf(self, node_id, tracker)``: *before*
  it runs, the linker reads the node's transfers
  (``tree_core.build_external_linker_offload_transfers``, the same builder
  write-through uses; None for a node already stored) and
  :meth:`EvictSealer.copy` copies its pages into the linker's staging
  blocks; the seal RPCs run later, on the sealer thread, from staging only;
- ``UnifiedCacheLinkerWrapper.__init__(self, cache, cache_linker)``: after
  it ran, the linker meets its cache (``attach_cache``): it checks the cache
  (the Full component alone) and raises the write-through threshold out of
  reach, so nothing is offloaded on insert.

Ordering (the copy of an evicted page finishes before SGLang reuses it):

- **CPU**: the copy is a synchronous ``index_select`` into the staging
  tensor; it has completed when the hook returns, which is before
  ``_evict_device_leaf`` frees the slots. The daemon reads staging only,
  never SGLang's pages.
- **CUDA**: the copy is issued on the scheduler thread's current stream,
  after that stream waited for the forward stream (pages the last forward
  wrote are complete). An event recorded right after it is (a) passed to the
  daemon with the offload (it reads staging only after the event), (b)
  waited on by the forward stream (``forward_stream.wait_event``: a forward
  enqueued later, which may write the freed slots, runs after the copy). A
  verified load's scatter runs on the same current stream, hence after the
  copy; the ``async`` load thread starts from an event recorded on that
  stream at ``start_layer_wise_loading``, after the eviction. No host wait.

Staging blocks are the bound: a copy waits up to ``evict_wait_s`` for free
blocks (the sealer frees them as seals complete); pages that get none are
not sealed (SGLang recomputes them when next needed, as it would alone), the
tail of the node first so what is sealed stays a prefix. After one such
expiry later evictions do not wait until a seal *succeeded*: a seal that
failed (a hung daemon's RPC ran out, the pool backs off) frees its blocks but
says nothing about the daemon being back, so it does not end the starvation.
A hung daemon costs the scheduler one wait, not one per leaf or per failed
seal; evictions meanwhile still take the blocks that are free, without
waiting, so the first seal that succeeds (the daemon is back) ends it.
"""

from __future__ import annotations

import functools
import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from kvseal.sglang import keys, pools
from kvseal.sglang.tier import ComponentTier

log = logging.getLogger("kvseal.sglang")

NEVER = 1 << 30  # a write-through threshold no node's hit count reaches
MARK = "__kvseal_evict__"

_lock = threading.Lock()


def _params(fn: Any) -> list[str]:
    try:
        return list(inspect.signature(fn).parameters) if callable(fn) else []
    except (TypeError, ValueError):
        return []


def _sealer_of(cache: Any) -> EvictSealer | None:
    wrapper = getattr(cache, "linker", None)
    sealer = getattr(getattr(wrapper, "cache_linker", None), "evict_sealer", None)
    return sealer if isinstance(sealer, EvictSealer) else None


def _wrap_evict(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def _evict_device_leaf(self: Any, node_id: Any, tracker: Any, *a: Any, **kw: Any) -> Any:
        sealer = _sealer_of(self)
        if sealer is not None:
            # Before the tree step frees the leaf's slots (module doc, ordering).
            sealer.on_evict(self, node_id)
        return orig(self, node_id, tracker, *a, **kw)

    setattr(_evict_device_leaf, MARK, True)
    return _evict_device_leaf


def _wrap_attach(orig: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(orig)
    def __init__(self: Any, cache: Any, cache_linker: Any, *a: Any, **kw: Any) -> None:
        orig(self, cache, cache_linker, *a, **kw)
        attach = getattr(cache_linker, "attach_cache", None)
        if callable(attach):
            attach(cache)

    setattr(__init__, MARK, True)
    return __init__


def install() -> str | None:
    """Install the two wrappers (module doc) once per process; None when
    they are in place, else why this SGLang does not fit them (nothing is
    changed then, and the caller runs write-through)."""
    with _lock:
        try:
            from sglang.srt.mem_cache.unified_cache import (  # noqa: PLC0415
                unified_cache_linker as ucl,
            )
            from sglang.srt.mem_cache.unified_cache import (  # noqa: PLC0415
                unified_tree_core_interface as uti,
            )
            from sglang.srt.mem_cache.unified_radix_cache import (  # noqa: PLC0415
                UnifiedRadixCache,
            )
        except ImportError as e:
            return f"no UnifiedRadixCache/UnifiedCacheLinkerWrapper in this SGLang ({e})"
        wrapper = ucl.UnifiedCacheLinkerWrapper
        evict_fn = UnifiedRadixCache.__dict__.get("_evict_device_leaf")
        init_fn = wrapper.__dict__.get("__init__")
        if getattr(evict_fn, MARK, False) and getattr(init_fn, MARK, False):
            return None
        reason = _misfit(UnifiedRadixCache, wrapper, uti.UnifiedTreeCoreInterface)
        if reason is not None:
            return reason
        if not getattr(evict_fn, MARK, False):
            UnifiedRadixCache._evict_device_leaf = _wrap_evict(evict_fn)
        if not getattr(init_fn, MARK, False):
            wrapper.__init__ = _wrap_attach(init_fn)
        return None


def _misfit(cache_cls: Any, wrapper_cls: Any, core_cls: Any) -> str | None:
    """Why the hooks do not fit these classes, or None."""
    evict_fn = cache_cls.__dict__.get("_evict_device_leaf")
    if not getattr(evict_fn, MARK, False):
        if _params(evict_fn) != ["self", "node_id", "tracker"]:
            return "UnifiedRadixCache._evict_device_leaf is not (self, node_id, tracker)"
        try:
            src = inspect.getsource(cache_cls._evict_components)
        except (OSError, TypeError, AttributeError):
            src = ""
        if "self._evict_device_leaf(" not in src:
            return "UnifiedRadixCache._evict_components does not evict through _evict_device_leaf"
    init_fn = wrapper_cls.__dict__.get("__init__")
    if not getattr(init_fn, MARK, False) and _params(init_fn)[:3] != [
        "self",
        "cache",
        "cache_linker",
    ]:
        return "UnifiedCacheLinkerWrapper.__init__ is not (self, cache, cache_linker)"
    for name in ("build_external_linker_offload_transfers", "prefetch_anchor_info"):
        if _params(getattr(core_cls, name, None)) != ["self", "node_id"]:
            return f"the tree core's {name} is not (self, node_id)"
    prop = getattr(cache_cls, "write_through_threshold", None)
    if not isinstance(prop, property) or prop.fset is None:
        return "UnifiedRadixCache.write_through_threshold is not a settable property"
    return None


def cache_misfit(cache: Any) -> str | None:
    """Why this cache cannot offload at eviction, or None: the Full KV
    component alone (an SWA or Mamba component evicts its state apart from
    the Full leaf, before the hook could read it), and no HiCache host tier."""
    kinds = {getattr(c, "name", str(c)) for c in getattr(cache, "tree_components", ())}
    if kinds != {"FULL"}:
        return (
            f"the tree has components {sorted(kinds)}: offload at eviction carries the "
            "Full KV component alone (SWA and Mamba state is evicted apart from the Full leaf)"
        )
    if getattr(cache, "cache_controller", None) is not None:
        return "HiCache's host tier is on"
    return None


class EvictSealer:
    """Copies an evicted node's pages into staging on the scheduler thread
    and seals them on its own thread (module doc). ``on_evict`` never raises
    for a daemon failure: a page not sealed is a future miss."""

    def __init__(
        self,
        tiers: dict[str, ComponentTier],
        tenants: Any,
        *,
        forward_stream: Any,
        wait_s: float,
        stats: dict[str, int],
        rank: int,
        owner: bool = True,
    ) -> None:
        self.tier = tiers[pools.KV]
        # MLA on a daemon all ranks share: rank 0 alone seals the latent.
        self.owner = owner
        self.tenants = tenants
        self.forward_stream = forward_stream
        self.wait_s = wait_s
        self.stats = stats
        for k in ("evictions", "evict_sealed_pages", "evict_held_pages",
                  "evict_dropped_pages", "evict_seal_failures",
                  "evict_waits_expired"):  # fmt: skip
            stats.setdefault(k, 0)
        self._q: queue.Queue[Any] = queue.Queue()
        self._inflight: set[tuple[bytes, bytes]] = set()
        self._inflight_lock = threading.Lock()
        # Set after a copy found no staging block in time; cleared only by a
        # seal that succeeded (a failed one proves nothing about the daemon).
        self._starved = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kvseal-evict-{rank}", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ scheduler thread

    def on_evict(self, cache: Any, node_id: Any) -> None:
        """SGLang is about to delete device leaf ``node_id``: copy the pages
        the tier lacks into staging and queue their seal."""
        if not self.owner:
            return
        try:
            core = cache.tree_core
            transfers = core.build_external_linker_offload_transfers(node_id)
            if not transfers:
                return  # stored already, or an offload of it is pending (write-through)
            kv = next((t for t in transfers if str(getattr(t.name, "value", t.name)) == "kv"), None)
            if kv is None or not kv.keys or kv.device_indices is None:
                return
            if int(kv.device_indices.numel()) != len(kv.keys) * self.tier.geometry.ipp:
                return  # not whole pages: nothing kvseal can name by a page key
            salt = core.prefetch_anchor_info(node_id)[1]
            tenant = self.tenants.of(salt)
            hashes = [keys.kvseal_hash(k) for k in kv.keys]
            self.stats["evictions"] += 1
            self.copy(tenant, hashes, kv.device_indices)
        except Exception:  # a bug here must not break SGLang's eviction
            log.exception("kvseal linker: offload at eviction of node %s failed", node_id)

    def copy(self, tenant: bytes, hashes: list[bytes], idx: Any) -> int:
        """Copy the pages at ``idx`` (page-aligned, one page per hash) that
        the tier neither holds nor is sealing into staging, and queue them;
        returns the pages queued. When this returns, the copy is complete
        (CPU) or ordered before any later write of those slots (CUDA)."""
        tier = self.tier
        m = tier.mirror
        ipp = tier.geometry.ipp
        keep: list[int] = []
        held: list[bytes] = []
        with self._inflight_lock:
            for i, h in enumerate(hashes):
                if m.contains(tenant, h):
                    held.append(h)
                elif (tenant, h) not in self._inflight:
                    keep.append(i)
            for i in keep:
                self._inflight.add((tenant, hashes[i]))
        if held:
            self.stats["evict_held_pages"] += len(held)
            m.touch(tenant, held)  # used again: the tier keeps it longer
        if not keep:
            return 0
        if len(keep) != len(hashes):
            pos = torch.tensor([i * ipp + j for i in keep for j in range(ipp)], dtype=torch.int64)
            idx = idx.index_select(0, pos.to(idx.device))
        todo = [hashes[i] for i in keep]
        since = time.monotonic()
        deadline = since + self.wait_s
        if tier.cuda and self.forward_stream is not None:
            torch.cuda.current_stream(tier.device).wait_stream(self.forward_stream)
        done = 0
        while done < len(todo):
            wait = 0.0 if self._starved.is_set() else max(0.0, deadline - time.monotonic())
            slots = tier.slots.take(len(todo) - done, wait)
            if not slots:
                if wait > 0:
                    self.stats["evict_waits_expired"] += 1
                self._starved.set()
                break
            n = len(slots)
            st = torch.tensor(slots, dtype=torch.int64, device=tier.device)
            tier.copier.gather(idx[done * ipp : (done + n) * ipp], tier.staging, st)
            event = tier.kv.engine_event()  # CUDA: after the copy, on this stream
            if event is not None and self.forward_stream is not None:
                self.forward_stream.wait_event(event.event)
            self._q.put((tenant, todo[done : done + n], slots, event, since))
            done += n
        if done < len(todo):
            lost = todo[done:]
            self.stats["evict_dropped_pages"] += len(lost)
            with self._inflight_lock:
                self._inflight.difference_update((tenant, h) for h in lost)
            log.debug("kvseal linker: %d evicted pages not sealed (no staging block)", len(lost))
        return done

    # ------------------------------------------------------------ sealer thread

    def _run(self) -> None:
        tier = self.tier
        while True:
            task = self._q.get()
            try:
                if task is None:
                    return
                tenant, hashes, slots, event, since = task
                try:
                    ok = tier.kv.offload(tenant, hashes, slots, event=event)
                except Exception:
                    log.exception("kvseal linker: seal of evicted pages failed")
                    ok = False
                finally:
                    tier.slots.give(slots)
                if ok:
                    self._starved.clear()  # the daemon seals again: evictions may wait
                    tier.mirror.stored(tenant, hashes, since)
                    self.stats["evict_sealed_pages"] += len(hashes)
                else:
                    self.stats["evict_seal_failures"] += 1
                with self._inflight_lock:
                    self._inflight.difference_update((tenant, h) for h in hashes)
            finally:
                self._q.task_done()

    def drain(self) -> None:
        """Wait until every queued seal ended (SGLang's flush, close)."""
        self._q.join()

    def close(self) -> None:
        self.drain()
        self._q.put(None)
        self._thread.join(timeout=30)
