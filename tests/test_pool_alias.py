"""Pools must not alias: no byte of engine memory may belong to two (segment,
page) pairs, whichever names the buffers use, or a restore into one page
would also rewrite another.

The daemon is real (``daemon_factory``) and so is the shared memory; the
memory-identity check itself (``check_disjoint``) is also compared against a
byte-by-byte enumeration on many small random geometries.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Callable, Iterator

import grpc
import pytest
from kvseal.client import KVSealRpcError, tenant_digest
from kvseal.client.shm import BLOCK_ORDER, SharedKVPool
from kvseal.server.errors import BadRequest
from kvseal.server.pools import BufferMemory, SegmentSpec, check_disjoint
from kvseal.v1 import kvseal_pb2 as pb

from .conftest import DaemonProc, fill_random, is_poisoned, poison

FP = b"model:alias"
SHM = "/dev/shm"  # POSIX shm objects live here on Linux
KV = 256  # bytes of one segment of one page in the hand-made geometries


@pytest.fixture
def shm_object() -> Iterator[Callable[[int], str]]:
    """Make /dev/shm objects of n bytes (random contents); unlinked afterwards."""
    names: list[str] = []

    def make(size: int) -> str:
        name = f"kvseal-test-alias-{os.getpid()}-{len(names)}-{os.urandom(3).hex()}"
        with open(os.path.join(SHM, name), "wb") as f:
            f.write(os.urandom(size))
        names.append(name)
        return name

    yield make
    for n in names:
        try:
            os.unlink(os.path.join(SHM, n))
        except FileNotFoundError:
            pass


def _geometry(
    num_pages: int, buffers: list[tuple[str, int, int]], segments: list[tuple[int, int, int, int]]
) -> pb.PoolGeometry:
    return pb.PoolGeometry(
        num_pages=num_pages,
        tokens_per_page=4,
        num_layers=1,
        num_kv_heads=1,
        head_dim=1,
        dtype="uint8",
        layout=BLOCK_ORDER,
        buffers=[pb.BufferHandle(shm_name=n, offset=o, size=s) for n, o, s in buffers],
        segments=[
            pb.Segment(buffer=b, offset=o, page_stride=st, bytes=n) for b, o, st, n in segments
        ],
    )


def _refused(d: DaemonProc, geo: pb.PoolGeometry) -> str:
    with d.client() as c, pytest.raises(KVSealRpcError) as e:
        c.register_pool("alias", FP, geo)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert e.value.reason == "BAD_REQUEST"
    with d.client() as c:
        assert c.stats().pools == 0  # nothing half-registered
        assert c.health() == "SERVING"
    return str(e.value)


def _read(name: str, offset: int, n: int) -> bytes:
    fd = os.open(os.path.join(SHM, name), os.O_RDONLY)
    try:
        return os.pread(fd, n, offset)
    finally:
        os.close(fd)


def _round_trip(d: DaemonProc, geo: pb.PoolGeometry, page_bytes: Callable[[int], bytes]) -> None:
    """Offload pages 0 and 1, scramble nothing, restore page 0's block into page 1:
    page 1 must then read exactly like page 0 and page 0 must be unchanged."""
    before = page_bytes(0)
    chain = [os.urandom(32), os.urandom(32)]
    with d.client() as c:
        h = c.register_pool("legal", FP, geo)
        assert c.offload(h.pool_id, tenant_digest("t"), chain[:1], [0]).stored_blocks == 1
        assert c.restore(h.pool_id, tenant_digest("t"), chain[:1], [1]).restored_blocks == 1
    assert page_bytes(1) == before
    assert page_bytes(0) == before


# ------------------------------------------------------------- refused aliases


def test_same_object_named_twice_is_refused(
    daemon: DaemonProc, shm_object: Callable[[int], str]
) -> None:
    name = shm_object(2 * KV)
    geo = _geometry(2, [(name, 0, 2 * KV), (name, 0, 2 * KV)], [(0, 0, KV, KV), (1, 0, KV, KV)])
    msg = _refused(daemon, geo)
    assert "overlap" in msg and "buffers 0 and 1 are the same memory" in msg


def test_overlapping_ranges_of_one_object_are_refused(
    daemon: DaemonProc, shm_object: Callable[[int], str]
) -> None:
    # Buffer 1 starts one page into buffer 0: segment 1's page 0 is segment 0's page 1.
    name = shm_object(3 * KV)
    geo = _geometry(2, [(name, 0, 2 * KV), (name, KV, 2 * KV)], [(0, 0, KV, KV), (1, 0, KV, KV)])
    msg = _refused(daemon, geo)
    assert re.search(r"page 1 of segments\[0\] and page 0 of segments\[1\]", msg), msg


def test_hard_linked_names_are_refused(
    daemon: DaemonProc, shm_object: Callable[[int], str]
) -> None:
    name = shm_object(2 * KV)
    link = name + "-link"
    os.link(os.path.join(SHM, name), os.path.join(SHM, link))
    try:
        geo = _geometry(
            2, [(name, 0, 2 * KV), (link, 0, 2 * KV)], [(0, 0, KV, KV), (1, KV // 2, KV, KV // 2)]
        )
        msg = _refused(daemon, geo)
        assert "buffers 0 and 1 are the same memory" in msg
    finally:
        os.unlink(os.path.join(SHM, link))


def test_interleaved_segments_that_collide_a_page_later_are_refused(
    daemon: DaemonProc, shm_object: Callable[[int], str]
) -> None:
    # One stride (2 KV), page-0 spans disjoint, but segment 1 runs past the end of
    # the stride: its page 0 = [1.5 KV, 2.5 KV) overlaps segment 0's page 1 = [2 KV, 3 KV).
    name = shm_object(7 * KV)
    geo = _geometry(3, [(name, 0, 7 * KV)], [(0, 0, 2 * KV, KV), (0, 3 * KV // 2, 2 * KV, KV)])
    msg = _refused(daemon, geo)
    assert re.search(r"page 1 of segments\[0\] and page 0 of segments\[1\]", msg), msg


# ------------------------------------------------------------- legal layouts


@pytest.mark.parametrize("layout", ["vllm_per_layer", "vllm_cross_layer", "sglang_per_layer"])
def test_engine_layouts_still_register_and_round_trip(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool], layout: str
) -> None:
    pool = pool_factory(num_pages=4, layout=layout)
    data = fill_random(pool)
    chain = [os.urandom(32) for _ in range(2)]
    with daemon.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        assert c.offload(h.pool_id, tenant_digest("t"), chain, [0, 1]).stored_blocks == 2
        poison(pool, [0, 1, 2, 3])
        assert c.restore(h.pool_id, tenant_digest("t"), chain, [3, 2]).restored_blocks == 2
    assert pool.read_block(3) == data[0] and pool.read_block(2) == data[1]
    assert is_poisoned(pool, 0) and is_poisoned(pool, 1)


def test_kv_segments_interleaved_within_a_page_stride_register(
    daemon: DaemonProc, shm_object: Callable[[int], str]
) -> None:
    # [pages, layers=2, K/V, KV] as four segments of one stride (the cross-layer
    # tensor described per layer and per K/V, as geometry_from_tensors may do).
    pages, stride = 3, 4 * KV
    name = shm_object(pages * stride)
    segs = [(0, k * KV, stride, KV) for k in (1, 0, 3, 2)]  # any order of the four
    geo = _geometry(pages, [(name, 0, pages * stride)], segs)

    def page(p: int) -> bytes:
        return b"".join(_read(name, p * stride + off, KV) for _, off, _, _ in segs)

    _round_trip(daemon, geo, page)


def test_disjoint_ranges_of_one_object_under_two_names_register(
    daemon: DaemonProc, shm_object: Callable[[int], str]
) -> None:
    # vLLM's [2, pages, KV]: K in the first half, V in the second, here through two
    # names (a hard link) and two buffers: the same memory, but no shared byte.
    pages = 3
    name = shm_object(2 * pages * KV)
    link = name + "-link"
    os.link(os.path.join(SHM, name), os.path.join(SHM, link))
    try:
        geo = _geometry(
            pages,
            [(name, 0, pages * KV), (link, pages * KV, pages * KV)],
            [(0, 0, KV, KV), (1, 0, KV, KV)],
        )

        def page(p: int) -> bytes:
            return _read(name, p * KV, KV) + _read(name, (pages + p) * KV, KV)

        _round_trip(daemon, geo, page)
    finally:
        os.unlink(os.path.join(SHM, link))


# ------------------------------------------------------- the check, exhaustively


def _brute_force(mem: list[BufferMemory], segs: list[SegmentSpec], pages: int) -> bool:
    owner: set[tuple[object, int]] = set()
    for s in segs:
        m = mem[s.buffer]
        for p in range(pages):
            first = m.start + s.offset + p * s.page_stride
            for x in range(first, first + s.bytes):
                if (m.identity, x) in owner:
                    return False
                owner.add((m.identity, x))
    return True


def test_check_disjoint_agrees_with_byte_enumeration() -> None:
    rng = random.Random(10)
    refused = 0
    for _ in range(4000):
        pages = rng.randint(1, 5)
        mem = [BufferMemory(rng.randint(0, 1), rng.randint(0, 20), 200) for _ in range(3)]
        segs = []
        for _ in range(rng.randint(1, 4)):
            n = rng.randint(1, 6)
            stride = rng.choice([n, rng.randint(n, 14)]) if pages > 1 else rng.randint(0, 9)
            segs.append(SegmentSpec(rng.randrange(3), rng.randint(0, 40), stride, n))
        expect = _brute_force(mem, segs, pages)
        try:
            check_disjoint(mem, segs, pages)
            got = True
        except BadRequest as e:
            got = False
            # The message names a real collision: that page of each segment shares a byte.
            m = re.search(
                r"page (\d+) of segments\[(\d+)\] and page (\d+) of segments\[(\d+)\]", str(e)
            )
            assert m, str(e)
            pa, a, pb_, b = map(int, m.groups())
            sa, sb = segs[a], segs[b]
            lo_a = mem[sa.buffer].start + sa.offset + pa * sa.page_stride
            lo_b = mem[sb.buffer].start + sb.offset + pb_ * sb.page_stride
            assert mem[sa.buffer].identity == mem[sb.buffer].identity
            assert lo_a < lo_b + sb.bytes and lo_b < lo_a + sa.bytes, str(e)
        assert got == expect, (pages, mem, segs)
        refused += not got
    assert 500 < refused < 3500  # both outcomes were exercised


def test_check_disjoint_is_cheap_for_many_interleaved_segments() -> None:
    # 65536 segments interleaved in one stride over 2**31 - 1 pages: no enumeration
    # of pages (that would never finish), one sweep.
    n = 1 << 16
    segs = [SegmentSpec(0, i * 16, n * 16, 16) for i in range(n)]
    check_disjoint([BufferMemory("m", 0, 1 << 62)], segs, 2**31 - 1)
    # One byte more in one segment collides with its neighbour.
    segs[7] = SegmentSpec(0, 7 * 16, n * 16, 17)
    with pytest.raises(BadRequest, match=r"page 0 of segments\[7\] and page 0 of segments\[8\]"):
        check_disjoint([BufferMemory("m", 0, 1 << 62)], segs, 2**31 - 1)
