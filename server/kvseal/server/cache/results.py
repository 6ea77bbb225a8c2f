"""What the cache's requests return, what it counts, and the hooks it calls."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvseal.server.index import StoreOutcome


@dataclass(frozen=True, slots=True)
class Registered:
    pool_id: str
    namespace: bytes
    block_bytes: int
    owner_token: bytes = b""


@dataclass(frozen=True, slots=True)
class OffloadResult:
    outcomes: list[StoreOutcome]
    stored_blocks: int
    stored_bytes: int
    evicted_blocks: int


@dataclass(frozen=True, slots=True)
class RestoreResult:
    restored_blocks: int
    restored_bytes: int


@dataclass
class Counters:
    lookups: int = 0
    lookup_blocks: int = 0
    lookup_hit_blocks: int = 0
    offloaded_blocks: int = 0
    offloaded_bytes: int = 0
    restored_blocks: int = 0
    restored_bytes: int = 0
    evicted_blocks: int = 0
    dropped_blocks: int = 0
    integrity_failures: int = 0
    # Restores that failed because a Drop(all_of_tenant) destroyed the blocks'
    # keys while they ran (not integrity failures: nothing was tampered with).
    restores_of_dropped: int = 0
    key_scopes_destroyed: int = 0


@dataclass(frozen=True, slots=True)
class Observer:
    """Hooks for metrics/tracing; all optional, called outside locks."""

    on_transfer: Callable[[str, int, int, float], None] | None = None  # dir, blocks, bytes, s
    on_integrity_failure: Callable[[str, int], None] | None = None  # pool id, blocks
