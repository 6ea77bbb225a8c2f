"""A real daemon's threads are exactly what its configuration says, whatever
its clients do (``kvseal.server.threads``; the soak checks the same every
sample).

Before, the gRPC handler executor started a thread per call while none was
idle and kept it, so the count grew with the highest concurrency ever seen
(the soak saw 20-28), and no thread of the daemon carried a name the kernel
shows. Here, against a real ``kvseal.server`` process: the census by kernel
name right after start, while pool holds, event watchers and many concurrent
calls are open, and after they all ended is the same, and equals the
configuration's.
"""

from __future__ import annotations

import threading
from pathlib import Path

from kvseal.client import ClientConfig, KVSealClient, tenant_digest
from kvseal.client.shm import KVShape, SharedKVPool

from .conftest import SMALL, start_daemon
from .suites.soak import expected_threads, thread_census

WORKERS, HOLDS = 3, 5


def test_threads_are_the_configured_ones_under_concurrent_calls_and_streams(
    tmp_path: Path,
) -> None:
    d = start_daemon(tmp_path / "d", "--workers", str(WORKERS), "--max-holds", str(HOLDS))
    pid = d.proc.pid
    want = expected_threads(WORKERS, HOLDS)
    pools = [
        SharedKVPool(KVShape(16, **SMALL), "vllm_per_layer", name_prefix=f"kvseal-thr{i}")
        for i in range(3)
    ]
    c = KVSealClient(ClientConfig(target=d.target, tenant_key=None))
    try:
        assert thread_census(pid)[0] == want
        handles = [c.register_pool(f"thr{i}", b"m", p.geometry()) for i, p in enumerate(pools)]
        holds = [c.hold_pool(h.pool_id) for h in handles]
        watches = [c.watch_events(handles[0].pool_id), c.watch_events(handles[1].pool_id)]
        hashes = [bytes([k]) * 32 for k in range(8)]
        for p in pools:
            for k in range(8):
                p.fill_page(k, k)
        errors: list[BaseException] = []
        seen: list[dict[str, int]] = []
        go = threading.Barrier(12)

        def caller(i: int) -> None:
            h = handles[i % 3]
            # A tenant per caller: two callers storing the same blocks at once would
            # race (one's restore can find the other's store still in progress).
            mine = tenant_digest(f"threads-{i}")
            try:
                go.wait(30)
                for _ in range(15):
                    c.offload(h.pool_id, mine, hashes, list(range(8)))
                    c.lookup(h.pool_id, mine, hashes)
                    c.restore(h.pool_id, mine, hashes, list(range(8, 16)))
                    seen.append(thread_census(pid)[0])
            except BaseException as e:
                errors.append(e)

        callers = [threading.Thread(target=caller, args=(i,)) for i in range(12)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(300)
        assert not errors, errors[:3]
        assert seen and all(s == want for s in seen), [s for s in seen if s != want][:3]
        for w in watches:
            w.close()  # type: ignore[attr-defined]  # a generator: close() cancels the stream
        for hold in holds:
            hold.close()  # the holder left: the daemon unregisters the pool
        assert thread_census(pid)[0] == want
    finally:
        c.close()
        for p in pools:
            p.close()
        d.stop()
