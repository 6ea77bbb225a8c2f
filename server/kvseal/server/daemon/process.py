"""Process set-up: logging (text or JSON lines), hardening (no core dumps, not
ptrace-able), and the systemd readiness protocol."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import os
import resource
import socket
import sys
import time

from kvseal.server.config import ServerConfig

log = logging.getLogger("kvseal")
_PR_SET_DUMPABLE = 4


class JsonFormatter(logging.Formatter):
    """One JSON object per line. Messages never contain key material or
    cache salts: the code that logs passes only ids, counts and digests."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, separators=(",", ":"))


def setup_logging(cfg: ServerConfig) -> None:
    h = logging.StreamHandler(sys.stderr)
    if cfg.log_format == "json":
        h.setFormatter(JsonFormatter())
    else:
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(cfg.log_level)


def harden_process() -> None:
    """Keep key material out of core dumps and away from same-uid debuggers."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_DUMPABLE, 0) failed: errno %d", ctypes.get_errno())


def sd_notify(state: str) -> None:
    """systemd readiness protocol (Type=notify); no-op without NOTIFY_SOCKET."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        try:
            s.sendto(state.encode(), addr)
        except OSError as e:
            log.warning("sd_notify(%s) failed: %s", state, e)
