"""The peer-credential relay during a graceful shutdown: once draining starts it
accepts no new connection (refused by the kernel) while relayed ones keep
working, and a connection it can no longer relay is not logged as an ERROR."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvseal.server.peercred import PeerCredGate


@pytest.fixture
def echo_server(tmp_path: Path) -> Iterator[str]:
    """A real Unix-socket echo server standing in for gRPC's internal socket."""
    path = str(tmp_path / "internal.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(4096):
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield path
    stop.set()
    srv.shutdown(socket.SHUT_RDWR)
    srv.close()


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    return s


def _echo(s: socket.socket, data: bytes) -> bytes:
    s.sendall(data)
    got = b""
    while len(got) < len(data):
        chunk = s.recv(4096)
        if not chunk:
            break
        got += chunk
    return got


def test_draining_gate_refuses_new_connections_and_keeps_relayed_ones(
    tmp_path: Path, echo_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    public = str(tmp_path / "public.sock")
    gate = PeerCredGate(public, echo_server, {os.getuid()})
    gate.start()
    try:
        with caplog.at_level(logging.INFO, logger="kvseal.peercred"):
            relayed = _connect(public)
            assert _echo(relayed, b"before") == b"before"
            gate.stop_accepting()
            gate.stop_accepting()  # idempotent
            with pytest.raises(ConnectionRefusedError):
                _connect(public).close()
            # The connection relayed before the drain still carries its requests.
            assert _echo(relayed, b"in flight") == b"in flight"
            relayed.close()
        assert os.path.exists(public)  # removed only by stop(), after the drain
    finally:
        gate.stop()
    assert not os.path.exists(public)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def _dropped(s: socket.socket) -> bool:
    """The gate closed this connection (after logging why)."""
    with s:
        return s.recv(1) == b""


def test_unreachable_grpc_socket_is_an_error_only_when_not_draining(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = str(tmp_path / "no-grpc.sock")  # gRPC not listening (stopped, or broken)
    gate = PeerCredGate(str(tmp_path / "public.sock"), missing, {os.getuid()})
    gate.start()
    try:
        with caplog.at_level(logging.INFO, logger="kvseal.peercred"):
            assert _dropped(_connect(gate.public_path))
            errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
            assert errors and errors[0].startswith("cannot reach the gRPC socket"), errors
            caplog.clear()
            # A connection accepted just as the drain began (stop_accepting() not
            # yet run on the loop): gRPC has stopped listening; that is the
            # shutdown, not a fault.
            gate.draining = True
            assert _dropped(_connect(gate.public_path))
            assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
            assert any("shutting down" in r.getMessage() for r in caplog.records)
    finally:
        gate.stop()
