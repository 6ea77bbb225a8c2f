"""kvseal inside a real SGLang 0.5.23 server on the CPU, against a real daemon.

Three server lifetimes share this module (each start costs ~30 s): a baseline
without kvseal (the reference tokens), a kvseal server in the default
``verified`` load mode, and, after it stopped, a second kvseal server in
``async`` load mode on the same warm daemon. The tests run in file order.

Token ids are greedy and fixed by seeds; SGLang's KV pool is 512 tokens (32
pages of 16), so the workload below is several times its capacity and
SGLang's own cache cannot hold it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests_sglang.server import Server, documented_commands, linker_flags, prompt
from tests_vllm.daemon import Daemon
from tests_vllm.tiny_model import make_tiny_llama

KV_TOKENS = 512
PAGE = 16
# 12 prompts of 160 tokens (10 pages) = 1920 tokens: 3.75x SGLang's KV pool.
WORKLOAD = [prompt(100 + i, 160) for i in range(12)]
ROUNDS = 3
SOLO = prompt(7, 80)  # 5 pages, for the single-prompt tests
MAX_NEW = 6


def cacheable(n: int) -> int:
    """Prompt tokens SGLang can take from a cache: whole pages of all but the
    last token (whose logits must be computed)."""
    return (n - 1) // PAGE * PAGE


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


def _run_workload(srv: Server) -> list[dict[str, Any]]:
    return [srv.generate(p, max_new=MAX_NEW) for _ in range(ROUNDS) for p in WORKLOAD]


@pytest.fixture(scope="module")
def baseline(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    srv = Server(model, tmp_path_factory.mktemp("baseline"), kv_tokens=KV_TOKENS, page_size=PAGE)
    srv.start()
    try:
        work = _run_workload(srv)
        solo = srv.generate(SOLO, max_new=MAX_NEW)
        salted = {s: srv.generate(prompt(9, 64), salt=s, max_new=MAX_NEW) for s in ("alice", "bob")}
    finally:
        srv.stop()
    return {"work": work, "solo": solo, "salted": salted}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(
        tmp_path_factory.mktemp("daemon"),
        extra=("--on-integrity-failure", "drop"),
        host_bytes="64MiB",
    ).start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def kv_server(
    model: Path, daemon: Daemon, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    srv = Server(
        model,
        tmp_path_factory.mktemp("sglang-kvseal"),
        kv_tokens=KV_TOKENS,
        page_size=PAGE,
        kvseal_socket=daemon.socket,
        linker={"staging_bytes": 4 << 20, "transfer_timeout_s": 5},
    )
    srv.start()
    yield srv
    srv.stop()


def _ids(results: list[dict[str, Any]]) -> list[list[int]]:
    return [r["ids"] for r in results]


def _wait_for(cond: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.2)
    return False


def test_outputs_identical_and_restored_beyond_sglang_capacity(
    baseline: dict[str, Any], kv_server: Server, daemon: Daemon
) -> None:
    """A workload 3.75x SGLang's KV pool: every token identical to the
    baseline's, and prompts SGLang had evicted come back from kvseal."""
    before = daemon.stats()
    work = _run_workload(kv_server)
    after = daemon.stats()
    assert all(r["status"] == 200 for r in work)
    assert _ids(work) == _ids(baseline["work"])
    assert after["offloaded_blocks"] > before["offloaded_blocks"]
    assert after["restored_blocks"] > before["restored_blocks"]
    # Rounds 2 and 3: SGLang alone re-used little (cyclic access, LRU), kvseal most.
    later = slice(len(WORKLOAD), None)
    base_cached = sum(r["cached"] for r in baseline["work"][later])
    kv_cached = sum(r["cached"] for r in work[later])
    assert kv_cached > base_cached
    assert kv_cached >= (ROUNDS - 1) * len(WORKLOAD) * cacheable(160) // 2  # at least half
    assert after["integrity_failures"] == 0


def test_flushed_cache_is_restored_from_kvseal(
    baseline: dict[str, Any], kv_server: Server, daemon: Daemon
) -> None:
    first = kv_server.generate(SOLO, max_new=MAX_NEW)
    assert _wait_for(lambda: daemon.stats()["blocks_ready"] >= 5)
    kv_server.flush()
    before = daemon.stats()["restored_blocks"]
    again = kv_server.generate(SOLO, max_new=MAX_NEW)
    assert first["ids"] == again["ids"] == baseline["solo"]["ids"]
    # every cacheable page, from kvseal (SGLang's own cache was empty)
    assert again["cached"] == cacheable(len(SOLO))
    assert daemon.stats()["restored_blocks"] >= before + cacheable(len(SOLO)) // PAGE


def test_no_cross_salt_hit_and_each_salt_hits_its_own(
    baseline: dict[str, Any], kv_server: Server, daemon: Daemon
) -> None:
    p = prompt(9, 64)
    alice = kv_server.generate(p, salt="alice", max_new=MAX_NEW)
    assert alice["ids"] == baseline["salted"]["alice"]["ids"]
    kv_server.flush()
    restored = daemon.stats()["restored_blocks"]
    bob = kv_server.generate(p, salt="bob", max_new=MAX_NEW)
    assert bob["cached"] == 0  # alice's pages are not bob's
    assert daemon.stats()["restored_blocks"] == restored
    assert bob["ids"] == baseline["salted"]["bob"]["ids"]
    kv_server.flush()
    again = kv_server.generate(p, salt="alice", max_new=MAX_NEW)
    assert again["cached"] == cacheable(len(p)) and again["ids"] == alice["ids"]


def test_many_tenants_each_get_their_own_hits(kv_server: Server, daemon: Daemon) -> None:
    """24 tenants, one shared system prefix each under its own salt: after a
    flush every tenant restores its own pages (and only its own)."""
    system = prompt(11, 48)
    salts = [f"user-{i}" for i in range(24)]
    first = {
        s: kv_server.generate(system + prompt(200 + i, 32), salt=s, max_new=4)
        for i, s in enumerate(salts)
    }
    assert all(r["status"] == 200 for r in first.values())
    kv_server.flush()
    again = {
        s: kv_server.generate(system + prompt(200 + i, 32), salt=s, max_new=4)
        for i, s in enumerate(salts)
    }
    for s in salts:
        assert again[s]["ids"] == first[s]["ids"]
        assert again[s]["cached"] == cacheable(80), s  # its own pages, all of them
    assert daemon.stats()["integrity_failures"] == 0


def test_tampered_restore_is_recomputed_with_identical_tokens(
    baseline: dict[str, Any], kv_server: Server, daemon: Daemon
) -> None:
    """The host flips bytes of the sealed tier (drop policy): the restore fails
    verification, the linker's load refuses, SGLang recomputes; identical tokens."""
    kv_server.generate(SOLO, max_new=MAX_NEW)
    kv_server.flush()
    before = daemon.stats()
    assert daemon.tamper() > 0
    out = kv_server.generate(SOLO, max_new=MAX_NEW)
    after = daemon.stats()
    assert out["status"] == 200 and out["ids"] == baseline["solo"]["ids"]
    assert after["integrity_failures"] > before["integrity_failures"]
    assert out["cached"] == 0


def test_sglang_restart_reuses_the_warm_daemon_async_mode(
    baseline: dict[str, Any], model: Path, kv_server: Server, daemon: Daemon, tmp_path: Path
) -> None:
    """A new SGLang (``load_mode: async``) on the warm daemon finds the pages
    the previous one stored (discovery: from the second request of a prefix on)
    and restores them with identical tokens."""
    p = prompt(31, 160)  # stored after the tamper test's flip: clean blocks
    want = kv_server.generate(p, max_new=MAX_NEW)["ids"]
    assert _wait_for(lambda: daemon.stats()["blocks_ready"] >= 10)
    kv_server.stop()
    srv = Server(
        model, tmp_path, kv_tokens=KV_TOKENS, page_size=PAGE, kvseal_socket=daemon.socket,
        linker={"load_mode": "async", "staging_bytes": 4 << 20},
    )  # fmt: skip
    srv.start()
    try:
        hit = None
        for _ in range(20):
            r = srv.generate(p, max_new=MAX_NEW)
            assert r["status"] == 200 and r["ids"] == want
            if r["cached"] > 0:
                hit = r
                break
            srv.flush()  # so the next one can only hit in kvseal
            time.sleep(0.3)
        assert hit is not None and hit["cached"] == cacheable(len(p))
    finally:
        srv.stop()


def test_documented_flag_line_is_the_one_tested() -> None:
    """README and docs/sglang.md carry one and the same flag line, and it is
    the linker configuration the other tests build (tests_sglang.server)."""
    docs = documented_commands()
    assert set(docs) == {"README.md", "sglang.md"}, docs
    assert len(set(docs.values())) == 1, docs
    cmd = docs["README.md"]
    flags = linker_flags("/run/kvseal/kvseal.sock")
    assert " ".join(flags[:4]) in cmd
    assert f"--unified-cache-external-linker-config '{flags[4].replace(' ', '')}'" in cmd.replace(
        ", ", ","
    ).replace(": ", ":")


def test_daemon_killed_mid_run_no_hang_then_reuse_resumes(
    baseline: dict[str, Any], model: Path, daemon: Daemon, tmp_path: Path
) -> None:
    """The server is the documented command, run as written (MODEL, port and
    socket substituted; CPU flags added). The daemon hangs, then dies mid-run:
    every request is still answered, identically; a new daemon is found again."""
    srv = Server(
        model, tmp_path, kv_tokens=KV_TOKENS, kvseal_socket=daemon.socket,
        documented=documented_commands()["README.md"],
    )  # fmt: skip
    srv.start()
    try:
        for p in WORKLOAD[:4]:
            srv.generate(p, max_new=MAX_NEW)
        time.sleep(1.0)
        # A hung daemon (SIGSTOP) while the mirror still says "hit": the verified
        # load gives up after load_timeout_s, SGLang recomputes; nothing hangs.
        srv.flush()
        assert daemon.proc is not None
        os.kill(daemon.proc.pid, signal.SIGSTOP)
        try:
            hung = [srv.generate(p, max_new=MAX_NEW, timeout=120) for p in WORKLOAD[:2]]
        finally:
            os.kill(daemon.proc.pid, signal.SIGCONT)
        assert all(r["status"] == 200 for r in hung)
        assert _ids(hung) == _ids(baseline["work"][:2])
        daemon.kill()
        # Every request is answered, identically, with no daemon at all.
        outs = [srv.generate(p, max_new=MAX_NEW, timeout=120) for p in WORKLOAD[:6]]
        assert all(r["status"] == 200 for r in outs)
        assert _ids(outs) == _ids(baseline["work"][:6])
        daemon.start()  # a new daemon: new keys, empty tier

        def reused() -> bool:
            srv.generate(SOLO, max_new=MAX_NEW)
            time.sleep(0.5)
            srv.flush()
            r = srv.generate(SOLO, max_new=MAX_NEW)
            assert r["ids"] == baseline["solo"]["ids"]
            return bool(r["cached"] > 0)

        # The pool registers again with back-off and the mirror resubscribes:
        # generous on a loaded 2-core machine (a wait, not a timing assertion).
        assert _wait_for(reused, timeout=180)
    finally:
        srv.stop()
