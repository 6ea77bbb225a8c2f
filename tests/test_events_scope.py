"""WatchEvents shows a peer only what its own pool uses, and tenant digests can
be keyed so that a peer cannot compute or search them.

Real daemon, real sockets. "Sees nothing of X" is proven without timing: the
daemon publishes in order, so after the hidden activity the test causes an
event the watcher must see (a sentinel); had the hidden event been delivered,
it would have arrived first.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kvseal.client import (
    ClientConfig,
    KVSealClient,
    KVSealRpcError,
    load_tenant_key,
    tenant_digest,
)
from kvseal.client.shm import SharedKVPool
from kvseal.v1 import kvseal_pb2 as pb

from .conftest import DaemonProc, fill_random

FP_A, FP_B = b"model:a", b"model:b"


class Watch:
    """A live WatchEvents stream: construction returns once the daemon has
    subscribed it (the "kvseal-watch" initial metadata)."""

    def __init__(self, c: KVSealClient, pool_id: str, tenant: bytes = b"") -> None:
        self.call: Any = c._stub.WatchEvents(
            pb.WatchEventsRequest(pool_id=pool_id, tenant=tenant), timeout=30
        )
        assert ("kvseal-watch", "subscribed") in tuple(self.call.initial_metadata())
        self._it: Iterator[pb.BlockEvent] = iter(self.call)

    def next(self) -> pb.BlockEvent:
        return next(self._it)

    def close(self) -> None:
        self.call.cancel()


@pytest.fixture
def env(daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]) -> Iterator[dict[str, Any]]:
    pools = {name: pool_factory(num_pages=4) for name in ("a", "a2", "b")}
    for p in pools.values():
        fill_random(p)
    c = daemon.client()
    handles = {
        "a": c.register_pool("a", FP_A, pools["a"].geometry()),
        "a2": c.register_pool("a2", FP_A, pools["a2"].geometry()),  # same namespace as a
        "b": c.register_pool("b", FP_B, pools["b"].geometry()),
    }
    assert handles["a"].namespace == handles["a2"].namespace != handles["b"].namespace
    ids = {name: h.pool_id for name, h in handles.items()}
    ns = {name: h.namespace for name, h in handles.items()}
    yield {"c": c, "ids": ids, "ns": ns, "pools": pools, "d": daemon}
    c.close()


def _h() -> bytes:
    return os.urandom(32)


def test_watch_needs_a_registered_pool(env: dict[str, Any]) -> None:
    c: KVSealClient = env["c"]
    for pool_id, code, reason in (
        ("", grpc.StatusCode.INVALID_ARGUMENT, "BAD_REQUEST"),
        ("nope#000000000000", grpc.StatusCode.NOT_FOUND, "UNKNOWN_POOL"),
    ):
        with pytest.raises(KVSealRpcError) as e:
            next(iter(c.watch_events(pool_id, timeout=10)))
        assert (e.value.code, e.value.reason) == (code, reason)


def test_watcher_sees_only_its_pools_namespace_and_tenants(env: dict[str, Any]) -> None:
    c: KVSealClient = env["c"]
    a, a2, b = env["ids"]["a"], env["ids"]["a2"], env["ids"]["b"]
    t1, t2, t3 = tenant_digest("t1"), tenant_digest("t2"), tenant_digest("t3")
    w_a2 = Watch(c, a2)  # same namespace as a, but has named no tenant yet
    w_b = Watch(c, b)
    try:
        h1, h2 = _h(), _h()
        c.offload(a, t1, [h1], [0])  # hidden from a2 (tenant t1 unnamed there) and b
        c.offload(b, t1, [h2], [0])  # b names t1 itself: visible to b
        ev = w_b.next()
        assert (ev.tenant, list(ev.block_hashes), ev.sequence) == (t1, [h2], 1)
        assert ev.namespace == env["ns"]["b"] and ev.kind == pb.BLOCK_STORED

        sentinel = _h()
        c.offload(a2, t3, [sentinel], [1])  # a2 names t3: its first visible event
        ev = w_a2.next()
        assert (ev.tenant, list(ev.block_hashes), ev.sequence) == (t3, [sentinel], 1)
        assert ev.namespace == env["ns"]["a2"]

        # Once a2 names t1 (any request does), t1's events in a2's namespace are
        # visible to it, whichever pool caused them.
        assert c.lookup(a2, t1, [h1]).hit_blocks == 1
        c.drop(a, t1, [h1])
        ev = w_a2.next()
        assert (ev.kind, ev.reason, ev.tenant) == (pb.BLOCK_REMOVED, pb.REMOVED_DROPPED, t1)
        assert list(ev.block_hashes) == [h1] and ev.sequence == 2  # per-watcher numbering

        # b saw neither a's nor a2's activity (other namespace): its next event is
        # its own sentinel, numbered 2.
        c.offload(b, t2, [sentinel], [1])
        ev = w_b.next()
        assert (ev.tenant, list(ev.block_hashes), ev.sequence) == (t2, [sentinel], 2)
    finally:
        w_a2.close()
        w_b.close()


def test_tenant_filter_narrows_further(env: dict[str, Any]) -> None:
    c: KVSealClient = env["c"]
    a = env["ids"]["a"]
    t1, t2 = tenant_digest("f1"), tenant_digest("f2")
    w = Watch(c, a, tenant=t2)
    try:
        c.offload(a, t1, [_h()], [0])  # named by a, but filtered out
        mine = _h()
        c.offload(a, t2, [mine], [1])
        ev = w.next()
        assert (ev.tenant, list(ev.block_hashes), ev.sequence) == (t2, [mine], 1)
    finally:
        w.close()


def test_watch_ends_with_unknown_pool_when_its_pool_goes(env: dict[str, Any]) -> None:
    c: KVSealClient = env["c"]
    b = env["ids"]["b"]
    w = Watch(c, b)
    c.unregister_pool(b)
    with pytest.raises(grpc.RpcError) as e:
        w.next()
    call: Any = e.value
    assert call.code() == grpc.StatusCode.NOT_FOUND
    assert dict(call.trailing_metadata())["kvseal-error"] == "UNKNOWN_POOL"


# ---------------------------------------------------------------- keyed tenant digests

KEY = bytes(range(32))


def test_keyed_digest_is_hmac_and_differs_from_unkeyed_and_per_key() -> None:
    salt = "user-42"
    keyed = tenant_digest(salt, key=KEY)
    assert keyed == hmac.new(KEY, b"kvseal/tenant/v2\x00user-42", hashlib.sha256).digest()
    assert keyed == tenant_digest(salt.encode(), key=KEY)  # deterministic, str == bytes
    assert keyed != tenant_digest(salt)  # unkeyed (v1) never coincides
    assert keyed != tenant_digest(salt, key=bytes(32))
    assert tenant_digest(None, key=KEY) != tenant_digest(None)
    with pytest.raises(ValueError, match="at least 32"):
        tenant_digest(salt, key=b"short")


def test_tenant_key_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tenant.key"
    path.write_bytes(KEY)
    path.chmod(0o600)
    assert load_tenant_key(str(path)) == KEY
    monkeypatch.setenv("KVSEAL_TENANT_KEY_FILE", str(path))
    assert load_tenant_key() == KEY
    cfg = ClientConfig(target="unix:///nonexistent")
    assert cfg.tenant_key == KEY and KEY.hex() not in repr(cfg)
    with KVSealClient(cfg) as c:
        assert c.tenant_digest("s") == tenant_digest("s", key=KEY)
    path.chmod(0o640)
    with pytest.raises(ValueError, match="group/others"):
        load_tenant_key()
    path.chmod(0o600)
    path.write_bytes(b"x" * 31)
    with pytest.raises(ValueError, match="31 bytes"):
        load_tenant_key()
    monkeypatch.delenv("KVSEAL_TENANT_KEY_FILE")
    assert load_tenant_key() is None and ClientConfig(target="unix:///x").tenant_key is None
