"""kvseal inside a real SGLang 0.5.23 server on the CPU, for a
sliding-window model (tests_sglang.tiny_models.make_tiny_gemma3: 3 local
layers with a 32-token window : 1 global). SGLang runs Gemma 3 on one MHA
pool (it disables hybrid SWA memory for Gemma 2/3): the window is applied in
attention, every layer's pages are kvseal's block.

The hybrid SWA pool itself (a full and an SWA component) does not run on
SGLang's CPU attention: ``torch_native`` writes SWA layers through the
full-to-SWA index map but reads them with full-pool indices (IndexError as
soon as an index passes the SWA pool; a tiny Mellum crashed SGLang alone
here). So the SWA component, like MLA, quantized pools and Mamba state, is
tested one level down (test_components.py; docs/sglang.md, "Model
families").

Two server lifetimes (a baseline without kvseal, then kvseal's), each ~30 s
to start; the tests run in file order.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests_sglang.server import Server, prompt
from tests_sglang.tiny_models import make_tiny_gemma3
from tests_vllm.daemon import Daemon

KV_TOKENS = 512
PAGE = 16
# 8 prompts of 160 tokens (10 pages) = 1280 tokens: 2.5x SGLang's KV pool.
WORKLOAD = [prompt(300 + i, 160) for i in range(8)]
ROUNDS = 2
SOLO = prompt(17, 96)
SALTED = prompt(19, 64)
MAX_NEW = 6


def cacheable(n: int) -> int:
    return (n - 1) // PAGE * PAGE


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("model") / "tiny-gemma3")


def _run(srv: Server) -> list[dict[str, Any]]:
    return [srv.generate(p, max_new=MAX_NEW) for _ in range(ROUNDS) for p in WORKLOAD]


def _ids(results: list[dict[str, Any]]) -> list[list[int]]:
    return [r["ids"] for r in results]


@pytest.fixture(scope="module")
def baseline(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    srv = Server(model, tmp_path_factory.mktemp("baseline"), kv_tokens=KV_TOKENS, page_size=PAGE)
    srv.start()
    try:
        work = _run(srv)
        solo = srv.generate(SOLO, max_new=MAX_NEW)
        salted = {s: srv.generate(SALTED, salt=s, max_new=MAX_NEW) for s in ("alice", "bob")}
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


def test_sliding_window_identical_tokens_and_restored(
    baseline: dict[str, Any], kv_server: Server, daemon: Daemon
) -> None:
    """A workload 2.5x SGLang's KV pool: every token identical to SGLang
    alone's; the second round's prefixes come back from kvseal."""
    before = daemon.stats()
    work = _run(kv_server)
    after = daemon.stats()
    assert all(r["status"] == 200 for r in work)
    assert _ids(work) == _ids(baseline["work"])
    assert after["restored_blocks"] > before["restored_blocks"]
    later = slice(len(WORKLOAD), None)
    assert sum(r["cached"] for r in work[later]) > sum(r["cached"] for r in baseline["work"][later])
    assert after["integrity_failures"] == 0


def test_sliding_window_flushed_prefix_restored_whole(
    baseline: dict[str, Any], kv_server: Server, daemon: Daemon
) -> None:
    first = kv_server.generate(SOLO, max_new=MAX_NEW)
    deadline = time.monotonic() + 30
    while daemon.stats()["blocks_ready"] < 5 and time.monotonic() < deadline:
        time.sleep(0.2)
    kv_server.flush()
    before = daemon.stats()["restored_blocks"]
    again = kv_server.generate(SOLO, max_new=MAX_NEW)
    assert first["ids"] == again["ids"] == baseline["solo"]["ids"]
    assert again["cached"] == cacheable(len(SOLO))  # every cacheable page, from kvseal
    assert daemon.stats()["restored_blocks"] >= before + cacheable(len(SOLO)) // PAGE


def test_sliding_window_salted_tenants_apart(
    baseline: dict[str, Any], kv_server: Server, daemon: Daemon
) -> None:
    alice = kv_server.generate(SALTED, salt="alice", max_new=MAX_NEW)
    assert alice["ids"] == baseline["salted"]["alice"]["ids"]
    kv_server.flush()
    before = daemon.stats()["restored_blocks"]
    bob = kv_server.generate(SALTED, salt="bob", max_new=MAX_NEW)
    assert bob["cached"] == 0 and daemon.stats()["restored_blocks"] == before
    assert bob["ids"] == baseline["salted"]["bob"]["ids"]
    kv_server.flush()
    again = kv_server.generate(SALTED, salt="alice", max_new=MAX_NEW)
    assert again["cached"] == cacheable(len(SALTED)) and again["ids"] == alice["ids"]


def test_sliding_window_tampered_tier_recomputed_identically(
    baseline: dict[str, Any], kv_server: Server, daemon: Daemon
) -> None:
    """The host flips bytes of the sealed tier: the load fails verification
    and returns False, SGLang recomputes; identical tokens."""
    kv_server.generate(SOLO, max_new=MAX_NEW)
    kv_server.flush()
    before = daemon.stats()
    assert daemon.tamper() > 0
    out = kv_server.generate(SOLO, max_new=MAX_NEW)
    assert out["status"] == 200 and out["ids"] == baseline["solo"]["ids"]
    assert out["cached"] == 0
    assert daemon.stats()["integrity_failures"] > before["integrity_failures"]
