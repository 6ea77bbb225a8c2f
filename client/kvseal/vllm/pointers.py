"""vLLM 0.34's ``DevicePointers`` mapped back to the pages of kvseal's pools.

From 0.34 on, vLLM's offloading worker no longer receives a job's GPU block
ids: it receives raw device addresses and byte sizes (``resolve_device_pointers``:
for each KV-cache group, for each of the group's data refs (layers), for each
block, one ``(ptr, size)``). kvseal's daemon copies whole pages of a
registered pool by page index, never arbitrary addresses, so every pointer is
mapped back to the page it addresses, and checked:

- it lies inside the region of the pool registered for that group and layer
  (the CPU backend's shared-memory KV object, :mod:`kvseal.core.shm_kv`, or
  a CUDA IPC export, :mod:`kvseal.core.kv_pool`): base + page x stride, with
  0 <= page < the pool's pages;
- it starts a page (an address inside a page, which would straddle two, is
  refused) and its size is that layer's page bytes exactly;
- every layer's pointer of one block names the same page (kvseal moves a
  block's layers together).

Anything else raises :class:`PointerError` and the job fails whole: no byte
of it is read or written (a failed load is recomputed, a failed store is a
later miss). Pure arithmetic, no vLLM and no numpy import: unit-tested in
``tests_vllm/v033/test_compat.py`` on every version.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PageRegion", "PointerError", "map_pointers"]


class PointerError(ValueError):
    """A pointer or size that does not address one whole page of a registered pool."""


@dataclass(frozen=True)
class PageRegion:
    """One layer's pages in one registered pool: page ``p`` is the bytes
    ``[base + p * stride, base + p * stride + page_bytes)``."""

    base: int
    stride: int
    pages: int
    page_bytes: int

    def page_of(self, ptr: int, size: int) -> int:
        """The page ``ptr`` starts, ``size`` bytes long; PointerError otherwise."""
        if size != self.page_bytes:
            raise PointerError(f"size {size} is not the page's {self.page_bytes} bytes")
        off = ptr - self.base
        if off < 0 or off >= self.pages * self.stride:
            raise PointerError(f"pointer {ptr:#x} is outside the registered pool")
        page, within = divmod(off, self.stride)
        if within:
            raise PointerError(f"pointer {ptr:#x} starts {within} bytes into page {page}")
        return page


def _ints(a: Any) -> list[int]:
    # numpy arrays (vLLM's uint64) and plain sequences alike, as Python ints.
    return [int(x) for x in (a.tolist() if hasattr(a, "tolist") else a)]


def map_pointers(
    ptrs: Any,
    sizes: Any,
    group_block_counts: Sequence[int],
    group_ref_counts: Sequence[int],
    regions: Sequence[Sequence[PageRegion]],
) -> tuple[list[int], list[int]]:
    """``(pages, group_sizes)``: the page of every block, ordered by group as
    vLLM orders them, and the blocks per group (vLLM's ``group_sizes``).

    ``regions[g][r]``: the registered region of group ``g``'s layer ``r``, in
    the order of vLLM's data refs (the pool's layer order). PointerError when
    the arrays, counts and regions do not line up, or a pointer does not map
    (module doc)."""
    p, s = _ints(ptrs), _ints(sizes)
    if len(p) != len(s):
        raise PointerError(f"{len(p)} pointers but {len(s)} sizes")
    if not len(group_block_counts) == len(group_ref_counts) == len(regions):
        raise PointerError(
            f"{len(group_block_counts)} groups of blocks, {len(group_ref_counts)} of refs, "
            f"{len(regions)} registered"
        )
    pages: list[int] = []
    at = 0
    for g, (kk, nn) in enumerate(zip(group_block_counts, group_ref_counts, strict=True)):
        k, n = int(kk), int(nn)
        if k == 0:
            continue
        if n != len(regions[g]):
            raise PointerError(f"group {g}: {n} data refs, {len(regions[g])} layers registered")
        if at + k * n > len(p):
            raise PointerError(f"group {g}: {k * n} pointers expected, {len(p) - at} left")
        block_pages: list[int] | None = None
        for r, region in enumerate(regions[g]):
            row = [region.page_of(p[at + j], s[at + j]) for j in range(k)]
            if block_pages is None:
                block_pages = row
            elif row != block_pages:
                raise PointerError(f"group {g}: layer {r} addresses other pages than layer 0")
            at += k
        assert block_pages is not None
        pages.extend(block_pages)
    if at != len(p):
        raise PointerError(f"{len(p) - at} pointers beyond the groups' blocks")
    return pages, [int(k) for k in group_block_counts]
