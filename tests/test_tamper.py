"""Playing the host: the daemon's ciphertext region is a file the test owns
(``--host-region``), so the test can do what a hypervisor can do to shared
memory: read it, flip bits, swap or replay slots, zero or truncate them.

Every attack must be rejected under both integrity policies; the engine's
destination pages keep their poison pattern (nothing written); ``abort``
ends the daemon with exit status 3 and the engine side degrades to
recompute; ``drop`` fails the request with DATA_LOSS, evicts the blocks and
keeps serving.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from kvseal.client import EnginePool, KVSealRpcError, chain_block_hashes, tenant_digest
from kvseal.client.shm import SharedKVPool
from kvseal.v1 import kvseal_pb2 as pb

from .conftest import DaemonProc, fill_random, is_poisoned, poison

FP = b"model:test"
EXIT_INTEGRITY = 3


class HostView:
    """The hypervisor's view of the region file: watch writes, edit bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.snap = path.read_bytes()

    def changed_extent(self) -> tuple[int, int]:
        """(offset, length) of the bytes that changed since the last call."""
        now = self.path.read_bytes()
        diff = [i for i in range(0, len(now), 64) if now[i : i + 64] != self.snap[i : i + 64]]
        self.snap = now
        assert diff, "nothing was written to the host region"
        start, end = diff[0], diff[-1] + 64
        return start, end - start

    def read(self, off: int, n: int) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(off)
            return f.read(n)

    def write(self, off: int, data: bytes) -> None:
        with open(self.path, "r+b") as f:
            f.seek(off)
            f.write(data)

    def truncate(self, size: int) -> None:
        os.truncate(self.path, size)


@dataclass
class Setup:
    d: DaemonProc
    pool: SharedKVPool
    pool_id: str
    tenant: bytes
    chain: list[bytes]
    data: dict[int, bytes]
    host: HostView
    slots: list[tuple[int, int]]  # one (offset, length) per chain block


def _setup(
    daemon_factory: Callable[..., DaemonProc],
    pool_factory: Callable[..., SharedKVPool],
    policy: str,
) -> Setup:
    d = daemon_factory("--on-integrity-failure", policy, region=True, host_bytes="4MiB")
    pool = pool_factory(num_pages=4)
    data = fill_random(pool)
    tenant = tenant_digest("victim")
    chain = chain_block_hashes(
        list(os.urandom(2 * pool.shape.tokens_per_page)),
        pool.shape.tokens_per_page,
        cache_salt="victim",
    )
    assert d.region is not None
    host = HostView(d.region)
    with d.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        slots = []
        for i, bh in enumerate(chain):
            c.offload(h.pool_id, tenant, [bh], [i], parent_hash=chain[i - 1] if i else None)
            off, n = host.changed_extent()
            assert n >= pool.shape.block_bytes  # whole ciphertext, nothing else
            slots.append((off, pool.shape.block_bytes))
    # Ciphertext only: no plaintext of the block appears in host memory.
    region = d.region.read_bytes()
    for i in range(2):
        assert data[i][:64] not in region
    return Setup(d, pool, h.pool_id, tenant, chain, data, host, slots)


def _flip_bit(s: Setup) -> None:
    off, n = s.slots[1]
    pos = off + n // 3
    s.host.write(pos, bytes([s.host.read(pos, 1)[0] ^ 0x10]))


def _swap(s: Setup) -> None:
    (a, n), (b, _) = s.slots
    ca, cb = s.host.read(a, n), s.host.read(b, n)
    s.host.write(a, cb)
    s.host.write(b, ca)


def _zero(s: Setup) -> None:
    off, n = s.slots[1]
    s.host.write(off, bytes(n))


def _zero_tail(s: Setup) -> None:
    off, n = s.slots[1]
    s.host.write(off + n - 16, bytes(16))


def _truncate(s: Setup) -> None:
    off, n = s.slots[1]
    s.host.truncate(off + n // 2)


def _replay(s: Setup) -> None:
    """Rewrite block 1 (new data, new generation), then put back the
    ciphertext the host recorded from the old version."""
    off, n = s.slots[1]
    old = s.host.read(off, n)
    with s.d.client() as c:
        c.drop(s.pool_id, s.tenant, [s.chain[1]])
        s.pool.write_block(1, os.urandom(s.pool.shape.block_bytes))
        c.offload(s.pool_id, s.tenant, [s.chain[1]], [1], parent_hash=s.chain[0])
        new_off, _ = s.host.changed_extent()
    s.slots[1] = (new_off, n)
    s.host.write(new_off, old)


ATTACKS = {
    "flip_bit": _flip_bit,
    "swap_slots": _swap,
    "zero_slot": _zero,
    "zero_tail": _zero_tail,
    "truncate": _truncate,
    "replay_old_generation": _replay,
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_attack_rejected_drop_policy(
    daemon_factory: Callable[..., DaemonProc],
    pool_factory: Callable[..., SharedKVPool],
    attack: str,
) -> None:
    s = _setup(daemon_factory, pool_factory, "drop")
    ATTACKS[attack](s)
    poison(s.pool, [2, 3])
    with s.d.client() as c:
        with pytest.raises(KVSealRpcError) as e:
            c.restore(s.pool_id, s.tenant, s.chain, [2, 3])
        assert e.value.code == grpc.StatusCode.DATA_LOSS
        assert e.value.reason == "INTEGRITY_FAILURE"
        # All-or-nothing: the block that did verify was not written either.
        assert is_poisoned(s.pool, 2) and is_poisoned(s.pool, 3)
        assert c.health() == "SERVING"
        st = c.stats()
        assert st.integrity_failures >= 1
        states = c.lookup(s.pool_id, s.tenant, s.chain).states
        assert states[1] == pb.BLOCK_ABSENT  # evicted, never served again
        if attack not in ("swap_slots", "truncate"):
            # Block 0 was untouched: it is still cached and restores intact.
            assert states[0] == pb.BLOCK_READY
            c.restore(s.pool_id, s.tenant, s.chain[:1], [2])
            assert s.pool.read_block(2) == s.data[0]
    assert s.d.proc.poll() is None


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_attack_rejected_abort_policy(
    daemon_factory: Callable[..., DaemonProc],
    pool_factory: Callable[..., SharedKVPool],
    attack: str,
) -> None:
    s = _setup(daemon_factory, pool_factory, "abort")
    ATTACKS[attack](s)
    poison(s.pool, [2, 3])
    with s.d.client() as c:
        engine = EnginePool(c, "engine", FP, s.pool.geometry())
        assert engine.wait_ready(10) is not None  # registration runs in the background
        # The engine's hot-path wrapper degrades: no exception, "recompute".
        assert engine.restore(s.tenant, s.chain, [2, 3]) is False
        assert is_poisoned(s.pool, 2) and is_poisoned(s.pool, 3)
        assert s.d.wait_exit() == EXIT_INTEGRITY
        assert "INTEGRITY FAILURE" in s.d.log()
        # Daemon gone: lookups are misses, offloads are dropped, nothing raises.
        assert engine.lookup(s.tenant, s.chain) == 0
        assert engine.offload(s.tenant, s.chain, [0, 1]) is False


@pytest.mark.parametrize("policy", ["drop", "abort"])
@pytest.mark.parametrize("move", ["tenant", "model"])
def test_block_moved_to_other_tenant_or_model(
    daemon_factory: Callable[..., DaemonProc],
    pool_factory: Callable[..., SharedKVPool],
    policy: str,
    move: str,
) -> None:
    """Victim and attacker-controlled entry share a block hash; the host
    copies the victim's ciphertext into the other entry's slot. The other
    tenant/model never gets the victim's data."""
    s = _setup(daemon_factory, pool_factory, policy)
    other_tenant = tenant_digest("attacker") if move == "tenant" else s.tenant
    with s.d.client() as c:
        pool_id = s.pool_id
        if move == "model":
            pool_id = c.register_pool("other-model", b"model:other", s.pool.geometry()).pool_id
        # Nothing leaks through the index: the victim's block is not visible.
        assert c.lookup(pool_id, other_tenant, s.chain).hit_blocks == 0
        c.offload(pool_id, other_tenant, s.chain[:1], [3])
        target, n = s.host.changed_extent()
        s.host.write(target, s.host.read(s.slots[0][0], n))
        poison(s.pool, [2])
        with pytest.raises(KVSealRpcError) as e:
            c.restore(pool_id, other_tenant, s.chain[:1], [2])
        assert e.value.code == grpc.StatusCode.DATA_LOSS
        assert is_poisoned(s.pool, 2)
    if policy == "abort":
        assert s.d.wait_exit() == EXIT_INTEGRITY
    else:
        assert s.d.proc.poll() is None
