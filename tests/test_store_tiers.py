"""What a daemon with a store tier tells its watchers and peers, against real
daemon processes, a real directory and a real client pool:

- events name their tier: the host tier's ``"cpu"``, the store's
  ``"storage"`` with the daemon's ``--store-locality``; a host eviction of a
  block the store holds is ``restorable``; a drop retracts both tiers; a
  restarted daemon announces the store blocks a Lookup finds;
- ``Stats`` carries the store's configuration (every scope) and counts (the
  operator's scope);
- registrations carrying a ``DeploymentIdentity`` are compared through the
  store, across replicas and restarts: a difference is a warning naming it.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from kvseal.client import KVSealClient, tenant_digest
from kvseal.client.shm import SharedKVPool
from kvseal.v1 import kvseal_pb2 as pb

from .conftest import DaemonProc, fill_random
from .store_helpers import FP, chain, key_file, store_and_stop, store_flags, wait_objects

Factory = Callable[..., DaemonProc]
# 128 KiB blocks (bfloat16): the smallest host tier (1 MiB) holds a few.
BIG = {"tokens_per_page": 16, "num_layers": 4, "num_kv_heads": 4, "head_dim": 128}
Event = tuple[str, int, int, tuple[bytes, ...], str, bool]  # medium, kind, reason, ...


@contextmanager
def _watching(
    c: KVSealClient, pool_id: str
) -> Iterator[Callable[[Callable[[list[Event]], bool]], list[Event]]]:
    """Collect the pool's events on a thread; ``take(done)`` waits until
    ``done(events)`` (a liveness bound of 20 s per event) and returns every
    one collected so far."""
    got: queue.Queue[Event] = queue.Queue()
    # The raw call (as the vLLM mirror makes it): cancellable from this thread.
    stream = c._stub.WatchEvents(pb.WatchEventsRequest(pool_id=pool_id))
    stream.initial_metadata()  # subscribed: nothing published from now on is missed

    def run() -> None:
        try:
            for ev in stream:
                got.put(
                    (ev.medium, ev.kind, ev.reason, tuple(ev.block_hashes), ev.locality,
                     ev.restorable)
                )  # fmt: skip
        except grpc.RpcError:
            pass  # cancelled

    t = threading.Thread(target=run, daemon=True)
    t.start()
    seen: list[Event] = []

    def take(done: Callable[[list[Event]], bool]) -> list[Event]:
        while not done(seen):
            try:
                seen.append(got.get(timeout=20))
            except queue.Empty:
                break
        return list(seen)

    try:
        yield take
    finally:
        stream.cancel()
        t.join(5)


def _blocks(events: list[Event], medium: str, kind: int, **match: object) -> set[bytes]:
    keys = ("reason", "locality", "restorable")
    out: set[bytes] = set()
    for ev in events:
        fields = dict(zip(keys, (ev[2], ev[4], ev[5]), strict=True))
        if ev[0] == medium and ev[1] == kind and all(fields[k] == v for k, v in match.items()):
            out.update(ev[3])
    return out


def test_events_name_their_tier_and_a_host_eviction_stays_restorable(
    tmp_path: Path, daemon_factory: Factory, pool_factory: Callable[..., SharedKVPool]
) -> None:
    store, key = tmp_path / "store", key_file(tmp_path / "key")
    flags = store_flags(store, f"file:{key}", "--store-locality", "remote")
    pool = pool_factory(num_pages=16, geometry=BIG)
    fill_random(pool)
    tenant = tenant_digest("user-a")
    per = pool.shape.tokens_per_page
    first, more = chain(4, per, b"a"), chain(12, per, b"b")
    d = daemon_factory(*flags, host_bytes="1MiB")  # 128 KiB blocks: 7 or 8 fit
    with d.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        c.lookup(h.pool_id, tenant, first[:1])  # names the tenant for the watcher
        with _watching(c, h.pool_id) as take:
            assert c.offload(h.pool_id, tenant, first, [0, 1, 2, 3]).stored_blocks == 4
            wait_objects(store, 4)
            ev = take(lambda e: len(_blocks(e, "storage", pb.BLOCK_STORED)) == 4)
            assert _blocks(ev, "cpu", pb.BLOCK_STORED, locality="") == set(first)
            stored = _blocks(ev, "storage", pb.BLOCK_STORED, locality="remote")
            assert stored == set(first)  # announced once spilled, with the locality
            # Offloads that evict the first chain from the host tier: each
            # eviction is a "cpu" removal the store still backs.
            for i in range(0, 12, 4):  # each spilled before the next evicts it
                c.offload(h.pool_id, tenant, more[i : i + 4], [4 + i, 5 + i, 6 + i, 7 + i])
                wait_objects(store, 8 + i)
            ev = take(lambda e: set(first) <= _blocks(e, "cpu", pb.BLOCK_REMOVED))
            evicted = _blocks(ev, "cpu", pb.BLOCK_REMOVED, reason=pb.REMOVED_EVICTED)
            assert set(first) <= evicted | _blocks(ev, "cpu", pb.BLOCK_REMOVED)
            restorable = _blocks(ev, "cpu", pb.BLOCK_REMOVED, restorable=True)
            assert set(first) <= restorable
            assert c.lookup(h.pool_id, tenant, first).hit_blocks == 4  # from the store
            # A drop takes both tiers' copies: neither removal is restorable.
            n = len(ev)
            c.drop(h.pool_id, tenant, more[-1:])
            ev = take(lambda e: more[-1] in _blocks(e[n:], "storage", pb.BLOCK_REMOVED))[n:]
            assert _blocks(ev, "storage", pb.BLOCK_REMOVED, reason=pb.REMOVED_DROPPED) == {more[-1]}
            dropped = pb.REMOVED_DROPPED
            assert not _blocks(ev, "storage", pb.BLOCK_REMOVED, restorable=True)
            assert more[-1] in _blocks(ev, "cpu", pb.BLOCK_REMOVED, reason=dropped)
            assert not _blocks(ev, "cpu", pb.BLOCK_REMOVED, reason=dropped, restorable=True)


def test_restarted_daemon_announces_the_store_blocks_a_lookup_finds(
    tmp_path: Path, daemon_factory: Factory, pool_factory: Callable[..., SharedKVPool]
) -> None:
    store, key = tmp_path / "store", key_file(tmp_path / "key")
    flags = store_flags(store, f"file:{key}")
    pool = pool_factory(num_pages=8)
    fill_random(pool)
    tenant = tenant_digest("user-a")
    hashes = chain(3, pool.shape.tokens_per_page, b"user-a")
    store_and_stop(daemon_factory, flags, pool.geometry(), tenant, hashes, store)
    b = daemon_factory(*flags)
    with b.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        c.touch(h.pool_id, tenant, [bytes(32)])  # names the tenant, changes nothing
        with _watching(c, h.pool_id) as take:
            assert c.lookup(h.pool_id, tenant, hashes).hit_blocks == 3
            ev = take(lambda e: len(e) >= 1)
            assert _blocks(ev, "storage", pb.BLOCK_STORED, locality="local") == set(hashes)
            assert c.lookup(h.pool_id, tenant, hashes).hit_blocks == 3  # announced once
            c.restore(h.pool_id, tenant, hashes, [5, 6, 7])  # promoted: a "cpu" store
            ev = take(lambda e: len(e) >= 2)
            assert _blocks(ev, "cpu", pb.BLOCK_STORED) == set(hashes)
            assert sum(1 for e in ev if e[0] == "storage") == 1


def test_stats_carry_the_store(
    tmp_path: Path, daemon_factory: Factory, pool_factory: Callable[..., SharedKVPool]
) -> None:
    store, key = tmp_path / "store", key_file(tmp_path / "key")
    flags = store_flags(store, f"file:{key}", "--store-policy", "write-through")
    d = daemon_factory(*flags, "--operator-uid", str(os.getuid()))
    plain = daemon_factory()
    pool = pool_factory(num_pages=4)
    fill_random(pool)
    tenant = tenant_digest(None)
    hashes = chain(2, pool.shape.tokens_per_page)
    with d.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        c.offload(h.pool_id, tenant, hashes, [0, 1])
        wait_objects(store, 2)
        mine = c.stats(h.pool_id)  # a pool's scope: the configuration, no store counts
        assert (mine.store_policy, mine.store_locality) == ("write-through", "local")
        assert mine.store_bytes_capacity == 64 * 1024**2 and mine.store_spilled_blocks == 0
        st = c.stats()  # the operator's scope
        assert st.scope == pb.STATS_SCOPE_DAEMON
        assert st.store_spilled_blocks == 2
        assert st.store_integrity_failures == 0 and st.store_restored_blocks == 0
    with plain.client() as c:
        assert c.stats().store_policy == ""  # no store tier


def _identity(**kw: object) -> pb.DeploymentIdentity:
    base: dict[str, object] = {
        "label": "tiny-llama/tp0of1",
        "hash_algorithm": "sha256_cbor",
        "hash_seed_check": b"\x01" * 16,
        "tenant_key_check": b"\x02" * 16,
    }
    return pb.DeploymentIdentity(**{**base, **kw})  # type: ignore[arg-type]


def test_replicas_that_disagree_are_told_why(
    tmp_path: Path, daemon_factory: Factory, pool_factory: Callable[..., SharedKVPool]
) -> None:
    """The first registration of a label is the reference, kept (sealed) in the
    store: a second replica on the same directory and key that differs gets a
    warning per difference, one that agrees gets none, and so does a restart.
    A random per-process seed is a warning even with nothing to compare."""
    store, key = tmp_path / "store", key_file(tmp_path / "key")
    flags = store_flags(store, f"file:{key}")
    pool = pool_factory(num_pages=2)
    a, b = daemon_factory(*flags), daemon_factory(*flags)
    geo = pool.geometry()
    with a.client() as ca, b.client() as cb:
        assert ca.register_pool("e", FP, geo, identity=_identity()).warnings == ()
        assert cb.register_pool("e", FP, geo, identity=_identity()).warnings == ()
        w = cb.register_pool("e2", FP, geo, identity=_identity(hash_seed_check=b"")).warnings
        assert len(w) == 1 and "prefix-hash seed" in w[0] and "tiny-llama/tp0of1" in w[0]
        w = cb.register_pool("e3", b"other-model", geo, identity=_identity()).warnings
        assert len(w) == 1 and "model fingerprint" in w[0]
        w = ca.register_pool("e4", FP, geo, identity=_identity(tenant_key_check=b"")).warnings
        assert len(w) == 1 and "tenant-digest key" in w[0]
        random_seed = _identity(label="x/tp0of1", hash_seed_random=True)
        w = ca.register_pool("e5", FP, geo, identity=random_seed).warnings
        assert any("random per-process seed" in x for x in w)
        # Another label is another deployment: nothing to compare with.
        w = ca.register_pool("e6", b"other", geo, identity=_identity(label="y/tp0of1")).warnings
        assert w == ()
        assert ca.register_pool("e7", FP, geo).warnings == ()  # no identity: no check
    assert "prefix-hash seed" in b.log() and "tiny-llama" in b.log()
    assert a.stop() == 0 and b.stop() == 0
    # A restart under the same key reads the same reference.
    r = daemon_factory(*flags)
    with r.client() as c:
        w = c.register_pool("e", FP, geo, identity=_identity(hash_algorithm="xxhash")).warnings
        assert len(w) == 1 and "prefix-hash algorithm" in w[0]
    # Under another key the reference is unreadable: this daemon's own becomes one.
    o = daemon_factory(*store_flags(store, f"file:{key_file(tmp_path / 'k2')}"))
    with o.client() as c:
        assert c.register_pool("e", FP, geo, identity=_identity(hash_seed_check=b"")).warnings == ()


def test_identities_agree_exactly_when_the_facts_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engines' side: the vLLM adapter's identity follows vLLM's seed rule
    (PYTHONHASHSEED, else a fixed default for sha256, a random seed for
    xxhash), the SGLang linker's has no seed, and neither carries the seed or
    the tenant key, only digests that differ when they do."""
    from kvseal.sglang.keys import Tenants
    from kvseal.vllm.keys import deployment_identity

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    a = deployment_identity("m/tp0of1", "sha256", None)
    assert a == deployment_identity("m/tp0of1", "sha256", None)
    assert len(a.hash_seed_check) == 16 and not a.hash_seed_random and not a.tenant_key_check
    monkeypatch.setenv("PYTHONHASHSEED", "4242")
    b = deployment_identity("m/tp0of1", "sha256", None)
    assert b.hash_seed_check != a.hash_seed_check
    assert b"4242" not in b.SerializeToString()
    monkeypatch.delenv("PYTHONHASHSEED")
    x = deployment_identity("m/tp0of1", "xxhash", None)
    assert x.hash_seed_random and not x.hash_seed_check
    key, other = os.urandom(32), os.urandom(32)
    k1 = deployment_identity("m/tp0of1", "sha256", key)
    assert k1.tenant_key_check == deployment_identity("m/tp0of1", "sha256", key).tenant_key_check
    assert k1.tenant_key_check != deployment_identity("m/tp0of1", "sha256", other).tenant_key_check
    assert key[:8] not in k1.SerializeToString()
    s1 = Tenants(key, from_env=False).identity("m/tp0of1")
    assert s1 == Tenants(key, from_env=False).identity("m/tp0of1")
    assert s1.hash_algorithm != a.hash_algorithm and not s1.hash_seed_random
    assert s1.tenant_key_check == k1.tenant_key_check
