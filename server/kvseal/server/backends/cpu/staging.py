"""Private memory for the CPU data path: bounce buffers and restore staging.

Everything here is anonymous, private memory of the daemon (``MAP_PRIVATE |
MAP_ANONYMOUS``): never shared with an engine or the host, excluded from
core dumps, and wiped in a forked child. The CPU backend seals and opens
only in such memory (see :mod:`kvseal.server.sealing` on why).

Why a pool at all: a fresh buffer costs a page fault and a kernel zero-fill
for every page on first touch, which for a 1 GiB restore is slower than the
AES itself (a fresh 1 GiB ``bytearray`` per request was the "1 GiB restore
cliff"). So restore staging is kept and reused up to a byte limit, and large
buffers ask for transparent huge pages (512 times fewer faults and TLB
entries; a hint the kernel may ignore).
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Callable
from typing import Protocol

from kvseal.server.hostregion import HostRegion

_MADV_WIPEONFORK = 18  # Linux >= 4.14; not exported by the mmap module
_HUGE = 2 << 20  # x86-64 transparent huge page size


class PrivateBuffer:
    """``size`` bytes of page-aligned private memory: ``view`` for Python
    (``preadv``/``pwritev``, the cipher) and ``address`` for ``memmove``.

    Valid until :meth:`close`; the owner must not use ``view``, its slices or
    ``address`` afterwards.
    """

    __slots__ = ("_anchor", "_map", "address", "size", "view")

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError("a private buffer needs a positive size")
        self.size = size
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        advice = [getattr(mmap, "MADV_DONTDUMP", None), _MADV_WIPEONFORK]
        if size >= _HUGE:
            advice.append(getattr(mmap, "MADV_HUGEPAGE", None))
        for a in advice:
            if a is not None:
                try:
                    self._map.madvise(a)
                except OSError:  # an older kernel, THP disabled: hints only
                    pass
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(self._map)
        self.address = ctypes.addressof(self._anchor)
        self.view = memoryview(self._map)

    def close(self) -> None:
        """Unmap the memory. If a slice of ``view`` is still alive somewhere the
        map cannot be closed yet; it is then unmapped when that slice goes."""
        self.view.release()
        self._anchor = None
        self.address = 0
        try:
            self._map.close()
        except BufferError:  # a slice still exports it: freed with the last one
            pass


class StagingPool:
    """Reusable restore staging: :meth:`take` gives the smallest idle buffer
    that fits (or a new one, rounded up to whole pages, huge pages from
    2 MiB on), :meth:`give` keeps it for the next request, the idle buffers
    totalling at most ``limit`` bytes. Thread-safe.

    What an idle buffer holds is the plaintext of the last restore that used
    it: private memory like the rest of the daemon's, overwritten by the next.
    """

    def __init__(self, limit: int) -> None:
        self._lock = threading.Lock()
        self._free: list[PrivateBuffer] = []  # sorted by size
        self._limit = limit

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.size for b in self._free)

    def take(self, n: int) -> PrivateBuffer:
        with self._lock:
            for i, b in enumerate(self._free):
                if b.size >= n:
                    return self._free.pop(i)
        unit = _HUGE if n >= _HUGE else mmap.PAGESIZE
        return PrivateBuffer(max(unit, -(-n // unit) * unit))

    def give(self, buf: PrivateBuffer) -> None:
        """Keep ``buf`` for reuse; over the limit, the smallest idle buffers go
        first (a large buffer serves small requests too, never the reverse),
        and ``buf`` itself if it alone is larger than the limit."""
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: b.size)
            drop = []
            total = sum(b.size for b in self._free)
            while self._free and total > self._limit:
                gone = self._free.pop(0) if self._free[-1].size <= self._limit else self._free.pop()
                total -= gone.size
                drop.append(gone)
        for b in drop:
            b.close()

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for b in free:
            b.close()


class Bounce(threading.local):
    """One cache-sized :class:`PrivateBuffer` per thread, where a block is
    gathered, sealed and published a chunk at a time (so each chunk is read
    from the engine once and stays in the core's cache from the read to the
    publish). Grown on demand; lives as long as its thread."""

    def __init__(self) -> None:
        self.buf: PrivateBuffer | None = None

    def get(self, n: int) -> PrivateBuffer:
        buf = self.buf
        if buf is None or buf.size < n:
            if buf is not None:
                buf.close()
            buf = self.buf = PrivateBuffer(n)
        return buf


class RegionIO(Protocol):
    """The two region calls the CPU data path makes (``backend.Region``)."""

    def write(self, offset: int, data: memoryview) -> None: ...

    def read_into(self, offset: int, out: memoryview) -> int: ...


def publisher(region: RegionIO) -> Callable[[int, PrivateBuffer, int], None]:
    """``publish(offset, buf, n)``: the first ``n`` bytes of ``buf`` (private
    ciphertext) into the region at ``offset``, with one copy."""
    if isinstance(region, HostRegion) and region.mapped:
        return lambda offset, buf, n: region.write_at(offset, buf.address, n)
    return lambda offset, buf, n: region.write(offset, buf.view[:n])


def snapshotter(region: RegionIO) -> Callable[[int, PrivateBuffer, int, int], int]:
    """``snapshot(offset, buf, at, n)``: copy ``n`` region bytes at ``offset``
    into ``buf`` at ``at``, once; returns the bytes copied (short if the host
    shrank a file-backed region)."""
    if isinstance(region, HostRegion) and region.mapped:
        return lambda offset, buf, at, n: region.read_at(offset, buf.address + at, n)
    return lambda offset, buf, at, n: region.read_into(offset, buf.view[at : at + n])
