"""The engine contract, against a real daemon process: once a transfer call
has returned any failure to the engine, the daemon never reads or writes a
page of that request again, and nothing it read after that is published.

An engine frees a failed transfer's pages at once (vLLM's worker reports the
job failed and the scheduler reallocates the blocks), so the tests do what an
engine does: the instant a call fails, overwrite its pages. Deadlines sweep
from 1 ms to 100 ms over requests large enough to outlast most of them, while
another engine keeps the daemon busy. Every page is checked at the end, after
the daemon has long finished: a late restore write would have replaced the
engine's new bytes, and a late offload read would show up as a published
block holding them.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from kvseal.client import ClientConfig, KVSealClient, KVSealRpcError, tenant_digest
from kvseal.client.shm import SharedKVPool
from kvseal.v1 import kvseal_pb2 as pb

from .conftest import DaemonProc

FP = b"model:contract"
# 1 MiB blocks in 64 per-layer segments: a 32-block request moves 32 MiB.
GEOMETRY = {"tokens_per_page": 16, "num_layers": 16, "num_kv_heads": 8, "head_dim": 128}
BLOCKS = 32
DEADLINES_MS = [1, 2, 4, 7, 12, 20, 35, 60, 100]
REUSED = 0x5A  # what the engine writes into a failed transfer's pages
TENANT = tenant_digest("contract")


@pytest.fixture
def busy_daemon(
    daemon_factory: Callable[..., DaemonProc], pool_factory: Callable[..., SharedKVPool]
) -> Iterator[DaemonProc]:
    """A daemon that another engine keeps busy with its own transfers."""
    d = daemon_factory("--workers", "2", host_bytes="640MiB")
    other = pool_factory(num_pages=8, geometry=GEOMETRY)
    other.write_block(0, os.urandom(other.shape.block_bytes))
    stop = threading.Event()

    def load() -> None:
        with d.client(transfer_timeout_s=30.0) as c:
            pid = c.register_pool("other-engine", FP + b"-other", other.geometry()).pool_id
            tenant = tenant_digest("other")
            n = 0
            while not stop.is_set():
                hashes = [os.urandom(32) for _ in range(4)]
                try:
                    c.offload(pid, tenant, hashes, [0, 1, 2, 3])
                    c.restore(pid, tenant, hashes, [4, 5, 6, 7], release=True)
                except KVSealRpcError:
                    pass
                n += 1

    t = threading.Thread(target=load, daemon=True)
    t.start()
    try:
        yield d
    finally:
        stop.set()
        t.join(30)


def _quiesce(d: DaemonProc) -> None:
    """Give a misbehaving daemon every chance to write late, then make sure
    it is idle: nothing pinned or pending."""
    time.sleep(0.5)
    with d.client() as c:
        for _ in range(100):
            s = c.stats()
            if s.blocks_pinned == 0 and s.blocks_pending == 0:
                return
            time.sleep(0.05)
    raise AssertionError("the daemon did not become idle")


def test_failed_restore_never_writes_a_page_afterwards(
    busy_daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    rounds = len(DEADLINES_MS)
    pool = pool_factory(num_pages=BLOCKS * (rounds + 1), geometry=GEOMETRY)
    src = list(range(BLOCKS))
    content = {p: os.urandom(pool.shape.block_bytes) for p in src}
    for p, data in content.items():
        pool.write_block(p, data)
    hashes = [os.urandom(32) for _ in src]
    failures: dict[str, int] = {}
    with busy_daemon.client(transfer_timeout_s=60.0, lookup_timeout_s=30.0) as c:
        pid = c.register_pool("engine", FP, pool.geometry()).pool_id
        c.offload(pid, TENANT, hashes, src)
        for r, ms in enumerate(DEADLINES_MS, start=1):
            dst = list(range(BLOCKS * r, BLOCKS * (r + 1)))
            try:
                c.restore(pid, TENANT, hashes, dst, timeout=ms / 1000)
            except KVSealRpcError as e:
                # The engine takes its pages back at once.
                for p in dst:
                    pool.fill_page(p, REUSED)
                failures[e.code.name] = failures.get(e.code.name, 0) + 1
                continue
            for i, p in enumerate(dst):
                assert pool.read_block(p) == content[src[i]], f"restore at {ms} ms: wrong bytes"
                pool.fill_page(p, REUSED)  # reused after a success too
    _quiesce(busy_daemon)
    late = [
        p
        for p in range(BLOCKS, BLOCKS * (rounds + 1))
        if pool.read_block(p) != bytes([REUSED]) * pool.shape.block_bytes
    ]
    assert not late, f"{len(late)} page(s) written after their restore returned ({failures})"
    # The sweep must have produced failures, or it tested nothing.
    assert failures.get("DEADLINE_EXCEEDED", 0) >= 1, failures


def test_failed_offload_never_publishes_bytes_written_after_it(
    busy_daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    rounds = len(DEADLINES_MS)
    pool = pool_factory(num_pages=BLOCKS * (rounds + 1), geometry=GEOMETRY)
    scratch = list(range(BLOCKS * rounds, BLOCKS * (rounds + 1)))
    sent: list[tuple[list[bytes], dict[bytes, bytes]]] = []
    failed = 0
    with busy_daemon.client(transfer_timeout_s=60.0, lookup_timeout_s=30.0) as c:
        pid = c.register_pool("engine", FP, pool.geometry()).pool_id
        for r, ms in enumerate(DEADLINES_MS):
            pages = list(range(BLOCKS * r, BLOCKS * (r + 1)))
            hashes = [os.urandom(32) for _ in pages]
            want = {}
            for h, p in zip(hashes, pages, strict=True):
                want[h] = os.urandom(pool.shape.block_bytes)
                pool.write_block(p, want[h])
            sent.append((hashes, want))
            try:
                c.offload(pid, TENANT, hashes, pages, timeout=ms / 1000)
            except KVSealRpcError:
                failed += 1
            # Failed or not, the engine now reuses the pages for other KV.
            for p in pages:
                pool.fill_page(p, REUSED)
        _quiesce(busy_daemon)
        stored = poisoned = 0
        for hashes, want in sent:
            states = c.lookup(pid, TENANT, hashes).states
            ready = [h for h, s in zip(hashes, states, strict=True) if s == pb.BLOCK_READY]
            for i in range(0, len(ready), len(scratch)):
                chunk = ready[i : i + len(scratch)]
                c.restore(pid, TENANT, chunk, scratch[: len(chunk)])
                for h, p in zip(chunk, scratch, strict=True):
                    stored += 1
                    if pool.read_block(p) != want[h]:
                        poisoned += 1
    assert poisoned == 0, f"{poisoned} of {stored} stored block(s) hold bytes written after"
    assert failed >= 1, "no offload failed: the sweep tested nothing"


class _Proxy:
    """A Unix-socket forwarder between a client and the daemon that can cut
    every connection at once (a connection lost mid-call, daemon alive)."""

    def __init__(self, path: str, upstream: str) -> None:
        self.path = path
        self._upstream = upstream
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(path)
        self._server.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self._server.accept()
            except OSError:
                return
            b = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            b.connect(self._upstream)
            with self._lock:
                self._socks += [a, b]
            for x, y in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(x, y), daemon=True).start()

    @staticmethod
    def _pump(x: socket.socket, y: socket.socket) -> None:
        try:
            while data := x.recv(1 << 16):
                y.sendall(data)
        except OSError:
            pass

    def cut(self) -> None:
        with self._lock:
            for s in self._socks:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
            self._socks.clear()

    def close(self) -> None:
        self._server.close()
        self.cut()


def test_lost_connection_returns_only_once_the_daemon_has_stopped(
    busy_daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool], tmp_path: Path
) -> None:
    """The client cannot know what the daemon still does after its connection
    drops, so it returns such a failure only after the call's gRPC deadline
    (by when the daemon has stopped at its cutoff): the pages are safe to
    reuse the moment the call returns."""
    pool = pool_factory(num_pages=BLOCKS * 2, geometry=GEOMETRY)
    src = list(range(BLOCKS))
    for p in src:
        pool.write_block(p, os.urandom(pool.shape.block_bytes))
    hashes = [os.urandom(32) for _ in src]
    dst = list(range(BLOCKS, 2 * BLOCKS))
    with busy_daemon.client() as c:
        c.register_pool("engine", FP, pool.geometry())
    proxy = _Proxy(str(tmp_path / "proxy.sock"), busy_daemon.socket)
    cut = 0
    try:
        cfg = ClientConfig(target="unix://" + proxy.path, transfer_grace_s=0.5)
        with KVSealClient(cfg) as c:
            pid = c.register_pool("engine", FP, pool.geometry()).pool_id
            c.offload(pid, TENANT, hashes, src, timeout=60)
            for _ in range(5):
                timer = threading.Timer(0.003, proxy.cut)
                timer.start()
                try:
                    c.restore(pid, TENANT, hashes, dst, timeout=0.5)
                except KVSealRpcError as e:
                    assert e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), e
                    cut += 1
                timer.join()
                for p in dst:
                    pool.fill_page(p, REUSED)
                time.sleep(0.3)  # a daemon still running would write now
                assert all(
                    pool.read_block(p) == bytes([REUSED]) * pool.shape.block_bytes for p in dst
                ), "a page was written after the failed call returned"
    finally:
        proxy.close()
    assert cut >= 1, "the connection was never cut mid-call"


def test_grace_over_the_limit_is_refused(
    daemon: DaemonProc, pool_factory: Callable[..., SharedKVPool]
) -> None:
    pool = pool_factory(num_pages=2)
    with daemon.client() as c:
        pid = c.register_pool("engine", FP, pool.geometry()).pool_id
        stub_req = pb.RestoreRequest(
            pool_id=pid, tenant=TENANT, block_hashes=[os.urandom(32)], page_ids=[0], grace_ms=60001
        )
        with pytest.raises(KVSealRpcError) as ei:
            c._call("Restore", stub_req, 5.0)
        assert ei.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.reason == "BAD_REQUEST"
        assert "grace_ms" in ei.value.details


def test_daemon_killed_mid_transfer_fails_without_waiting_out_the_deadline(
    daemon_factory: Callable[..., DaemonProc], pool_factory: Callable[..., SharedKVPool]
) -> None:
    """A dead daemon touches nothing: the client sees its lock released
    (``kvseal.client.liveness``) and returns the failure without sitting out
    a long transfer deadline."""
    d = daemon_factory("--workers", "2", host_bytes="128MiB")
    pool = pool_factory(num_pages=BLOCKS * 2, geometry=GEOMETRY)
    src = list(range(BLOCKS))
    for p in src:
        pool.write_block(p, os.urandom(pool.shape.block_bytes))
    hashes = [os.urandom(32) for _ in src]
    outcome: list[BaseException | None] = []
    with d.client() as c:
        pid = c.register_pool("engine", FP, pool.geometry()).pool_id
        c.offload(pid, TENANT, hashes, src, timeout=60)

        def restore_forever() -> None:
            try:
                for _ in range(1000):
                    c.restore(pid, TENANT, hashes, list(range(BLOCKS, 2 * BLOCKS)), timeout=300)
                outcome.append(None)
            except KVSealRpcError as e:
                outcome.append(e)

        t = threading.Thread(target=restore_forever, daemon=True)
        t.start()
        time.sleep(0.2)
        d.proc.kill()
        d.proc.wait()
        t.join(60)  # far below the 300 s deadline the client would otherwise sit out
        assert not t.is_alive(), "the client waited for a dead daemon"
    assert outcome and isinstance(outcome[0], KVSealRpcError), outcome
    assert outcome[0].code == grpc.StatusCode.UNAVAILABLE, outcome[0]
