"""Byte comparisons for the GPU tests that fail fast and say where.

``assert a == b`` on two 4 MiB byte strings makes pytest build a diff of them
(seconds to minutes with ``-v``, and a wall of text without it): a kernel bug then
shows as a per-test timeout with no offset. :func:`assert_same_bytes` compares in
64 KiB chunks (``memcmp``), narrows down to the first differing byte, and raises an
AssertionError of one line: that offset, its 16-byte AES block, the length of each
side and a short hex context, in well under a second for any size.

Imports neither torch nor numpy: the CPU tests (tests/test_device_check.py) check it.
"""

from __future__ import annotations

from typing import TypeAlias

Buffer: TypeAlias = bytes | bytearray | memoryview

CHUNK = 1 << 16
CONTEXT = 16  # bytes of hex context shown on each side of the first difference


def _bytes(x: Buffer) -> bytes:
    return x if isinstance(x, bytes) else bytes(memoryview(x).cast("B"))


def first_difference(got: Buffer, want: Buffer) -> int | None:
    """The offset of the first byte where ``got`` and ``want`` differ, the shorter
    one's length if one is a prefix of the other, or None if they are equal."""
    a, b = _bytes(got), _bytes(want)
    n = min(len(a), len(b))
    for start in range(0, n, CHUNK):
        lo, hi = start, min(n, start + CHUNK)
        if a[lo:hi] == b[lo:hi]:
            continue
        while hi - lo > 64:  # halve the differing range, memcmp each half
            mid = (lo + hi) // 2
            if a[lo:mid] != b[lo:mid]:
                hi = mid
            else:
                lo = mid
        return next(i for i in range(lo, hi) if a[i] != b[i])
    return None if len(a) == len(b) else n


def describe_difference(got: Buffer, want: Buffer, what: str = "bytes") -> str | None:
    """None if equal, else the one-line report :func:`assert_same_bytes` raises."""
    a, b = _bytes(got), _bytes(want)
    off = first_difference(a, b)
    if off is None:
        return None
    lo = max(0, off - CONTEXT)
    sizes = f"{len(a)} bytes" if len(a) == len(b) else f"got {len(a)} bytes, want {len(b)}"
    return (
        f"{what}: first difference at offset {off} (AES block {off // 16}, byte {off % 16}; "
        f"{sizes}); from offset {lo}: got {a[lo : off + CONTEXT].hex(' ', 4)} | "
        f"want {b[lo : off + CONTEXT].hex(' ', 4)}"
    )


def assert_same_bytes(got: Buffer, want: Buffer, what: str = "bytes") -> None:
    """Raise AssertionError (one line: first differing offset and context) unless
    ``got`` and ``want`` hold the same bytes."""
    msg = describe_difference(got, want, what)
    if msg is not None:
        raise AssertionError(msg)
