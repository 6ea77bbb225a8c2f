"""An engine cannot crash the daemon by shrinking its own pool.

A real engine process truncates (and re-grows) its shared-memory pool object
in a tight loop while offloads and restores of that pool run. The daemon
reads and writes engine pools with ``preadv``/``pwritev`` on an fd, never a
memory map, so a shrink is a short read (that request fails with
HANDLE_UNUSABLE and publishes nothing), never SIGBUS. Meanwhile a second
pool on the same daemon keeps round-tripping byte-exact.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable

import grpc
from kvseal.client import KVSealRpcError, tenant_digest
from kvseal.client.shm import SharedKVPool

from .conftest import QWEN3_32B, DaemonProc, fill_random, poison

FP = b"model:shrink"

# The engine: shrink its pool object to a random size (often 0) and grow it back,
# over and over, until told to stop (stdin closes).
SHRINKER = """
import os, random, sys, threading
path, size = sys.argv[1], int(sys.argv[2])
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
fd = os.open(path, os.O_RDWR)
print("ready", flush=True)
n = 0
while not stop.is_set():
    os.ftruncate(fd, random.choice([0, random.randrange(size)]))
    os.ftruncate(fd, size)
    n += 1
print(n, flush=True)
"""

ROUNDS = 100


def test_engine_shrinking_its_pool_during_copies_does_not_kill_the_daemon(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    # 4 MiB blocks, one segment per page (one long read per block: the window
    # in which a shrink lands mid-copy is wide).
    victim = pool_factory(num_pages=8, layout="vllm_cross_layer", geometry=QWEN3_32B)
    other = pool_factory(num_pages=4, layout="vllm_per_layer")
    obj = victim.buffers[0]
    tenant = tenant_digest("t")
    failures: list[KVSealRpcError] = []
    failed_offloads: list[list[bytes]] = []
    other_errors: list[BaseException] = []

    with daemon.client() as c:
        hv = c.register_pool("victim", FP, victim.geometry())
        ho = c.register_pool("other", b"model:other", other.geometry())
        fill_random(victim)
        stored = [os.urandom(32) for _ in range(4)]
        assert c.offload(hv.pool_id, tenant, stored, [0, 1, 2, 3]).stored_blocks == 4

        engine = subprocess.Popen(
            [sys.executable, "-c", SHRINKER, os.path.join("/dev/shm", obj.name), str(obj.size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert engine.stdout is not None and engine.stdin is not None
        assert engine.stdout.readline().strip() == "ready"

        def serve_other() -> None:
            """The second pool must keep working, byte-exact, the whole time."""
            try:
                with daemon.client() as c2:
                    for _ in range(ROUNDS // 2):
                        data = fill_random(other, [0, 1])
                        chain = [os.urandom(32), os.urandom(32)]
                        assert c2.offload(ho.pool_id, tenant, chain, [0, 1]).stored_blocks == 2
                        poison(other, [0, 1, 2, 3])
                        assert c2.restore(ho.pool_id, tenant, chain, [3, 2]).restored_blocks == 2
                        assert other.read_block(3) == data[0] and other.read_block(2) == data[1]
            except BaseException as e:
                other_errors.append(e)

        side = threading.Thread(target=serve_other)
        side.start()
        try:
            for i in range(ROUNDS):
                fresh = [os.urandom(32) for _ in range(4)]
                try:
                    if i % 2:
                        c.restore(hv.pool_id, tenant, stored, [4, 5, 6, 7])
                    else:
                        c.offload(hv.pool_id, tenant, fresh, [0, 1, 2, 3])
                except KVSealRpcError as e:
                    failures.append(e)
                    if not i % 2:
                        failed_offloads.append(fresh)
        finally:
            engine.stdin.close()
            shrinks = engine.stdout.readline().strip()
            engine.wait(30)
            side.join(120)

        assert daemon.proc.poll() is None, f"daemon died with {daemon.proc.returncode}"
        assert int(shrinks) > 0
        assert not other_errors, other_errors
        # The engine truncated its object nonstop: requests of its pool failed,
        # each one cleanly (the refusal names the pool's memory), none hung.
        assert failures, "no request ever saw the shrinking pool"
        for e in failures:
            assert e.code == grpc.StatusCode.FAILED_PRECONDITION, e
            assert e.reason == "HANDLE_UNUSABLE", e
        # A failed offload published nothing.
        for chain in failed_offloads:
            assert c.lookup(hv.pool_id, tenant, chain).hit_blocks == 0
        assert c.health() == "SERVING"
        # The daemon still serves the other pool, byte-exact.
        data = fill_random(other, [1])
        chain = [os.urandom(32)]
        assert c.offload(ho.pool_id, tenant, chain, [1]).stored_blocks == 1
        poison(other, [0])
        assert c.restore(ho.pool_id, tenant, chain, [0]).restored_blocks == 1
        assert other.read_block(0) == data[1]
