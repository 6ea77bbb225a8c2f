"""Observer pools (RegisterPoolRequest.observer): a namespace without memory.

Real daemon processes, real sockets, real shared memory for the pool being
observed. An observer states the block geometry of the pool it observes and
gets that pool's namespace; it sees that pool's blocks (Lookup) and events
(WatchEvents, for the tenants it named), can Touch, Drop and be held, and
refuses every transfer. The CUDA backend, which maps no shared memory, accepts
observers too (the scheduler side of a GPU engine).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kvseal.client import ClientConfig, KVSealClient, KVSealRpcError, tenant_digest
from kvseal.client.shm import SharedKVPool
from kvseal.v1 import kvseal_pb2 as pb

from .conftest import DaemonProc, fill_random, wait_serving

FP = b"model:observed"
TENANT = tenant_digest("salt-a")
OTHER = tenant_digest("salt-b")


def observer_geometry(g: pb.PoolGeometry) -> pb.PoolGeometry:
    """What an observer of the pool with geometry ``g`` registers: its block
    geometry, no pages, buffers or segments."""
    return pb.PoolGeometry(
        num_pages=0,
        tokens_per_page=g.tokens_per_page,
        num_layers=g.num_layers,
        num_kv_heads=g.num_kv_heads,
        head_dim=g.head_dim,
        dtype=g.dtype,
        layout=g.layout,
        block_bytes=sum(s.bytes for s in g.segments),
    )


@pytest.fixture
def env(daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]) -> Iterator[dict[str, Any]]:
    pool = pool_factory(num_pages=4)
    data = fill_random(pool)
    c = daemon.client()
    worker = c.register_pool("worker", FP, pool.geometry())
    obs = c.register_pool("obs", FP, observer_geometry(pool.geometry()), observer=True)
    yield {"c": c, "pool": pool, "data": data, "worker": worker, "obs": obs, "d": daemon}
    c.close()


def _watch(c: KVSealClient, pool_id: str) -> tuple[Any, Iterator[pb.BlockEvent]]:
    call: Any = c._stub.WatchEvents(pb.WatchEventsRequest(pool_id=pool_id), timeout=30)
    assert ("kvseal-watch", "subscribed") in tuple(call.initial_metadata())
    return call, iter(call)


def test_namespace_and_block_bytes_equal_the_observed_pools(env: dict[str, Any]) -> None:
    worker, obs = env["worker"], env["obs"]
    assert obs.namespace == worker.namespace
    assert obs.block_bytes == worker.block_bytes
    assert obs.pool_id != worker.pool_id


def test_a_different_geometry_or_model_is_another_namespace(env: dict[str, Any]) -> None:
    c: KVSealClient = env["c"]
    g = observer_geometry(env["pool"].geometry())
    seen = {env["obs"].namespace}
    for i, change in enumerate(
        (
            {"block_bytes": g.block_bytes * 2},
            {"tokens_per_page": g.tokens_per_page + 1},
            {"dtype": "float16" if g.dtype != "float16" else "bfloat16"},
            {"layout": g.layout + "-other"},
        )
    ):
        other = pb.PoolGeometry()
        other.CopyFrom(g)
        for k, v in change.items():
            setattr(other, k, v)
        seen.add(c.register_pool(f"o{i}", FP, other, observer=True).namespace)
    seen.add(c.register_pool("o-model", b"model:other", g, observer=True).namespace)
    assert len(seen) == 6


def test_lookups_see_the_observed_pools_blocks(env: dict[str, Any]) -> None:
    c: KVSealClient = env["c"]
    hashes = [os.urandom(32) for _ in range(3)]
    assert c.lookup(env["obs"].pool_id, TENANT, hashes).hit_blocks == 0
    c.offload(env["worker"].pool_id, TENANT, hashes[:2], [0, 1])
    r = c.lookup(env["obs"].pool_id, TENANT, hashes)
    assert r.hit_blocks == 2
    assert r.states == [pb.BLOCK_READY, pb.BLOCK_READY, pb.BLOCK_ABSENT]
    assert c.lookup(env["obs"].pool_id, OTHER, hashes).hit_blocks == 0  # tenants stay apart
    assert c.touch(env["obs"].pool_id, TENANT, hashes[:2]) == 2


def test_watch_gets_events_for_the_tenants_it_named(env: dict[str, Any]) -> None:
    c: KVSealClient = env["c"]
    worker, obs = env["worker"].pool_id, env["obs"].pool_id
    call, events = _watch(c, obs)
    try:
        c.lookup(obs, TENANT, [bytes(32)])  # names TENANT on the observer
        hidden = [os.urandom(32)]
        c.offload(worker, OTHER, hidden, [0])  # OTHER was never named on the observer
        seen = [os.urandom(32), os.urandom(32)]
        c.offload(worker, TENANT, seen, [1, 2])
        ev = next(events)  # publishing is ordered: OTHER's event would have come first
        assert ev.kind == pb.BLOCK_STORED
        assert ev.tenant == TENANT and list(ev.block_hashes) == seen
        assert ev.namespace == env["obs"].namespace
        # Drop through the observer: the removal reaches its watcher.
        assert c.drop(obs, TENANT, seen[1:]) == 1
        ev = next(events)
        assert ev.kind == pb.BLOCK_REMOVED and ev.reason == pb.REMOVED_DROPPED
        assert list(ev.block_hashes) == seen[1:]
    finally:
        call.cancel()
    assert c.lookup(worker, TENANT, seen).hit_blocks == 1


def test_transfers_on_an_observer_are_refused_and_change_nothing(env: dict[str, Any]) -> None:
    c: KVSealClient = env["c"]
    worker, obs = env["worker"].pool_id, env["obs"].pool_id
    h = [os.urandom(32)]
    c.offload(worker, TENANT, h, [0])
    before = c.stats()
    for call in (
        lambda: c.offload(obs, TENANT, [os.urandom(32)], [0]),
        lambda: c.restore(obs, TENANT, h, [0]),
        lambda: c.restore(obs, TENANT, h, [0], release=True),
    ):
        with pytest.raises(KVSealRpcError) as err:
            call()
        assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.reason == "OBSERVER_POOL"
        assert "observer pool" in str(err.value)
    after = c.stats()
    assert after.blocks_ready == before.blocks_ready == 1
    assert after.offloaded_blocks == before.offloaded_blocks
    assert after.restored_blocks == before.restored_blocks
    # The block is still there and restorable through the pool with memory.
    env["pool"].fill_page(2, 0)
    c.restore(worker, TENANT, h, [2])
    assert env["pool"].read_block(2) == env["data"][0]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"num_pages": 1}, "num_pages must be 0"),
        ({"segments": [pb.Segment(buffer=0, offset=0, page_stride=8, bytes=8)]}, "segments"),
        ({"buffers": [pb.BufferHandle(shm_name="x", size=8)]}, "buffers"),
        ({"block_bytes": 0}, "block_bytes"),
        ({"block_bytes": (1 << 30) + 1}, "block_bytes"),
        ({"dtype": ""}, "dtype"),
        ({"layout": "bad\nlayout"}, "layout"),
    ],
)
def test_bad_observer_geometry_is_refused(
    env: dict[str, Any], change: dict[str, Any], needle: str
) -> None:
    c: KVSealClient = env["c"]
    g = observer_geometry(env["pool"].geometry())
    for k, v in change.items():
        if isinstance(v, list):
            getattr(g, k).extend(v)
        else:
            setattr(g, k, v)
    pools_before = c.stats().pools
    with pytest.raises(KVSealRpcError) as err:
        c.register_pool("bad-obs", FP, g, observer=True)
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.reason == "BAD_REQUEST"
    assert needle in str(err.value)
    assert c.stats().pools == pools_before


def test_observer_on_the_other_backend_is_refused(env: dict[str, Any]) -> None:
    c: KVSealClient = env["c"]
    g = observer_geometry(env["pool"].geometry())
    with pytest.raises(KVSealRpcError) as err:
        c.register_pool("obs-cuda", FP, g, pb.BACKEND_CUDA, observer=True)
    assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.reason == "BACKEND_MISMATCH"


def test_declared_block_bytes_of_a_pool_with_memory_must_match(env: dict[str, Any]) -> None:
    c: KVSealClient = env["c"]
    g = env["pool"].geometry()
    total = sum(s.bytes for s in g.segments)
    g.block_bytes = total  # a correct cross-check is accepted
    assert c.register_pool("worker", FP, g).namespace == env["worker"].namespace
    g.block_bytes = total + 1
    with pytest.raises(KVSealRpcError) as err:
        c.register_pool("worker-2", FP, g)
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "block_bytes" in str(err.value)


def test_holds_and_unregister_work_on_an_observer(env: dict[str, Any]) -> None:
    c: KVSealClient = env["c"]
    obs = env["obs"]
    hold = c.hold_pool(obs.pool_id)
    assert c.stats().pool_holds == 1
    # Held: another engine cannot take the name over.
    g = observer_geometry(env["pool"].geometry())
    with pytest.raises(KVSealRpcError) as err:
        c.register_pool("obs", FP, g, observer=True)
    assert err.value.code is grpc.StatusCode.ALREADY_EXISTS
    # Its owner can, with the owner token (the old observer is then gone).
    again = c.register_pool("obs", FP, g, observer=True, owner_token=obs.owner_token)
    assert again.namespace == obs.namespace
    assert hold.ended.wait(10)
    with pytest.raises(KVSealRpcError) as err:
        c.lookup(obs.pool_id, TENANT, [bytes(32)])
    assert err.value.code is grpc.StatusCode.NOT_FOUND
    # A hold whose holder leaves unregisters the observer.
    hold2 = c.hold_pool(again.pool_id)
    hold2.close()
    with KVSealClient(ClientConfig(target=env["d"].target, timeout_s=5)) as c2:
        for _ in range(200):
            if c2.stats().pool_holds == 0 and c2.stats().pools == 1:
                break
            hold2.ended.wait(0.05)
        assert c2.stats().pools == 1  # only the worker pool is left
    c.unregister_pool(env["worker"].pool_id)
    assert c.stats().pools == 0


# ------------------------------------------------------------------ CUDA backend

_EMULATED_CUDA_DAEMON = """
import sys
from kvseal.server import main as m
from kvseal.server.backends.cuda.backend import CudaBackend
from kvseal.server.backends.cuda.emulated_device import EmulatedDevice
from kvseal.server.daemon import daemon as d
d.make_backend = lambda cfg, sealer: CudaBackend(sealer, cfg.device, dev=EmulatedDevice(), cc="off")
sys.exit(m.main(sys.argv[1:]))
"""


@pytest.fixture
def cuda_daemon(tmp_path: Path) -> Iterator[str]:
    """kvseal-server's main() on the CUDA backend over the emulated device (no GPU
    here): a daemon process that refuses shared-memory pools, as on a GPU host."""
    from kvseal.server.backends.cuda import emulated as E

    try:
        E.load_emulator()
    except E.EmulatorUnavailable as exc:
        pytest.skip(f"CPU emulator unavailable: {exc}")
    root = Path(__file__).resolve().parent.parent
    sock = tmp_path / "run" / "k.sock"
    log_path = tmp_path / "daemon.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [
                str(root),
                str(root / "client"),
                str(root / "server"),
                os.environ.get("PYTHONPATH", ""),
            ]
        ),
    }
    args = ["--listen", f"unix://{sock}", "--backend", "cuda", "--host-bytes", "1MiB"]
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-c", _EMULATED_CUDA_DAEMON, *args, "--grace", "1"],
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        wait_serving(f"unix://{sock}", proc, log_path)
        yield f"unix://{sock}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_an_observer_registers_on_the_cuda_backend(
    cuda_daemon: str, daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    pool = pool_factory(num_pages=2)
    with daemon.client() as cpu:  # the namespace does not depend on the backend
        cpu_ns = cpu.register_pool("worker", FP, pool.geometry()).namespace
    with KVSealClient(ClientConfig(target=cuda_daemon, timeout_s=5)) as c:
        # What the scheduler's mirror did before observers: a shm probe pool. Refused.
        with pytest.raises(KVSealRpcError) as err:
            c.register_pool("probe", FP, pool.geometry())
        assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
        g = observer_geometry(pool.geometry())
        obs = c.register_pool("obs", FP, g, observer=True)
        assert obs.block_bytes == g.block_bytes
        assert obs.namespace == cpu_ns
        assert c.lookup(obs.pool_id, TENANT, [os.urandom(32)]).hit_blocks == 0
        call, _ = _watch(c, obs.pool_id)
        call.cancel()
        with pytest.raises(KVSealRpcError) as err:
            c.offload(obs.pool_id, TENANT, [os.urandom(32)], [0])
        assert err.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.reason == "OBSERVER_POOL"
        c.hold_pool(obs.pool_id).close()
