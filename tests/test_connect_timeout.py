"""A client waits, up to each call's own deadline, for a connection that is
being established.

gRPC's ``min_reconnect_backoff_ms`` doubles as its minimum connect timeout; the
client once set it to 100 ms, so against a daemon whose handshake took longer
every call failed UNAVAILABLE after about 0.13 s whatever its deadline. Here a
real Unix-socket relay accepts at once but waits before splicing to a real
daemon, so the HTTP/2 handshake is slow."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from kvseal.client import (
    ClientConfig,
    EnginePool,
    KVSealClient,
    KVSealRpcError,
    chain_block_hashes,
    tenant_digest,
)
from kvseal.client.shm import SharedKVPool

from .conftest import DaemonProc, fill_random

FP = b"model:connect-timeout"


class SlowRelay:
    """Accepts on ``path``; each connection waits ``delay`` seconds before it is
    spliced to ``upstream`` (nothing is read or answered meanwhile)."""

    def __init__(self, path: str, upstream: str, delay: float) -> None:
        self.path, self.upstream, self.delay = path, upstream, delay
        self.accepted = 0
        self._socks: list[socket.socket] = []
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(path)
        self._srv.listen(16)
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            self.accepted += 1
            self._socks.append(conn)
            threading.Thread(target=self._splice, args=(conn,), daemon=True).start()

    def _splice(self, conn: socket.socket) -> None:
        if self._stop.wait(self.delay):
            return
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.connect(self.upstream)
        except OSError:
            conn.close()
            return
        self._socks.append(up)
        threading.Thread(target=self._pump, args=(up, conn), daemon=True).start()
        self._pump(conn, up)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._stop.set()
        self._srv.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()


@pytest.fixture
def slow(daemon: DaemonProc, tmp_path: Path) -> Iterator[Callable[[float], str]]:
    relays: list[SlowRelay] = []

    def make(delay: float) -> str:
        path = str(tmp_path / f"slow{len(relays)}.sock")
        relays.append(SlowRelay(path, daemon.socket, delay))
        return "unix://" + path

    yield make
    for r in relays:
        r.close()


def test_health_waits_for_a_slow_handshake(slow: Callable[[float], str]) -> None:
    # The handshake takes 1 s, far more than the old 0.1 s connect timeout,
    # far less than the call's 10 s.
    with KVSealClient(ClientConfig(target=slow(1.0), timeout_s=10)) as c:
        assert c.health() == "SERVING"


def test_a_call_gives_up_at_its_own_deadline_not_before(slow: Callable[[float], str]) -> None:
    target = slow(30.0)
    with KVSealClient(ClientConfig(target=target, timeout_s=1.0, retries=1)) as c:
        with pytest.raises(KVSealRpcError) as e:
            c.health()
        # DEADLINE_EXCEEDED: it waited for its deadline; an abandoned connection
        # attempt would have been UNAVAILABLE ("timed out before SETTINGS").
        assert e.value.code is grpc.StatusCode.DEADLINE_EXCEEDED, e.value


def test_engine_pool_first_lookup_does_not_degrade(
    daemon: DaemonProc, slow: Callable[[float], str], pool_factory: Callable[..., SharedKVPool]
) -> None:
    pool = pool_factory(num_pages=4)
    fill_random(pool, [0, 1])
    tenant = tenant_digest(None)
    hashes = chain_block_hashes(list(os.urandom(2 * pool.shape.tokens_per_page)), 4)
    with daemon.client() as direct:
        h = direct.register_pool("seed", FP, pool.geometry())
        assert direct.offload(h.pool_id, tenant, hashes, [0, 1]).stored_blocks == 2
    cfg = ClientConfig(target=slow(1.0), timeout_s=10, lookup_timeout_s=10)
    with KVSealClient(cfg) as c:
        engine = EnginePool(c, "engine", FP, pool.geometry(), hold=False)
        # Registration runs in the background, on the same slow connection: it
        # must wait for the handshake, not give up after gRPC's connect minimum.
        assert engine.wait_ready(20)
        assert engine.lookup(tenant, hashes) == 2
        assert engine.failures == 0
        engine.close()


def test_no_daemon_still_fails_at_once(tmp_path: Path) -> None:
    # Nothing listens: the connection is refused, which is no reason to wait.
    missing = "unix://" + str(tmp_path / "nobody.sock")
    with KVSealClient(ClientConfig(target=missing, timeout_s=30, retries=1)) as c:
        with pytest.raises(KVSealRpcError) as e:
            c.health()
        assert e.value.code is grpc.StatusCode.UNAVAILABLE
