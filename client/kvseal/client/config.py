"""Client configuration: one frozen, validated dataclass (:class:`ClientConfig`)
and the daemon's default socket (:func:`default_target`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvseal.client.hashing import load_tenant_key


def socket_target(path: str) -> str:
    """The gRPC target of a Unix socket path. ``unix://`` takes an absolute
    path only (gRPC reads ``unix://run/k.sock`` as an authority and refuses
    it), so a relative path is made absolute here."""
    return "unix://" + os.path.abspath(path)


def default_target() -> str:
    """KVSEAL_SOCKET (a path or a gRPC target), else the daemon's default
    socket path."""
    sock = os.environ.get("KVSEAL_SOCKET")
    if sock:
        return sock if "://" in sock else socket_target(sock)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(runtime, "kvseal") if runtime else f"/tmp/kvseal-{os.getuid()}"  # noqa: S108
    return "unix://" + os.path.join(base, "kvseal.sock")


@dataclass(frozen=True)
class ClientConfig:
    target: str = field(default_factory=default_target)
    timeout_s: float = 2.0  # control calls (register, stats, drop)
    lookup_timeout_s: float = 0.2  # hot-path lookups
    transfer_timeout_s: float = 30.0  # offload/restore: large batches move GBs
    # Engine contract (README "Engine contract"): the daemon stops touching a
    # transfer's pages this long before the call's gRPC deadline, and a failure
    # the daemon did not report itself is returned no earlier than that
    # deadline. Must cover the request's transit plus one block's copy.
    transfer_grace_s: float = 1.0
    retries: int = 3  # attempts for idempotent calls, first one included
    backoff_initial_s: float = 0.2  # EnginePool: pause after a failure...
    backoff_max_s: float = 10.0  # ...doubling up to this
    tls_root_ca: bytes | None = None  # tcp:// targets: mutual TLS material
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    tls_server_name: str | None = None
    # Key of the tenant digests (hashing.tenant_digest): $KVSEAL_TENANT_KEY_FILE by
    # default, None (unkeyed) when unset. Never sent to the daemon.
    tenant_key: bytes | None = field(default_factory=load_tenant_key, repr=False)

    def __post_init__(self) -> None:
        if min(self.timeout_s, self.lookup_timeout_s, self.transfer_timeout_s) <= 0:
            raise ValueError("timeouts must be positive")
        if not 0.05 <= self.transfer_grace_s <= 60:
            raise ValueError("transfer_grace_s must be in 0.05..60 seconds")
        if not 1 <= self.retries <= 5:
            raise ValueError("retries must be in 1..5 (gRPC caps attempts at 5)")
