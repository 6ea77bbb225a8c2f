"""One component's share of kvseal: its staging blocks, daemon pool and mirror.

The linker (:mod:`kvseal.sglang.linker`) holds one :class:`ComponentTier`
per component SGLang hands it (:mod:`kvseal.sglang.pools`): ``kv``, and
``swa`` or ``mamba`` for hybrid models. Each has

- its own staging blocks of its own block size (the component's real bytes
  per page) and its own :class:`~kvseal.sglang.staging.Slots`;
- its own daemon pool, whose fingerprint and layout name bind the component,
  its kind and geometry: its own namespace, so a block of one component
  never verifies as another's;
- its own :class:`~kvseal.core.mirror.DaemonMirror` (lookups never make an
  RPC).

:meth:`ComponentTier.store` and :meth:`ComponentTier.restore` move pages
between SGLang's tensors and the daemon through staging, in chunks of the
free blocks; neither raises for a daemon failure.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from kvseal.client import KVSealClient
from kvseal.core.kv_pool import KVPool
from kvseal.core.mirror import DaemonMirror
from kvseal.sglang import keys
from kvseal.sglang.layout import PageCopier
from kvseal.sglang.pools import KV, Component
from kvseal.sglang.staging import Slots, new_staging, pool_inputs
from kvseal.v1 import kvseal_pb2 as pb

log = logging.getLogger("kvseal.sglang")


class ComponentTier:
    """A component's staging, pool and mirror (module doc). ``stats`` is the
    linker's counter dict (shared: one set of counters per linker)."""

    def __init__(
        self,
        comp: Component,
        *,
        client: KVSealClient,
        target: str,
        tag: str,
        model: str,
        revision: str | None,
        tp: tuple[int, int],
        pp_rank: int,
        staging_bytes: int,
        discovery: bool,
        identity: pb.DeploymentIdentity | None,
        stats: dict[str, int],
    ) -> None:
        g = comp.geometry
        self.name = comp.name
        self.component = comp
        self.geometry = g
        self.device = comp.device
        self.cuda = self.device.type == "cuda"
        self.copier = PageCopier(None, None, g, comp.parts)
        blocks = max(1, min(1 << 16, staging_bytes // g.block_bytes))
        self.blocks = blocks
        self.staging = new_staging(blocks, g.block_bytes, self.device)
        self.slots = Slots(blocks)
        # An offload takes at most half the blocks at a time, so a load (on the
        # scheduler thread in "verified" mode) rarely waits for a whole offload.
        self._offload_chunk = max(1, blocks // 2)
        self.stats = stats
        tp_rank, tp_size = tp
        self.fingerprint = keys.model_fingerprint(
            model=model,
            revision=revision,
            dtype=g.dtype,
            page_size=g.page_size,
            num_layers=g.num_layers,
            start_layer=comp.start_layer,
            heads=g.heads,
            head_dim=g.head_dim,
            v_head_dim=g.v_head_dim,
            block_bytes=g.block_bytes,
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=pp_rank,
            component=comp.name,
            kind=g.kind,
            layout=g.layout,
            rank_replicated=comp.rank_replicated,
        )
        self.template = pb.PoolGeometry(
            num_pages=1,
            tokens_per_page=g.page_size,
            num_layers=g.num_layers,
            num_kv_heads=g.heads,
            head_dim=g.head_dim,
            dtype=g.dtype,
            layout=g.layout if comp.name == KV else f"{g.layout}/{comp.name}",
            segments=[
                pb.Segment(buffer=0, offset=0, page_stride=g.block_bytes, bytes=g.block_bytes)
            ],
        )
        role = "kv" if comp.name == KV else comp.name
        tensors, refs = pool_inputs(self.staging)
        self.kv = KVPool(
            client,
            keys.pool_name(tag, tp_rank, pp_rank, role),
            self.fingerprint,
            self.template,
            tensors,
            refs,
        )
        self.mirror = DaemonMirror(
            tp_rank,
            target,
            keys.pool_name(tag, tp_rank, pp_rank, f"probe-{role}"),
            self.fingerprint,
            self.template,
            _ignore_change,
            discovery=discovery,
            identity=identity,
        )

    # ------------------------------------------------------------ presence

    def present(self, tenant: bytes, h: bytes) -> bool:
        """The mirror holds ``h``; when it has no word of it, a background
        discovery lookup is started (the next lookup may then hit)."""
        m = self.mirror
        if m.contains(tenant, h):
            return True
        if not m.discovery.known_absent(tenant, h):
            m.discovery.discover(tenant, h)
        return False

    # ------------------------------------------------------------ transfers

    def restore(self, tenant: bytes, hashes: list[bytes], idx: Any, deadline: float) -> bool:
        """Restore ``hashes`` into SGLang's pages ``idx`` through staging, in
        chunks of the free staging blocks, all by ``deadline`` (monotonic; the
        wait for staging blocks included: an offload may hold them for a whole
        offload RPC). True: every page holds its verified block. False: a
        chunk failed or the deadline passed; pages of earlier chunks hold
        verified blocks, the failed chunk's pages were not written, and the
        request recomputes all of them (its slots are private to it).
        Nothing is released here, whatever the write mode: the host copies
        stay until the caller knows the whole load verified (:meth:`release`),
        so a later chunk's failure (or another request's in the batch) leaves
        every block in the tier for the recompute's next load."""
        ipp = self.geometry.ipp
        pos = 0
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
                self.copier.scatter(self.staging, st, idx[pos * ipp : (pos + n) * ipp])
                if self.cuda:  # the blocks are free again only once the copy read them
                    torch.cuda.current_stream(self.device).synchronize()
            finally:
                self.slots.give(slots)
            pos += n
        return True

    def release(self, tenant: bytes, hashes: list[bytes], timeout: float) -> bool:
        """Write-back, once the whole load verified: the daemon frees these
        restored blocks (one Release RPC) and the mirror drops them at once
        (before the daemon's removal event lands, an eviction must find them
        absent and seal them again). False (daemon down, RPC failed): the
        copies stay in the tier and in the mirror, so the next eviction only
        touches them; host memory is spent, no page is lost."""
        if not self.kv.release(tenant, hashes, timeout=timeout):
            return False
        self.mirror.released(tenant, hashes)
        self.stats["released_pages"] += len(hashes)
        return True

    def store(self, tenant: bytes, hashes: list[bytes], idx: Any, since: float) -> bool:
        """Seal SGLang's pages ``idx`` as ``hashes`` (offload thread); pages
        the daemon already holds are only touched."""
        m = self.mirror
        ipp = self.geometry.ipp
        held = [i for i, h in enumerate(hashes) if m.contains(tenant, h)]
        if held:
            self.stats["skipped_pages"] += len(held)
            m.touch(tenant, [hashes[i] for i in held])
            if len(held) == len(hashes):
                return True
            keep = sorted(set(range(len(hashes))) - set(held))
            hashes = [hashes[i] for i in keep]
            pos = torch.tensor([i * ipp + j for i in keep for j in range(ipp)], dtype=torch.int64)
            idx = idx.index_select(0, pos.to(idx.device))
        done = 0
        while done < len(hashes):
            slots = self.slots.take(min(len(hashes) - done, self._offload_chunk))
            if not slots:
                return False
            n = len(slots)
            try:
                st = torch.tensor(slots, dtype=torch.int64, device=self.device)
                self.copier.gather(idx[done * ipp : (done + n) * ipp], self.staging, st)
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

    def close(self) -> None:
        self.slots.close()
        self.mirror.close()
        self.kv.close()


def _ignore_change(rank: int, tenant: bytes, h: bytes, present: bool) -> None:
    """The mirror's change callback: the linker reads the mirror directly."""
