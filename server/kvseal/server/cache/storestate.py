"""The store tier's bookkeeping records (:mod:`kvseal.server.cache.storetier`
owns and locks every instance; nothing here takes a lock but
:class:`PlaintextBuffers`, its own)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable, Sequence
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


NAMED_DROPS_KEPT = 4096  # Drop(block_hashes) remembered for victims chosen before them


class NamedDrops:
    """Every ``Drop(block_hashes)`` by sequence number, for the eviction
    snapshots of victims chosen before the drop began (the store tier holds
    its ``_cv`` around every call).

    An offload (or a promotion) takes :meth:`mark` before the index chooses
    its victims, and snapshots each victim only if no drop naming it began
    since the mark or is still in progress (:meth:`dropped_since`): a drop
    that lands between the choice and the snapshot finds the block neither in
    the index (already marked evicted) nor in the spill queue (not yet
    snapshotted), so without this check the snapshot would publish a block
    the drop reported removed. The log keeps the newest ``kept`` drops; a
    mark older than the log answers "dropped" (the snapshot is skipped: the
    store is a cache, a skipped spill costs a miss)."""

    def __init__(self, kept: int = NAMED_DROPS_KEPT) -> None:
        self._seq = 0
        self._kept = kept
        self._log: deque[tuple[int, ScopeKey, frozenset[bytes]]] = deque()
        self._active: dict[int, tuple[ScopeKey, frozenset[bytes]]] = {}

    def mark(self) -> int:
        """The sequence number below every drop begun so far or still running:
        a drop in progress at the mark counts as begun after it, since its
        index pass may already have run and miss a victim chosen after it."""
        return min(self._active, default=self._seq + 1) - 1

    def begin(self, key: ScopeKey, hashes: Sequence[bytes]) -> int:
        """A drop of ``hashes`` of ``key`` begins; returns its number for :meth:`end`."""
        self._seq += 1
        named = frozenset(hashes)
        self._log.append((self._seq, key, named))
        self._active[self._seq] = (key, named)
        while len(self._log) > self._kept:
            self._log.popleft()
        return self._seq

    def end(self, seq: int) -> None:
        """The drop ``seq`` finished (its queued and copying spills cancelled)."""
        self._active.pop(seq, None)

    def dropped_since(self, mark: int, key: ScopeKey, block_hash: bytes) -> bool:
        """Whether a drop naming ``block_hash`` of ``key`` is in progress, or
        began after ``mark`` (or the log no longer reaches back to ``mark``)."""
        for k, named in self._active.values():
            if k == key and block_hash in named:
                return True
        if mark >= self._seq:
            return False
        if not self._log or self._log[0][0] > mark + 1:
            return True  # trimmed past the mark: unknown, so treated as dropped
        for seq, k, named in reversed(self._log):
            if seq <= mark:
                break
            if k == key and block_hash in named:
                return True
        return False


@dataclass(frozen=True, slots=True)
class DropFence:
    """A drop between :meth:`StoreTier.begin_drop` and :meth:`StoreTier.end_drop`."""

    key: ScopeKey
    hashes: tuple[bytes, ...]  # empty: all of the tenant
    all_of_tenant: bool
    failed: str | None  # why the store's part failed at the beginning
    named_seq: int = 0  # Drop(block_hashes): its number in NamedDrops


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
