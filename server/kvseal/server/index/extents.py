"""Set arithmetic on extents (disjoint byte ranges of the host region): which
of a store's victims its written slots overlap, and what a plan must hold."""

from __future__ import annotations

import bisect

from kvseal.server.hostregion import Extent


def overlapping(pieces: list[Extent], taken: list[Extent]) -> list[bool]:
    """For each of ``pieces``: whether it shares a byte with one of ``taken``
    (disjoint). O((P + T) log T)."""
    cuts = sorted((t.offset, t.offset + t.size) for t in taken if t.size)
    starts = [a for a, _ in cuts]
    out = []
    for p in pieces:
        # The last cut starting before the piece ends is the only candidate
        # that can reach into it (cuts are disjoint, so ends are sorted too).
        i = bisect.bisect_left(starts, p.offset + p.size) - 1
        out.append(p.size > 0 and i >= 0 and cuts[i][1] > p.offset)
    return out


def subtract(pieces: list[Extent], taken: list[Extent]) -> list[Extent]:
    """The parts of ``pieces`` (disjoint) not covered by ``taken`` (disjoint).
    O((P + T) log T)."""
    cuts = sorted((t.offset, t.offset + t.size) for t in taken if t.size)
    starts = [a for a, _ in cuts]
    out: list[Extent] = []
    for p in pieces:
        lo, hi = p.offset, p.offset + p.size
        i = max(bisect.bisect_right(starts, lo) - 1, 0)
        while lo < hi and i < len(cuts):
            a, b = cuts[i]
            if a >= hi:
                break
            if b > lo:
                if a > lo:
                    out.append(Extent(lo, a - lo))
                lo = max(lo, b)
            i += 1
        if lo < hi:
            out.append(Extent(lo, hi - lo))
    return out
