"""Daemon configuration: one frozen, validated dataclass.

Command-line flags and ``KVSEAL_*`` environment variables map onto it in
``daemon.cli``; everything below reads only this object.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from enum import Enum


class IntegrityPolicy(Enum):
    ABORT = "abort"  # fail the request, stop serving, exit with EXIT_INTEGRITY
    DROP = "drop"  # fail the request with DATA_LOSS, evict the blocks, keep serving


EXIT_INTEGRITY = 3  # exit status after an integrity abort (systemd: do not restart)


class StorePolicy(Enum):
    """When blocks reach the store tier (``--store-policy``; docs/store.md)."""

    WRITE_THROUGH = "write-through"  # every block the host tier stores is also spilled
    SPILL = "spill"  # only blocks the host tier evicts are spilled (write-back)


_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*", re.IGNORECASE)  # fullmatch
_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "KI": 1024,
    "KIB": 1024,
    "M": 1000**2,
    "MB": 1000**2,
    "MI": 1024**2,
    "MIB": 1024**2,
    "G": 1000**3,
    "GB": 1000**3,
    "GI": 1024**3,
    "GIB": 1024**3,
    "T": 1000**4,
    "TB": 1000**4,
    "TI": 1024**4,
    "TIB": 1024**4,
}


def parse_size(text: str) -> int:
    """'64GiB' -> 68719476736. Raises ValueError with the offending text."""
    m = _SIZE.fullmatch(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 512MiB, 64GiB)")
    unit = (m.group(2) or "").upper()
    if unit not in _UNITS:
        raise ValueError(f"unknown size unit in {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def default_socket_path() -> str:
    """systemd's RUNTIME_DIRECTORY, else XDG_RUNTIME_DIR/kvseal, else
    /tmp/kvseal-<uid>; the socket is ``kvseal.sock`` inside it."""
    runtime = os.environ.get("RUNTIME_DIRECTORY")
    if runtime:
        base = runtime.split(":")[0]
    elif os.environ.get("XDG_RUNTIME_DIR"):
        base = os.path.join(os.environ["XDG_RUNTIME_DIR"], "kvseal")
    else:
        base = f"/tmp/kvseal-{os.getuid()}"  # noqa: S108 - private 0700 dir, checked at bind
    return os.path.join(base, "kvseal.sock")


@dataclass(frozen=True)
class ServerConfig:
    listen: str = field(default_factory=lambda: "unix://" + default_socket_path())
    backend: str = "auto"  # auto | cpu | cuda
    device: int = 0
    host_bytes: int = 4 * 1024**3
    host_region: str | None = None
    integrity_policy: IntegrityPolicy = IntegrityPolicy.ABORT
    allow_uids: tuple[int, ...] = ()  # empty: the daemon's own uid
    # Peers whose Stats without a pool id get the daemon-wide counts (they are
    # admitted too). A uid other than the daemon's own (and root) needs the
    # SO_PEERCRED relay to be told apart; the daemon's own uid here makes every
    # peer of an owner-only socket an operator (they all share that uid).
    operator_uids: tuple[int, ...] = ()
    # Group (name or gid) that may open the Unix socket (mode 0660); None: the
    # mode follows the allow list (0600 for the daemon's uid alone, else 0666).
    socket_group: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    metrics_address: str | None = None
    workers: int = 0  # CPU sealing threads; 0: min(4, cpu count)
    grpc_threads: int = 16
    max_batch_blocks: int = 4096
    max_batch_bytes: int = 2 * 1024**3
    max_pools: int = 64
    max_watchers: int = 8
    max_holds: int = 8  # open HoldPool streams (each occupies one gRPC thread)
    rekey_after: int = 2**32
    grace_seconds: float = 5.0
    engine_event_timeout: float = 30.0  # cuda: how long an engine's IPC event may stay pending
    # Seconds between checks that the device still works while idle (a lost CUDA
    # context: health NOT_SERVING, exit 4); 0 turns the check off.
    device_check_interval: float = 5.0
    log_format: str = "text"
    log_level: str = "INFO"
    # The sealed store tier under the host tier (docs/store.md); off when
    # store_dir is None, and then nothing below is used.
    store_dir: str | None = None
    # An S3 store instead of a directory (--store s3://BUCKET/PREFIX?...;
    # store.s3): everything below applies to it as well, but store_fsync.
    store_url: str | None = None
    store_bytes: int = 16 * 1024**3
    store_key: str = "local"  # local | file:PATH | cdh:REPO/TYPE/TAG
    store_cdh_endpoint: str = "http://127.0.0.1:8006"
    # A CDH endpoint off the guest's loopback is refused unless this is set
    # (the key would cross the host's network in plaintext; store.keysource).
    store_cdh_insecure_endpoint: bool = False
    store_key_wait: float = 30.0  # seconds the cdh source retries while the CDH is not up
    store_policy: StorePolicy = StorePolicy.WRITE_THROUGH
    store_locality: str = "local"  # the store events' locality: local | remote
    store_fsync: bool = True  # flush each record before it is published
    store_max_block_bytes: int = 16 * 1024**2  # blocks larger than this are not spilled

    def __post_init__(self) -> None:
        if not (self.listen.startswith("unix://") or self.listen.startswith("tcp://")):
            raise ValueError(
                f"--listen must be unix:///path or tcp://host:port, not {self.listen!r}"
            )
        if self.listen.startswith("tcp://") and not (
            self.tls_cert and self.tls_key and self.tls_client_ca
        ):
            raise ValueError(
                "tcp:// listening requires mutual TLS: give --tls-cert, --tls-key "
                "and --tls-client-ca (plaintext TCP is refused)"
            )
        if self.backend not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--backend must be auto, cpu or cuda, not {self.backend!r}")
        if self.host_bytes < 1024 * 1024:
            raise ValueError("--host-bytes must be at least 1MiB")
        for name in (
            "max_batch_blocks",
            "max_batch_bytes",
            "max_pools",
            "max_watchers",
            "max_holds",
            "rekey_after",
            "grpc_threads",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.workers < 0:
            raise ValueError("--workers must be >= 0")
        if not self.engine_event_timeout > 0:
            raise ValueError("--engine-event-timeout must be > 0 seconds")
        if not self.device_check_interval >= 0:  # also refuses NaN
            raise ValueError("--device-check-interval must be >= 0 seconds (0: off)")
        if self.socket_group is not None and not self.listen.startswith("unix://"):
            raise ValueError("--socket-group applies to a unix:// socket only")
        if self.socket_group is not None and not self.socket_group.strip():
            raise ValueError("--socket-group must name a group or a gid")
        if self.log_format not in ("text", "json"):
            raise ValueError("--log-format must be text or json")
        if self.store_dir is not None and self.store_url is not None:
            raise ValueError("give --store-dir or --store, not both")
        if self.store_url is not None and not self.store_url.startswith(("s3://", "mooncake://")):
            raise ValueError(
                "--store must be s3://BUCKET/PREFIX?..., mooncake://MASTER:PORT?... or dir:///PATH"
            )
        if self.store_dir is not None or self.store_url is not None:
            if self.store_dir is not None and not self.store_dir.strip():
                raise ValueError("--store-dir must name a directory")
            if self.store_max_block_bytes < 1:
                raise ValueError("--store-max-block-bytes must be positive")
            if self.store_bytes <= self.store_max_block_bytes:
                raise ValueError(
                    "--store-bytes must exceed --store-max-block-bytes (one block per shard "
                    "at the very least; 8 or more per shard is the store's own sizing)"
                )
            if not 0 <= self.store_key_wait <= 3600:  # also refuses NaN
                raise ValueError("--store-key-wait must be in [0, 3600] seconds")

    @property
    def unix_path(self) -> str | None:
        return self.listen[len("unix://") :] if self.listen.startswith("unix://") else None

    @property
    def effective_allow_uids(self) -> frozenset[int]:
        return frozenset(self.allow_uids or (os.getuid(),)) | frozenset(self.operator_uids)

    @property
    def effective_workers(self) -> int:
        return self.workers or max(1, min(4, os.cpu_count() or 1))
