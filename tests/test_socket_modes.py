"""Who checks a peer on the public Unix socket, in each socket mode, and that a
uid outside the allow list never reaches gRPC in any of them.

- owner-only (the default: the daemon's uid, root at most, no --socket-group):
  gRPC listens on the 0600 socket itself and the kernel's permission check is
  the uid check (``connect`` fails EACCES); root passes it whatever is listed;
- relay (other uids listed, or --socket-group): the SO_PEERCRED relay accepts,
  refuses and logs an unlisted uid before a byte reaches gRPC.

A raw probe (no gRPC client) tells the three outcomes apart: refused by the
kernel, accepted and closed by the relay, or answered by gRPC (its HTTP/2
SETTINGS). Other uids run through ``setpriv`` (root needed for those tests).
"""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvseal.server.config import ServerConfig
from kvseal.server.daemon.socket_access import socket_access

from .conftest import start_daemon, wait_serving
from .test_allow_uid import ADMITTED, GROUP, OUTSIDER, REFUSED, _needs_caps, _setpriv

PROBE = r"""
import errno, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(20)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print("REFUSED_BY_KERNEL", errno.errorcode.get(e.errno, e.errno))
    sys.exit(0)
# The HTTP/2 client preface and an empty SETTINGS frame: gRPC answers with its own.
try:
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000"))
    data = s.recv(64)
except OSError:  # closed under us (EPIPE, ECONNRESET)
    data = b""
print("GRPC_ANSWERED" if data else "CLOSED_BY_RELAY")
"""
KERNEL, RELAY, GRPC = "REFUSED_BY_KERNEL EACCES", "CLOSED_BY_RELAY", "GRPC_ANSWERED"

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to run peers as other uids",
)


# ------------------------------------------------------------ the decision


def _access(*uids: int, group: str | None = None) -> tuple[int, bool]:
    cfg = ServerConfig(listen="unix:///unused/kvseal.sock", allow_uids=uids, socket_group=group)
    a = socket_access(cfg)
    return a.mode, a.relay


def test_the_relay_runs_exactly_when_the_kernel_check_would_differ_from_the_list() -> None:
    me = os.geteuid()
    other = me + 4242
    assert _access() == (0o600, False)  # default: the daemon's own uid
    assert _access(me) == (0o600, False)
    assert _access(me, 0) == (0o600, False)  # root passes a 0600 socket anyway
    assert _access(me, other) == (0o666, True)
    assert _access(other) == (0o666, True)  # the daemon's own uid not listed
    assert _access(me, group=str(os.getgid())) == (0o660, True)
    if me != 0:
        # Only root listed: the kernel would admit the daemon's uid, the relay does not.
        assert _access(0) == (0o600, True)


# ------------------------------------------------------------ real peers


def probe(path: str, uid: int | None = None, gid: int | None = None) -> str:
    """Connect to ``path`` as ``uid`` (None: this process) and say what happened."""
    prefix = [] if uid is None else _setpriv(uid, uid if gid is None else gid, _CAPS[0])
    r = subprocess.run(
        [*prefix, sys.executable, "-S", "-c", PROBE, path],
        capture_output=True,
        text=True,
        timeout=60,
        cwd="/",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip()


_CAPS: list[bool] = []


@pytest.fixture
def base() -> Iterator[Path]:
    """A work directory every uid can traverse (pytest's own tmp is root-only)."""
    if not _CAPS:
        _CAPS.append(_needs_caps())
    d = Path(tempfile.mkdtemp(prefix="kvseal-socket-modes-"))
    d.chmod(0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


MODES = {
    # mode: (daemon flags, [(uid, gid, expected probe outcome)], relay?)
    "owner-only": ([], [(None, None, GRPC), (REFUSED, None, KERNEL)], False),
    "allow-uid": (
        ["--allow-uid", str(ADMITTED), "--allow-uid", "0"],
        [(ADMITTED, None, GRPC), (REFUSED, None, RELAY), (None, None, GRPC)],
        True,
    ),
    "socket-group": (
        ["--allow-uid", str(ADMITTED), "--allow-uid", "0", "--socket-group", str(GROUP)],
        [
            (ADMITTED, GROUP, GRPC),
            (OUTSIDER, GROUP, RELAY),  # may open the socket, not listed
            (REFUSED, None, KERNEL),  # not in the group: the 0660 mode keeps it out
        ],
        True,
    ),
}


@needs_root
@pytest.mark.parametrize("mode", MODES)
def test_a_disallowed_uid_never_reaches_grpc(base: Path, mode: str) -> None:
    flags, peers, relay = MODES[mode]
    d = start_daemon(base / "d", *flags)
    try:
        for uid, gid, expected in peers:
            assert probe(d.socket, uid, gid) == expected, (mode, uid, gid)
        log = d.log()
        private = list(Path(d.socket).parent.glob(".kvseal-*"))
        assert bool(private) == relay
        if relay:
            assert f"uid {REFUSED if mode == 'allow-uid' else OUTSIDER}: uid not in" in log
        else:
            assert "no relay" in log and "refused connection" not in log
    finally:
        assert d.stop() == 0


def _daemon_as(uid: int, work: Path, *flags: str) -> tuple[subprocess.Popen[bytes], str, Path]:
    """A daemon running as ``uid`` (its socket directory its own, created by it)."""
    work.mkdir()
    os.chown(work, uid, uid)
    sock, log = str(work / "run" / "kvseal.sock"), work / "daemon.log"
    args = [sys.executable, "-m", "kvseal.server", "--listen", "unix://" + sock]
    args += ["--backend", "cpu", "--host-bytes", "16MiB", "--grace", "2", *flags]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*_setpriv(uid, uid, _CAPS[0]), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd="/",
            env={**os.environ, "HOME": "/", "PYTHONDONTWRITEBYTECODE": "1"},
        )
    try:
        wait_serving("unix://" + sock, proc, log)  # as root: admitted in both modes below
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, sock, log


def _stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=30)


@needs_root
def test_owner_only_daemon_of_another_uid_admits_its_uid_and_root_only(base: Path) -> None:
    proc, sock, log = _daemon_as(ADMITTED, base / "d")
    try:
        st = os.stat(sock)
        assert st.st_uid == ADMITTED and stat.S_IMODE(st.st_mode) == 0o600
        assert probe(sock, ADMITTED) == GRPC
        assert probe(sock, REFUSED) == KERNEL
        assert probe(sock) == GRPC  # root: CAP_DAC_OVERRIDE passes any mode (documented)
        assert "no relay" in log.read_text()
    finally:
        assert _stop(proc) == 0
    assert not os.path.exists(sock)  # removed on the way out


@needs_root
def test_a_list_without_the_daemons_own_uid_keeps_the_relay(base: Path) -> None:
    proc, sock, log = _daemon_as(ADMITTED, base / "d", "--allow-uid", "0")
    try:
        assert probe(sock) == GRPC  # root, listed
        assert probe(sock, ADMITTED) == RELAY  # the daemon's own uid, not listed
        assert f"uid {ADMITTED}: uid not in the allow list" in log.read_text()
    finally:
        assert _stop(proc) == 0
