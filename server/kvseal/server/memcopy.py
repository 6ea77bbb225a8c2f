"""Bulk copies that release the GIL.

``memoryview`` slice assignment is a ``memcpy`` done while holding the GIL,
so sealing threads serialise on it; ``ctypes.memmove`` is a foreign call,
which drops the GIL, so copies overlap with other threads' AES work (which
``cryptography`` also runs without the GIL). Callers work with raw addresses:
every bound is checked by the caller before a copy (see ``backend`` and
``hostregion``); this module checks nothing.
"""

from __future__ import annotations

import ctypes
from typing import Any

memmove = ctypes.memmove


class Pinned:
    """The address of a writable buffer, and the export that keeps it valid.

    While a ``Pinned`` exists the buffer cannot be resized or closed (Python
    raises BufferError instead), so the address stays good; ``release`` ends
    that guarantee.
    """

    __slots__ = ("_anchor", "address", "size")

    def __init__(self, buf: Any) -> None:
        self._anchor: Any = (ctypes.c_char * len(buf)).from_buffer(buf)
        self.address = ctypes.addressof(self._anchor)
        self.size = len(buf)

    def release(self) -> None:
        self._anchor = None
        self.address = 0
