"""The SO_PEERCRED relay moves bytes faithfully: in order, both ways, under
backpressure (a reader slower than its writer), across many connections at
once, and ends a connection as a whole (a side that closes after writing has
all its bytes delivered first). Real sockets, a real upstream server."""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kvseal.server.peercred import PeerCredGate

Serve = Callable[[socket.socket], None]


def _echo(conn: socket.socket) -> None:
    while data := conn.recv(65536):
        conn.sendall(data)


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[Callable[[Serve], str]]:
    """Start a Unix-socket server (standing in for gRPC's internal socket) whose
    connections run ``serve``; returns its path."""
    servers: list[socket.socket] = []

    def start(serve: Serve) -> str:
        path = str(tmp_path / f"up{len(servers)}.sock")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(64)
        servers.append(srv)

        def run(conn: socket.socket) -> None:
            with conn:
                serve(conn)

        def accept() -> None:
            while True:
                try:
                    conn, _ = srv.accept()
                except OSError:
                    return
                threading.Thread(target=run, args=(conn,), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()
        return path

    yield start
    for srv in servers:
        srv.shutdown(socket.SHUT_RDWR)
        srv.close()


@pytest.fixture
def gate_to(tmp_path: Path) -> Iterator[Callable[..., PeerCredGate]]:
    gates: list[PeerCredGate] = []

    def make(internal: str, allowed: set[int] | None = None) -> PeerCredGate:
        g = PeerCredGate(
            str(tmp_path / f"public{len(gates)}.sock"), internal, allowed or {os.getuid()}
        )
        g.start()
        gates.append(g)
        return g

    yield make
    for g in gates:
        g.stop()


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(path)
    return s


def _recv_all(s: socket.socket, slow: bool = False) -> bytes:
    parts = []
    while chunk := s.recv(4096 if slow else 1 << 20):
        parts.append(chunk)
        if slow and len(parts) % 64 == 0:
            time.sleep(0.002)  # a slow reader: the relay's write side fills up
    return b"".join(parts)


def test_large_transfers_both_ways_with_a_slow_reader(
    upstream: Callable[[Serve], str], gate_to: Callable[..., PeerCredGate]
) -> None:
    gate = gate_to(upstream(_echo))
    payload = os.urandom(12 * 1024 * 1024)  # far more than socket buffers hold
    s = _connect(gate.public_path)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(_recv_all(s, slow=True)))
    reader.start()
    view = memoryview(payload)
    for off in range(0, len(payload), 100_003):  # odd sizes: no framing to lean on
        s.sendall(view[off : off + 100_003])
    s.shutdown(socket.SHUT_WR)  # the relay ends the pair; echoed bytes come first
    reader.join(timeout=60)
    s.close()
    assert got and hashlib.sha256(got[0]).digest() == hashlib.sha256(payload).digest()


def test_a_side_that_closes_after_writing_has_every_byte_delivered(
    upstream: Callable[[Serve], str], gate_to: Callable[..., PeerCredGate]
) -> None:
    blob = os.urandom(6 * 1024 * 1024)

    def send_and_close(conn: socket.socket) -> None:
        conn.sendall(blob)  # then the handler returns and the connection closes

    gate = gate_to(upstream(send_and_close))
    with _connect(gate.public_path) as s:
        assert _recv_all(s, slow=True) == blob  # then EOF: the relay closed it


def test_many_connections_at_once_keep_their_own_bytes(
    upstream: Callable[[Serve], str], gate_to: Callable[..., PeerCredGate]
) -> None:
    gate = gate_to(upstream(_echo))
    errors: list[str] = []

    def client(i: int) -> None:
        with _connect(gate.public_path) as s:
            for n in range(50):
                msg = f"{i}:{n}:".encode() + os.urandom(1 + (i * 131 + n * 17) % 3000)
                s.sendall(msg)
                got = b""
                while len(got) < len(msg):
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    got += chunk
                if got != msg:
                    errors.append(f"client {i} message {n}")
                    return

    threads = [threading.Thread(target=client, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors


def test_closing_the_engine_side_closes_the_grpc_side(
    upstream: Callable[[Serve], str], gate_to: Callable[..., PeerCredGate]
) -> None:
    ended = threading.Event()

    def wait_for_eof(conn: socket.socket) -> None:
        _echo(conn)
        ended.set()

    gate = gate_to(upstream(wait_for_eof))
    s = _connect(gate.public_path)
    s.sendall(b"hello")
    assert s.recv(5) == b"hello"
    s.close()
    assert ended.wait(10)


def test_an_unlisted_uid_is_refused_and_logged_once_per_interval(
    upstream: Callable[[Serve], str],
    gate_to: Callable[..., PeerCredGate],
    caplog: pytest.LogCaptureFixture,
) -> None:
    reached = threading.Event()

    def never(conn: socket.socket) -> None:
        reached.set()

    gate = gate_to(upstream(never), allowed={os.getuid() + 4242})
    with caplog.at_level(logging.INFO, logger="kvseal.peercred"):
        for _ in range(3):
            with _connect(gate.public_path) as s:
                assert s.recv(1) == b""  # closed by the gate, nothing relayed
    assert gate.denied == 3
    refusals = [r.getMessage() for r in caplog.records if "refused connection" in r.getMessage()]
    assert len(refusals) == 1 and f"uid {os.getuid()}: uid not in the allow list" in refusals[0]
    assert not reached.is_set()
