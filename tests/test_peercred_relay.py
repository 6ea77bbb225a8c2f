"""The SO_PEERCRED relay moves bytes faithfully: in order, both ways, under
backpressure (a reader slower than its writer), across many connections at
once, and ends a connection as a whole (a side that closes after writing has
all its bytes delivered first). Its upstream abstract names are random and
tell nothing (they are listed in /proc/net/unix for every local user), and a
name bound first by another process never drops a connection. Real sockets,
a real upstream server."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kvseal.server import peercred
from kvseal.server.peercred import PeerCredGate, relayed_uid

from .conftest import until

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

    def make(internal: str, allowed: set[int] | None = None, tag: str = "") -> PeerCredGate:
        g = PeerCredGate(
            str(tmp_path / f"public{len(gates)}.sock"), internal, allowed or {os.getuid()}, tag=tag
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


# ---------------------------------------------------------------- upstream names

NAME = re.compile(r"kvseal-peer-[0-9a-f]{32}")


def _listed_names() -> set[str]:
    """The relay's abstract names as any local user sees them."""
    with open("/proc/net/unix") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return {r[7][1:] for r in rows if len(r) == 8 and r[7].startswith("@kvseal-peer-")}


def _echoing_upstream(
    upstream: Callable[[Serve], str],
) -> tuple[str, list[str]]:
    """An echo server that records each relayed connection's abstract name."""
    names: list[str] = []

    def serve(conn: socket.socket) -> None:
        addr = conn.getpeername()
        names.append(addr[1:].decode() if isinstance(addr, bytes) else addr)
        _echo(conn)

    return upstream(serve), names


def _round_trip(s: socket.socket, msg: bytes) -> bytes:
    s.sendall(msg)
    got = b""
    while len(got) < len(msg) and (chunk := s.recv(65536)):
        got += chunk
    return got


def test_upstream_names_are_random_and_tell_no_uid_or_sequence(
    upstream: Callable[[Serve], str], gate_to: Callable[..., PeerCredGate]
) -> None:
    """Each relayed connection's name is 128 random bits and nothing else: no
    uid, gate tag or sequence number in /proc/net/unix. relayed_uid still tells
    the admitted uid from the name, for this gate's tag only, while the
    connection lives."""
    path, names = _echoing_upstream(upstream)
    gate = gate_to(path, tag="tag0feed")
    conns = [_connect(gate.public_path) for _ in range(3)]
    for i, s in enumerate(conns):
        assert _round_trip(s, b"ping %d" % i) == b"ping %d" % i
    assert len(names) == 3 and len(set(names)) == 3
    listed = _listed_names()
    for name in names:
        assert NAME.fullmatch(name), name
        assert name in listed
        assert "uid" not in name and "tag0feed" not in name
        assert relayed_uid(f"unix-abstract:{name}", "tag0feed") == os.getuid()
        assert relayed_uid(f"unix-abstract:{name}", "another-gate") is None
    for s in conns:
        s.close()
    # Closed: the names are forgotten (a later holder of one would tell nothing).
    until(
        lambda: all(relayed_uid(f"unix-abstract:{n}", "tag0feed") is None for n in names),
        "the relay forgets closed connections' names",
    )
    assert not set(names) & _listed_names()


def test_names_bound_first_by_another_process_drop_no_connection(
    upstream: Callable[[Serve], str], gate_to: Callable[..., PeerCredGate]
) -> None:
    """A local process binds the names the relay used to pick next
    (``kvseal-peer-<tag>-uid<uid>-<n>``, read off /proc/net/unix): every
    connection is still relayed, under a name of its own."""
    tag = "guessme0"
    squatters = []
    for n in range(1, 33):
        sq = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sq.bind(f"\0kvseal-peer-{tag}-uid{os.getuid()}-{n}")
        squatters.append(sq)
    try:
        path, names = _echoing_upstream(upstream)
        gate = gate_to(path, tag=tag)
        for i in range(8):
            with _connect(gate.public_path) as s:
                assert _round_trip(s, b"survives %d" % i) == b"survives %d" % i
        assert len(names) == 8 and all(NAME.fullmatch(n) for n in names)
    finally:
        for sq in squatters:
            sq.close()


def test_a_taken_name_is_retried_with_a_new_one(
    upstream: Callable[[Serve], str],
    gate_to: Callable[..., PeerCredGate],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Force the draw to hit names another socket holds (a collision no one can
    arrange by guessing): the relay draws again and the connection lives."""
    taken = ["0" * 32, "1" * 32]
    squatters = []
    for t in taken:
        sq = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sq.bind(f"\0kvseal-peer-{t}")
        squatters.append(sq)
    draws = iter(taken)
    real = peercred.fresh_upstream_name
    monkeypatch.setattr(peercred, "fresh_upstream_name", lambda: next(draws, None) or real())
    try:
        path, names = _echoing_upstream(upstream)
        gate = gate_to(path, tag="retry")
        with _connect(gate.public_path) as s:
            assert _round_trip(s, b"still here") == b"still here"
            assert len(names) == 1 and NAME.fullmatch(names[0]) and names[0][12:] not in taken
            assert relayed_uid(f"unix-abstract:{names[0]}", "retry") == os.getuid()
    finally:
        for sq in squatters:
            sq.close()
