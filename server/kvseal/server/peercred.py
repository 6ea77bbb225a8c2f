"""Who may talk to the daemon over its public Unix socket, and who checks it.

Two ways, chosen by ``kvseal.server.main.socket_access`` from the allow list:

- **Owner-only** (the default: only the daemon's own uid is admitted, root
  possibly listed too, no ``--socket-group``): gRPC listens on the public
  path itself (:func:`listen_owner_only`). The socket is created 0600 and owned
  by the daemon's uid, so the kernel's permission check at ``connect(2)``
  (write permission on the socket inode) admits exactly the processes whose
  filesystem uid is the daemon's, plus any process holding ``CAP_DAC_OVERRIDE``
  (root, normally), which can connect to any socket whatever its mode. That is
  the allow list, except that root is admitted even when not listed; root can
  also read the daemon's memory, so refusing it at the socket protected
  nothing. (The filesystem uid is the effective uid that ``SO_PEERCRED``
  reports unless ``setfsuid`` changed it, which without ``CAP_SETUID`` picks
  only among the process's own uids: one that could present the daemon's uid
  here could present it as its effective uid too.) No hop, no relay thread,
  nothing logged per connection.
- **Relay** (other uids admitted, or ``--socket-group``): grpcio exposes
  neither the accepted socket nor the peer's credentials, so
  :class:`PeerCredGate` accepts on the public socket, reads the peer's uid with
  ``SO_PEERCRED`` (set by the kernel at connect time, so it cannot be forged),
  refuses and logs uids that are not allowed, and relays an admitted
  connection's bytes both ways to gRPC's own socket, which sits in a 0700
  directory only the daemon's uid can enter. The check runs once per
  connection; after it, the relay only moves bytes (``make bench``: round trip
  through the relay vs gRPC's own socket).

  The relay binds its side of each connection to gRPC to an abstract address
  named by 128 fresh random bits and nothing else (``kvseal-peer-<32 hex>``),
  which gRPC reports as the call's peer: :func:`relayed_uid` looks the name
  up in the relay's table of live connections (name -> gate tag, admitted
  uid), so that a handler can tell which admitted uid calls (the operator's
  Stats view). The names are listed in ``/proc/net/unix`` for every local
  user, so they carry no uid, tag or sequence number, and cannot be guessed:
  no other process can bind the next name first. A name that is taken all
  the same is retried with a new one; the connection is never dropped for
  it. Only processes that can enter the 0700 directory of gRPC's socket (the
  daemon's uid, root) could connect there with an address of their own, and
  they can read the daemon's state anyway.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable

import grpc

_ABSTRACT = "kvseal-peer-"  # the relay's upstream addresses, in the abstract namespace
_PEER_PREFIX = "unix-abstract:" + _ABSTRACT  # ...as gRPC reports them (context.peer())

log = logging.getLogger("kvseal.peercred")
_UCRED = struct.Struct("3i")  # pid, uid, gid
_CHUNK = 256 * 1024  # bytes read per wake-up; also the most one direction buffers
_CONNECT_RETRY_S = 1.0  # how long an admitted peer waits while gRPC's backlog is full
_NAME_TRIES = 8  # random upstream names tried before relaying without one
# Live relayed connections: upstream name (after _ABSTRACT) -> (gate tag, uid).
# Written by the relay threads, read by gRPC handler threads; single dict
# operations (get, set, pop) are atomic under the GIL, which is all they do.
_RELAYED: dict[str, tuple[str, int]] = {}
_IN, _OUT = select.EPOLLIN, select.EPOLLOUT


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected ``sock``."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


def _replace_with_socket(path: str, mode: int, bind: Callable[[], None]) -> None:
    """Remove whatever is at ``path`` and run ``bind``, which creates the socket
    there, under a umask that gives it ``mode`` from its first instant (a chmod
    afterwards would leave a window with a wider mode). The caller holds the
    socket's lock (``kvseal.server.locks``), so nothing it must keep is there."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    old = os.umask(0o777 & ~mode)
    try:
        bind()
    finally:
        os.umask(old)


def listen_owner_only(server: grpc.Server, path: str) -> None:
    """Make ``server`` (not yet started) listen on ``path`` itself, a socket of
    mode 0600 owned by this process's uid: the kernel then admits only that uid
    and holders of ``CAP_DAC_OVERRIDE`` (see the module docstring). gRPC binds
    here, so a client may connect as soon as this returns (its connection is
    served once the server starts); gRPC removes the socket file when it stops.
    Raises OSError when gRPC cannot bind."""

    def bind() -> None:
        if server.add_insecure_port("unix://" + path) == 0:  # pragma: no cover
            raise OSError(f"gRPC cannot listen on {path}")

    _replace_with_socket(path, 0o600, bind)
    if os.stat(path).st_mode & 0o077:  # pragma: no cover - umask honoured above
        raise OSError(f"{path} was not created owner-only")


def relayed_uid(peer: str, tag: str) -> int | None:
    """The uid the relay admitted for a call whose ``context.peer()`` is ``peer``
    (a connection a :class:`PeerCredGate` with this ``tag`` relays now); None
    for any other peer (a direct connection to gRPC's socket, another gate's
    connection, one already closed, TCP)."""
    if not tag or not peer.startswith(_PEER_PREFIX):
        return None
    entry = _RELAYED.get(peer[len(_PEER_PREFIX) :])
    return entry[1] if entry is not None and entry[0] == tag else None


def fresh_upstream_name() -> str:
    """A new upstream name (after ``kvseal-peer-``): 128 random bits in hex."""
    return secrets.token_hex(16)


class _End:
    """One side of a relayed connection: its socket, the bytes read from the other
    side that wait to be written to it, and whether it has sent its EOF (``eof``:
    nothing more to read from it) and been sent ours (``shut``). While bytes
    wait for one side the other is not read, so each direction holds at most one
    read (``_CHUNK``)."""

    __slots__ = ("eof", "fd", "mask", "name", "peer", "pending", "shut", "sock")

    def __init__(self, sock: socket.socket, name: str = "") -> None:
        self.sock = sock
        self.name = name  # the upstream side's entry in _RELAYED ("" for none)
        self.fd = sock.fileno()
        self.peer: _End = self
        self.pending = b""
        self.eof = False
        self.shut = False
        self.mask = _IN  # the epoll interest registered for it (0: not registered)


class PeerCredGate:
    """Accept on ``public_path``; relay allowed peers to ``internal_path``.

    ``start`` binds the public socket (mode 0600 unless ``mode`` says
    otherwise; group ``gid`` when given) before returning, so a client that
    sees the socket can connect. The caller must hold the socket's lock
    (``kvseal.server.locks``): binding replaces whatever file is at the path.
    The socket's mode only says who may *try*: ``SO_PEERCRED`` against the
    allow list is the gate.

    One thread runs an epoll loop: a connection's credentials are checked once
    when it is accepted, then each wake-up reads what arrived and writes it to
    the other side (no per-message objects, no coroutine). A side's EOF reaches
    the other once the bytes before it are written (a half-close); the pair is
    closed when both directions have ended, or at once when either side fails.
    """

    REFUSAL_LOG_INTERVAL_S = 10.0  # per uid: a looping client cannot flood the log

    def __init__(
        self,
        public_path: str,
        internal_path: str,
        allowed_uids: Iterable[int],
        mode: int = 0o600,
        gid: int | None = None,
        tag: str = "",
    ) -> None:
        self.public_path = public_path
        # Tells this gate's connections in _RELAYED (relayed_uid) from other
        # gates'; empty: upstream sockets stay unbound (no uid is told).
        self.tag = tag
        self.internal_path = internal_path
        self.allowed = frozenset(allowed_uids)
        self.mode = mode
        self.gid = gid
        self.denied = 0
        self.draining = False  # stop_accepting() was called: shutdown has begun
        self._refusals: dict[int, tuple[float, int]] = {}  # uid -> (last logged, since)
        self._ends: dict[int, _End] = {}  # fd -> end, both sides of every connection
        # Admitted peers whose gRPC connection waits for room in gRPC's backlog.
        self._waiting: list[tuple[socket.socket, float, int]] = []
        self._listener: socket.socket | None = None
        self._epoll: select.epoll | None = None
        self._wake_r, self._wake_w = -1, -1
        self._commands: list[tuple[str, threading.Event]] = []
        self._commands_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvseal-peercred", daemon=True)
        self._stopped = False

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

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Bind the public socket and start relaying. Raises OSError when the
        socket cannot be bound."""

        def bind() -> None:
            s = socket.socket(
                socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
            )
            try:
                s.bind(self.public_path)
                s.listen(socket.SOMAXCONN)
            except BaseException:
                s.close()
                raise
            self._listener = s

        _replace_with_socket(self.public_path, self.mode, bind)
        assert self._listener is not None
        if self.gid is not None:
            os.chown(self.public_path, -1, self.gid)
        os.chmod(self.public_path, self.mode)
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._epoll.register(self._wake_r, _IN)
        self._epoll.register(self._listener.fileno(), _IN)
        self._thread.start()

    def _command(self, name: str) -> None:
        """Run ``name`` on the loop thread and wait for it (at most 5 s)."""
        done = threading.Event()
        with self._commands_lock:
            self._commands.append((name, done))
        with contextlib.suppress(BlockingIOError):  # a wake-up is already pending
            os.write(self._wake_w, b"\0")
        done.wait(timeout=5)

    def stop_accepting(self) -> None:
        """Shutdown has begun: accept no new connection from now on (a client that
        connects is refused by the kernel, ECONNREFUSED: its gRPC channel fails the
        call UNAVAILABLE at once), while the connections already relayed keep
        working so that requests in flight can finish. The socket file stays (and
        so does the daemon's socket lock) until :meth:`stop`. Idempotent; returns
        once the listening socket is closed."""
        self.draining = True
        if self._thread.is_alive():
            self._command("stop_accepting")

    def stop(self) -> None:
        """Stop accepting, close relayed connections, remove the socket file."""
        if not self._thread.is_alive():
            return
        self.draining = True
        self._command("stop")
        self._thread.join(timeout=5)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.public_path)

    # ------------------------------------------------------------ the loop

    def _run(self) -> None:
        ep = self._epoll
        assert ep is not None
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        ends = self._ends
        while not self._stopped:
            try:
                events = ep.poll(0.01 if self._waiting else -1)
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                continue
            for fd, ev in events:
                try:
                    end = ends.get(fd)
                    if end is not None:
                        if ev & _OUT and end.pending:
                            self._flush(end)
                        if ev & ~_OUT and fd in ends:  # readable, hung up or failed
                            self._pump(end, buf, view)
                    elif fd == self._wake_r:
                        self._run_commands()
                    elif self._listener is not None and fd == self._listener.fileno():
                        self._accept()
                except Exception:  # a bug must cost one connection, not the socket
                    log.exception("relay failure; closing the connection concerned")
                    if fd in ends:
                        self._close(ends[fd])
            if self._waiting:
                self._retry_waiting()
        for end in list(ends.values()):
            self._close(end)  # both sides of each connection
        for sock, _, _ in self._waiting:
            sock.close()
        self._waiting.clear()
        self._close_listener()
        ep.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run_commands(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 4096)
        with self._commands_lock:
            commands, self._commands = self._commands, []
        for name, done in commands:
            self._close_listener()
            if name == "stop":
                self._stopped = True
            done.set()

    def _close_listener(self) -> None:
        if self._listener is not None:
            assert self._epoll is not None
            self._epoll.unregister(self._listener.fileno())
            self._listener.close()
            self._listener = None

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # e.g. EMFILE: the kernel keeps the peer queued
                log.error("cannot accept a connection: %s", e)
                return
            try:
                pid, uid, _ = peer_credentials(conn)
            except OSError as e:  # pragma: no cover - the kernel sets them at connect
                log.error("cannot read a peer's credentials: %s", e)
                conn.close()
                continue
            if uid not in self.allowed:
                self.denied += 1
                self.log_refusal(pid, uid)
                conn.close()
                continue
            # Ids only: a connection carries no secret the log could leak.
            log.info("admitted connection from pid %d uid %d", pid, uid)
            conn.setblocking(False)
            self._connect_upstream(conn, time.monotonic() + _CONNECT_RETRY_S, uid)

    def _connect_upstream(self, conn: socket.socket, give_up_at: float, uid: int) -> None:
        up = socket.socket(
            socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
        )
        name = self._bind_upstream(up, uid) if self.tag else ""
        try:
            up.connect(self.internal_path)
        except OSError as e:
            _RELAYED.pop(name, None)
            up.close()
            # A Unix socket connects at once or not at all: EAGAIN means gRPC's
            # backlog is full (it is not accepting fast enough): try again soon.
            if e.errno == errno.EAGAIN and time.monotonic() < give_up_at:
                self._waiting.append((conn, give_up_at, uid))
                return
            if self.draining:
                # Accepted just before stop_accepting(): gRPC stopped listening for
                # the shutdown. Expected, not an error; the client sees UNAVAILABLE.
                log.info("refused a connection: kvseal is shutting down (%s)", e)
            else:
                log.error("cannot reach the gRPC socket: %s", e)
            conn.close()
            return
        down_end, up_end = _End(conn), _End(up, name)
        down_end.peer, up_end.peer = up_end, down_end
        assert self._epoll is not None
        for end in (down_end, up_end):
            self._ends[end.fd] = end
            self._epoll.register(end.fd, _IN)

    def _bind_upstream(self, up: socket.socket, uid: int) -> str:
        """Bind ``up`` to a fresh random abstract name and enter it in _RELAYED
        for ``uid`` (what :func:`relayed_uid` reads); the name, or "" when no
        name could be bound (the connection is relayed all the same, its calls
        then tell no uid: least privilege, never a dropped connection)."""
        for _ in range(_NAME_TRIES):
            name = fresh_upstream_name()
            try:
                up.bind(f"\0{_ABSTRACT}{name}")  # a failed bind leaves it unbound
            except OSError as e:
                if e.errno == errno.EADDRINUSE:  # taken (never by guessing): another
                    continue
                log.error("cannot bind a relay address: %s", e)
                return ""
            _RELAYED[name] = (self.tag, uid)
            return name
        log.error("no free relay address in %d tries; relaying without the uid", _NAME_TRIES)
        return ""

    def _retry_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        for conn, give_up_at, uid in waiting:
            self._connect_upstream(conn, give_up_at, uid)

    def _pump(self, src: _End, buf: bytearray, view: memoryview) -> None:
        """Move what ``src`` has to its peer. Its EOF is passed on (a half-close,
        once the bytes before it are written); an error closes both sides."""
        dst = src.peer
        if src.eof:  # only a hang-up can report it now: nothing left to read
            return
        try:
            n = src.sock.recv_into(buf)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(src)
            return
        if n == 0:
            src.eof = True
            self._update(src)
            if not dst.pending:
                self._shut(dst)
            return
        if dst.pending:
            # Only after a hang-up or an error (src is not read while dst has bytes
            # waiting): keep the order; what is left in src's buffer is bounded.
            dst.pending += view[:n]
            return
        try:
            sent = dst.sock.send(view[:n])
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(src)
            return
        if sent < n:
            # dst's socket buffer is full: keep the rest and stop reading src until
            # it drains (backpressure then reaches the sender through src's buffer).
            dst.pending = bytes(view[sent:n])
            self._update(dst)
            self._update(src)

    def _flush(self, dst: _End) -> None:
        try:
            sent = dst.sock.send(dst.pending)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(dst)
            return
        dst.pending = dst.pending[sent:]
        if dst.pending:
            return
        self._update(dst)
        self._update(dst.peer)
        if dst.peer.eof:  # the other side had finished: pass its EOF on
            self._shut(dst)

    def _shut(self, end: _End) -> None:
        """Tell ``end`` that its peer will send no more; close the pair once both
        directions have ended."""
        with contextlib.suppress(OSError):  # it may be gone already
            end.sock.shutdown(socket.SHUT_WR)
        end.shut = True
        if end.peer.shut:
            self._close(end)

    def _close(self, end: _End) -> None:
        """Close ``end`` and its peer now."""
        for e in (end, end.peer):
            if self._ends.pop(e.fd, None) is not None:
                self._set_interest(e, 0)
                e.sock.close()
            if e.name:
                _RELAYED.pop(e.name, None)

    def _update(self, end: _End) -> None:
        """Register the interest ``end``'s state calls for: read it until its EOF
        while its peer has nothing waiting, write it while it has bytes waiting.
        An end with neither is not registered at all (epoll would keep
        reporting a hang-up)."""
        if end.fd in self._ends:
            read = not end.eof and not end.peer.pending
            self._set_interest(end, (_IN if read else 0) | (_OUT if end.pending else 0))

    def _set_interest(self, end: _End, mask: int) -> None:
        if mask == end.mask:
            return
        assert self._epoll is not None
        if not mask:
            self._epoll.unregister(end.fd)
        elif not end.mask:
            self._epoll.register(end.fd, mask)
        else:
            self._epoll.modify(end.fd, mask)
        end.mask = mask
