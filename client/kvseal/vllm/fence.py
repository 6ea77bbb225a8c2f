"""The seat of eviction mode's reuse fence in vLLM's block pool: a watcher
table that keeps kvseal's fence on a block whatever else is written there.

vLLM 0.32-0.34 keep one callback per block, ``BlockPool._reuse_watchers``
(block id -> callback), which ``get_new_blocks`` pops and calls when it hands
the block out, and which ``BlockPool.unpin_blocks`` *overwrites* for each
block it releases. Eviction mode (:mod:`kvseal.vllm.evict`) puts its fence
there for every block whose store job runs; another user of
``unpin_blocks`` (vLLM's HiSparse coordinator) writing over it on such a
block would have the block handed out unfenced, and the forward could
overwrite the page while the daemon reads it: a torn page sealed as authentic.

:class:`FencedWatchers` replaces the pool's table (same contents, a ``dict``
subclass, so vLLM's reads, ``pop`` and truthiness are unchanged) and is the
only place that decides what a write means:

- anyone else's watcher written over kvseal's fence is *chained* with it:
  the block keeps the fence, and the other user's watcher replaces only the
  other user's previous one (vLLM's own last-writer rule among them);
- kvseal's fence written over another user's watcher chains the same way;
- when the pool hands the block out it pops one callable, which runs the
  fence first and then the other user's watcher, even if the fence raised;
- :meth:`FencedWatchers.release` (the store finished) takes the fence off
  and leaves the other user's watcher in place.

Writes through ``[]=``, ``setdefault``, ``update`` and ``|=`` are all seen.
Everything runs on vLLM's scheduler thread (the pool is not thread-safe).
This module imports no vLLM; :func:`kvseal.vllm.compat.set_reuse_watchers`
installs the table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

Watcher = Callable[[Any], None]


class _Chained:
    """kvseal's fence and another user's watcher on one block."""

    __slots__ = ("fence", "other")

    def __init__(self, fence: Watcher, other: Watcher) -> None:
        self.fence = fence
        self.other = other

    def __call__(self, block: Any) -> None:
        try:
            self.fence(block)  # first: the job is fenced before anything else runs
        finally:
            self.other(block)


class FencedWatchers(dict[int, Watcher]):
    """vLLM's reuse-watcher table with kvseal's ``fence`` kept on the blocks it
    was written for (module doc). ``entries``: the table it replaces."""

    def __init__(self, fence: Watcher, entries: Mapping[int, Watcher] | None = None) -> None:
        super().__init__()
        self.fence = fence
        self.chained = 0  # writes that met the other party's watcher (diagnostic)
        self.update(entries or {})

    def __setitem__(self, block_id: int, watcher: Watcher) -> None:
        old = self.get(block_id)
        if watcher is self.fence:
            if old is None or old is self.fence or isinstance(old, _Chained):
                new: Watcher = old if isinstance(old, _Chained) else watcher
            else:
                new = _Chained(self.fence, old)
                self.chained += 1
        elif old is self.fence or isinstance(old, _Chained):
            new = _Chained(self.fence, watcher)
            self.chained += 1
        else:
            new = watcher
        super().__setitem__(block_id, new)

    def setdefault(self, block_id: int, watcher: Watcher) -> Watcher:
        if block_id not in self:
            self[block_id] = watcher
        return self[block_id]

    def update(self, *args: Any, **kw: Any) -> None:
        for k, v in dict(*args, **kw).items():
            self[k] = v

    def __ior__(self, other: Any) -> FencedWatchers:  # type: ignore[override,misc]
        self.update(other)
        return self

    def fenced(self, block_id: int) -> bool:
        """Whether kvseal's fence is on ``block_id`` (alone or chained)."""
        w = self.get(block_id)
        return w is self.fence or isinstance(w, _Chained)

    def release(self, block_ids: Iterable[int]) -> None:
        """Take kvseal's fence off these blocks (their store finished): another
        user's watcher chained with it stays, as that user wrote it."""
        for bid in block_ids:
            w = self.get(bid)
            if w is self.fence:
                del self[bid]
            elif isinstance(w, _Chained):
                super().__setitem__(bid, w.other)
