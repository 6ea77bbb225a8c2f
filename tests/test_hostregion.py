"""kvseal.server.hostregion: the extent allocator and the untrusted region.

The region tests play the hypervisor where they can: a file-backed region is
truncated behind the daemon's back (reads come back short, never a crash),
and the anonymous memfd refuses to be shrunk at all.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvseal.server.hostregion import (
    SLOT_ALIGN,
    Extent,
    ExtentAllocator,
    HostRegion,
    RegionError,
    align_up,
)

A = SLOT_ALIGN


def free_list(alloc: ExtentAllocator) -> list[tuple[int, int]]:
    return list(zip(alloc._offsets, alloc._sizes, strict=True))


# ---------------------------------------------------------------- ExtentAllocator


def test_align_up() -> None:
    assert [align_up(n) for n in (0, 1, A - 1, A, A + 1)] == [0, A, A, A, 2 * A]


def test_capacity_rounds_down_and_empty() -> None:
    assert ExtentAllocator(10 * A + A - 1).capacity == 10 * A
    empty = ExtentAllocator(A - 1)
    assert empty.capacity == 0 and empty.allocate(1) is None and empty.free_bytes() == 0


def test_first_fit_and_alignment() -> None:
    alloc = ExtentAllocator(10 * A)
    a = alloc.allocate(1)
    b = alloc.allocate(A + 1)
    c = alloc.allocate(A)
    assert a == Extent(0, A)
    assert b == Extent(A, 2 * A)
    assert c == Extent(3 * A, A)
    assert alloc.used == 4 * A and alloc.free_bytes() == 6 * A
    alloc.free(b)  # hole of 2A at A
    assert alloc.allocate(A) == Extent(A, A)  # first fit: the hole, not the tail
    assert alloc.allocate(2 * A) == Extent(4 * A, 2 * A)  # does not fit the 1A hole left
    assert alloc.allocate(A) == Extent(2 * A, A)  # fills the hole
    assert free_list(alloc) == [(6 * A, 4 * A)]


def test_allocation_failure_changes_nothing() -> None:
    alloc = ExtentAllocator(4 * A)
    x = alloc.allocate(A)
    alloc.allocate(A)
    assert x is not None
    alloc.free(x)  # free: [0,A) and [2A,4A): 3A free, largest run 2A
    before = (free_list(alloc), alloc.used)
    assert alloc.allocate(3 * A) is None
    assert (free_list(alloc), alloc.used) == before


def _five_slots() -> tuple[ExtentAllocator, list[Extent]]:
    alloc = ExtentAllocator(5 * A)
    ex = [alloc.allocate(A) for _ in range(5)]
    assert all(e is not None for e in ex)
    return alloc, [e for e in ex if e is not None]


def test_coalescing_with_previous_run() -> None:
    alloc, e = _five_slots()
    alloc.free(e[1])
    alloc.free(e[2])  # merges with [A, 2A) before it
    assert free_list(alloc) == [(A, 2 * A)]


def test_coalescing_with_next_run() -> None:
    alloc, e = _five_slots()
    alloc.free(e[2])
    alloc.free(e[1])  # merges with [2A, 3A) after it
    assert free_list(alloc) == [(A, 2 * A)]


def test_coalescing_both_sides() -> None:
    alloc, e = _five_slots()
    alloc.free(e[1])
    alloc.free(e[3])
    assert free_list(alloc) == [(A, A), (3 * A, A)]  # not adjacent: two runs
    alloc.free(e[2])  # bridges them
    assert free_list(alloc) == [(A, 3 * A)]
    alloc.free(e[0])  # at offset 0, merges with the next run
    alloc.free(e[4])  # at the end, merges with the previous run
    assert free_list(alloc) == [(0, 5 * A)]
    assert alloc.used == 0


def test_coalescing_with_the_tail_run() -> None:
    alloc = ExtentAllocator(4 * A)
    a, b = alloc.allocate(A), alloc.allocate(A)
    assert a is not None and b is not None
    assert free_list(alloc) == [(2 * A, 2 * A)]
    alloc.free(b)
    assert free_list(alloc) == [(A, 3 * A)]
    alloc.free(a)
    assert free_list(alloc) == [(0, 4 * A)]


def test_free_everything_coalesces_to_one_run() -> None:
    alloc = ExtentAllocator(8 * A)
    ex = [alloc.allocate(A) for _ in range(8)]
    for i in (5, 0, 7, 2, 6, 1, 3, 4):
        x = ex[i]
        assert x is not None
        alloc.free(x)
    assert free_list(alloc) == [(0, 8 * A)]
    assert alloc.used == 0


def test_double_free_raises() -> None:
    alloc = ExtentAllocator(4 * A)
    a = alloc.allocate(A)
    alloc.allocate(A)
    assert a is not None
    alloc.free(a)
    before = (free_list(alloc), alloc.used)
    with pytest.raises(RegionError):
        alloc.free(a)
    assert (free_list(alloc), alloc.used) == before


def test_overlapping_free_raises() -> None:
    alloc = ExtentAllocator(4 * A)
    a = alloc.allocate(2 * A)
    assert a is not None
    alloc.free(a)
    alloc.allocate(A)  # [0,A) used; [A,4A) free
    with pytest.raises(RegionError):
        alloc.free(Extent(0, 2 * A))  # its second half is already free
    with pytest.raises(RegionError):
        alloc.free(Extent(2 * A, A))  # inside the free run
    assert alloc.used == A


def test_can_allocate_all_changes_nothing() -> None:
    alloc = ExtentAllocator(4 * A)
    a = alloc.allocate(A)
    alloc.allocate(A)
    assert a is not None
    alloc.free(a)
    before = (free_list(alloc), alloc.used, alloc.capacity)
    assert alloc.can_allocate_all([A, A, A])
    assert not alloc.can_allocate_all([A, A, A, A])
    assert not alloc.can_allocate_all([3 * A])  # 3A free, but not contiguous
    assert alloc.can_allocate_all([2 * A, A])
    assert not alloc.can_allocate_all([A, 2 * A, A])
    assert alloc.can_allocate_all([])
    assert (free_list(alloc), alloc.used, alloc.capacity) == before


def test_clone_is_independent() -> None:
    alloc = ExtentAllocator(4 * A)
    a = alloc.allocate(A)
    assert a is not None
    twin = alloc.clone()
    assert free_list(twin) == free_list(alloc) and twin.used == alloc.used
    twin.free(a)
    b = twin.allocate(3 * A)
    assert b is not None
    assert free_list(alloc) == [(A, 3 * A)] and alloc.used == A
    assert twin.used == 3 * A
    alloc.allocate(A)
    assert twin.free_bytes() == A
    assert alloc.free_bytes() == 2 * A


@settings(max_examples=200, deadline=None)
@given(
    capacity_slots=st.integers(1, 40),
    ops=st.lists(
        st.tuples(st.booleans(), st.integers(1, 6 * A), st.integers(0, 1000)), max_size=80
    ),
)
def test_random_allocate_free(capacity_slots: int, ops: list[tuple[bool, int, int]]) -> None:
    alloc = ExtentAllocator(capacity_slots * A)
    live: list[Extent] = []
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            largest = max(alloc._sizes, default=0)
            ext = alloc.allocate(size)
            if ext is None:
                assert largest < align_up(size)  # refused only when no run fits
                continue
            assert ext.size == align_up(size) and ext.offset % A == 0
            assert ext.offset >= 0 and ext.offset + ext.size <= alloc.capacity
            live.append(ext)
        else:
            alloc.free(live.pop(pick % len(live)))
        # free + used == capacity, and the books agree with what is live
        assert alloc.free_bytes() + alloc.used == alloc.capacity
        assert alloc.used == sum(e.size for e in live)
        # no two extents (live or free) overlap, and free runs are coalesced
        spans = sorted([(e.offset, e.size, "used") for e in live] + [
            (o, s, "free") for o, s in free_list(alloc)
        ])  # fmt: skip
        pos = 0
        for (off, span, kind), nxt in zip(spans, [*spans[1:], None], strict=True):
            assert off == pos, "gap or overlap"
            pos = off + span
            if nxt is not None and kind == "free":
                assert nxt[2] == "used", "adjacent free runs were not coalesced"
        assert pos == alloc.capacity
    for e in live:
        alloc.free(e)
    assert free_list(alloc) == ([(0, alloc.capacity)] if alloc.capacity else [])


# ---------------------------------------------------------------- HostRegion


@pytest.fixture(params=["memfd", "file"])
def region(request: pytest.FixtureRequest, tmp_path: Path) -> HostRegion:
    path = None if request.param == "memfd" else str(tmp_path / "region.bin")
    r = HostRegion(64 * 1024, path)
    request.addfinalizer(r.close)
    return r


def test_write_read_round_trip(region: HostRegion) -> None:
    data = os.urandom(5000)
    region.write(1000, memoryview(bytearray(data)))
    out = bytearray(5000)
    assert region.read_into(1000, memoryview(out)) == 5000
    assert bytes(out) == data
    # Edges: the first and last bytes of the region.
    region.write(0, memoryview(bytearray(b"\x01\x02")))
    region.write(region.capacity - 3, memoryview(bytearray(b"xyz")))
    out3 = bytearray(3)
    assert region.read_into(region.capacity - 3, memoryview(out3)) == 3
    assert bytes(out3) == b"xyz"
    out2 = bytearray(2)
    region.read_into(0, memoryview(out2))
    assert bytes(out2) == b"\x01\x02"


def test_fresh_region_reads_zeros(region: HostRegion) -> None:
    out = bytearray(b"\xff" * 1024)
    assert region.read_into(4096, memoryview(out)) == 1024
    assert bytes(out) == bytes(1024)


def test_write_of_non_byte_format_view(region: HostRegion) -> None:
    import array

    arr = array.array("I", [1, 2, 3, 4])
    region.write(256, memoryview(arr))
    out = bytearray(16)
    region.read_into(256, memoryview(out))
    assert bytes(out) == arr.tobytes()


@pytest.mark.parametrize(
    ("offset", "size"),
    [(-1, 10), (64 * 1024, 1), (64 * 1024 - 9, 10), (0, 64 * 1024 + 1), (2**62, 1)],
)
def test_out_of_range_write_raises(region: HostRegion, offset: int, size: int) -> None:
    with pytest.raises(RegionError):
        region.write(offset, memoryview(bytearray(size)))
    out = bytearray(16)
    region.read_into(0, memoryview(out))
    assert bytes(out) == bytes(16)  # nothing was written anywhere visible


def test_read_past_end_is_short(region: HostRegion) -> None:
    region.write(region.capacity - 4, memoryview(bytearray(b"tail")))
    out = bytearray(10)
    assert region.read_into(region.capacity - 4, memoryview(out)) == 4
    assert bytes(out[:4]) == b"tail"
    assert region.read_into(region.capacity + 100, memoryview(bytearray(8))) == 0


def test_file_region_is_mode_0600(tmp_path: Path) -> None:
    old = os.umask(0)  # even with a permissive umask
    try:
        path = tmp_path / "region.bin"
        r = HostRegion(1 << 20, str(path))
    finally:
        os.umask(old)
    try:
        st_ = path.stat()
        assert stat.S_IMODE(st_.st_mode) == 0o600
        assert st_.st_size == 1 << 20
        assert r.description == str(path)
    finally:
        r.close()


def test_existing_file_is_tightened_and_wiped(tmp_path: Path) -> None:
    path = tmp_path / "region.bin"
    path.write_bytes(b"stale ciphertext" * 100)
    path.chmod(0o644)
    r = HostRegion(4096, str(path))
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        out = bytearray(16)
        r.read_into(0, memoryview(out))
        assert bytes(out) == bytes(16)  # old contents are gone
    finally:
        r.close()


def test_symlink_and_non_regular_paths_are_refused(tmp_path: Path) -> None:
    target = tmp_path / "target.bin"
    target.write_bytes(b"")
    link = tmp_path / "link.bin"
    link.symlink_to(target)
    with pytest.raises(RegionError):
        HostRegion(4096, str(link))
    with pytest.raises(RegionError):
        HostRegion(4096, str(tmp_path))  # a directory
    with pytest.raises(RegionError):
        HostRegion(4096, str(tmp_path / "missing-dir" / "r.bin"))


def test_bad_capacity() -> None:
    for cap in (0, -1):
        with pytest.raises(RegionError):
            HostRegion(cap)


def test_truncated_file_gives_short_read_not_crash(tmp_path: Path) -> None:
    path = tmp_path / "region.bin"
    r = HostRegion(64 * 1024, str(path))
    try:
        data = os.urandom(8192)
        r.write(16 * 1024, memoryview(bytearray(data)))
        os.truncate(path, 20 * 1024)  # "the host" shrinks the file under us
        out = bytearray(8192)
        got = r.read_into(16 * 1024, memoryview(out))
        assert got == 4 * 1024
        assert bytes(out[:got]) == data[:got]
        assert r.read_into(32 * 1024, memoryview(bytearray(100))) == 0
        os.truncate(path, 0)
        assert r.read_into(0, memoryview(bytearray(100))) == 0
        # Writing again still works (the file grows back as needed).
        r.write(0, memoryview(bytearray(b"again")))
        out5 = bytearray(5)
        assert r.read_into(0, memoryview(out5)) == 5 and bytes(out5) == b"again"
    finally:
        r.close()


def test_memfd_cannot_be_shrunk_or_grown() -> None:
    r = HostRegion(64 * 1024)
    try:
        assert r.description == "anonymous memfd" and r.path is None
        fd = r._fd  # the hostile party would get at it via /proc/<pid>/fd
        with pytest.raises(OSError) as e:
            os.ftruncate(fd, 4096)
        assert e.value.errno == errno.EPERM
        with pytest.raises(OSError) as e:
            os.ftruncate(fd, 128 * 1024)
        assert e.value.errno == errno.EPERM
        assert os.fstat(fd).st_size == 64 * 1024
        # Also through a separate open file description of the same memfd.
        fd2 = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
        try:
            with pytest.raises(OSError):
                os.ftruncate(fd2, 0)
        finally:
            os.close(fd2)
        r.write(60 * 1024, memoryview(bytearray(b"still here")))
        out = bytearray(10)
        assert r.read_into(60 * 1024, memoryview(out)) == 10 and bytes(out) == b"still here"
    finally:
        r.close()


def test_close_is_idempotent_and_releases_fd(tmp_path: Path) -> None:
    r = HostRegion(4096, str(tmp_path / "r.bin"))
    fd = r._fd
    r.close()
    r.close()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_concurrent_writers_to_disjoint_extents(region: HostRegion) -> None:
    import threading

    chunks = {i * 4096: os.urandom(4096) for i in range(16)}

    def write(off: int) -> None:
        for _ in range(20):
            region.write(off, memoryview(bytearray(chunks[off])))

    ts = [threading.Thread(target=write, args=(off,)) for off in chunks]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for off, data in chunks.items():
        out = bytearray(4096)
        region.read_into(off, memoryview(out))
        assert bytes(out) == data


# ---------------------------------------------------------------- read-only sources


def test_memfd_write_accepts_read_only_source() -> None:
    # Regression: the memfd path used to pin its source with ctypes
    # from_buffer, which raised TypeError for read-only views.
    r = HostRegion(4096)
    try:
        r.write(0, memoryview(b"ciphertext"))
        out = bytearray(10)
        r.read_into(0, memoryview(out))
        assert bytes(out) == b"ciphertext"
    finally:
        r.close()


def test_file_write_accepts_read_only_source(tmp_path: Path) -> None:
    r = HostRegion(4096, str(tmp_path / "r.bin"))
    try:
        r.write(0, memoryview(b"ciphertext"))
        out = bytearray(10)
        r.read_into(0, memoryview(out))
        assert bytes(out) == b"ciphertext"
    finally:
        r.close()


# ---------------------------------------------------------------- regressions

_NEGATIVE_READ = """
import sys
from kvseal.server.hostregion import HostRegion, RegionError
r = HostRegion(64 * 1024, sys.argv[1] if len(sys.argv) > 1 else None)
try:
    n = r.read_into(-4096, memoryview(bytearray(100)))
except (RegionError, OSError):
    sys.exit(0)
sys.exit(0 if n == 0 else 2)
"""


@pytest.mark.parametrize(
    "kind",
    [
        "memfd",  # used to memmove from before the mapping (SIGSEGV)
        "file",
    ],
)
def test_negative_offset_read_is_refused(kind: str, tmp_path: Path) -> None:
    import subprocess
    import sys

    args = [sys.executable, "-c", _NEGATIVE_READ]
    if kind == "file":
        args.append(str(tmp_path / "r.bin"))
    proc = subprocess.run(args, capture_output=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
