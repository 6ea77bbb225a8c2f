"""How often the CPU backend's page writer asks whether it may go on.

``CpuMappedPool.write_pages`` calls its ``check`` (the restore's commit
deadline) once per block's worth of writes instead of before every segment
write (a 64-layer block is 128 writes). The contract it keeps, checked here on
real shared memory in every layout, for one page and for batches of
consecutive and scattered pages: the first write comes after a check, and
once a check refuses, at most one block's bytes were written after the last
check that passed (the pool is compared byte for byte with what it held).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from kvseal.client.shm import LAYOUTS, KVShape, SharedKVPool
from kvseal.server import convert
from kvseal.server.backends.cpu.shmpool import CpuMappedPool
from kvseal.v1 import kvseal_pb2 as pb

from .conftest import SMALL

PAGES = 8


class Refused(Exception):
    """The check's verdict: no write may follow."""


@pytest.fixture(params=LAYOUTS)
def pools(request: pytest.FixtureRequest) -> Iterator[tuple[SharedKVPool, CpuMappedPool]]:
    shared = SharedKVPool(KVShape(PAGES, **SMALL), request.param, name_prefix="kvseal-wpc")
    req = pb.RegisterPoolRequest(name="wpc", model_fingerprint=b"m", geometry=shared.geometry())
    mapped = CpuMappedPool(convert.pool_spec(req, "cpu"))
    yield shared, mapped
    mapped.close()
    shared.close()


@pytest.mark.parametrize("pages", [[3], [0, 1, 2, 3], [6, 1, 2, 5, 0]], ids=str)
def test_each_touch_after_a_check_is_at_most_one_block(
    pools: tuple[SharedKVPool, CpuMappedPool], pages: list[int]
) -> None:
    shared, mapped = pools
    size = shared.shape.block_bytes
    src = memoryview(bytearray(os.urandom(size * len(pages))))
    starts = [j * size for j in range(len(pages))]
    want = {p: bytes(src[s : s + size]) for p, s in zip(pages, starts, strict=True)}
    # Each page of the request starts as the complement of what it will get, so
    # a byte equal to the source is a byte that was written; the others random.
    before = {p: os.urandom(size) for p in range(PAGES)}
    before.update({p: bytes(b ^ 0xFF for b in w) for p, w in want.items()})

    def reset() -> None:
        for p, data in before.items():
            shared.write_block(p, data)

    def written() -> int:
        """Bytes of the request's pages that hold their new value; the other
        pages must not have changed at all."""
        for p in range(PAGES):
            if p not in want:
                assert shared.read_block(p) == before[p], f"page {p} is not in the request"
        return sum(
            sum(1 for a, b in zip(shared.read_block(p), w, strict=True) if a == b)
            for p, w in want.items()
        )

    # Unrefused: every byte lands, after about one check per block.
    reset()
    calls = 0

    def count() -> None:
        nonlocal calls
        calls += 1

    mapped.write_pages(pages, src, starts, count)
    assert written() == size * len(pages)
    assert len(pages) <= calls <= 2 * len(pages)

    # Refused at each check in turn: at most one block written per check passed.
    for allow in range(calls):
        reset()
        passed = 0

        def refuse_after(allow: int = allow) -> None:
            nonlocal passed
            if passed == allow:
                raise Refused
            passed += 1

        with pytest.raises(Refused):
            mapped.write_pages(pages, src, starts, refuse_after)
        assert written() <= allow * size
