"""``Stats`` is scoped to the caller (proto ``StatsRequest``): an engine sees its
own pool's requests and its own tenants' blocks, an operator (``--operator-uid``)
the whole daemon, anyone else only the daemon's configuration. Real daemons,
two engines of different tenants sharing one namespace."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from kvseal.client import ClientConfig, KVSealClient, KVSealRpcError, chain_block_hashes
from kvseal.client import tenant_digest as digest
from kvseal.client.shm import SharedKVPool
from kvseal.v1 import kvseal_pb2 as pb

from .conftest import DaemonProc, fill_random, start_daemon

FP = b"model:stats-scope"
# No operator: the default a deployment gets (tests/__init__.py sets one for the rest).
NO_OPERATOR = {"KVSEAL_OPERATOR_UIDS": ""}
COUNTS = (
    "lookups",
    "lookup_hit_blocks",
    "offloaded_blocks",
    "offloaded_bytes",
    "restored_blocks",
    "restored_bytes",
    "evicted_blocks",
    "dropped_blocks",
    "integrity_failures",
    "blocks_ready",
    "blocks_pending",
    "blocks_pinned",
    "host_bytes_used",
    "pools",
    "pool_holds",
    "key_epoch",
    "seals_under_current_key",
)


def _counts(s: pb.StatsReply) -> dict[str, int]:
    return {k: getattr(s, k) for k in COUNTS}


def _engine_work(
    c: KVSealClient, pool_id: str, pool: SharedKVPool, salt: str, blocks: int
) -> list[bytes]:
    """Offload ``blocks`` blocks of ``salt``'s tenant, look them up, restore them."""
    tenant = digest(salt)
    fill_random(pool)
    hashes = chain_block_hashes(list(range(blocks * 16)), 16, cache_salt=salt)
    c.offload(pool_id, tenant, hashes, list(range(blocks)))
    assert c.lookup(pool_id, tenant, hashes).hit_blocks == blocks
    c.restore(pool_id, tenant, hashes, list(range(blocks)))
    return hashes


def test_each_engine_sees_its_own_pool_and_nobody_the_daemon(
    daemon_factory: Callable[..., DaemonProc], pool_factory: Callable[..., SharedKVPool]
) -> None:
    d = daemon_factory(env=NO_OPERATOR)
    pa, pb_ = pool_factory(num_pages=4), pool_factory(num_pages=4)
    with (
        KVSealClient(ClientConfig(target=d.target, timeout_s=10)) as a,
        KVSealClient(ClientConfig(target=d.target, timeout_s=10)) as b,
    ):
        ida = a.register_pool("engine-a", FP, pa.geometry()).pool_id
        idb = b.register_pool("engine-b", FP, pb_.geometry()).pool_id  # same namespace
        facts0 = a.stats()
        _engine_work(a, ida, pa, "tenant-a", 3)
        own_a = a.stats(ida)
        assert own_a.scope == pb.STATS_SCOPE_POOL
        assert (own_a.offloaded_blocks, own_a.lookups, own_a.lookup_hit_blocks) == (3, 1, 3)
        assert (own_a.restored_blocks, own_a.blocks_ready) == (3, 3)
        assert own_a.host_bytes_used == 3 * pa.shape.block_bytes
        # Engine B's view of its own pool does not move with A's work...
        before_b = _counts(b.stats(idb))
        assert before_b["blocks_ready"] == 0 and before_b["offloaded_blocks"] == 0
        # ...and A's view does not move with B's, although both share a namespace.
        _engine_work(b, idb, pb_, "tenant-b", 2)
        own_b = b.stats(idb)
        assert (own_b.offloaded_blocks, own_b.blocks_ready, own_b.lookups) == (2, 2, 1)
        assert _counts(a.stats(ida)) == _counts(own_a)
        # Without a pool id, a peer that is not an operator gets the configuration
        # only: every count 0, before and after both engines' work.
        facts = b.stats()
        assert facts.scope == pb.STATS_SCOPE_FACTS
        assert set(_counts(facts).values()) == {0} and _counts(facts) == _counts(facts0)
        assert facts.server_instance and facts.host_bytes_capacity == 256 * 1024 * 1024
        assert facts.integrity_policy == "abort" and facts.backend == pb.BACKEND_CPU
        # A pool id that is not registered is an error, not an empty view.
        with pytest.raises(KVSealRpcError) as e:
            a.stats("engine-a#000000000000")
        assert e.value.reason == "UNKNOWN_POOL"


def test_a_tenant_the_pool_named_is_counted_once_its_blocks_are_there(
    daemon_factory: Callable[..., DaemonProc], pool_factory: Callable[..., SharedKVPool]
) -> None:
    """The pool's block counts cover the tenants its requests named: another
    engine's blocks of a tenant this pool looked up are counted (the same blocks
    its WatchEvents stream announces), others' tenants are not."""
    d = daemon_factory(env=NO_OPERATOR)
    pa, pb_ = pool_factory(num_pages=4), pool_factory(num_pages=4)
    with KVSealClient(ClientConfig(target=d.target, timeout_s=10)) as c:
        ida = c.register_pool("engine-a", FP, pa.geometry()).pool_id
        idb = c.register_pool("engine-b", FP, pb_.geometry()).pool_id
        shared = _engine_work(c, idb, pb_, "shared", 2)
        _engine_work(c, idb, pb_, "b-only", 1)
        assert c.stats(ida).blocks_ready == 0
        assert c.lookup(ida, digest("shared"), shared).hit_blocks == 2  # names the tenant
        s = c.stats(ida)
        assert (s.blocks_ready, s.lookups, s.lookup_hit_blocks, s.offloaded_blocks) == (2, 1, 2, 0)
        c.drop(idb, digest("shared"), [], all_of_tenant=True)
        assert c.stats(ida).blocks_ready == 0


def test_an_operator_of_an_owner_only_socket_sees_the_daemon(
    daemon_factory: Callable[..., DaemonProc], pool_factory: Callable[..., SharedKVPool]
) -> None:
    d = daemon_factory("--operator-uid", str(os.geteuid()), env=NO_OPERATOR)
    pa = pool_factory(num_pages=4)
    with KVSealClient(ClientConfig(target=d.target, timeout_s=10)) as c:
        ida = c.register_pool("engine-a", FP, pa.geometry()).pool_id
        _engine_work(c, ida, pa, "tenant-a", 2)
        s = c.stats()
        assert s.scope == pb.STATS_SCOPE_DAEMON
        assert (s.blocks_ready, s.offloaded_blocks, s.pools, s.lookups) == (2, 2, 1, 1)
        assert c.stats(ida).scope == pb.STATS_SCOPE_POOL  # a pool id still scopes


ENGINE_UID = 23461  # a uid with no operator rights; the test runs as root (the operator)

PEER = r"""
import sys
from kvseal.client import ClientConfig, KVSealClient
with KVSealClient(ClientConfig(target=sys.argv[1], timeout_s=5)) as c:
    s = c.stats()
    print("SCOPE", s.scope, s.offloaded_blocks, flush=True)
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to run a peer as another uid",
)
def test_behind_the_relay_only_the_operator_uid_sees_the_daemon(
    tmp_path: Path, pool_factory: Callable[..., SharedKVPool]
) -> None:
    """Two admitted uids on one socket (the SO_PEERCRED relay): the operator's
    Stats is daemon-wide, the other uid's is the configuration only."""
    d = start_daemon(
        tmp_path / "d",
        "--allow-uid",
        str(ENGINE_UID),
        "--operator-uid",
        "0",
        env=NO_OPERATOR,
    )
    try:
        pa = pool_factory(num_pages=4)
        with KVSealClient(ClientConfig(target=d.target, timeout_s=10)) as c:
            ida = c.register_pool("engine-a", FP, pa.geometry()).pool_id
            _engine_work(c, ida, pa, "tenant-a", 2)
            s = c.stats()
            assert (s.scope, s.offloaded_blocks) == (pb.STATS_SCOPE_DAEMON, 2)
        # The other uid (caps to read the interpreter wherever it lives, not to
        # pass the socket's permission check: the relay admits it by uid).
        os.chmod(tmp_path / "d" / "run", 0o755)
        out = subprocess.run(
            [
                "setpriv",
                f"--reuid={ENGINE_UID}",
                f"--regid={ENGINE_UID}",
                "--clear-groups",
                "--inh-caps=+dac_read_search",
                "--ambient-caps=+dac_read_search",
                sys.executable,
                "-c",
                PEER,
                d.target,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        assert f"SCOPE {pb.STATS_SCOPE_FACTS} 0" in out.stdout, out.stdout + out.stderr
    finally:
        d.stop()
