"""Eviction mode's reuse fence beside another user of vLLM's reuse watchers
(kvseal.vllm.fence), on vLLM 0.33's own scheduler, block pool and offloading
connector against a real daemon (tests_vllm/v033/engine.py).

vLLM keeps one watcher per block (``BlockPool._reuse_watchers``) and
``BlockPool.unpin_blocks`` overwrites it; vLLM's HiSparse coordinator unpins
the blocks it still reads so. Here another user does exactly that (a prefix
hit takes the block, ``unpin_blocks`` releases it with its own watcher) on a
block whose store job is in flight (the daemon is stopped): the block must
still be fenced when the pool hands it out (the forward that overwrites it
waits for the store, which seals the original bytes), and the other user's
watcher must still run."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from kvseal.vllm import keys
from kvseal.vllm.worker import KVSealOffloadingWorker

from tests_vllm.daemon import Daemon
from tests_vllm.helpers import wait_for
from tests_vllm.v033.test_evict033 import (  # daemon: the fixture, reused
    _engine,
    _pages_match,
    _prompt,
    daemon,  # noqa: F401
)


def _in_fence_wait(t: threading.Thread) -> bool:
    """Whether thread ``t`` is inside kvseal's worker ``wait`` (the fence)."""
    f: Any = sys._current_frames().get(t.ident or -1)
    while f is not None:
        if f.f_code is KVSealOffloadingWorker.wait.__code__:
            return True
        f = f.f_back
    return False


def test_another_users_watcher_over_the_fence_keeps_the_block_fenced(
    daemon: Daemon,  # noqa: F811
    tmp_path: Path,
) -> None:
    # A long transfer timeout: the store must still be running (daemon
    # stopped) when the block is handed out, however slow this machine is.
    e = _engine(daemon, tmp_path, kvseal_eviction_horizon_blocks=4, kvseal_transfer_timeout_s=300)
    assert daemon.proc is not None
    pid = daemon.proc.pid
    stopped = False
    try:
        ev = e.manager.evict
        assert ev is not None
        pool = e.scheduler.kv_cache_manager.block_pool
        prompts: dict[str, list[int]] = {}
        for i in range(30):  # until a step sends store jobs (freed blocks reach the head)
            e.run()
            assert wait_for(lambda: not ev.busy)
            prompts[f"r{i}"] = _prompt(40 + i, 3)
            os.kill(pid, signal.SIGSTOP)
            stopped = True
            req = e.add(f"r{i}", prompts[f"r{i}"])
            while not req.is_finished():
                e.step()
            if ev._jobs:
                break
            os.kill(pid, signal.SIGCONT)
            stopped = False
        assert stopped and ev.state == "active" and ev._jobs, ev.stats
        jid, job = next(iter(ev._jobs.items()))
        bid = job.block_ids[0]
        owner = [
            rid
            for rid in prompts
            if set(job.keys)
            & {keys.make_offload_key(bytes(h), 0) for h in e.requests[rid].block_hashes}
        ]
        assert len(owner) == 1, owner
        assert all(b in pool._reuse_watchers for b in job.block_ids)

        # The other user, as HiSparse does: holds the job's blocks, then
        # releases them with unpin_blocks and its own watcher, written over
        # kvseal's on every one of them.
        reused: list[int] = []

        def other(block: Any) -> None:
            reused.append(block.block_id)

        blocks = [pool.blocks[b] for b in job.block_ids]
        pool.touch(blocks)
        pool.unpin_blocks(blocks, other)
        assert jid not in ev._flush
        block = pool.blocks[bid]

        # vLLM's pool hands the blocks out (every free block: they went to the tail).
        flushed = ev.stats["flushed_jobs"]
        got = pool.get_new_blocks(pool.get_num_free_blocks())
        assert all(b in got for b in blocks)
        assert jid in ev._flush, "the blocks were handed out unfenced"
        assert ev.stats["flushed_jobs"] > flushed
        assert sorted(reused) == sorted(job.block_ids)  # the other user's watcher ran, once each
        assert not any(b in pool._reuse_watchers for b in job.block_ids)
        # Back to the pool, the block first: the next request is given it and
        # its forward overwrites the page the stopped daemon has not read yet.
        pool.free_blocks([block, *[b for b in got if b is not block]])

        e.add("n0", _prompt(90, 3))
        waited = threading.Event()
        t = threading.Thread(target=e.step, name="engine-step")
        t.start()
        # The step either ends (no fence: its forward wrote the page while the
        # store had not read it) or blocks in the worker's wait (the fence).
        assert wait_for(lambda: not t.is_alive() or _in_fence_wait(t), 120)
        if t.is_alive():
            waited.set()
        os.kill(pid, signal.SIGCONT)
        stopped = False
        t.join(300)
        assert not t.is_alive()
        assert waited.is_set(), "the forward that reuses the block did not wait for its store"
        assert bid in e.block_ids("n0")  # the page was overwritten after the seal
        e.run()
        assert wait_for(lambda: not ev.busy)
        assert ev.stats["done_jobs"] == ev.stats["jobs"]

        # The owner's prompt again: its blocks come back from the tier as the
        # bytes it computed, not the later request's.
        restored = daemon.stats()["restored_blocks"]
        toks = prompts[owner[0]]
        e.add(f"{owner[0]}-again", toks)
        e.run()
        assert e.worker.take_failed_block_ids() == set()
        assert daemon.stats()["restored_blocks"] > restored
        _pages_match(e, f"{owner[0]}-again", toks, 3)
        assert daemon.stats()["integrity_failures"] == 0
        assert sorted(reused) == sorted(job.block_ids)
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        e.shutdown()
