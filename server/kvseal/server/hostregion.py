"""The untrusted host region: where ciphertext lives, and its allocator.

Threat model: the hypervisor can read and rewrite every byte of this region at
any time (in a confidential VM it is shared, unencrypted memory). So:

- only ciphertext is ever written here (the sealing contract);
- nothing read from here is trusted: nonces, tags, sizes and generations live
  in the trusted index; a slot's bytes are *snapshotted* into private memory
  with one copy (``read_into``) and only that snapshot is authenticated and
  decrypted, so the host cannot change bytes between check and use;
- the host can also shrink a backing file; reads then come back short, which
  the caller treats exactly like tampering (never a crash).

On the CPU backend the region is either an anonymous ``memfd``, sealed
against shrinking (``F_SEAL_SHRINK``) and accessed through a memory map with
plain ``memcpy``; or a file given with ``--host-region`` (mode 0600), which is
how tests play the hypervisor, accessed with ``pread``/``pwrite`` because a
memory map of a file someone else can truncate raises SIGBUS.
"""

from __future__ import annotations

import bisect
import fcntl
import mmap
import os
import stat
import threading
from dataclasses import dataclass

from kvseal.server.memcopy import Pinned, memmove

SLOT_ALIGN = 256  # keeps slots aligned for DMA engines and AVX stores


def align_up(n: int, a: int = SLOT_ALIGN) -> int:
    return (n + a - 1) // a * a


class RegionError(Exception):
    """The region cannot be created or accessed."""


@dataclass(frozen=True, slots=True)
class Extent:
    offset: int
    size: int


class ExtentAllocator:
    """First-fit allocator of aligned extents in ``[0, capacity)``.

    Not thread-safe: the cache calls it under its index lock. ``clone`` gives
    a scratch copy (tests, diagnostics). Eviction planning instead frees
    victims for real and, if the plan cannot be completed, takes them back
    with ``reserve``: free runs are always coalesced, so free-then-reserve of
    the same extents restores exactly the same free list.

    ``fits(need)`` answers "how many blocks of ``need`` bytes would first-fit
    place" in O(1) for the few block sizes in use: the count is kept up to
    date on every change of a free run (first-fit of equal-sized blocks never
    splits one block across runs, so the count is the sum over free runs of
    ``run // need``).
    """

    _TRACKED_NEEDS = 8  # block sizes whose fit count is maintained (one per pool, typically)

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity // SLOT_ALIGN * SLOT_ALIGN
        # Free extents, sorted by offset, never adjacent (always coalesced).
        self._offsets: list[int] = [0] if self.capacity else []
        self._sizes: list[int] = [self.capacity] if self.capacity else []
        self.used = 0
        self._fit: dict[int, int] = {}  # aligned need -> sum(run // need) over free runs

    def clone(self) -> ExtentAllocator:
        other = ExtentAllocator.__new__(ExtentAllocator)
        other.capacity = self.capacity
        other._offsets = list(self._offsets)
        other._sizes = list(self._sizes)
        other.used = self.used
        other._fit = dict(self._fit)
        return other

    def _runs_changed(self, gone: tuple[int, ...], added: tuple[int, ...]) -> None:
        """Keep the fit counts in step: free runs of sizes ``gone`` were
        replaced by runs of sizes ``added``."""
        for need in self._fit:
            self._fit[need] += sum(a // need for a in added) - sum(g // need for g in gone)

    def fits(self, need: int) -> int:
        """How many blocks of ``align_up(need)`` bytes first-fit could place
        now. O(1) once the size is tracked (the first call for a size walks
        the free list; at most ``_TRACKED_NEEDS`` sizes are tracked)."""
        need = align_up(need)
        if need <= 0:
            raise ValueError("block size must be positive")
        count = self._fit.get(need)
        if count is None:
            if len(self._fit) >= self._TRACKED_NEEDS:
                del self._fit[next(iter(self._fit))]
            count = self._fit[need] = sum(s // need for s in self._sizes)
        return count

    def allocate(self, size: int) -> Extent | None:
        """Return an extent of ``align_up(size)`` bytes, or None if no free
        run is large enough (nothing changes then)."""
        need = align_up(size)
        for i, free in enumerate(self._sizes):
            if free >= need:
                off = self._offsets[i]
                if free == need:
                    del self._offsets[i]
                    del self._sizes[i]
                    self._runs_changed((free,), ())
                else:
                    self._offsets[i] = off + need
                    self._sizes[i] = free - need
                    self._runs_changed((free,), (free - need,))
                self.used += need
                return Extent(off, need)
        return None

    def reserve(self, extent: Extent) -> None:
        """Take exactly ``extent`` (aligned, wholly free) out of the free
        list, e.g. to hold it for a block that may come back. Raises
        RegionError and changes nothing if any byte of it is not free."""
        off, size = extent.offset, extent.size
        i = bisect.bisect_right(self._offsets, off) - 1
        if size <= 0 or i < 0 or off + size > self._offsets[i] + self._sizes[i]:
            raise RegionError(f"cannot reserve {size} bytes at {off}: not free")
        run_off, run_size = self._offsets[i], self._sizes[i]
        left, right = off - run_off, run_off + run_size - (off + size)
        pieces = [(o, s) for o, s in ((run_off, left), (off + size, right)) if s]
        self._offsets[i : i + 1] = [o for o, _ in pieces]
        self._sizes[i : i + 1] = [s for _, s in pieces]
        self._runs_changed((run_size,), tuple(s for _, s in pieces))
        self.used += size

    def can_allocate_all(self, sizes: list[int]) -> bool:
        """Whether ``allocate`` would succeed for every size, in order."""
        trial = self.clone()
        return all(trial.allocate(s) is not None for s in sizes)

    def free(self, extent: Extent) -> None:
        off, size = extent.offset, extent.size
        i = bisect.bisect_left(self._offsets, off)
        if i < len(self._offsets) and self._offsets[i] < off + size:
            raise RegionError("double free or overlapping extent")
        if i > 0 and self._offsets[i - 1] + self._sizes[i - 1] > off:
            raise RegionError("double free or overlapping extent")
        self.used -= size
        merge_prev = i > 0 and self._offsets[i - 1] + self._sizes[i - 1] == off
        merge_next = i < len(self._offsets) and self._offsets[i] == off + size
        if merge_prev and merge_next:
            prev, nxt = self._sizes[i - 1], self._sizes[i]
            self._sizes[i - 1] += size + nxt
            del self._offsets[i]
            del self._sizes[i]
            self._runs_changed((prev, nxt), (prev + size + nxt,))
        elif merge_prev:
            prev = self._sizes[i - 1]
            self._sizes[i - 1] += size
            self._runs_changed((prev,), (prev + size,))
        elif merge_next:
            nxt = self._sizes[i]
            self._offsets[i] = off
            self._sizes[i] += size
            self._runs_changed((nxt,), (nxt + size,))
        else:
            self._offsets.insert(i, off)
            self._sizes.insert(i, size)
            self._runs_changed((), (size,))

    def free_bytes(self) -> int:
        return sum(self._sizes)


class HostRegion:
    """A file descriptor of ``capacity`` bytes that only ever holds ciphertext.

    ``write``/``read_into`` are thread-safe (positional I/O on one fd). The
    region owns its fd; ``close`` releases it (a memfd's memory goes with it).
    """

    def __init__(self, capacity: int, path: str | None = None) -> None:
        if capacity <= 0:
            raise RegionError("host region capacity must be positive")
        self.capacity = capacity
        self.path = path
        self._map: mmap.mmap | None = None
        self._pin: Pinned | None = None
        if path is None:
            self._fd = os.memfd_create("kvseal-host-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            self.description = "anonymous memfd"
        else:
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
            try:
                self._fd = os.open(path, flags, 0o600)
            except OSError as e:
                raise RegionError(f"cannot open host region {path!r}: {e.strerror}") from e
            st = os.fstat(self._fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(self._fd)
                raise RegionError(f"host region {path!r} is not a regular file")
            os.fchmod(self._fd, 0o600)
            self.description = path
        try:
            os.ftruncate(self._fd, 0)  # stale ciphertext from a previous key is useless
            os.ftruncate(self._fd, capacity)
        except OSError as e:
            os.close(self._fd)
            raise RegionError(f"cannot size host region to {capacity} bytes: {e.strerror}") from e
        if path is None:
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            self._map = mmap.mmap(self._fd, capacity, mmap.MAP_SHARED)
            self._pin = Pinned(self._map)
        self._closed = threading.Event()

    def write(self, offset: int, data: memoryview) -> None:
        """Publish ``data`` (ciphertext, private buffer) at ``offset``."""
        view = data.cast("B") if data.format != "B" else data
        if not 0 <= offset <= self.capacity - len(view):
            raise RegionError(f"write of {len(view)} bytes at {offset} is outside the region")
        if self._pin is not None:
            if view.readonly:  # no address to take without a copy; rare (not the data path)
                assert self._map is not None
                self._map[offset : offset + len(view)] = view
                return
            src = Pinned(view)
            memmove(self._pin.address + offset, src.address, len(view))
            src.release()
            return
        done = 0
        while done < len(view):
            n = os.pwrite(self._fd, view[done:], offset + done)
            if n <= 0:
                raise RegionError("short write to host region")
            done += n

    @property
    def mapped(self) -> bool:
        """Whether :meth:`write_at`/:meth:`read_at` work (the memfd region;
        a ``--host-region`` file is only reached with ``pread``/``pwrite``)."""
        return self._pin is not None

    def write_at(self, offset: int, src: int, n: int) -> None:
        """Publish ``n`` bytes of ciphertext from the private address ``src``
        (which the caller keeps valid) at ``offset``: one ``memmove``, which
        releases the GIL. Mapped regions only."""
        if self._pin is None:
            raise RegionError("write_at needs the mapped (memfd) region")
        if not 0 <= offset <= self.capacity - n or n < 0:
            raise RegionError(f"write of {n} bytes at {offset} is outside the region")
        memmove(self._pin.address + offset, src, n)

    def read_at(self, offset: int, dst: int, n: int) -> int:
        """Snapshot ``n`` bytes at ``offset`` into the private address ``dst``
        with one ``memmove``; returns the bytes copied (short only past the
        region's end). Mapped regions only."""
        if self._pin is None:
            raise RegionError("read_at needs the mapped (memfd) region")
        if offset < 0 or n < 0:
            raise RegionError(f"read at negative offset {offset}")
        n = max(0, min(n, self.capacity - offset))
        memmove(dst, self._pin.address + offset, n)
        return n

    def read_into(self, offset: int, out: memoryview) -> int:
        """Snapshot ``len(out)`` bytes at ``offset`` into private ``out``.

        Returns the number of bytes read, which is short if the host shrank
        the backing file; the caller must then treat the slot as tampered.
        """
        if offset < 0:
            raise RegionError(f"read at negative offset {offset}")
        if self._pin is not None:
            n = max(0, min(len(out), self.capacity - offset))
            dst = Pinned(out)
            memmove(dst.address, self._pin.address + offset, n)
            dst.release()
            return n
        done = 0
        while done < len(out):
            n = os.preadv(self._fd, [out[done:]], offset + done)
            if n <= 0:
                break
            done += n
        return done

    def close(self) -> None:
        if not self._closed.is_set():
            self._closed.set()
            if self._pin is not None:
                self._pin.release()
            if self._map is not None:
                self._map.close()
            os.close(self._fd)
