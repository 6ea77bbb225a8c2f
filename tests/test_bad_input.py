"""Every malformed request gets its documented status code and reason, and
changes nothing: the daemon stays SERVING, the index and the engine's pages
are exactly as before."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from kvseal.client import KVSealClient, KVSealRpcError, chain_block_hashes, tenant_digest
from kvseal.client.shm import SharedKVPool
from kvseal.v1 import kvseal_pb2 as pb

from .conftest import fill_random

FP = b"model:test"
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
FAILED_PRE = grpc.StatusCode.FAILED_PRECONDITION


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from .conftest import start_daemon

    d = start_daemon(tmp_path_factory.mktemp("bad"), "--max-batch-blocks", "8", host_bytes="1MiB")
    from kvseal.client.shm import KVShape

    pool = SharedKVPool(KVShape(8, 4, 2, 2, 16), "vllm_per_layer", name_prefix="kvseal-test")
    data = fill_random(pool)
    c = d.client()
    h = c.register_pool("engine", FP, pool.geometry())
    tenant = tenant_digest("t")
    chain = chain_block_hashes(list(os.urandom(8 * 4)), 4, cache_salt="t")
    c.offload(h.pool_id, tenant, chain[:4], [0, 1, 2, 3])
    yield {
        "d": d,
        "c": c,
        "pool": pool,
        "pool_id": h.pool_id,
        "tenant": tenant,
        "chain": chain,
        "data": data,
    }
    c.close()
    pool.close()
    d.stop()


def _snapshot(env: dict[str, Any]) -> tuple[Any, ...]:
    c: KVSealClient = env["c"]
    s = c.stats()
    pool: SharedKVPool = env["pool"]
    pages = tuple(pool.read_block(p) for p in range(pool.shape.num_pages))
    lk = c.lookup(env["pool_id"], env["tenant"], env["chain"])
    return (
        s.blocks_ready,
        s.blocks_pending,
        s.blocks_pinned,
        s.host_bytes_used,
        s.offloaded_blocks,
        s.restored_blocks,
        s.pools,
        tuple(lk.states),
        pages,
    )


def _expect(
    env: dict[str, Any],
    code: grpc.StatusCode,
    reason: str,
    fn: Callable[[KVSealClient], object],
    words: str,
) -> None:
    before = _snapshot(env)
    with pytest.raises(KVSealRpcError) as e:
        fn(env["c"])
    assert e.value.code == code, e.value
    assert e.value.reason == reason, e.value
    assert words in e.value.details, e.value.details
    assert env["c"].health() == "SERVING"
    assert _snapshot(env) == before


H = os.urandom(32)


def test_unknown_pool(env: dict[str, Any]) -> None:
    t = env["tenant"]
    _expect(env, NOT_FOUND, "UNKNOWN_POOL", lambda c: c.lookup("nope", t, [H]), "not registered")
    _expect(
        env, NOT_FOUND, "UNKNOWN_POOL", lambda c: c.offload("nope", t, [H], [0]), "not registered"
    )
    _expect(
        env, NOT_FOUND, "UNKNOWN_POOL", lambda c: c.restore("nope", t, [H], [0]), "not registered"
    )
    _expect(env, NOT_FOUND, "UNKNOWN_POOL", lambda c: c.drop("nope", t, [H]), "not registered")
    _expect(env, NOT_FOUND, "UNKNOWN_POOL", lambda c: c.touch("nope", t, [H]), "not registered")
    _expect(env, NOT_FOUND, "UNKNOWN_POOL", lambda c: c.unregister_pool("nope"), "not registered")


@pytest.mark.parametrize("op", ["offload", "restore"])
def test_page_out_of_range_checked_before_any_copy(env: dict[str, Any], op: str) -> None:
    ch, t, pid = env["chain"], env["tenant"], env["pool_id"]
    hashes = ch[:2] if op == "restore" else ch[4:6]
    for bad in (8, 2**31, 4_000_000_000):
        _expect(
            env,
            INVALID,
            "PAGE_OUT_OF_RANGE",
            lambda c, b=bad: getattr(c, op)(pid, t, hashes, [0, b]),
            "out of range",
        )


@pytest.mark.parametrize("op", ["offload", "restore"])
def test_batch_shape_errors(env: dict[str, Any], op: str) -> None:
    ch, t, pid = env["chain"], env["tenant"], env["pool_id"]
    hashes = ch[:2] if op == "restore" else ch[4:6]
    call = lambda hs, ps: lambda c: getattr(c, op)(pid, t, hs, ps)  # noqa: E731
    _expect(env, INVALID, "BAD_REQUEST", call(hashes, [0]), "page_ids")
    _expect(env, INVALID, "BAD_REQUEST", call([hashes[0], hashes[0]], [0, 1]), "repeats")
    _expect(env, INVALID, "BAD_REQUEST", call(hashes, [5, 5]), "repeats")
    _expect(env, INVALID, "BAD_REQUEST", call([b"short"], [0]), "32 bytes")
    _expect(env, INVALID, "BAD_REQUEST", call([], []), "empty")
    nine = [os.urandom(32) for _ in range(9)]
    _expect(env, INVALID, "BAD_REQUEST", call(nine, list(range(9))), "limit 8")
    _expect(
        env,
        INVALID,
        "BAD_REQUEST",
        lambda c: getattr(c, op)(pid, b"x" * 31, hashes, [0, 1]),
        "tenant",
    )


def test_bad_parent_hash_and_drop_flags(env: dict[str, Any]) -> None:
    ch, t, pid = env["chain"], env["tenant"], env["pool_id"]
    _expect(
        env,
        INVALID,
        "BAD_REQUEST",
        lambda c: c.offload(pid, t, ch[4:5], [4], parent_hash=b"x" * 5),
        "parent_hash",
    )
    _expect(
        env,
        INVALID,
        "BAD_REQUEST",
        lambda c: c.drop(pid, t, ch[:1], all_of_tenant=True),
        "not both",
    )
    _expect(env, INVALID, "BAD_REQUEST", lambda c: c.lookup(pid, t, [H, H]), "repeats")


def test_restore_of_absent_or_foreign_blocks(env: dict[str, Any]) -> None:
    ch, t, pid = env["chain"], env["tenant"], env["pool_id"]
    _expect(
        env,
        NOT_FOUND,
        "BLOCK_NOT_PRESENT",
        lambda c: c.restore(pid, t, [ch[0], ch[6]], [5, 6]),
        "absent",
    )
    other = tenant_digest("other")
    _expect(
        env, NOT_FOUND, "BLOCK_NOT_PRESENT", lambda c: c.restore(pid, other, ch[:1], [5]), "absent"
    )


def test_capacity_exhausted(env: dict[str, Any]) -> None:
    """A 1 MiB tier cannot hold a 1.5 MiB request even after evicting every
    other block: the eviction plan is dropped, nothing evicted or stored."""
    from kvseal.client.shm import KVShape

    big = SharedKVPool(KVShape(3, 16, 8, 8, 128), "vllm_cross_layer", name_prefix="kvseal-test")
    try:
        c: KVSealClient = env["c"]
        h = c.register_pool("big", FP, big.geometry())
        assert big.shape.block_bytes == 512 * 1024
        _expect(
            env,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "CAPACITY_EXHAUSTED",
            lambda c: c.offload(
                h.pool_id, env["tenant"], [os.urandom(32) for _ in range(3)], [0, 1, 2]
            ),
            "do not fit",
        )
        c.unregister_pool(h.pool_id)
    finally:
        big.close()


def _geometry(env: dict[str, Any]) -> pb.PoolGeometry:
    g = pb.PoolGeometry()
    g.CopyFrom(env["pool"].geometry())
    return g


def _register_expect(
    env: dict[str, Any],
    g: pb.PoolGeometry,
    code: grpc.StatusCode,
    reason: str,
    words: str,
    backend: int = pb.BACKEND_UNSPECIFIED,
    fp: bytes = FP,
    name: str = "x",
) -> None:
    _expect(env, code, reason, lambda c: c.register_pool(name, fp, g, backend), words)


def test_registration_errors(env: dict[str, Any]) -> None:
    g = _geometry(env)
    g.segments[3].offset += 1  # last page of V of layer 1 runs past its buffer
    _register_expect(env, g, INVALID, "BAD_REQUEST", "does not fit the buffer")
    g = _geometry(env)
    g.buffers[0].size *= 4  # claims more than the shared-memory object holds
    for s in g.segments:
        s.page_stride = s.page_stride
    _register_expect(env, g, FAILED_PRE, "HANDLE_UNUSABLE", "has")
    g = _geometry(env)
    g.buffers[1].shm_name = "kvseal-no-such-object"
    _register_expect(env, g, FAILED_PRE, "HANDLE_UNUSABLE", "cannot open")
    g = _geometry(env)
    g.buffers[1].shm_name = "../etc/passwd"
    _register_expect(env, g, INVALID, "BAD_REQUEST", "no '/'")
    g = _geometry(env)
    g.segments[0].page_stride = 8
    _register_expect(env, g, INVALID, "BAD_REQUEST", "overlap")
    g = _geometry(env)
    g.segments[0].buffer = 99
    _register_expect(env, g, INVALID, "BAD_REQUEST", "buffers")
    g = _geometry(env)
    g.num_pages = 0
    _register_expect(env, g, INVALID, "BAD_REQUEST", "num_pages")
    g = _geometry(env)
    del g.segments[:]
    _register_expect(env, g, INVALID, "BAD_REQUEST", "segments")
    _register_expect(env, _geometry(env), INVALID, "BAD_REQUEST", "model_fingerprint", fp=b"")
    _register_expect(env, _geometry(env), INVALID, "BAD_REQUEST", "name", name="bad name/")
    _register_expect(
        env, _geometry(env), INVALID, "BAD_REQUEST", "cuda_ipc_handle", backend=pb.BACKEND_CUDA
    )


def test_request_after_unregister(env: dict[str, Any]) -> None:
    c: KVSealClient = env["c"]
    h = c.register_pool("temp", FP, env["pool"].geometry())
    c.unregister_pool(h.pool_id)
    t = env["tenant"]
    _expect(
        env,
        NOT_FOUND,
        "UNKNOWN_POOL",
        lambda c: c.offload(h.pool_id, t, [H], [0]),
        "register it again",
    )
    _expect(
        env, NOT_FOUND, "UNKNOWN_POOL", lambda c: c.unregister_pool(h.pool_id), "not registered"
    )
