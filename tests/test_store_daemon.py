"""Daemons with a store tier (``--store-dir``), as real processes with a real
client pool: a restart under a key file keeps serving from the store; two
replicas sharing one directory and key restore each other's blocks while a
daemon with another key only misses; eviction spills (``--store-policy
spill``); a drop rotates the tenant's store epoch; start-up refuses bad keys
and layouts with exit 2; and the default daemon (no ``--store-dir``) is
unchanged.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from kvseal.client import KVSealRpcError, tenant_digest
from kvseal.client.shm import SharedKVPool
from kvseal.server.store.fsstore import FsStore, StoreConfig
from kvseal.server.store.keysource import FileKeySource
from kvseal.v1 import kvseal_pb2 as pb

from .conftest import DaemonProc, fill_random, is_poisoned, poison, until
from .store_helpers import (
    FP,
    MAX_BLOCK,
    STORE_BYTES,
    chain,
    key_file,
    objects,
    scrape,
    store_flags,
    wait_objects,
)

Factory = Callable[..., DaemonProc]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_restart_with_key_file_restores_from_store(
    tmp_path: Path, daemon_factory: Factory, pool_factory: Callable[..., SharedKVPool]
) -> None:
    store, key = tmp_path / "store", key_file(tmp_path / "key")
    flags = store_flags(store, f"file:{key}")
    pool = pool_factory(num_pages=8)
    data = fill_random(pool)
    tenant = tenant_digest("user-a")
    hashes = chain(4, pool.shape.tokens_per_page, b"user-a")
    a = daemon_factory(*flags)
    with a.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        assert c.offload(h.pool_id, tenant, hashes, [0, 1, 2, 3]).stored_blocks == 4
    wait_objects(store, 4)
    assert a.stop() == 0
    b = daemon_factory(*flags)  # a restart: an empty host tier, the same store
    with b.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        r = c.lookup(h.pool_id, tenant, hashes)
        assert r.hit_blocks == 4 and r.states == [pb.BLOCK_READY] * 4
        poison(pool, list(range(8)))
        res = c.restore(h.pool_id, tenant, hashes, [7, 6, 5, 4])
        assert res.restored_blocks == 4
        for src, dst in zip([0, 1, 2, 3], [7, 6, 5, 4], strict=True):
            assert pool.read_block(dst) == data[src]
        assert all(is_poisoned(pool, p) for p in range(4))
        # Promoted into the host tier: a second restore needs no store read.
        c.restore(h.pool_id, tenant, hashes[:2], [0, 1])
        assert pool.read_block(0) == data[0] and pool.read_block(1) == data[1]
        # Another tenant's lookup of the same hashes finds nothing.
        assert c.lookup(h.pool_id, tenant_digest("user-b"), hashes).hit_blocks == 0


def test_lookup_states_report_store_blocks_past_a_gap(
    tmp_path: Path, daemon_factory: Factory, pool_factory: Callable[..., SharedKVPool]
) -> None:
    """After a restart, a Lookup's ``states`` say READY for every block the
    store holds, also after a block neither tier holds (the vLLM mirror's
    discovery asks about several requests' blocks in one Lookup and reads the
    states); ``hit_blocks`` stays the leading READY run, host or store."""
    store, key = tmp_path / "store", key_file(tmp_path / "key")
    flags = store_flags(store, f"file:{key}")
    pool = pool_factory(num_pages=8)
    fill_random(pool)
    tenant = tenant_digest("user-a")
    per = pool.shape.tokens_per_page
    stored = chain(4, per, b"user-a")
    a = daemon_factory(*flags)
    with a.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        c.offload(h.pool_id, tenant, stored, [0, 1, 2, 3])
    wait_objects(store, 4)
    assert a.stop() == 0
    b = daemon_factory(*flags)  # empty host tier, the same store
    x, y = chain(1, per, b"never"), chain(1, per, b"stored")
    host = chain(1, per, b"host-only")  # stored after the restart: host tier (and store)
    ready, absent = pb.BLOCK_READY, pb.BLOCK_ABSENT
    with b.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        c.offload(h.pool_id, tenant, host, [4])
        r = c.lookup(h.pool_id, tenant, [*x, stored[0], stored[1], *y, stored[2], *host])
        assert r.hit_blocks == 0
        assert list(r.states) == [absent, ready, ready, absent, ready, ready]
        r = c.lookup(h.pool_id, tenant, [stored[0], *host, stored[1], *x, stored[3]])
        assert r.hit_blocks == 3 and list(r.states) == [ready, ready, ready, absent, ready]
        r = c.lookup(h.pool_id, tenant_digest("user-b"), [*x, *stored])
        assert r.hit_blocks == 0 and list(r.states) == [absent] * 5


def test_local_key_serves_only_its_own_lifetime(
    tmp_path: Path, daemon_factory: Factory, pool_factory: Callable[..., SharedKVPool]
) -> None:
    store = tmp_path / "store"
    pool = pool_factory(num_pages=4)
    fill_random(pool)
    tenant = tenant_digest(None)
    hashes = chain(2, pool.shape.tokens_per_page)
    # Configured through the environment this time (KVSEAL_STORE_*; flags win).
    env = {
        "KVSEAL_STORE_DIR": str(store),
        "KVSEAL_STORE_BYTES": STORE_BYTES,
        "KVSEAL_STORE_MAX_BLOCK_BYTES": MAX_BLOCK,
        "KVSEAL_STORE_KEY": "local",
        "KVSEAL_STORE_FSYNC": "off",
        "KVSEAL_STORE_POLICY": "write-through",
    }
    a = daemon_factory(env=env)
    assert "key local, policy write-through, fsync off" in a.log()
    with a.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        c.offload(h.pool_id, tenant, hashes, [0, 1])
    wait_objects(store, 2)
    a.stop()
    b = daemon_factory(*store_flags(store, "local"))
    with b.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        assert c.lookup(h.pool_id, tenant, hashes).hit_blocks == 0


def test_two_replicas_share_blocks_and_another_key_only_misses(
    tmp_path: Path, daemon_factory: Factory, pool_factory: Callable[..., SharedKVPool]
) -> None:
    store, key = tmp_path / "store", key_file(tmp_path / "key")
    other = key_file(tmp_path / "other-key")
    a = daemon_factory(*store_flags(store, f"file:{key}"))
    b = daemon_factory(*store_flags(store, f"file:{key}"))
    c_ = daemon_factory(*store_flags(store, f"file:{other}"))
    pool_a, pool_b, pool_c = (pool_factory(num_pages=6) for _ in range(3))
    data = fill_random(pool_a)
    tenant = tenant_digest("conversation-1")
    hashes = chain(5, pool_a.shape.tokens_per_page, b"conversation-1")
    with a.client() as ca:
        ha = ca.register_pool("engine", FP, pool_a.geometry())
        ca.offload(ha.pool_id, tenant, hashes, [0, 1, 2, 3, 4])
    wait_objects(store, 5)
    poison(pool_b, list(range(6)))
    with b.client() as cb:
        hb = cb.register_pool("engine", FP, pool_b.geometry())
        assert cb.lookup(hb.pool_id, tenant, hashes).hit_blocks == 5
        cb.restore(hb.pool_id, tenant, hashes, [0, 1, 2, 3, 4])
        for p in range(5):
            assert pool_b.read_block(p) == data[p]
    poison(pool_c, list(range(6)))
    with c_.client() as cc:
        hc = cc.register_pool("engine", FP, pool_c.geometry())
        assert cc.lookup(hc.pool_id, tenant, hashes).hit_blocks == 0
        with pytest.raises(KVSealRpcError) as e:
            cc.restore(hc.pool_id, tenant, hashes, [0, 1, 2, 3, 4])
        assert e.value.code == grpc.StatusCode.NOT_FOUND
    assert all(is_poisoned(pool_c, p) for p in range(6))
    # Replica B drops the tenant: its store epoch is replaced, so B (whose
    # promoted copies the drop removed too) and a replica started afterwards
    # miss; A's own host tier is A's (a drop is per daemon there).
    with b.client() as cb:
        cb.drop(hb.pool_id, tenant, [], all_of_tenant=True)
        assert cb.lookup(hb.pool_id, tenant, hashes).hit_blocks == 0
    d = daemon_factory(*store_flags(store, f"file:{key}"))
    with d.client() as cd:
        hd = cd.register_pool("engine", FP, pool_c.geometry())
        assert cd.lookup(hd.pool_id, tenant, hashes).hit_blocks == 0


def test_spill_policy_spills_evicted_blocks_and_restores_them(
    tmp_path: Path, daemon_factory: Factory, pool_factory: Callable[..., SharedKVPool]
) -> None:
    """--store-policy spill: nothing goes to the store until the host tier
    evicts; an evicted block then restores from the store, byte for byte."""
    store, key = tmp_path / "store", key_file(tmp_path / "key")
    port = _free_port()
    d = daemon_factory(
        *store_flags(store, f"file:{key}", "--store-policy", "spill"),
        "--metrics-address", f"127.0.0.1:{port}",
        host_bytes="1MiB",
    )  # fmt: skip
    pool = pool_factory(num_pages=8)
    data = fill_random(pool)
    tenant = tenant_digest(None)
    per = pool.shape.tokens_per_page
    first = chain(8, per)
    with d.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        c.offload(h.pool_id, tenant, first, list(range(8)))
        assert objects(store) == []  # nothing evicted yet: nothing spilled
        # 1 MiB of 1 KiB blocks: 1,024 fit; 1,200 more evict the first ones.
        for _ in range(150):
            c.offload(h.pool_id, tenant, chain(8, per), list(range(8)))
        until(lambda: c.lookup(h.pool_id, tenant, first).hit_blocks == 8, "first chain spilled")
        poison(pool, list(range(8)))
        c.restore(h.pool_id, tenant, first, list(range(8)))
        for p in range(8):
            assert pool.read_block(p) == data[p]
    m = scrape(port)
    assert m["kvseal_store_spills_total"] >= 8
    assert m["kvseal_store_promoted_blocks_total"] == 8
    assert m["kvseal_store_integrity_failures_total"] == 0
    assert m["kvseal_store_bytes_capacity"] == 64 * 2**20


def test_default_daemon_has_no_store(
    daemon_factory: Factory, pool_factory: Callable[..., SharedKVPool]
) -> None:
    """No --store-dir: no store files, no store log line, no store metrics,
    and a restart serves nothing from before it (the behaviour before the
    store tier existed)."""
    port = _free_port()
    d = daemon_factory("--metrics-address", f"127.0.0.1:{port}")
    pool = pool_factory(num_pages=4)
    fill_random(pool)
    tenant = tenant_digest(None)
    hashes = chain(2, pool.shape.tokens_per_page)
    with d.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        c.offload(h.pool_id, tenant, hashes, [0, 1])
        assert c.lookup(h.pool_id, tenant, hashes).hit_blocks == 2
    assert not any(name.startswith("kvseal_store") for name in scrape(port))
    assert "store tier" not in d.log()
    assert not any(p.name == "kvseal-store" for p in d.workdir.rglob("*"))
    d.stop()
    e = daemon_factory()
    with e.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        assert c.lookup(h.pool_id, tenant, hashes).hit_blocks == 0


def _start_fails(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvseal.server", "--listen",
         f"unix://{tmp_path}/run/s.sock", "--backend", "cpu", "--host-bytes", "1MiB", *flags],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_bad_store_configuration_exits_2(tmp_path: Path) -> None:
    secret = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"
    loose = tmp_path / "loose-key"
    loose.write_text(secret)
    loose.chmod(0o644)
    store = tmp_path / "store"
    cases = [
        (store_flags(store, f"file:{tmp_path}/missing"), "--store-key"),
        (store_flags(store, f"file:{loose}"), "--store-key"),
        (store_flags(store, secret), "unknown store key source"),  # the key pasted as a source
        (store_flags(store, "local", "--store-policy", "sometimes"), "invalid choice"),
        (("--store-dir", str(store), "--store-bytes", "1MiB"), "--store-bytes"),
    ]
    for flags, said in cases:
        r = _start_fails(tmp_path, *flags)
        assert r.returncode == 2, (flags, r.stderr)
        assert said in r.stderr, (flags, r.stderr)
        assert secret not in r.stderr
    # A directory laid out with 4 shards, reopened with a capacity whose
    # shards cannot hold one record: a layout error, exit 2.
    key = key_file(tmp_path / "key")
    FsStore(
        StoreConfig(str(store), capacity_bytes=64 << 20, max_object_bytes=1 << 20),
        FileKeySource(str(key)).load(),
    ).close()
    assert "fanout=4" in (store / "kvseal-store").read_text()
    r = _start_fails(
        tmp_path, "--store-dir", str(store), "--store-bytes", "2MiB",
        "--store-max-block-bytes", "1MiB", "--store-key", f"file:{key}",
    )  # fmt: skip
    assert r.returncode == 2 and "--store-dir" in r.stderr, r.stderr
