"""kvseal as a vLLM ``OffloadingSpec``: the sealed host tier behind vLLM's
OffloadingConnector.

Enable it with :mod:`kvseal.vllm.connector` (one ``--kv-transfer-config``
line, see docs/vllm.md); the spec can also be named on vLLM's own
``OffloadingConnector`` (``spec_name``/``spec_module_path``), but then the
KV cache is not in shared memory (CPU platform), ``cache_salt`` is not known
(every request is the shared tenant; vLLM's salted hashes still never match
across salts) and a failed restore cannot be reported as a recompute.

- :class:`KVSealOffloadingManager` (scheduler process) answers ``lookup`` from
  :class:`~kvseal.core.mirror.DaemonMirror`\\ s, one per rank: a block is a hit
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
  hands to vLLM as load errors, so vLLM recomputes them (vLLM 0.32/0.33; on
  0.34 the job's ``TransferResult`` says it failed and vLLM recomputes the
  request: :mod:`kvseal.vllm.compat`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from kvseal.client.config import socket_target
from kvseal.v1 import kvseal_pb2 as pb
from kvseal.vllm import compat, keys, orphan
from kvseal.vllm.evict import offload_mode
from kvseal.vllm.groups import FULL, GroupLayout, describe_groups
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
from kvseal.vllm.worker import KVSealOffloadingWorker

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

log = logging.getLogger("kvseal.vllm")

__all__ = [
    "GroupLayout",
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
# engine's VllmConfig (head geometry, revision, hash algorithm) and its
# KVCacheConfig (each offloaded group's kind and real bytes; vLLM's
# OffloadingConfig carries neither). Requests' salts reach the manager
# through note_request_salt (vLLM's ReqContext carries no salt).
_current_vllm_config: Any = None
_current_kv_cache_config: Any = None


def socket_for_rank(extra: dict[str, Any], rank: int) -> str:
    """The daemon of ``rank``: ``kvseal_sockets`` (a list, one per rank) or
    ``kvseal_socket`` (may contain ``{rank}``; one daemon per GPU)."""
    socks = extra.get("kvseal_sockets")
    if socks:
        s = str(socks[rank])
    else:
        s = str(extra.get("kvseal_socket", DEFAULT_SOCKET)).format(rank=rank)
    return s if "://" in s else socket_target(s)


class KVSealOffloadingSpec(OffloadingSpec):
    """The kvseal tier as a vLLM offloading spec.

    ``kv_connector_extra_config`` keys: ``kvseal_socket`` (the daemon's socket;
    ``{rank}`` is replaced by the worker's rank: one daemon per GPU) or
    ``kvseal_sockets`` (a list, one per rank); ``kvseal_transfer_timeout_s``
    (default 10: the deadline of one Offload/Restore); ``kvseal_write_back``
    (default false: write-through, a restored block stays in the tier; true: its
    host copy is released once restored); ``kvseal_lookup_discovery``
    (default: on when the daemon has a store tier, off otherwise: also find
    blocks the daemon held before this engine subscribed, at the price of
    deferring a request with unknown blocks by a scheduler step while one
    batched Lookup runs in the background; true or false forces it);
    ``kvseal_stats_path`` (a diagnostic: each worker writes its per-group
    transfer counts there as JSON); ``kvseal_offload`` (default
    ``write-through``: every block vLLM offers is stored when computed;
    ``eviction``: a block is stored only when vLLM's prefix cache is about to
    evict it, :mod:`kvseal.vllm.evict`, with ``kvseal_eviction_horizon_blocks``).

    Every KV-cache group vLLM's offloading config selects is offloaded, each as
    its own pool and namespace (:mod:`kvseal.vllm.groups`): full attention,
    sliding window, MLA, Mamba / linear-attention state (``align`` mode),
    quantized KV. One vLLM block per offloaded chunk (``blocks_per_chunk`` 1,
    the default); anything kvseal cannot carry is refused at start with a clear
    error.

    MLA under tensor parallelism (vLLM's ``replicated_layout``: every rank's
    latent pages are the same bytes): when every rank uses one daemon, each
    block is stored once (rank 0 writes, vLLM skips the other ranks' stores)
    under a rank-independent namespace, and every rank restores it from that
    daemon. With a daemon per GPU, each rank stores its own copy: a daemon
    writes only into the KV cache of the GPU it serves, so another rank's
    daemon cannot restore from it.
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
        # vLLM builds the spec in its engine core and in each worker: a process
        # whose parent was killed (kill -9 of the API server alone) stops itself,
        # so its KV object and pools do not outlive it (kvseal.vllm.orphan).
        orphan.stop_when_orphaned()
        if self.blocks_per_chunk != 1:
            raise ValueError(
                "kvseal needs one vLLM block per offloaded chunk "
                f"(blocks_per_chunk={self.blocks_per_chunk}): leave kv_connector_extra_config's "
                "block_size and blocks_per_chunk unset"
            )
        self.layouts: list[GroupLayout] = describe_groups(config, _current_kv_cache_config)
        self.groups = tuple(g.group_id for g in self.layouts)
        self.group = self.groups[0]
        self._layout = {g.group_id: g for g in self.layouts}
        if len(self.layouts) > 1 and self.extra_config.get("sync_load_budget_bytes"):
            # vLLM 0.33 runs an expedited load's request in the same step and can
            # hear of its failure only as block ids, which it refuses for models
            # with several groups (RuntimeError), while a failed receive of a
            # running request is ignored: such a request would run on a prefix
            # whose window or state was never written. Regular loads report a
            # failed receive, and vLLM recomputes the request (tests_vllm/v033).
            log.warning(
                "kvseal: sync_load_budget_bytes ignored: this model has %d KV-cache "
                "groups, and vLLM cannot recompute a failed expedited load of several",
                len(self.layouts),
            )
            self.extra_config["sync_load_budget_bytes"] = 0
        elif not compat.EXPEDITED_LOADS and self.extra_config.get("sync_load_budget_bytes"):
            # vLLM 0.34 raises RuntimeError in its worker when a sync load fails (its
            # request already ran on the unloaded KV). A kvseal load fails by design
            # when a block is tampered with, evicted or late, so no sync load: every
            # load is a regular one, whose failure vLLM recomputes (docs/vllm.md).
            log.warning(
                "kvseal: sync_load_budget_bytes ignored on vLLM %d.%d: a failed sync load "
                "would crash the engine; loads run asynchronously and a failed one is "
                "recomputed",
                *compat.VERSION,
            )
            self.extra_config["sync_load_budget_bytes"] = 0
        raw = self.extra_config.get("kvseal_lookup_discovery")
        # None: the manager turns discovery on once a daemon says it has a store
        # (blocks that outlive a restart are found after one).
        self.discovery_setting: bool | None = None if raw is None else bool(raw)
        self.discovery = bool(raw)
        self.engine_id = config.engine_id
        self.dp_index = config.parallel.data_parallel_index
        self.rank = config.parallel.rank
        self.world_size = config.parallel.world_size
        # MLA latent replicated across TP ranks: store once only when every rank
        # talks to the same daemon (see the class doc). vLLM's worker reads this
        # attribute: True makes only rank 0 write.
        sockets = {self.socket(r) for r in range(self.world_size)}
        self.replicated_layout = bool(config.replicated_layout) and len(sockets) == 1
        vc = _current_vllm_config
        self.revision: str | None = None
        self.hash_algo = "sha256"
        self.heads, self.head_dim = 0, 0
        self.offload = offload_mode(self.extra_config)  # an unknown mode fails the start
        self.max_step_tokens: int | None = None  # the eviction horizon's unit (evict.py)
        if vc is not None:
            sc = vc.scheduler_config
            self.max_step_tokens = sc.max_num_scheduled_tokens or sc.max_num_batched_tokens
            mc = vc.model_config
            self.revision = mc.revision
            self.hash_algo = str(vc.cache_config.prefix_caching_hash_algo)
            self.heads = mc.get_num_kv_heads(vc.parallel_config)
            self.head_dim = mc.get_head_size()
        self._manager: KVSealOffloadingManager | None = None
        self._worker: KVSealOffloadingWorker | None = None

    @property
    def hit_ranks(self) -> int:
        """Daemons whose mirrors a hit needs: one when a replicated MLA latent is
        stored once, else every rank's."""
        return 1 if self.replicated_layout else self.world_size

    def socket(self, rank: int) -> str:
        return socket_for_rank(dict(self.extra_config), rank)

    def layout(self, group: int | None = None) -> GroupLayout:
        return self._layout[self.group if group is None else group]

    def fingerprint(self, rank: int, group: int | None = None) -> bytes:
        c = self.config
        g = self.layout(group)
        tag = g.fingerprint_tag
        # A latent stored once is every rank's: one namespace for all ranks.
        fp_rank = 0 if self.replicated_layout else rank
        return keys.model_fingerprint(
            model=c.model.name,
            revision=self.revision,
            kv_dtype=c.model.dtype + (f";{tag}" if tag else ""),
            tokens_per_block=c.groups[self.groups.index(g.group_id)].tokens_per_block,
            layer_names=g.layer_names,
            bytes_per_block=self._block_bytes(g),
            kv_cache_layout=c.kv_cache_layout,
            hash_algo=self.hash_algo,
            group=g.group_id,
            tp_rank=fp_rank,
            tp_size=c.parallel.tp_size,
        )

    def _block_bytes(self, g: GroupLayout) -> int:
        # One group: vLLM's own per-block figure, as in earlier releases (the
        # same bytes when nothing is padded; the worker checks they agree).
        if len(self.layouts) == 1 and g.kind == FULL:
            return int(self.config.worker_kv_bytes_per_block)
        return g.block_bytes

    def identity(self, rank: int, tenant_key: bytes | None) -> pb.DeploymentIdentity:
        """What this rank's replicas must agree on (docs/store.md, "Replicas"):
        labelled by ``kvseal_deployment_label`` (default: the model's last path
        component) and the TP rank."""
        c = self.config
        name = str(self.extra_config.get("kvseal_deployment_label") or "")
        name = name or str(c.model.name).rstrip("/").rsplit("/", 1)[-1]
        label = f"{name}/tp{rank}of{c.parallel.tp_size}"
        return keys.deployment_identity(label, self.hash_algo, tenant_key)

    def geometry_template(self, group: int | None = None) -> pb.PoolGeometry:
        """One group's pool geometry without buffers: what the namespace depends
        on. Block bytes are vLLM's page bytes of the group's layers (``layout``
        says so: they are in vLLM's in-page order, not kvseal's canonical
        L,KV,T,H,D; ``kind`` names the group's layer kind when not full
        attention)."""
        c = self.config
        g = self.layout(group)
        nbytes = self._block_bytes(g)
        heads, head_dim = (self.heads, self.head_dim) if g.kind == FULL else (g.heads, g.head_dim)
        layout = f"vllm-page:{c.kv_cache_layout or 'default'}"
        if g.kind != FULL:
            layout += f":{g.kind}"
        return pb.PoolGeometry(
            num_pages=1,
            tokens_per_page=c.groups[self.groups.index(g.group_id)].tokens_per_block,
            num_layers=len(g.layer_names),
            num_kv_heads=heads,
            head_dim=head_dim,
            dtype=str(c.model.dtype).removeprefix("torch."),
            layout=layout[:64],
            segments=[pb.Segment(buffer=0, offset=0, page_stride=nbytes, bytes=nbytes)]
            if nbytes
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
