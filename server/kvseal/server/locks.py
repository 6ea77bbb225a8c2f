"""One daemon per socket and per host region: exclusive OFD locks held for the
daemon's lifetime.

Why OFD locks (``F_OFD_SETLK``): they belong to the open file description, not
to the process, so a second lock attempt from the same process conflicts too,
and the kernel drops them when the daemon dies, however it dies (``kill -9``):
a stale lock never blocks a restart, and nothing has to be cleaned up.

The convention clients rely on (``kvseal.client.liveness``):

- the socket lock file is ``<public socket path> + ".lock"``, created if missing
  with mode 0644 (clients only open it read-only to *probe* it with
  ``F_OFD_GETLK``) and never unlinked (unlinking would let two daemons lock two
  different inodes under one name);
- the daemon write-locks the whole file, then writes ``pid=<pid> started=<UTC
  time>`` into it, which names the holder (``F_OFD_GETLK`` reports ``l_pid``
  -1 for OFD locks);
- a ``--host-region`` file is write-locked itself, before it is truncated, so a
  second daemon can never destroy the first one's ciphertext.

Both locks are taken before the daemon touches anything else; failures are
:class:`LockError` with one line for the operator.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import struct
import time

# struct flock on Linux (x86_64, aarch64): short l_type, short l_whence,
# off_t l_start, off_t l_len, pid_t l_pid, padding.
_FLOCK = struct.Struct("@hhqqixxxx")
LOCK_SUFFIX = ".lock"


class LockError(Exception):
    """Another process holds the lock, or the lock file cannot be used."""


def _try_write_lock(fd: int) -> bool:
    """Take an OFD write lock on the whole file; False if someone else holds one."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):  # held by another open file description
            return False
        raise
    return True


def socket_lock_path(socket_path: str) -> str:
    return socket_path + LOCK_SUFFIX


def _holder(fd: int) -> str:
    """What the holder wrote into the lock file (its pid and start time)."""
    try:
        text = os.pread(fd, 200, 0).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return text.splitlines()[0] if text else "pid unknown: it is still starting"


def lock_socket(socket_path: str) -> int:
    """Lock ``socket_path + ".lock"`` for this daemon's lifetime; returns the fd,
    which the caller keeps open until exit (closing it releases the lock).

    Raises LockError naming the holder when another daemon serves this socket
    path, or when the lock file is not a regular file owned by this uid (in a
    shared directory another uid could otherwise plant a file and hold it).
    """
    path = socket_lock_path(socket_path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise LockError(f"cannot open the socket lock file {path}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LockError(f"socket lock file {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise LockError(
                f"socket lock file {path} is owned by uid {st.st_uid}, not {os.geteuid()}: "
                "refusing to use it"
            )
        if not _try_write_lock(fd):
            raise LockError(
                f"another kvseal-server ({_holder(fd)}) serves {socket_path} "
                f"(it holds {path}): refusing to start a second daemon on the same socket"
            )
        # Readable by every uid that may connect: clients probe it, never lock it.
        os.fchmod(fd, 0o644)
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid={os.getpid()} started={started}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _region_holder(path: str) -> str:
    """Best effort: the pid of a process that has ``path`` open (visible for our
    own uid, or every uid when root). Only called to word an error."""
    try:
        target = os.path.realpath(path)
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    with contextlib.suppress(OSError):
                        if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                            return f"pid {pid}"
    except OSError:
        pass
    return "another process"


def lock_region(path: str) -> int:
    """Lock the ``--host-region`` file for this daemon's lifetime, creating it
    (mode 0600) if missing; returns the fd (keep it open until exit).

    Must be called before the region is opened for use: the region truncates
    the file, which must never happen to a file another daemon serves from.
    Raises LockError naming the holder (best effort) if the file is locked.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        raise LockError(f"cannot open host region {path!r}: {e.strerror}") from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LockError(f"host region {path!r} is not a regular file")
        if not _try_write_lock(fd):
            raise LockError(
                f"host region {path} is in use by {_region_holder(path)} (another "
                "kvseal-server holds its lock): refusing to start, which would destroy "
                "its ciphertext"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def same_file(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd`` (not swapped meanwhile)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
