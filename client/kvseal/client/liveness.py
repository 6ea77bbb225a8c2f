"""Is the daemon process gone? A cheap, side-effect-free probe of its lock.

The daemon holds an OFD write lock on ``<socket path>.lock`` for its whole
life (see ``kvseal.server.locks``); the kernel drops that lock when the
process dies, however it dies. So "the lock file exists and nobody holds a
write lock on it" means no daemon process is alive for that socket, hence no
transfer it started can still touch the engine's pages.

The probe uses ``F_OFD_GETLK``, which only *asks*: it never takes a lock, so a
daemon starting at the same moment is never refused because a client probed.
"""

from __future__ import annotations

import fcntl
import os
import stat
import struct

# struct flock on Linux: short l_type, short l_whence, off_t l_start, off_t
# l_len, pid_t l_pid, padding.
_FLOCK = struct.Struct("@hhqqixxxx")
LOCK_SUFFIX = ".lock"


def _socket_path(target: str) -> str | None:
    """The filesystem path of a Unix-socket target, or None (TCP, abstract...)."""
    if target.startswith("unix://"):
        target = target[len("unix://") :]
    elif target.startswith("unix:"):
        target = target[len("unix:") :]
    elif "://" in target or target.startswith(("dns:", "ipv4:", "ipv6:", "unix-abstract:")):
        return None
    return target or None


def daemon_gone(socket_path: str) -> bool:
    """True only when ``socket_path + ".lock"`` exists and no process holds a
    write lock on it: the daemon that served this socket has exited.

    False when a daemon holds the lock, and whenever it cannot tell (no lock
    file, no permission to open it, a TCP target, any error). Never raises,
    never blocks, never acquires a lock; costs one open, one fstat, one fcntl, one close.
    ``socket_path`` may be a path or a ``unix:`` target.
    """
    try:
        path = _socket_path(socket_path)
        if path is None:
            return False
        fd = os.open(path + LOCK_SUFFIX, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except Exception:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        # Ask whether a read lock could be placed: only a write lock conflicts.
        # l_pid must be 0 for OFD requests.
        probe = _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, 0, 0, 0)
        l_type = _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_OFD_GETLK, probe))[0]
        return bool(l_type == fcntl.F_UNLCK)
    except Exception:
        return False
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
