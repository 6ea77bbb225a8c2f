"""A transfer gives the daemon's verdict at its cutoff however busy the sealing
threads are (issue 20, item 5: restores that ran to the client's whole gRPC
deadline without a daemon verdict).

The CPU backend's sealing threads are shared by every request. A request whose
blocks were queued behind other requests' work used to wait for a free thread
with no limit, so its DeadlinePassed verdict could come only after the client's
own deadline had fired (a failure without the daemon's reason, which the client
must settle for the whole deadline). Now a chunk still queued at the cutoff is
cancelled and the request fails with DeadlinePassed at once, having touched
nothing.

In process, on a real ``CpuBackend`` and real shared memory: both sealing
threads are held by stand-ins for other requests' work until the test releases
them, so the wait is certain, not a matter of timing. The call must end, with
DeadlinePassed, while they are still held: before the fix it ended only once
they were released.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from kvseal.client.shm import KVShape, SharedKVPool
from kvseal.server import convert
from kvseal.server.backends.base import BlockIO
from kvseal.server.backends.cpu.backend import CpuBackend
from kvseal.server.backends.cpu.shmpool import CpuMappedPool
from kvseal.server.deadline import Deadline
from kvseal.server.errors import DeadlinePassed
from kvseal.server.hostregion import Extent, HostRegion, align_up
from kvseal.server.sealing import BlockAD, BlockSealer
from kvseal.v1 import kvseal_pb2 as pb

from .conftest import POISON, SMALL, fill_random, poison

NS, TENANT = b"N" * 32, b"T" * 32
PAGES = [0, 1, 2, 3]


@pytest.fixture
def rig() -> Iterator[tuple[SharedKVPool, CpuBackend, HostRegion, CpuMappedPool]]:
    pool = SharedKVPool(KVShape(8, **SMALL), "vllm_per_layer", name_prefix="kvseal-verdict")
    backend = CpuBackend(BlockSealer(), 2, chunk_bytes=4096)
    region = backend.make_region(1 << 20, None)
    spec = convert.pool_spec(
        pb.RegisterPoolRequest(name="v", model_fingerprint=b"m", geometry=pool.geometry()), "cpu"
    )
    mapped = backend.map_pool(spec)
    try:
        yield pool, backend, region, mapped
    finally:
        mapped.close()
        backend.close()
        region.close()
        pool.close()


def _blocks(pool: SharedKVPool, first_slot: int) -> list[BlockIO]:
    size = pool.shape.block_bytes
    slot = align_up(size)
    return [
        BlockIO(
            page,
            Extent((first_slot + k) * slot, slot),
            BlockAD(NS, TENANT, bytes([k]) * 32, k),
            size,
        )
        for k, page in enumerate(PAGES)
    ]


@pytest.mark.parametrize("op", ["restore", "offload"])
def test_a_transfer_queued_behind_busy_sealing_threads_fails_at_its_cutoff(
    rig: tuple[SharedKVPool, CpuBackend, HostRegion, CpuMappedPool], op: str
) -> None:
    pool, backend, region, mapped = rig
    fill_random(pool)
    sealed = _blocks(pool, 0)
    records = backend.seal_blocks(mapped, sealed, region)
    poison(pool, PAGES)
    fresh = _blocks(pool, len(PAGES))  # the offload's slots: never written yet

    # Both sealing threads busy with other requests' work until released.
    release = threading.Event()
    both_busy = threading.Barrier(3)

    def other_request() -> None:
        both_busy.wait(30)
        release.wait(60)

    held = [backend._pool.submit(other_request) for _ in range(2)]
    both_busy.wait(30)

    outcome: dict[str, object] = {}
    ended = threading.Event()

    def transfer() -> None:
        deadline = Deadline.after(0.2, grace=1.0)
        try:
            if op == "restore":
                backend.open_blocks(mapped, sealed, records, region, deadline=deadline)
            else:
                backend.seal_blocks(mapped, fresh, region, deadline=deadline)
            outcome["result"] = "returned"
        except DeadlinePassed:
            outcome["result"] = "DeadlinePassed"
        except BaseException as e:  # anything else is a failure of this test
            outcome["result"] = repr(e)
        outcome["threads still held"] = not release.is_set()
        ended.set()

    t = threading.Thread(target=transfer)
    t.start()
    ended.wait(30)  # before the fix: no end until the threads are released
    release.set()
    t.join(60)
    for f in held:
        f.result(60)
    assert outcome == {"result": "DeadlinePassed", "threads still held": True}
    # It touched nothing: no page written (restore), no slot written (offload).
    for p in PAGES:
        assert pool.read_block(p) == bytes([POISON]) * pool.shape.block_bytes
    for blk in fresh:
        got = bytearray(blk.extent.size)
        region.read_into(blk.extent.offset, memoryview(got))
        assert not any(got)
    # The threads serve the next request as before.
    assert backend.open_blocks(mapped, sealed, records, region) == []
