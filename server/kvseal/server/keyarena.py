"""Where key bytes live: 32-byte slots in ``mlock``ed anonymous pages.

Only :mod:`kvseal.server.sealing` uses this module. A key is written into a
slot straight from the kernel CSPRNG (:func:`fill_random`), never into an
immutable Python ``bytes``, and the slot is zeroed when it is given back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap

from kvseal.server.errors import CapacityExhausted

KEY_BYTES = 32
_MADV_WIPEONFORK = 18  # Linux >= 4.14; not exported by the mmap module

log = logging.getLogger("kvseal.sealing")


class ArenaFull(CapacityExhausted):
    """Every slot is taken and the arena is at ``max_keys`` (the sealer turns
    this into its own ``KeysExhausted``)."""


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC  # noqa: PLW0603 - loaded once, on first use
    if _LIBC is None:
        _LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return _LIBC


def fill_random(buf: ctypes.Array[ctypes.c_char]) -> None:
    """Fill ``buf`` from the kernel CSPRNG without creating a Python bytes."""
    n = len(buf)
    got = _libc().getrandom(buf, ctypes.c_size_t(n), 0)
    if got != n:  # getrandom(2) on a 32-byte request never returns short
        raise OSError(ctypes.get_errno(), "getrandom failed")


KeySlot = ctypes.Array[ctypes.c_char]


class KeyArena:
    """Slots of 32 bytes for keys, in ``mlock``ed anonymous pages.

    One locked page per 32-byte key would hit ``RLIMIT_MEMLOCK`` (often 8 MiB,
    64 KiB on older systems) at a few thousand tenants; here one page holds 128
    keys. The arena grows by one page whenever every slot is taken, up to
    ``max_keys`` slots rounded up to whole pages (then :class:`ArenaFull`),
    keeps its pages until :meth:`close` (so it stays at the peak number of live
    keys, 32 bytes each), and reuses freed slots first. A page ``mlock`` refuses (over the limit) is
    used unlocked and logged once: keys stay out of Python objects either way,
    but may then reach swap (see the README on swap in a CVM). Pages are also
    excluded from core dumps and wiped in a forked child.

    A slot is zeroed when it is given back; :meth:`close` zeroes every page.
    Not thread-safe: the sealer's lock guards it.
    """

    def __init__(self, max_keys: int) -> None:
        self.max_keys = max_keys
        self.slots_per_page = mmap.PAGESIZE // KEY_BYTES
        self._pages: list[tuple[mmap.mmap, int, bool]] = []  # (map, address, locked)
        self._free: list[KeySlot] = []
        self._warned = False

    @property
    def pages(self) -> int:
        return len(self._pages)

    @property
    def unlocked_pages(self) -> int:
        return sum(1 for _, _, locked in self._pages if not locked)

    def _grow(self) -> None:
        if (len(self._pages) + 1) * self.slots_per_page > self.max_keys and self._pages:
            raise ArenaFull(
                f"{self.max_keys} key epochs are live (one per tenant and model with "
                "blocks cached, plus seals in flight); evict or drop blocks first"
            )
        mem = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for advice in (getattr(mmap, "MADV_DONTDUMP", None), _MADV_WIPEONFORK):
            if advice is not None:
                try:
                    mem.madvise(advice)
                except OSError:  # an older kernel: defence in depth only
                    pass
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
        locked = _libc().mlock(ctypes.c_void_p(addr), ctypes.c_size_t(mmap.PAGESIZE)) == 0
        if not locked and not self._warned:
            self._warned = True
            log.warning(
                "mlock of a key page failed (RLIMIT_MEMLOCK?): keys beyond the limit are "
                "not locked in memory and could be swapped; raise LimitMEMLOCK"
            )
        self._pages.append((mem, addr, locked))
        # Later slots last: take() pops from the end, so a page fills in order.
        for i in reversed(range(self.slots_per_page)):
            self._free.append((ctypes.c_char * KEY_BYTES).from_buffer(mem, i * KEY_BYTES))

    def take(self) -> KeySlot:
        """A zeroed slot (ArenaFull when ``max_keys`` are taken)."""
        if not self._free:
            self._grow()
        return self._free.pop()

    def give(self, slot: KeySlot) -> None:
        """Wipe ``slot`` and make it reusable."""
        ctypes.memset(slot, 0, KEY_BYTES)
        self._free.append(slot)

    def close(self) -> None:
        """Zero and unlock every page (the maps themselves go with the process:
        slots handed out may still be referenced)."""
        for _, addr, locked in self._pages:
            ctypes.memset(addr, 0, mmap.PAGESIZE)
            if locked:
                _libc().munlock(ctypes.c_void_p(addr), ctypes.c_size_t(mmap.PAGESIZE))
        self._pages = [(m, a, False) for m, a, _ in self._pages]
        self._free = []
