"""Erasure the host cannot undo, against real daemons and a real directory
(issue 28): after ``Drop(all_of_tenant)`` the host tries to bring the
tenant's pre-drop store epoch back, and no daemon that has seen the drop or
reads what the drop wrote serves a pre-drop block again.

Two attacks, each against the dropping daemon, a restarted daemon and a
second replica sharing the directory:

- **restoring the pre-drop scope marker, again and again** (the dropping
  daemon once kept 16 retired epochs per tenant, and each rollback pushed the
  pre-drop one further out: the 17th restore was served);
- **hiding the marker before the drop**, so the drop finds no epoch to
  retire, then putting it back (also against a daemon whose first contact
  with the tenant is the drop).

What the design cannot give (a host that also deletes or replaces the floor
the drop wrote, shown to a daemon that knows nothing newer) is the
documented limit, tested in ``test_store_fs.py``. Waits here are the
daemon's scope TTL (a replica re-reads the marker once it is older than
that), not timing assertions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from kvseal.client import KVSealClient, KVSealRpcError, tenant_digest
from kvseal.client.shm import SharedKVPool

from .conftest import DaemonProc, fill_random, is_poisoned, poison
from .store_helpers import FP, chain, key_file, store_flags, wait_objects

Factory = Callable[..., DaemonProc]
SCOPE_TTL_S = 2.0  # the daemon's StoreConfig.scope_ttl_s
TENANT = tenant_digest("user-a")
RESTORES = 20  # more than the 16 retired epochs the dropping daemon once kept


def _past_ttl() -> None:
    time.sleep(SCOPE_TTL_S + 0.3)


def _scope_files(store: Path) -> dict[Path, bytes]:
    """Every ``.scope`` file (the tenant's marker, and its floor where there
    is one) with its bytes: what the host copies."""
    return {p: p.read_bytes() for p in sorted(store.glob("*/*.scope"))}


def _marker(files: dict[Path, bytes]) -> Path:
    """The scope marker among them (the larger record: it holds the seed)."""
    return max(files, key=lambda p: len(files[p]))


def _put_back(files: dict[Path, bytes]) -> None:
    for p, raw in files.items():
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(raw)


def _serves_nothing(c: KVSealClient, pool: SharedKVPool, hashes: list[bytes]) -> None:
    """The daemon behind ``c`` neither finds nor restores a pre-drop block."""
    h = c.register_pool("engine", FP, pool.geometry())
    poison(pool, [2, 3])
    assert c.lookup(h.pool_id, TENANT, hashes).hit_blocks == 0, "a pre-drop block found"
    with pytest.raises(KVSealRpcError) as e:
        c.restore(h.pool_id, TENANT, hashes, [2, 3])
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert is_poisoned(pool, 2) and is_poisoned(pool, 3), "pre-drop bytes reached the pool"


def _store_blocks(d: DaemonProc, pool: SharedKVPool, store: Path) -> list[bytes]:
    hashes = chain(2, pool.shape.tokens_per_page, b"user-a")
    with d.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        c.offload(h.pool_id, TENANT, hashes, [0, 1])
    wait_objects(store, 2)
    return hashes


def _drop(d: DaemonProc, pool: SharedKVPool) -> None:
    with d.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        c.drop(h.pool_id, TENANT, [], all_of_tenant=True)


def _sees(d: DaemonProc, pool: SharedKVPool, hashes: list[bytes]) -> None:
    """A replica reads the tenant's scope: it finds both blocks (pre-drop)."""
    with d.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        assert c.lookup(h.pool_id, TENANT, hashes).hit_blocks == 2


@pytest.mark.parametrize("target", ["dropping", "restarted", "replica"])
def test_restored_pre_drop_marker_is_never_served(
    tmp_path: Path,
    daemon_factory: Factory,
    pool_factory: Callable[..., SharedKVPool],
    target: str,
) -> None:
    store, key = tmp_path / "store", key_file(tmp_path / "key")
    flags = store_flags(store, f"file:{key}")
    pool = pool_factory(num_pages=4)
    fill_random(pool)
    a = daemon_factory(*flags)
    hashes = _store_blocks(a, pool, store)
    replica = daemon_factory(*flags) if target == "replica" else None
    if replica is not None:
        _sees(replica, pool, hashes)
    before = _scope_files(store)  # the host keeps a copy of the pre-drop records
    _drop(a, pool)
    if target == "dropping":
        # The host puts every pre-drop record back, again and again.
        with a.client() as c:
            for _ in range(RESTORES):
                _put_back(before)
                _past_ttl()
                _serves_nothing(c, pool, hashes)
        return
    only_marker = {_marker(before): before[_marker(before)]}  # the drop's floor stays
    if target == "restarted":
        assert a.stop() == 0
        for _ in range(2):  # restored before each start
            _put_back(only_marker)
            r = daemon_factory(*flags)
            with r.client() as c:
                _serves_nothing(c, pool, hashes)
            assert r.stop() == 0
        return
    assert replica is not None
    with replica.client() as c:
        for _ in range(3):
            _put_back(only_marker)
            _past_ttl()
            _serves_nothing(c, pool, hashes)


@pytest.mark.parametrize("target", ["dropping", "first-contact", "restarted", "replica"])
def test_marker_hidden_before_the_drop_is_never_served(
    tmp_path: Path,
    daemon_factory: Factory,
    pool_factory: Callable[..., SharedKVPool],
    target: str,
) -> None:
    """The host moves the tenant's scope records away, the drop finds no
    epoch (``first-contact``: a daemon whose first call for the tenant is the
    drop), then the host puts them back."""
    store, key = tmp_path / "store", key_file(tmp_path / "key")
    flags = store_flags(store, f"file:{key}")
    pool = pool_factory(num_pages=4)
    fill_random(pool)
    a = daemon_factory(*flags)
    hashes = _store_blocks(a, pool, store)
    replica = daemon_factory(*flags) if target == "replica" else None
    if replica is not None:
        _sees(replica, pool, hashes)
    hidden = _scope_files(store)
    for p in hidden:
        p.unlink()  # moved away: the host keeps the bytes
    if target == "first-contact":
        assert a.stop() == 0
        a = daemon_factory(*flags)  # never saw the tenant
    else:
        _past_ttl()
        with a.client() as c:  # a's next look at the store finds no marker
            h = c.register_pool("engine", FP, pool.geometry())
            # One block beyond the host tier's: the Lookup asks the store.
            more = chain(3, pool.shape.tokens_per_page, b"user-a")
            assert c.lookup(h.pool_id, TENANT, [*hashes, more[2]]).hit_blocks == 2
    _drop(a, pool)  # OK, with no epoch visible to retire
    if target in ("dropping", "first-contact"):
        _put_back(hidden)  # marker and floor alike
        _past_ttl()
        with a.client() as c:
            _serves_nothing(c, pool, hashes)
            _past_ttl()
            _serves_nothing(c, pool, hashes)
        return
    _put_back({_marker(hidden): hidden[_marker(hidden)]})  # the drop's floor stays
    if target == "restarted":
        assert a.stop() == 0
        r = daemon_factory(*flags)
        with r.client() as c:
            _serves_nothing(c, pool, hashes)
        return
    assert replica is not None
    _past_ttl()
    with replica.client() as c:
        _serves_nothing(c, pool, hashes)
