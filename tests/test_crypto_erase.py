"""Per-tenant keys and crypto-erase: ``Drop(all_of_tenant)`` destroys the key
scope (pool namespace, tenant), so none of that tenant's ciphertext can be
opened again, even if the host puts it back and (in process) its index entries
are restored too, while other tenants keep their keys and blocks.

In process: a real ``SealedCache`` over a real ``CpuBackend`` and a
file-backed ``HostRegion`` (the test plays the host and, to model a stolen
index, reaches into the trusted index). End to end: a real daemon with a
``--host-region`` file.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kvseal.client import KVSealRpcError, chain_block_hashes, tenant_digest
from kvseal.client.shm import KVShape, SharedKVPool
from kvseal.server import convert
from kvseal.server.backends.cpu.backend import CpuBackend
from kvseal.server.cache import SealedCache
from kvseal.server.config import IntegrityPolicy, ServerConfig
from kvseal.server.deadline import Deadline
from kvseal.server.errors import BlockNotPresent, IntegrityFailure
from kvseal.server.hostregion import Extent, HostRegion
from kvseal.server.index import Entry, State
from kvseal.server.sealing import BlockSealer, KeyDestroyed, SealRecord
from kvseal.v1 import kvseal_pb2 as pb

from .conftest import SMALL, DaemonProc, fill_random, is_poisoned, poison
from .test_tamper import HostView

FP = b"model:erase"
TPP = SMALL["tokens_per_page"]


def _chain(n: int, salt: str) -> list[bytes]:
    return chain_block_hashes(list(os.urandom(n * TPP)), TPP, cache_salt=salt)


class Rig:
    """A SealedCache over a real CpuBackend, a file-backed HostRegion and a real
    shared-memory pool of 8 pages; one registered pool (``ns``)."""

    def __init__(self, tmp: Path, policy: IntegrityPolicy = IntegrityPolicy.DROP) -> None:
        cfg = ServerConfig(
            listen="unix://" + str(tmp / "unused.sock"),
            backend="cpu",
            host_bytes=1 << 20,
            integrity_policy=policy,
            workers=1,
        )
        self.sealer = BlockSealer()
        self.backend = CpuBackend(self.sealer, 1)
        self.region_path = tmp / "region.bin"
        self.region = HostRegion(1 << 20, str(self.region_path))
        self.cache = SealedCache(cfg, self.backend, self.region, self.sealer)
        self.pool = SharedKVPool(KVShape(8, **SMALL), "vllm_per_layer", name_prefix="kvseal-ce")
        self.data = fill_random(self.pool)
        req = pb.RegisterPoolRequest(
            name="engine", model_fingerprint=FP, geometry=self.pool.geometry()
        )
        reg = self.cache.register_pool(convert.pool_spec(req, "cpu"))
        self.pool_id, self.ns = reg.pool_id, reg.namespace

    def entries(self, tenant: bytes, hashes: list[bytes]) -> list[Entry]:
        return [self.cache.index._map[(self.ns, tenant, h)] for h in hashes]

    def read_region(self, extent: Extent) -> bytes:
        with open(self.region_path, "rb") as f:
            f.seek(extent.offset)
            return f.read(extent.size)

    def write_region(self, offset: int, data: bytes) -> None:
        with open(self.region_path, "r+b") as f:
            f.seek(offset)
            f.write(data)

    def close(self) -> None:
        self.cache.close()
        self.pool.close()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(tmp_path)
    yield r
    r.close()


Saved = tuple[tuple[bytes, bytes, bytes], Extent, int, int, SealRecord]


def _steal(r: Rig, tenant: bytes, hashes: list[bytes]) -> tuple[list[Saved], list[bytes]]:
    """What an attacker who kept the index entries and the region bytes holds."""
    saved: list[Saved] = []
    cts: list[bytes] = []
    for e in r.entries(tenant, hashes):
        assert e.record is not None
        extent = Extent(e.extent.offset, e.size)
        saved.append((e.key, extent, e.size, e.generation, e.record))
        cts.append(r.read_region(extent))
    return saved, cts


def _put_back(r: Rig, saved: list[Saved], cts: list[bytes], epoch: int | None = None) -> None:
    """Write the old ciphertext back at its offsets and re-insert its index
    entries (READY, same nonce/tag/generation; optionally naming ``epoch``)."""
    index = r.cache.index
    for (key, extent, size, gen, rec), ct in zip(saved, cts, strict=True):
        r.write_region(extent.offset, ct)
        if epoch is not None:
            rec = SealRecord(epoch, rec.nonce, rec.tag)  # noqa: PLW2901
        with index._lock:
            old = index._map.get(key)
            if old is not None:  # put back earlier: only the record changes
                old.record = rec
                continue
            index._alloc.reserve(Extent(extent.offset, size))
            e = Entry(key, Extent(extent.offset, size), size, gen, State.READY, rec)
            index._clock += 1
            e.last_use = index._clock
            index._insert(e)
            index._show(e)
            index._consider(e)


def test_drop_all_of_tenant_erases_its_keys_and_spares_other_tenants(rig: Rig) -> None:
    a, b = tenant_digest("tenant-a"), tenant_digest("tenant-b")
    ha, hb = _chain(3, "tenant-a"), _chain(3, "tenant-b")
    rig.cache.offload(rig.pool_id, a, None, ha, [0, 1, 2])
    rig.cache.offload(rig.pool_id, b, None, hb, [3, 4, 5])
    saved, cts = _steal(rig, a, ha)
    epochs_a = rig.sealer.scope_epoch_ids(rig.ns, a)
    epochs_b = rig.sealer.scope_epoch_ids(rig.ns, b)
    assert epochs_a and epochs_b and not epochs_a & epochs_b  # a key scope each
    live = [rig.sealer._epochs[e] for e in epochs_a]
    addrs = [e.slot_address for e in live]
    aeads = [e.aead for e in live]
    refs = [sys.getrefcount(x) for x in aeads]
    assert all(ctypes.string_at(x, 32) != bytes(32) for x in addrs)

    assert rig.cache.drop(rig.pool_id, a, [], all_of_tenant=True) == 3

    # The key bytes are wiped in the arena and the ciphers are no longer held
    # (AESGCM takes no weak references; the reference count shows the sealer let go).
    assert all(ctypes.string_at(x, 32) == bytes(32) for x in addrs), "key bytes survive"
    assert [sys.getrefcount(x) for x in aeads] == [n - 1 for n in refs]
    del aeads
    assert all(e.destroyed and e.aead is None for e in live)
    assert rig.sealer.scope_epoch_ids(rig.ns, a) == frozenset()
    assert rig.sealer.scope_epoch_ids(rig.ns, b) == epochs_b
    assert rig.cache.counters.key_scopes_destroyed == 1

    # The host puts A's ciphertext back, and its index entries are put back too:
    # nothing of it opens, together or block by block, and no page is written.
    _put_back(rig, saved, cts)
    poison(rig.pool, [0, 1, 2])
    with pytest.raises(KeyDestroyed) as e:
        rig.cache.restore(rig.pool_id, a, ha, [0, 1, 2], release=False)
    assert e.value.code == grpc.StatusCode.NOT_FOUND
    for i, h in enumerate(ha):
        with pytest.raises(KeyDestroyed):
            rig.cache.restore(rig.pool_id, a, [h], [i], release=False)
    assert all(is_poisoned(rig.pool, p) for p in (0, 1, 2))
    assert rig.cache.counters.integrity_failures == 0  # nobody tampered
    assert rig.cache.counters.restores_of_dropped == 4

    # Not under A's new key either: A stores again (a fresh random key), and the old
    # entries are made to name that key's epoch: every block fails authentication.
    ha2 = _chain(1, "tenant-a")
    rig.cache.offload(rig.pool_id, a, None, ha2, [6])
    (new_epoch,) = rig.sealer.scope_epoch_ids(rig.ns, a)
    assert new_epoch not in epochs_a
    _put_back(rig, saved, cts, epoch=new_epoch)
    with pytest.raises(IntegrityFailure):
        rig.cache.restore(rig.pool_id, a, ha, [0, 1, 2], release=False)
    assert rig.cache.counters.integrity_failures == 3
    assert all(is_poisoned(rig.pool, p) for p in (0, 1, 2))

    # B was never touched: its blocks restore byte-exact.
    poison(rig.pool, [3, 4, 5])
    rig.cache.restore(rig.pool_id, b, hb, [3, 4, 5], release=False)
    assert [rig.pool.read_block(p) for p in (3, 4, 5)] == [rig.data[p] for p in (3, 4, 5)]


def test_drop_is_scoped_to_the_pool_namespace(tmp_path: Path, rig: Rig) -> None:
    """The same tenant in another model's pool (another namespace) keeps its key."""
    other = SharedKVPool(KVShape(4, **SMALL), "vllm_per_layer", name_prefix="kvseal-ce2")
    try:
        data = fill_random(other)
        req = pb.RegisterPoolRequest(
            name="other", model_fingerprint=b"model:other", geometry=other.geometry()
        )
        reg = rig.cache.register_pool(convert.pool_spec(req, "cpu"))
        assert reg.namespace != rig.ns
        t = tenant_digest("shared-tenant")
        h1, h2 = _chain(2, "shared-tenant"), _chain(2, "shared-tenant")
        rig.cache.offload(rig.pool_id, t, None, h1, [0, 1])
        rig.cache.offload(reg.pool_id, t, None, h2, [0, 1])
        kept = rig.sealer.scope_epoch_ids(reg.namespace, t)
        assert rig.cache.drop(rig.pool_id, t, [], all_of_tenant=True) == 2
        assert rig.sealer.scope_epoch_ids(rig.ns, t) == frozenset()
        assert rig.sealer.scope_epoch_ids(reg.namespace, t) == kept
        poison(other, [2, 3])
        rig.cache.restore(reg.pool_id, t, h2, [2, 3], release=False)
        assert other.read_block(2) == data[0] and other.read_block(3) == data[1]
    finally:
        rig.cache.unregister_pool(reg.pool_id)
        other.close()


class _DropDuring(Deadline):
    """A deadline without a cutoff that runs ``hook`` (once) when the backend
    checks it before ``when``: the drop then races the restore at that point."""

    def __init__(self, when: str, hook: Callable[[], Any]) -> None:
        super().__init__()
        self._when, self._hook, self.fired = when, hook, False

    def check(self, what: str = "the next page") -> None:
        if not self.fired and what == self._when:
            self.fired = True
            t = threading.Thread(target=self._hook)  # another request thread
            t.start()
            t.join()
        super().check(what)


@pytest.mark.parametrize(
    "when",
    ["verification", "the first destination page"],
    ids=["before-open", "after-verify-before-scatter"],
)
def test_drop_racing_a_pinned_restore_fails_it_cleanly(rig: Rig, when: str) -> None:
    """Drop(all_of_tenant) while a restore of that tenant has its blocks pinned:
    the keys go at once; the restore fails with KeyDestroyed (NOT_FOUND, not an
    integrity failure), writes no page, and the cache stays consistent."""
    a, b = tenant_digest("tenant-a"), tenant_digest("tenant-b")
    ha, hb = _chain(3, "tenant-a"), _chain(1, "tenant-b")
    rig.cache.offload(rig.pool_id, a, None, ha, [0, 1, 2])
    rig.cache.offload(rig.pool_id, b, None, hb, [3])
    dropped: list[int] = []

    def drop() -> None:
        assert rig.cache.index.stats().pinned == 3  # the restore holds its pins
        dropped.append(rig.cache.drop(rig.pool_id, a, [], all_of_tenant=True))

    deadline = _DropDuring(when, drop)
    poison(rig.pool, [4, 5, 6])
    with pytest.raises(KeyDestroyed):
        rig.cache.restore(rig.pool_id, a, ha, [4, 5, 6], release=False, deadline=deadline)
    assert deadline.fired and dropped == [3]
    assert all(is_poisoned(rig.pool, p) for p in (4, 5, 6)), "a dropped tenant was served"
    assert rig.cache.counters.integrity_failures == 0
    assert rig.cache.counters.restores_of_dropped == 1
    assert rig.cache.serving
    stats = rig.cache.index.stats()
    assert stats.pinned == 0 and stats.ready == 1  # only B's block is left
    rig.cache.index.check_invariants()
    with pytest.raises(BlockNotPresent):
        rig.cache.restore(rig.pool_id, a, ha, [4, 5, 6], release=False)
    # A can store again (fresh key); B restores byte-exact.
    rig.cache.offload(rig.pool_id, a, None, ha, [0, 1, 2])
    rig.cache.restore(rig.pool_id, a, ha, [4, 5, 6], release=False)
    assert [rig.pool.read_block(p) for p in (4, 5, 6)] == [rig.data[p] for p in (0, 1, 2)]
    rig.cache.restore(rig.pool_id, b, hb, [7], release=False)
    assert rig.pool.read_block(7) == rig.data[3]


def test_drop_of_a_tenant_in_a_real_daemon_erases_it_for_good(
    daemon_factory: Callable[..., DaemonProc], pool_factory: Callable[..., SharedKVPool]
) -> None:
    """The host keeps A's ciphertext, A is dropped, the host writes it back into
    the region file at the same offsets: it is never served, before or after A
    stores new blocks there under its new key; B keeps restoring."""
    d = daemon_factory("--on-integrity-failure", "drop", region=True, host_bytes="4MiB")
    pool = pool_factory(num_pages=8)
    data = fill_random(pool)
    a, b = tenant_digest("tenant-a"), tenant_digest("tenant-b")
    ha, hb = _chain(2, "tenant-a"), _chain(2, "tenant-b")
    assert d.region is not None
    host = HostView(d.region)
    with d.client() as c:
        pid = c.register_pool("engine", FP, pool.geometry()).pool_id
        slots = []
        for i, h in enumerate(ha):
            c.offload(pid, a, [h], [i], parent_hash=ha[i - 1] if i else None)
            off, _ = host.changed_extent()
            slots.append(off)
        c.offload(pid, b, hb, [2, 3])
        n = pool.shape.block_bytes
        stolen = [host.read(off, n) for off in slots]

        assert c.drop(pid, a, all_of_tenant=True) == 2
        for off, ct in zip(slots, stolen, strict=True):
            host.write(off, ct)
        poison(pool, [4, 5])
        with pytest.raises(KVSealRpcError) as e:
            c.restore(pid, a, ha, [4, 5])
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        assert is_poisoned(pool, 4) and is_poisoned(pool, 5)

        # A stores the same hashes again with new contents (a fresh key); the new
        # ciphertext lands in the freed slots. The host swaps the old bytes back in.
        fill_random(pool, [0, 1])
        c.offload(pid, a, ha, [0, 1])
        now = d.region.read_bytes()
        landed = [i for i, off in enumerate(slots) if now[off : off + n] != stolen[i]]
        assert landed, "the new blocks should reuse the freed slots"
        for off, ct in zip(slots, stolen, strict=True):
            host.write(off, ct)
        with pytest.raises(KVSealRpcError) as e:
            c.restore(pid, a, ha, [4, 5])
        assert e.value.code in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.NOT_FOUND)
        assert is_poisoned(pool, 4) and is_poisoned(pool, 5), "old ciphertext was served"

        poison(pool, [6, 7])
        c.restore(pid, b, hb, [6, 7])
        assert pool.read_block(6) == data[2] and pool.read_block(7) == data[3]
        assert c.health() == "SERVING"
    assert d.proc.poll() is None
