"""A daemon restoring from a store directory the host tampered with, and the
``cdh:`` key source against a local HTTP server that speaks the
confidential-data-hub's resource endpoint (the CDH and KBS do not install
here).

Tampering (a byte flipped, an object truncated, two objects swapped) makes
the restore fail under the daemon's ``--on-integrity-failure`` policy exactly
as a tampered host region does: ``drop`` answers DATA_LOSS and keeps serving
(the bad object is gone from the store), ``abort`` answers DATA_LOSS and the
daemon exits 3. Never is a byte written to the engine's pages.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from kvseal.client import KVSealRpcError, tenant_digest
from kvseal.client.shm import SharedKVPool
from kvseal.server.config import EXIT_INTEGRITY

from .conftest import DaemonProc, fill_random, is_poisoned, poison
from .store_helpers import (
    FP,
    chain,
    key_file,
    objects,
    scope_records,
    store_and_stop,
    store_flags,
    wait_objects,
)

Factory = Callable[..., DaemonProc]
RESOURCE = "default/kvseal/store-key"


def _flip(paths: list[Path]) -> None:
    for p in paths:
        raw = bytearray(p.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        p.write_bytes(bytes(raw))


def _truncate(paths: list[Path]) -> None:
    for p in paths:
        os.truncate(p, p.stat().st_size - 1)


def _swap(paths: list[Path]) -> None:
    a, b = paths[0].read_bytes(), paths[1].read_bytes()
    paths[0].write_bytes(b)
    paths[1].write_bytes(a)


ATTACKS = {"flip": _flip, "truncate": _truncate, "swap": _swap}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
@pytest.mark.parametrize("policy", ["drop", "abort"])
def test_tampered_store_fails_under_the_integrity_policy(
    tmp_path: Path,
    daemon_factory: Factory,
    pool_factory: Callable[..., SharedKVPool],
    policy: str,
    attack: str,
) -> None:
    store, key = tmp_path / "store", key_file(tmp_path / "key")
    flags = store_flags(store, f"file:{key}")
    pool = pool_factory(num_pages=6)
    fill_random(pool)
    tenant = tenant_digest("user-a")
    hashes = chain(3, pool.shape.tokens_per_page, b"user-a")
    found = store_and_stop(daemon_factory, flags, pool.geometry(), tenant, hashes, store)
    ATTACKS[attack](found)
    b = daemon_factory(*flags, "--on-integrity-failure", policy)
    poison(pool, list(range(6)))
    with b.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        assert c.lookup(h.pool_id, tenant, hashes).hit_blocks == 3  # names only: not read
        with pytest.raises(KVSealRpcError) as e:
            c.restore(h.pool_id, tenant, hashes, [3, 4, 5])
        assert e.value.code == grpc.StatusCode.DATA_LOSS
        assert all(is_poisoned(pool, p) for p in range(6))
        if policy == "drop":
            # Still serving; the failed object was removed, so the prefix is
            # shorter now, and whatever still fails, fails the same way.
            assert c.lookup(h.pool_id, tenant, hashes).hit_blocks < 3
            assert len(objects(store)) < 3
            with pytest.raises(KVSealRpcError) as again:
                c.restore(h.pool_id, tenant, hashes, [3, 4, 5])
            assert again.value.code in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.NOT_FOUND)
            assert all(is_poisoned(pool, p) for p in range(6))
            assert c.health() == "SERVING"
    if policy == "abort":
        assert b.wait_exit() == EXIT_INTEGRITY
        assert "INTEGRITY FAILURE" in b.log()
    assert all(is_poisoned(pool, p) for p in range(6))


@pytest.mark.parametrize("policy", ["drop", "abort"])
def test_tampered_scope_marker_fails_under_the_integrity_policy(
    tmp_path: Path,
    daemon_factory: Factory,
    pool_factory: Callable[..., SharedKVPool],
    policy: str,
) -> None:
    """The tenant's scope marker (its store epoch) flipped: a restore fails
    DATA_LOSS under the policy, as a tampered object does."""
    store, key = tmp_path / "store", key_file(tmp_path / "key")
    flags = store_flags(store, f"file:{key}")
    pool = pool_factory(num_pages=4)
    fill_random(pool)
    tenant = tenant_digest("user-a")
    hashes = chain(2, pool.shape.tokens_per_page, b"user-a")
    a = daemon_factory(*flags)
    with a.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        c.offload(h.pool_id, tenant, hashes, [0, 1])
    wait_objects(store, 2)
    assert a.stop() == 0
    (marker,), _ = scope_records(store)
    _flip([marker])
    b = daemon_factory(*flags, "--on-integrity-failure", policy)
    poison(pool, [0, 1, 2, 3])
    with b.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        with pytest.raises(KVSealRpcError) as e:
            c.restore(h.pool_id, tenant, hashes, [2, 3])
        assert e.value.code == grpc.StatusCode.DATA_LOSS
        if policy == "drop":
            assert c.lookup(h.pool_id, tenant, hashes).hit_blocks == 0  # marker removed
            assert c.health() == "SERVING"
    if policy == "abort":
        assert b.wait_exit() == EXIT_INTEGRITY
    assert all(is_poisoned(pool, p) for p in range(4))


@pytest.mark.parametrize("policy", ["drop", "abort"])
def test_tampered_scope_marker_met_by_a_lookup_runs_the_policy(
    tmp_path: Path,
    daemon_factory: Factory,
    pool_factory: Callable[..., SharedKVPool],
    policy: str,
) -> None:
    """The engine's normal order: a Lookup first. It reads the tenant's scope
    marker, which fails: under ``abort`` the Lookup answers DATA_LOSS and the
    daemon exits 3 (it used to answer a miss and never stop); under ``drop``
    it answers the miss, counts the failure and keeps serving."""
    store, key = tmp_path / "store", key_file(tmp_path / "key")
    flags = store_flags(store, f"file:{key}")
    pool = pool_factory(num_pages=4)
    fill_random(pool)
    tenant = tenant_digest("user-a")
    hashes = chain(2, pool.shape.tokens_per_page, b"user-a")
    store_and_stop(daemon_factory, flags, pool.geometry(), tenant, hashes, store)
    (marker,), _ = scope_records(store)
    _flip([marker])
    b = daemon_factory(*flags, "--on-integrity-failure", policy)
    poison(pool, [0, 1, 2, 3])
    with b.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        if policy == "abort":
            with pytest.raises(KVSealRpcError) as e:
                c.lookup(h.pool_id, tenant, hashes)
            assert e.value.code == grpc.StatusCode.DATA_LOSS
        else:
            assert c.lookup(h.pool_id, tenant, hashes).hit_blocks == 0
            assert c.stats().integrity_failures == 1
            assert c.health() == "SERVING"
    assert not marker.exists(), "the failed marker was removed"
    if policy == "abort":
        assert b.wait_exit() == EXIT_INTEGRITY
        assert "INTEGRITY FAILURE" in b.log()
    assert all(is_poisoned(pool, p) for p in range(4))


class _Cdh:
    """A local HTTP server speaking ``GET /cdh/resource/<repo>/<type>/<tag>``:
    ``answers`` are (status, body) pairs served in turn, the last one forever."""

    def __init__(self, answers: list[tuple[int, bytes]]) -> None:
        self.answers = answers
        self.requests: list[str] = []
        cdh = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                cdh.requests.append(self.path)
                status, body = cdh.answers[min(len(cdh.requests), len(cdh.answers)) - 1]
                if self.path != "/cdh/resource/" + RESOURCE:
                    status, body = 404, b""
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                return

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def cdh_factory() -> Iterator[Callable[[list[tuple[int, bytes]]], _Cdh]]:
    made: list[_Cdh] = []

    def make(answers: list[tuple[int, bytes]]) -> _Cdh:
        made.append(_Cdh(answers))
        return made[-1]

    yield make
    for c in made:
        c.close()


def test_cdh_key_is_the_deployment_key(
    tmp_path: Path,
    daemon_factory: Factory,
    pool_factory: Callable[..., SharedKVPool],
    cdh_factory: Callable[[list[tuple[int, bytes]]], _Cdh],
) -> None:
    """A daemon keyed by the CDH (after two 503s: the CDH starting beside it)
    stores blocks a daemon keyed by a file holding the same key restores."""
    secret = os.urandom(32)
    cdh = cdh_factory([(503, b""), (503, b""), (200, secret.hex().encode())])
    store = tmp_path / "store"
    pool = pool_factory(num_pages=4)
    data = fill_random(pool)
    tenant = tenant_digest(None)
    hashes = chain(2, pool.shape.tokens_per_page)
    a = daemon_factory(*store_flags(store, f"cdh:{RESOURCE}", "--store-cdh-endpoint", cdh.endpoint))
    assert len(cdh.requests) == 3
    with a.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        c.offload(h.pool_id, tenant, hashes, [0, 1])
    wait_objects(store, 2)
    a.stop()
    assert secret.hex() not in a.log()
    b = daemon_factory(*store_flags(store, f"file:{key_file(tmp_path / 'key', secret)}"))
    poison(pool, [0, 1, 2, 3])
    with b.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        c.restore(h.pool_id, tenant, hashes, [2, 3])
        assert pool.read_block(2) == data[0] and pool.read_block(3) == data[1]


def _start(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvseal.server", "--listen", f"unix://{tmp_path}/run/s.sock",
         "--backend", "cpu", "--host-bytes", "1MiB", *flags],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("status", "said"),
    [(401, "HTTP 401"), (403, "HTTP 403"), (404, "HTTP 404"), (500, "HTTP 500")],
)
def test_cdh_refusals_stop_the_start(
    tmp_path: Path,
    cdh_factory: Callable[[list[tuple[int, bytes]]], _Cdh],
    status: int,
    said: str,
) -> None:
    cdh = cdh_factory([(status, b"")])
    flags = store_flags(tmp_path / "store", f"cdh:{RESOURCE}")
    r = _start(tmp_path, *flags, "--store-cdh-endpoint", cdh.endpoint, "--store-key-wait", "0")
    assert r.returncode == 2, r.stderr
    assert said in r.stderr and "--store-key" in r.stderr
    assert len(cdh.requests) == 1  # with no time to wait, nothing is retried


def test_cdh_unreachable_retries_for_the_wait_then_exits_2(
    tmp_path: Path, cdh_factory: Callable[[list[tuple[int, bytes]]], _Cdh]
) -> None:
    closed = cdh_factory([(200, b"")])
    endpoint = closed.endpoint
    closed.close()  # nothing listens there any more
    t0 = time.monotonic()
    r = _start(
        tmp_path,
        *store_flags(tmp_path / "store", f"cdh:{RESOURCE}"),
        "--store-cdh-endpoint", endpoint, "--store-key-wait", "1",
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "connection refused" in r.stderr
    assert time.monotonic() - t0 >= 1.0
