"""Peer-credential gate for the public Unix socket.

grpcio exposes neither the accepted socket nor the peer's credentials, so the
daemon puts a small splice in front of gRPC: it accepts on the public socket,
reads the peer's uid with ``SO_PEERCRED`` (set by the kernel at connect time,
so it cannot be forged), refuses uids that are not allowed, and otherwise
relays bytes both ways to gRPC's own socket, which sits in a 0700 directory
only the daemon's uid can enter. Costs one extra local hop per message (see
``make bench``: round trip through the gate vs direct).

Runs an asyncio loop on one thread; backpressure comes from ``drain``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
import threading
from collections.abc import Iterable

log = logging.getLogger("kvseal.peercred")
_UCRED = struct.Struct("3i")  # pid, uid, gid


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected ``sock``."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


class PeerCredGate:
    """Accept on ``public_path``; relay allowed peers to ``internal_path``.

    ``start`` binds the public socket (mode 0600 unless ``mode`` says
    otherwise) before returning, so a client that sees the socket can connect.
    """

    def __init__(
        self, public_path: str, internal_path: str, allowed_uids: Iterable[int], mode: int = 0o600
    ) -> None:
        self.public_path = public_path
        self.internal_path = internal_path
        self.allowed = frozenset(allowed_uids)
        self.mode = mode
        self.denied = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kvseal-peercred", daemon=True)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._server: asyncio.AbstractServer | None = None

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
            self._server = await asyncio.start_unix_server(self._serve, path=self.public_path)
        finally:
            os.umask(old)
        os.chmod(self.public_path, self.mode)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        pid, uid, _ = peer_credentials(sock)
        if uid not in self.allowed:
            self.denied += 1
            log.warning(
                "refused connection from pid %d uid %d: uid not in the allow list", pid, uid
            )
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(self.internal_path)
        except OSError as e:
            log.error("cannot reach the gRPC socket: %s", e)
            writer.close()
            return
        await asyncio.gather(
            self._pump(reader, up_writer), self._pump(up_reader, writer), return_exceptions=True
        )

    @staticmethod
    async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(1 << 18):
                dst.write(data)
                await dst.drain()
        finally:
            dst.close()

    def stop(self) -> None:
        """Stop accepting, close relayed connections, remove the socket file."""
        if not self._thread.is_alive():
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.public_path)
