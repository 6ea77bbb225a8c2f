"""The store tier's bookkeeping records (:mod:`kvseal.server.cache.storetier`
owns and locks every instance; nothing here takes a lock but
:class:`PlaintextBuffers`, its own)."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass

from kvseal.server.sealing import SealRecord
from kvseal.server.store.keysource import wipe

ScopeKey = tuple[bytes, bytes]  # (namespace, tenant)


@dataclass(slots=True, eq=False)  # identity: jobs are found in lists by `is`
class Spill:
    """One block on its way to the store."""

    ns: bytes
    tenant: bytes
    block_hash: bytes
    drops: int  # its tenant's drop count when queued (changed: discarded)
    size: int = 0
    sealed: bytearray | None = None  # spill policy: ciphertext || tag, retained epoch
    record: SealRecord | None = None
    generation: int = 0
    cancelled: bool = False  # its block was dropped (Drop(block_hashes))


@dataclass(slots=True)
class Fence:
    """One (namespace, tenant)'s drop state (see the module docstring)."""

    drops: int = 0  # Drop(all_of_tenant)s begun or ended: queued spills carry it
    dropping_all: int = 0  # Drop(all_of_tenant)s in progress: no spill publishes
    changes: int = 0  # every drop's begin and end: promotions carry it
    dropping: int = 0  # drops of any kind in progress: no promotion seals
    promoting: int = 0  # promotions in flight

    def idle(self) -> bool:
        """Nothing refers to this fence: it may be forgotten. Never once a
        Drop(all_of_tenant) counted (queued spills compare against ``drops``);
        ``changes`` matters only to promotions in flight."""
        return not (self.drops or self.dropping or self.promoting)


@dataclass(frozen=True, slots=True)
class DropFence:
    """A drop between :meth:`StoreTier.begin_drop` and :meth:`StoreTier.end_drop`."""

    key: ScopeKey
    hashes: tuple[bytes, ...]  # empty: all of the tenant
    all_of_tenant: bool
    failed: str | None  # why the store's part failed at the beginning


@dataclass(slots=True)
class StoreCounts:
    lookup_hits: int = 0  # blocks lookups found only in the store
    promoted: int = 0  # blocks read from the store into the host tier
    spills_skipped: int = 0  # queue full, block gone, too large, dropped
    errors: int = 0  # OSError from the filesystem (misses or skipped spills)
    host_auth_failures: int = 0  # a host-tier copy failed to open while spilling


class PlaintextBuffers:
    """Private plaintext buffers for promotions, reused: fresh memory faults in
    page by page, which was the cost of a store read. A buffer is wiped when
    it is given back, and kept only while all kept ones total at most
    ``limit`` bytes. Thread-safe."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._free: dict[int, list[bytearray]] = {}  # by size
        self._bytes = 0

    def take(self, size: int) -> bytearray:
        """A buffer of ``size`` bytes (owned by the caller until given back)."""
        with self._lock:
            free = self._free.get(size)
            if free:
                self._bytes -= size
                return free.pop()
        return bytearray(size)

    def give(self, bufs: Iterable[bytearray]) -> None:
        """Wipe ``bufs`` and keep them for reuse, within the bound; the caller
        must not touch them again."""
        for b in bufs:
            wipe(b)
            with self._lock:
                if self._bytes + len(b) <= self._limit:
                    self._free.setdefault(len(b), []).append(b)
                    self._bytes += len(b)

    @property
    def kept_bytes(self) -> int:
        return self._bytes
