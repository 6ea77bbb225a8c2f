"""What the cache's requests return, what it counts, and the hooks it calls."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvseal.server import telemetry
from kvseal.server.index import IndexStats, StoreOutcome


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


def tier_sample(
    c: Counters, ix: IndexStats, pools: int, holds: int, store: telemetry.StoreSample | None
) -> telemetry.TierSample:
    """The cache's scrape-time sample: counters read without their lock, as a
    scrape always was (each value is one consistent int)."""
    return telemetry.TierSample(
        lookups=c.lookups,
        lookup_blocks=c.lookup_blocks,
        lookup_hit_blocks=c.lookup_hit_blocks,
        offloaded_blocks=c.offloaded_blocks,
        offloaded_bytes=c.offloaded_bytes,
        restored_blocks=c.restored_blocks,
        restored_bytes=c.restored_bytes,
        evicted_blocks=c.evicted_blocks,
        dropped_blocks=c.dropped_blocks,
        integrity_failures=c.integrity_failures,
        key_scopes_destroyed=c.key_scopes_destroyed,
        restores_of_dropped=c.restores_of_dropped,
        host_bytes_used=ix.used_bytes,
        host_bytes_capacity=ix.capacity_bytes,
        host_blocks=ix.ready,
        registered_pools=pools,
        pool_holds=holds,
        store=store,
    )
