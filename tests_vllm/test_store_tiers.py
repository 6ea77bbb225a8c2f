"""vLLM's side of a daemon with a store tier (issue 22), against real daemons
on a real directory: the KV events vLLM publishes name the tier (medium CPU
for the host tier, STORAGE with the daemon's locality for the store), a host
eviction the store backs stays a hit, and replicas that cannot share blocks
(here: different prefix-hash seeds) are told so in the engine's log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvseal.client import ClientConfig, KVSealClient
from kvseal.vllm.spec import KVSealLoadStoreSpec
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium

from tests_vllm.daemon import Daemon
from tests_vllm.helpers import wait_for
from tests_vllm.test_adapter import _key
from tests_vllm.test_store import _engine, _objects, _request, _store_flags


def _key_file(path: Path) -> Path:
    path.write_bytes(os.urandom(32))
    path.chmod(0o600)
    return path


def test_kv_events_name_the_tier_and_its_locality(tmp_path: Path) -> None:
    store, key = tmp_path / "store", _key_file(tmp_path / "key")
    ids = [1, 2, 3]
    keys_ = [_key(i) for i in ids]
    d = Daemon(tmp_path / "d", extra=(*_store_flags(store, key), "--store-locality", "remote"))
    d.start()
    try:
        with _engine(d) as (mgr, rank):
            assert wait_for(lambda: mgr.mirrors[0].store_policy == "write-through")
            assert mgr.mirrors[0].store_locality == "remote"
            ctx = _request(mgr, "r1", "alice")
            out = mgr.prepare_store(keys_, ctx)
            assert out is not None and isinstance(out.store_spec, KVSealLoadStoreSpec)
            for b in ids:
                rank.fill(b, b)
            rank.run(True, out.store_spec.tenant, out.store_spec.hashes, ids)
            mgr.complete_store(out.keys_to_store, ctx)
            assert wait_for(lambda: _objects(store) >= len(ids))
            events: list = []

            def tiers() -> dict[tuple[Medium, bool], set[bytes]]:
                events.extend(mgr.take_events())
                out: dict[tuple[Medium, bool], set[bytes]] = {}
                for e in events:
                    out.setdefault((e.medium, e.removed), set()).update(e.keys)
                return out

            both = {(Medium.CPU, False): set(keys_), (Medium.STORAGE, False): set(keys_)}
            assert wait_for(lambda: tiers() == both)
            for e in events:  # a STORAGE event carries the locality, a CPU one none
                assert e.locality == (Locality.REMOTE if e.medium is Medium.STORAGE else None)
            # A drop takes the block out of both tiers: a removal for each medium.
            pool_id = mgr.mirrors[0].pool_id
            assert pool_id is not None
            with KVSealClient(ClientConfig(target=d.target)) as c:
                assert c.drop(pool_id, out.store_spec.tenant, out.store_spec.hashes[2:]) == 1
            assert wait_for(
                lambda: (
                    tiers().get((Medium.STORAGE, True)) == {keys_[2]}
                    and tiers().get((Medium.CPU, True)) == {keys_[2]}
                )
            )
            assert wait_for(lambda: mgr.lookup(keys_[2], ctx) is LookupResult.MISS)
            assert mgr.lookup(keys_[0], ctx) is LookupResult.HIT
    finally:
        d.stop()


_CHILD = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from kvseal.vllm.spec import KVSealOffloadingSpec
from tests_vllm.helpers import offloading_config, wait_for
mgr = KVSealOffloadingSpec(offloading_config([sys.argv[1]], 0)).get_manager()
assert wait_for(lambda: mgr.mirrors[0].pool_id is not None)
print("WARNINGS", len(mgr.mirrors[0].warnings), flush=True)
mgr.shutdown()
"""


@pytest.mark.parametrize("seed", ["1234"])
def test_replicas_with_another_hash_seed_are_warned(tmp_path: Path, seed: str) -> None:
    """Two engines (processes) on one daemon with a store: the first sets the
    reference; one whose PYTHONHASHSEED differs (vLLM's prefix-hash seed: its
    block hashes differ, so nothing would ever hit) gets a warning naming it
    in its log; one that agrees gets none."""
    store, key = tmp_path / "store", _key_file(tmp_path / "key")
    d = Daemon(tmp_path / "d", extra=_store_flags(store, key)).start()
    try:

        def engine(hash_seed: str) -> subprocess.CompletedProcess[str]:
            env = {**os.environ, "PYTHONHASHSEED": hash_seed}
            return subprocess.run(
                [sys.executable, "-c", _CHILD, d.target],
                env=env, capture_output=True, text=True, timeout=120, check=True,
            )  # fmt: skip

        first = engine(seed)
        assert "WARNINGS 0" in first.stdout, first.stderr
        same = engine(seed)
        assert "WARNINGS 0" in same.stdout, same.stderr
        other = engine("999")
        assert "WARNINGS 1" in other.stdout, other.stderr
        assert "WARNING" in other.stderr and "prefix-hash seed (PYTHONHASHSEED)" in other.stderr
    finally:
        d.stop()


def test_tier_events_count_ranks_not_events() -> None:
    """TP=2: a block is announced in a tier once both ranks' daemons hold it
    there, a rank announcing it twice (a restarted daemon finding the store's
    blocks again) changes nothing, one rank's removal retracts it, a rank's
    stream gap retracts what it held, and 16-byte vLLM hashes are named as
    vLLM named them, also on removal."""
    import queue

    from kvseal.v1 import kvseal_pb2 as pb
    from kvseal.vllm import keys
    from kvseal.vllm.tier_events import TierEvents

    out: queue.SimpleQueue = queue.SimpleQueue()
    vllm_hash = {keys.kvseal_hash(b"v" * 16): b"v" * 16}
    tiers = TierEvents(2, 0, out, lambda h: vllm_hash.get(h, h), lambda h: vllm_hash.pop(h, None))
    a, b = bytes([1]) * 32, keys.kvseal_hash(b"v" * 16)
    t = bytes(32)

    def ev(kind: int, medium: str, *hs: bytes) -> pb.BlockEvent:
        loc = "remote" if medium == "storage" else ""
        return pb.BlockEvent(kind=kind, medium=medium, locality=loc, tenant=t, block_hashes=hs)

    def take() -> list[tuple[Medium, bool, list[bytes], Locality | None]]:
        got = []
        while not out.empty():
            e = out.get()
            got.append((e.medium, e.removed, [bytes(k) for k in e.keys], e.locality))
        return got

    def key(vh: bytes) -> bytes:
        return keys.make_offload_key(vh, 0)

    S, R = pb.BLOCK_STORED, pb.BLOCK_REMOVED
    tiers.event(0, ev(S, "storage", a, b))
    tiers.event(0, ev(S, "storage", a, b))  # again from rank 0: still one rank
    assert take() == []
    tiers.event(1, ev(S, "storage", a, b))
    assert take() == [(Medium.STORAGE, False, [key(a), key(b"v" * 16)], Locality.REMOTE)]
    tiers.event(1, ev(S, "cpu", a))
    tiers.event(0, ev(S, "cpu", a))
    assert take() == [(Medium.CPU, False, [key(a)], None)]
    tiers.event(0, ev(R, "storage", b))  # one rank lost it: no longer in that tier
    assert take() == [(Medium.STORAGE, True, [key(b"v" * 16)], Locality.REMOTE)]
    assert b in vllm_hash  # rank 1 still holds it: its removal must name it too
    tiers.event(1, ev(R, "storage", b))
    assert take() == [] and b not in vllm_hash  # in no tier on any rank: the name goes
    tiers.reset(1)  # rank 1's stream had a gap: what needed it is retracted
    got = take()
    assert len(got) == 2 and (Medium.CPU, True, [key(a)], None) in got
    assert (Medium.STORAGE, True, [key(a)], Locality.REMOTE) in got
    tiers.event(1, ev(S, "cpu", a))  # announced again after the gap
    assert take() == [(Medium.CPU, False, [key(a)], None)]
