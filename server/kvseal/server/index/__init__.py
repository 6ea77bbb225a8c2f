"""The trusted index of the host tier: block -> slot, nonce, tag, generation, LRU.

- ``index``   :class:`~kvseal.server.index.index.Index`: lookup, the two-phase
  store, pinned restore, drop; atomic under one lock, no I/O (its docstring
  has the lifecycle of an entry and the two-phase eviction);
- ``entry``   the records (``Entry``, ``State``, ``StorePlan``, ...);
- ``leaves``  which blocks may be evicted, in recency order, and the eviction plan;
- ``extents`` byte-range arithmetic for settling a failed store's eviction.

The names below are the package's interface; its modules import each other
directly, never through this file.
"""

from kvseal.server.index.entry import (
    BlockKey,
    Entry,
    IndexStats,
    Removal,
    State,
    StoreOutcome,
    StorePlan,
)
from kvseal.server.index.index import Index

__all__ = [
    "BlockKey",
    "Entry",
    "Index",
    "IndexStats",
    "Removal",
    "State",
    "StoreOutcome",
    "StorePlan",
]
