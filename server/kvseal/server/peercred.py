"""Peer-credential gate for the public Unix socket.

grpcio exposes neither the accepted socket nor the peer's credentials, so the
daemon puts a small splice in front of gRPC: it accepts on the public socket,
reads the peer's uid with ``SO_PEERCRED`` (set by the kernel at connect time,
so it cannot be forged), refuses uids that are not allowed, and otherwise
relays bytes both ways to gRPC's own socket, which sits in a 0700 directory
only the daemon's uid can enter. Costs one extra local hop per message (see
``make bench``: round trip through the gate vs direct).

Runs an asyncio loop on one thread with callback protocols (no coroutine
per message); backpressure pauses the reading side when a write buffer fills.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterable

log = logging.getLogger("kvseal.peercred")
_UCRED = struct.Struct("3i")  # pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected ``sock``."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


class _Relay(asyncio.Protocol):
    """One direction's endpoint of a relayed connection.

    Plain protocols (callbacks, no coroutines) keep the relay's cost per
    message to two ``write`` calls. Flow control: when the other side's
    transport buffers too much, it pauses reading here, and resumes later.
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Relay | None = None
        self.pending: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.write(data)
        else:
            self.pending.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    # The peer's transport calls these when *its* write buffer crosses the
    # high/low water marks; the data it buffers comes from our side.
    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


class _Downstream(_Relay):
    """The engine's side: checks SO_PEERCRED, then connects upstream."""

    def __init__(self, gate: PeerCredGate) -> None:
        super().__init__()
        self.gate = gate

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        assert self.transport is not None
        pid, uid, _ = peer_credentials(self.transport.get_extra_info("socket"))
        if uid not in self.gate.allowed:
            self.gate.denied += 1
            self.gate.log_refusal(pid, uid)
            self.transport.close()
            return
        # Ids only: a connection carries no secret the log could leak.
        log.info("admitted connection from pid %d uid %d", pid, uid)
        self.gate.connections.add(self)
        self.transport.pause_reading()
        self._task = asyncio.get_running_loop().create_task(self._connect_upstream())

    def connection_lost(self, exc: Exception | None) -> None:
        self.gate.connections.discard(self)
        super().connection_lost(exc)

    async def _connect_upstream(self) -> None:
        assert self.transport is not None
        loop = asyncio.get_running_loop()
        try:
            _, up = await loop.create_unix_connection(_Relay, self.gate.internal_path)
        except OSError as e:
            if self.gate.draining:
                # Accepted just before stop_accepting(): gRPC stopped listening for
                # the shutdown. Expected, not an error; the client sees UNAVAILABLE.
                log.info("refused a connection: kvseal is shutting down (%s)", e)
            else:
                log.error("cannot reach the gRPC socket: %s", e)
            self.transport.close()
            return
        assert isinstance(up, _Relay) and up.transport is not None
        self.peer, up.peer = up, self
        for chunk in self.pending:
            up.transport.write(chunk)
        self.pending.clear()
        if self.transport.is_closing():
            up.transport.close()
        else:
            self.transport.resume_reading()


class PeerCredGate:
    """Accept on ``public_path``; relay allowed peers to ``internal_path``.

    ``start`` binds the public socket (mode 0600 unless ``mode`` says
    otherwise; group ``gid`` when given) before returning, so a client that
    sees the socket can connect. The caller must hold the socket's lock
    (``kvseal.server.locks``): binding replaces whatever file is at the path.
    The socket's mode only says who may *try*: ``SO_PEERCRED`` against the
    allow list is the gate.
    """

    REFUSAL_LOG_INTERVAL_S = 10.0  # per uid: a looping client cannot flood the log

    def __init__(
        self,
        public_path: str,
        internal_path: str,
        allowed_uids: Iterable[int],
        mode: int = 0o600,
        gid: int | None = None,
    ) -> None:
        self.public_path = public_path
        self.internal_path = internal_path
        self.allowed = frozenset(allowed_uids)
        self.mode = mode
        self.gid = gid
        self.denied = 0
        self.draining = False  # stop_accepting() was called: shutdown has begun
        self._refusals: dict[int, tuple[float, int]] = {}  # uid -> (last logged, since)
        self.connections: set[_Downstream] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kvseal-peercred", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._server: asyncio.base_events.Server | None = None

    def log_refusal(self, pid: int, uid: int) -> None:
        """Log a refused peer, at most once per uid every REFUSAL_LOG_INTERVAL_S
        (the ones in between are counted in the next line and in ``denied``)."""
        now = time.monotonic()
        last, since = self._refusals.get(uid, (-1e18, 0))
        if now - last < self.REFUSAL_LOG_INTERVAL_S:
            self._refusals[uid] = (last, since + 1)
            return
        if len(self._refusals) > 1024:  # bounded: uids are few, but never trust that
            self._refusals.clear()
        self._refusals[uid] = (now, 0)
        more = f" ({since} more refused since the last line)" if since else ""
        log.warning(
            "refused connection from pid %d uid %d: uid not in the allow list%s", pid, uid, more
        )

    def start(self) -> None:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._bind())
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    async def _bind(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.public_path)
        # Create the socket file with restrictive permissions from the start.
        old = os.umask(0o777 & ~self.mode)
        try:
            loop = asyncio.get_running_loop()
            self._server = await loop.create_unix_server(
                lambda: _Downstream(self), path=self.public_path
            )
        finally:
            os.umask(old)
        if self.gid is not None:
            os.chown(self.public_path, -1, self.gid)
        os.chmod(self.public_path, self.mode)

    def stop_accepting(self) -> None:
        """Shutdown has begun: accept no new connection from now on (a client that
        connects is refused by the kernel, ECONNREFUSED: its gRPC channel fails the
        call UNAVAILABLE at once), while the connections already relayed keep
        working so that requests in flight can finish. The socket file stays (and
        so does the daemon's socket lock) until :meth:`stop`. Idempotent; returns
        once the listening socket is closed."""
        self.draining = True
        if not self._thread.is_alive() or self._server is None:
            return
        server = self._server

        async def close() -> None:
            server.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=5)

    def stop(self) -> None:
        """Stop accepting, close relayed connections, remove the socket file."""
        if not self._thread.is_alive():
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for conn in list(self.connections):
                if conn.transport is not None:
                    conn.transport.close()  # closes the upstream half too
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.public_path)
