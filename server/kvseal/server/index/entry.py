"""The index's records: an entry per block, its states, and the results of
the index's operations (see ``kvseal.server.index.index`` for the lifecycle)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvseal.server.hostregion import Extent
from kvseal.server.sealing import SealRecord

BlockKey = tuple[bytes, bytes, bytes]  # (namespace, tenant, block hash)


class State(Enum):
    ABSENT = 1
    PENDING = 2
    READY = 3


class StoreOutcome(Enum):
    STORED = 1
    ALREADY_PRESENT = 2
    IN_PROGRESS = 3


class Removal(Enum):
    EVICTED = 1
    DROPPED = 2
    RELEASED = 3
    INTEGRITY = 4


@dataclass(eq=False, slots=True)
class Entry:
    key: BlockKey
    extent: Extent
    size: int  # ciphertext bytes (== plaintext bytes)
    generation: int
    state: State = State.PENDING
    record: SealRecord | None = None
    parent: Entry | None = None
    children: set[Entry] = field(default_factory=set)
    pins: int = 0
    removed: bool = False
    # Recency stamp (larger = more recently used); meaningful while READY.
    last_use: int = 0
    # Where the eviction planner finds it (leaves.UNTRACKED, ORDERED or HEAP), and the
    # sequence number of its current heap item (0: none).
    tracked: int = 0
    heaped: int = 0
    # Set while the entry is an eviction victim of a store that has not settled.
    doomed_by: Eviction | None = None
    # A doomed entry that must leave even if its store is aborted (dropped, or
    # an ancestor failed meanwhile), and the reason to announce then.
    doom_removal: Removal | None = None
    # New entries of a plan that evicted: the eviction their completion settles.
    eviction: Eviction | None = None

    @property
    def block_hash(self) -> bytes:
        return self.key[2]

    @property
    def visible(self) -> bool:
        """READY and not doomed: what lookup/restore/touch can see."""
        return self.state is State.READY and self.doomed_by is None and not self.removed


@dataclass(eq=False, slots=True)
class Eviction:
    """The victims one store doomed, and the bytes held for them."""

    victims: list[Entry]  # in the order they were chosen (LRU leaves first)
    new: list[Entry]  # the plan's new entries
    holds: list[Extent]  # victims' bytes no new block was placed in (kept allocated)
    settled: bool = False


@dataclass(slots=True)
class StorePlan:
    """Result of :meth:`Index.begin_store`. The caller seals ``new`` entries
    and then settles the plan exactly once: :meth:`Index.complete_store`
    with ``new`` and one record (or None) each, or :meth:`Index.abort_store`.

    ``evicted`` are the victims the plan *doomed* to make room: they leave
    for good when the store completes with every record; an aborted store
    removes only those whose bytes may have been written."""

    outcomes: list[StoreOutcome]
    new: list[Entry]  # PENDING, in request order, parallel to new_positions
    new_positions: list[int]  # index into the request's hashes
    evicted: list[Entry]


@dataclass(slots=True)
class IndexStats:
    ready: int
    pending: int
    pinned: int
    used_bytes: int
    capacity_bytes: int
