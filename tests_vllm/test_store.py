"""Store hits reach vLLM's scheduler after a daemon restart, without an RPC on
the scheduler thread (issue 22), scheduler side, against real daemons with a
store tier (``--store-dir``, ``--store-key file:``) on a real directory: the
blocks an engine stored before its daemon restarted (a new process: an empty
host tier, new host keys) are found by the mirror's background discovery
Lookup, are hits, and restore byte for byte; another tenant gets no hit. The
same with a real vLLM engine, token for token: test_store_engine.py."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from kvseal.vllm.spec import (
    KVSealLoadStoreSpec,
    KVSealOffloadingManager,
    KVSealOffloadingSpec,
    note_request_salt,
)
from vllm.v1.kv_offload.base import LookupResult, ReqContext

from tests_vllm.daemon import Daemon
from tests_vllm.helpers import block_bytes, offloading_config, wait_for
from tests_vllm.test_adapter import NUM_BLOCKS, Rank, _key

OBJECT = re.compile(r"[0-9a-f]{64}")


def _store_flags(store: Path, key: Path) -> tuple[str, ...]:
    return (
        "--store-dir", str(store), "--store-key", f"file:{key}",
        "--store-bytes", "64MiB", "--store-max-block-bytes", "1MiB",
    )  # fmt: skip


def _objects(store: Path) -> int:
    """Block objects published in the store (not markers, layout or temp files)."""
    return sum(
        1 for shard in store.iterdir() if shard.is_dir() for p in shard.iterdir()
        if OBJECT.fullmatch(p.name)
    )  # fmt: skip


@contextmanager
def _engine(d: Daemon) -> Iterator[tuple[KVSealOffloadingManager, Rank]]:
    """A scheduler-side manager with ``kvseal_lookup_discovery`` and one rank's
    worker (an engine, without the model), mirror synced and pool registered."""
    sock = [d.target]
    cfg = offloading_config(sock, 0)
    cfg = type(cfg)(
        **{**cfg.__dict__, "extra_config": {**cfg.extra_config, "kvseal_lookup_discovery": True}}
    )
    mgr = KVSealOffloadingSpec(cfg).get_manager()
    assert isinstance(mgr, KVSealOffloadingManager)
    rank = Rank(sock, 0)
    try:
        assert wait_for(lambda: mgr.mirrors[0].synced.is_set() and rank.worker.kv is not None)
        yield mgr, rank
    finally:
        mgr.shutdown()
        rank.worker.shutdown()


def _request(mgr: KVSealOffloadingManager, req_id: str, salt: str) -> ReqContext:
    note_request_salt(req_id, salt)
    ctx = ReqContext(req_id=req_id)
    mgr.on_new_request(ctx)
    return ctx


def test_store_hits_after_a_daemon_restart_reach_the_scheduler_by_discovery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, key = tmp_path / "store", tmp_path / "store-key"
    key.write_bytes(os.urandom(32))  # the deployment key: 32 raw bytes, mode 0600
    key.chmod(0o600)
    ids = [1, 2, 3]
    keys_ = [_key(i) for i in ids]

    # An engine stores a salted tenant's blocks; write-through spills them.
    first = Daemon(tmp_path / "d1", extra=_store_flags(store, key)).start()
    try:
        with _engine(first) as (mgr, rank):
            ctx = _request(mgr, "r1", "alice")
            out = mgr.prepare_store(keys_, ctx)
            assert out is not None and isinstance(out.store_spec, KVSealLoadStoreSpec)
            data = [rank.fill(b, 100 + b) for b in ids]
            rank.run(True, out.store_spec.tenant, out.store_spec.hashes, ids)
            mgr.complete_store(out.keys_to_store, ctx)
            assert mgr.lookup(keys_[0], ctx) is LookupResult.HIT
            assert wait_for(lambda: _objects(store) >= len(ids))
    finally:
        rc = first.stop()
    assert rc == 0  # SIGTERM: a clean stop; its host tier is gone with it

    # A new daemon on the same directory and key; a restarted engine.
    second = Daemon(tmp_path / "d2", extra=_store_flags(store, key)).start()
    try:
        assert second.stats()["blocks_ready"] == 0  # an empty host tier
        with _engine(second) as (mgr, rank):
            m = mgr.mirrors[0]
            scheduler = threading.current_thread()
            callers: list[threading.Thread] = []
            asked: list[list[bytes]] = []
            gate = threading.Event()
            lookup = m._client.lookup

            def recorded(*a: Any, **k: Any) -> Any:
                callers.append(threading.current_thread())
                asked.append(list(a[2]))
                gate.wait(20)  # held until the step's lookups are all queued
                return lookup(*a, **k)

            monkeypatch.setattr(m._client, "lookup", recorded)
            busy = _request(mgr, "r0", "alice")  # another request of alice, never stored
            ctx = _request(mgr, "r2", "alice")
            # The mirror never heard of any of them: a miss for this step that
            # asks the daemon in the background (RETRY: vLLM looks again next
            # step). The first discovery Lookup holds the thread, so the next one
            # asks about a block nobody stored followed by the stored ones.
            assert mgr.lookup(_key(8), busy) is LookupResult.RETRY
            assert wait_for(lambda: len(asked) == 1)
            assert mgr.lookup(_key(9), busy) is LookupResult.RETRY
            assert [mgr.lookup(k, ctx) for k in keys_] == [LookupResult.RETRY] * len(ids)
            gate.set()
            assert wait_for(lambda: all(mgr.lookup(k, ctx) is LookupResult.HIT for k in keys_))
            assert [bytes([i]) * 32 for i in (9, *ids)] in asked  # a gap, then store blocks
            assert mgr.lookup(_key(9), busy) is LookupResult.MISS
            assert scheduler not in callers  # every Lookup off the scheduler thread

            # Another tenant: the same hashes are no hit.
            bob = _request(mgr, "r3", "bob")
            assert mgr.lookup(keys_[0], bob) is LookupResult.RETRY
            assert wait_for(lambda: mgr.lookup(keys_[0], bob) is LookupResult.MISS)

            # The load restores them (read and verified from the store) into
            # other blocks of the new engine's KV cache: the bytes stored.
            spec = mgr.prepare_load(keys_, ctx)
            assert isinstance(spec, KVSealLoadStoreSpec)
            dst = [5, 6, 7]
            rank.run(False, spec.tenant, spec.hashes, dst)
            assert rank.worker.take_failed_block_ids() == set()
            for d, want in zip(dst, data, strict=True):
                assert block_bytes(rank.buf, NUM_BLOCKS, d) == want
            assert second.stats()["restored_blocks"] == len(ids)
            assert scheduler not in callers
    finally:
        second.stop()
