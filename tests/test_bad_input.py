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


# ---------------------------------------------------------------- hostile input, every RPC

LONG = "p" * 20_000  # 20 kB: its echo alone would exceed gRPC's metadata limit
_STREAMS = ("HoldPool", "WatchEvents")


def _raw(target: str, rpc: str, body: bytes) -> tuple[grpc.StatusCode, str, str]:
    """Send ``body`` as-is (no client-side serialisation or checks) and return
    (status, kvseal-error reason, details)."""
    path = f"/kvseal.v1.KVSeal/{rpc}"
    with grpc.insecure_channel(target) as ch:
        try:
            if rpc in _STREAMS:
                for _ in ch.unary_stream(path)(body, timeout=10):
                    break
            else:
                ch.unary_unary(path)(body, timeout=10)
        except grpc.RpcError as e:
            call: Any = e
            reason = dict(call.trailing_metadata() or ()).get("kvseal-error", "")
            return call.code(), str(reason), call.details() or ""
    return grpc.StatusCode.OK, "", ""


def _not_utf8(field: int) -> bytes:
    """A length-delimited string field holding bytes that are not UTF-8."""
    return bytes([field << 3 | 2, 2]) + b"\xff\xfe"


def _hostile_cases(env: dict[str, Any]) -> list[tuple[str, str, bytes, grpc.StatusCode, str, str]]:
    """(case, rpc, body, code, reason, words in details)."""
    pid, t, ch = env["pool_id"], env["tenant"], env["chain"]
    g = _geometry(env)
    cases: list[tuple[str, str, bytes, grpc.StatusCode, str, str]] = []

    def add(case: str, rpc: str, msg: Any, code: grpc.StatusCode, reason: str, words: str) -> None:
        body = msg if isinstance(msg, bytes) else msg.SerializeToString()
        cases.append((case, rpc, body, code, reason, words))

    by_pool_id: dict[str, Callable[[str], Any]] = {
        "UnregisterPool": lambda p: pb.UnregisterPoolRequest(pool_id=p),
        "HoldPool": lambda p: pb.HoldPoolRequest(pool_id=p),
        "Lookup": lambda p: pb.LookupRequest(pool_id=p, tenant=t, block_hashes=[H]),
        "Touch": lambda p: pb.TouchRequest(pool_id=p, tenant=t, block_hashes=[H]),
        "Offload": lambda p: pb.OffloadRequest(pool_id=p, tenant=t, block_hashes=[H], page_ids=[7]),
        "Restore": lambda p: pb.RestoreRequest(pool_id=p, tenant=t, block_hashes=[H], page_ids=[7]),
        "Drop": lambda p: pb.DropRequest(pool_id=p, tenant=t, block_hashes=[H]),
        "Release": lambda p: pb.ReleaseRequest(pool_id=p, tenant=t, block_hashes=[H]),
        "WatchEvents": lambda p: pb.WatchEventsRequest(pool_id=p),
    }
    for rpc, make in by_pool_id.items():
        add("20 kB pool id", rpc, make(LONG), NOT_FOUND, "UNKNOWN_POOL", "...(20000 bytes)")
        add("pool id + newline", rpc, make(pid + "\n"), NOT_FOUND, "UNKNOWN_POOL", "\\n")
        add("pool id with NUL", rpc, make(pid + "\0"), NOT_FOUND, "UNKNOWN_POOL", "\\x00")
        add("non-UTF-8 pool id", rpc, make("é" * 3000), NOT_FOUND, "UNKNOWN_POOL", "(6000 bytes)")
        field = 2 if rpc == "WatchEvents" else 1
        add("pool id not UTF-8", rpc, _not_utf8(field), INVALID, "BAD_REQUEST", "not a valid")
        add("truncated body", rpc, b"\x0a\x05ab", INVALID, "BAD_REQUEST", "not a valid")
    add("truncated body", "Stats", b"\x0a\x05ab", INVALID, "BAD_REQUEST", "not a valid")
    add("no pool id", "WatchEvents", pb.WatchEventsRequest(), INVALID, "BAD_REQUEST", "pool_id")
    add(
        "20 kB tenant",
        "WatchEvents",
        pb.WatchEventsRequest(pool_id=pid, tenant=b"t" * 20_000),
        INVALID,
        "BAD_REQUEST",
        "20000 bytes",
    )
    # Block RPCs on the real pool: oversized and repeated fields.
    for rpc, cls in (("Lookup", pb.LookupRequest), ("Touch", pb.TouchRequest)):
        add(
            "20 kB tenant",
            rpc,
            cls(pool_id=pid, tenant=b"t" * 20_000, block_hashes=[H]),
            INVALID,
            "BAD_REQUEST",
            "got 20000 bytes",
        )
        add(
            "100k hashes",
            rpc,
            cls(pool_id=pid, tenant=t, block_hashes=[os.urandom(32) for _ in range(100_000)]),
            INVALID,
            "BAD_REQUEST",
            "limit 8",
        )
        add(
            "20 kB hash",
            rpc,
            cls(pool_id=pid, tenant=t, block_hashes=[b"h" * 20_000]),
            INVALID,
            "BAD_REQUEST",
            "has 20000 bytes",
        )
    add(
        "100k page ids",
        "Offload",
        pb.OffloadRequest(pool_id=pid, tenant=t, block_hashes=ch[4:6], page_ids=range(100_000)),
        INVALID,
        "BAD_REQUEST",
        "page_ids",
    )
    add(
        "page id 2^32-1",
        "Restore",
        pb.RestoreRequest(pool_id=pid, tenant=t, block_hashes=ch[:1], page_ids=[2**32 - 1]),
        INVALID,
        "PAGE_OUT_OF_RANGE",
        "out of range",
    )
    add(
        "20 kB parent hash",
        "Offload",
        pb.OffloadRequest(
            pool_id=pid, tenant=t, parent_hash=b"x" * 20_000, block_hashes=ch[4:5], page_ids=[4]
        ),
        INVALID,
        "BAD_REQUEST",
        "parent_hash has 20000 bytes",
    )
    add(
        "20 kB CUDA event",
        "Restore",
        pb.RestoreRequest(
            pool_id=pid,
            tenant=t,
            block_hashes=ch[:1],
            page_ids=[5],
            cuda_event_ipc_handle=b"e" * 20_000,
        ),
        INVALID,
        "BAD_REQUEST",
        "CUDA backend",
    )

    # RegisterPool: names, enums, strings and repeated fields.
    def reg(name: str = "hostile", fp: bytes = FP, backend: int = 0, geo: Any = g) -> Any:
        return pb.RegisterPoolRequest(
            name=name, model_fingerprint=fp, geometry=geo, backend=backend
        )

    add("name + newline", "RegisterPool", reg("engine\n"), INVALID, "BAD_REQUEST", "name")
    add("name with NUL", "RegisterPool", reg("engine\0"), INVALID, "BAD_REQUEST", "name")
    add("20 kB name", "RegisterPool", reg(LONG), INVALID, "BAD_REQUEST", "name")
    add("name not UTF-8", "RegisterPool", _not_utf8(1), INVALID, "BAD_REQUEST", "not a valid")
    add("unknown backend", "RegisterPool", reg(backend=99), INVALID, "BAD_REQUEST", "enum value 99")
    add(
        "20 kB fingerprint", "RegisterPool", reg(fp=b"f" * 20_000), INVALID, "BAD_REQUEST", "1..256"
    )
    for what, mutate in (
        (
            "shm name + newline",
            lambda x: setattr(x.buffers[0], "shm_name", x.buffers[0].shm_name + "\n"),
        ),
        ("dtype + newline", lambda x: setattr(x, "dtype", "bfloat16\n")),
        ("dtype with NUL", lambda x: setattr(x, "dtype", "bf\0")),
        ("20 kB layout", lambda x: setattr(x, "layout", LONG)),
        ("5000 buffers", lambda x: x.buffers.extend([x.buffers[0]] * 5000)),
        ("70k segments", lambda x: x.segments.extend([x.segments[0]] * 70_000)),
    ):
        geo = _geometry(env)
        mutate(geo)
        add(what, "RegisterPool", reg(geo=geo), INVALID, "BAD_REQUEST", "geometry")
    return cases


def test_every_rpc_refuses_hostile_input_with_its_status_and_changes_nothing(
    env: dict[str, Any],
) -> None:
    """Table: each RPC x hostile input gives the exact documented status and reason,
    a bounded printable message (never a transport error: no input decides the
    status), and leaves stats, index, pages and the stored blocks exactly as
    they were."""
    d, c = env["d"], env["c"]
    for case, rpc, body, code, reason, words in _hostile_cases(env):
        before = _snapshot(env)
        got = _raw(d.target, rpc, body)
        where = f"{rpc} / {case}: {got[0]} {got[1]} {got[2][:200]!r}"
        assert got[:2] == (code, reason), where
        assert words in got[2], where
        assert len(got[2]) <= 1024 and got[2].isascii() and got[2].isprintable(), where
        assert c.health() == "SERVING", where
        assert _snapshot(env) == before, where
    assert LONG[:100] not in d.log()
    # The stored reference blocks are still byte-exact.
    c.restore(env["pool_id"], env["tenant"], env["chain"][:2], [6, 7])
    pool: SharedKVPool = env["pool"]
    assert pool.read_block(6) == env["data"][0] and pool.read_block(7) == env["data"][1]
