"""vLLM's KV events for daemons with a store tier (docs/store.md, "Events,
Stats and replicas").

Such a daemon's event stream names each event's tier (``medium`` ``"cpu"``:
the host tier; ``"storage"``: the store, with its locality), so vLLM's
``OffloadingEvent``s come from it, a medium per tier: a block is announced
stored in a tier once every TP rank's daemon announced it there, and removed
once one rank's no longer holds it there. Each rank's facts are a bit, so a
rank announcing a block twice (a restarted daemon finding the store's blocks
again) changes nothing; a rank whose stream had a gap (a restart, a watcher
cut off for falling behind) is reset: its bits are cleared, and what every
rank held is announced removed (the daemon does not announce again what it
already held, so a block may then go unannounced: an under-report, never a
claim of a block that is gone).

Not thread-safe: the manager calls it under its lock (the mirrors' update
lock).
"""

from __future__ import annotations

import queue
from collections.abc import Callable

from kvseal.v1 import kvseal_pb2 as pb
from kvseal.vllm import keys

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

MAX_BLOCKS = 1 << 19  # (tier, tenant, block)s tracked; the oldest is retracted beyond
_LOCALITY = {"local": Locality.LOCAL, "remote": Locality.REMOTE}


class TierEvents:
    """``vllm_hash``: the kvseal hash -> the vLLM hash the events must name
    (``forget``: called once a block is in no tier, to drop that mapping)."""

    def __init__(
        self,
        world: int,
        group: int,
        out: queue.SimpleQueue[OffloadingEvent],
        vllm_hash: Callable[[bytes], bytes],
        forget: Callable[[bytes], object],
        *,
        max_blocks: int = MAX_BLOCKS,
    ) -> None:
        self._full = (1 << world) - 1
        self._group = group
        self._out = out
        self._vllm_hash = vllm_hash
        self._forget = forget
        self._max = max_blocks
        # (medium, tenant, hash) -> bit per rank that holds it there; oldest first
        self._held: dict[tuple[str, bytes, bytes], int] = {}
        self._locality: dict[str, Locality | None] = {}  # medium -> as last announced

    def __len__(self) -> int:
        return len(self._held)

    def event(self, rank: int, ev: pb.BlockEvent) -> None:
        """One event of rank's stream."""
        bit = 1 << rank
        stored = ev.kind == pb.BLOCK_STORED
        medium = "storage" if ev.medium == "storage" else "cpu"
        if medium == "storage":
            self._locality[medium] = _LOCALITY.get(ev.locality)
        tenant = bytes(ev.tenant)
        changed: list[bytes] = []
        emptied: list[bytes] = []
        for raw in ev.block_hashes:
            h = bytes(raw)
            k = (medium, tenant, h)
            before = self._held.get(k, 0)
            after = before | bit if stored else before & ~bit
            if after:
                self._held[k] = after
            else:
                self._held.pop(k, None)
                emptied.append(h)
            if (after == self._full) != (before == self._full):
                changed.append(h)
        self._emit(medium, tenant, changed, removed=not stored)
        self._unname(tenant, emptied)
        while len(self._held) > self._max:  # retract the oldest: never claim blindly
            (m, t, h), held = next(iter(self._held.items()))
            del self._held[(m, t, h)]
            if held == self._full:
                self._emit(m, t, [h], removed=True)
            self._unname(t, [h])

    def reset(self, rank: int) -> None:
        """Rank's stream had a gap: forget its facts (module docstring)."""
        bit = 1 << rank
        gone: dict[tuple[str, bytes], list[bytes]] = {}
        emptied: list[tuple[bytes, bytes]] = []
        for k, held in list(self._held.items()):
            if not held & bit:
                continue
            if held & ~bit:
                self._held[k] = held & ~bit
            else:
                del self._held[k]
                emptied.append(k[1:])
            if held == self._full:
                gone.setdefault(k[:2], []).append(k[2])
        for (medium, tenant), hashes in gone.items():
            self._emit(medium, tenant, hashes, removed=True)
        for tenant, h in emptied:
            self._unname(tenant, [h])

    def _emit(self, medium: str, tenant: bytes, hashes: list[bytes], *, removed: bool) -> None:
        if not hashes:
            return
        okeys = [OffloadKey(keys.make_offload_key(self._vllm_hash(h), self._group)) for h in hashes]
        ev = OffloadingEvent(
            keys=okeys,
            medium=Medium.STORAGE if medium == "storage" else Medium.CPU,
            removed=removed,
        )
        ev.locality = self._locality.get(medium) if medium == "storage" else None
        self._out.put(ev)

    def _unname(self, tenant: bytes, hashes: list[bytes]) -> None:
        """Blocks no rank holds in any tier any more: their vLLM names go."""
        for h in hashes:
            if not any((m, tenant, h) in self._held for m in ("cpu", "storage")):
                self._forget(h)
