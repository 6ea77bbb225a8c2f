"""Who may reach the public Unix socket: its mode and group, its directory, and
the private directory for gRPC's own socket (behind the SO_PEERCRED relay)."""

from __future__ import annotations

import grp
import logging
import os
import pwd
import stat
import tempfile
from dataclasses import dataclass

from kvseal.server.config import ServerConfig

log = logging.getLogger("kvseal")


@dataclass(frozen=True)
class SocketAccess:
    """Who may open the public socket file, and who then checks the peer.

    ``mode``: the socket's mode. ``gid``: its group (None: the daemon's).
    ``dir_search``: the search ("x") bit the socket directory needs so that the
    admitted uids can reach the socket and its lock file (0: none).
    ``relay``: the SO_PEERCRED relay checks each peer against the allow list
    (``kvseal.server.peercred.PeerCredGate``); False: gRPC listens on the socket
    itself and the kernel's permission check on the 0600 socket is the check
    (``kvseal.server.peercred.listen_owner_only``).
    """

    mode: int
    gid: int | None
    dir_search: int
    summary: str
    relay: bool = True


def socket_access(cfg: ServerConfig) -> SocketAccess:
    """Derive the socket's mode and group from ``--socket-group`` and the allow list.

    - ``--socket-group G``: 0660 in group G, the directory group-searchable;
    - otherwise, uids other than the daemon's (and root, which passes any mode)
      in the allow list: 0666, the directory searchable by all: every local uid
      can connect, and the gate refuses (and logs) every uid not in the list;
    - otherwise: 0600. When the daemon's own uid is in the list (with root at
      most), the kernel's check on a 0600 socket admits exactly that uid, and
      root: gRPC listens there itself, no relay. Otherwise (e.g. only root
      listed) the relay still refuses the daemon's own uid.

    Exits (status 2) when the group does not exist.
    """
    if cfg.socket_group is not None:
        name = cfg.socket_group.strip()
        try:
            gid = int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
        except KeyError:
            raise SystemExit(f"kvseal-server: --socket-group {name}: no such group") from None
        for uid in sorted(cfg.effective_allow_uids - {0}):
            if not _in_group(uid, gid):
                log.warning(
                    "allowed uid %d is not a member of socket group %d: it cannot open the socket",
                    uid,
                    gid,
                )
        return SocketAccess(0o660, gid, 0o010, f"mode 0660, group {gid}")
    others = cfg.effective_allow_uids - {os.geteuid(), 0}
    if others:
        return SocketAccess(
            0o666,
            None,
            0o001,
            f"mode 0666 for allowed uids {sorted(others)} (SO_PEERCRED admits only the allow "
            "list; --socket-group narrows who can connect at all)",
        )
    uid = os.geteuid()
    if uid in cfg.effective_allow_uids:
        return SocketAccess(
            0o600,
            None,
            0,
            f"mode 0600, owner-only: the kernel admits uid {uid}{'' if uid == 0 else ' and root'}"
            "; no relay",
            relay=False,
        )
    return SocketAccess(0o600, None, 0, "mode 0600")


def _in_group(uid: int, gid: int) -> bool:
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return True  # unknown here (e.g. a uid of another container): cannot tell
    if pw.pw_gid == gid:
        return True
    try:
        return pw.pw_name in grp.getgrgid(gid).gr_mem
    except KeyError:
        return False


def prepare_unix_dir(path: str, access: SocketAccess | None = None) -> bool:
    """Make sure nobody but this uid (or root) controls the socket directory.

    Creates it 0700 if missing (plus the search bit ``access`` needs, and its
    group). Refuses (exit 2) a directory that is a symlink, or owned by another
    uid: its owner could replace the socket and answer the engine in kvseal's
    name. Returns
    whether the directory is *private* (ours and not writable by group/others);
    a shared one (e.g. a Kubernetes emptyDir, root-owned 0777, reachable only
    from the pod) is accepted with a warning, and gRPC's own socket then goes
    elsewhere.
    """
    access = access or SocketAccess(0o600, None, 0, "mode 0600")
    d = os.path.dirname(path) or "."
    if not os.path.lexists(d):
        os.makedirs(d, mode=0o700, exist_ok=True)
        st = os.lstat(d)
        if st.st_uid == os.geteuid():
            if access.gid is not None:
                os.chown(d, -1, access.gid)
            os.chmod(d, 0o700 | access.dir_search)
    st = os.lstat(d)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise SystemExit(
            f"kvseal-server: socket directory {d} is not a directory (or is a symlink)"
        )
    if st.st_uid not in (os.geteuid(), 0):
        raise SystemExit(
            f"kvseal-server: socket directory {d} is owned by uid {st.st_uid}: refusing to use it "
            "(its owner could replace the socket)"
        )
    private = st.st_uid == os.geteuid() and not st.st_mode & 0o022
    if not private:
        log.warning(
            "socket directory %s is writable by others (mode %o): fine for a pod-private volume, "
            "not on a shared host",
            d,
            stat.S_IMODE(st.st_mode),
        )
    return private


def grant_search(path: str, access: SocketAccess) -> None:
    """Give the admitted uids the search bit they need on the socket directory
    (of ours: never read or write, never on someone else's). Called once the
    socket lock is held, so a refused second daemon changes nothing."""
    d = os.path.dirname(path) or "."
    st = os.lstat(d)
    reachable = st.st_mode & 0o001 or (
        access.dir_search == 0o010 and st.st_gid == access.gid and st.st_mode & 0o010
    )
    if access.dir_search and not reachable:
        # A directory in another group than the socket's gets the "others" search
        # bit: the socket's own mode (0660) still keeps non-members from connecting.
        bit = access.dir_search if access.gid in (None, st.st_gid) else 0o001
        if st.st_uid == os.geteuid():
            os.chmod(d, stat.S_IMODE(st.st_mode) | bit)
            st = os.lstat(d)
            log.info(
                "socket directory %s: added search permission (mode %o)",
                d,
                stat.S_IMODE(st.st_mode),
            )
        else:
            log.warning(
                "socket directory %s (mode %o, owner uid %d) cannot be searched by the allowed "
                "uids: they cannot reach the socket",
                d,
                stat.S_IMODE(st.st_mode),
                st.st_uid,
            )


def make_private_dir(socket_dir: str, socket_dir_private: bool) -> str:
    """A fresh 0700 directory (random name: nothing can be planted there in
    advance) for gRPC's own socket.

    Where: in the socket directory when that is private; else in the system
    temp directory if it is sticky or private (nobody else can rename our
    entry there); else, e.g. in a Kubernetes pod whose emptyDir volumes are
    all 0777, back in the socket directory, which is then no less exposed
    than the public socket itself (reachable only from the pod).
    """
    base = socket_dir
    if not socket_dir_private:
        tmp = tempfile.gettempdir()
        st = os.lstat(tmp)
        if st.st_mode & stat.S_ISVTX or (st.st_uid == os.geteuid() and not st.st_mode & 0o022):
            base = tmp
        else:
            log.warning("no private place for the internal socket; using %s", socket_dir)
    d = tempfile.mkdtemp(prefix=".kvseal-", dir=base)
    st = os.lstat(d)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:  # pragma: no cover
        raise SystemExit(f"kvseal-server: {d} is not a private directory")
    return d
