"""The gRPC channel to one daemon: connection and retry settings, and the
trace context each call carries.

Why the settings are what they are (a call must wait up to its own deadline
for a connection being made, but fail at once when no daemon listens; only
idempotent calls are retried) is said next to each.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
from kvseal.client.config import ClientConfig

# Calls that are safe to repeat: gRPC's own retry policy repeats them on
# UNAVAILABLE, bounded by attempts and by the call's deadline. Offload and
# restore move data and are never retried (the engine decides).
IDEMPOTENT_METHODS = ("Lookup", "Touch", "Stats")


def service_config(retries: int) -> str:
    """The channel's service config: the retry policy of the idempotent calls
    and of the health check, ``retries`` attempts at most (first included)."""
    return json.dumps(
        {
            "methodConfig": [
                {
                    "name": [
                        {"service": "kvseal.v1.KVSeal", "method": m} for m in IDEMPOTENT_METHODS
                    ]
                    + [{"service": "grpc.health.v1.Health"}],
                    "retryPolicy": {
                        "maxAttempts": max(2, retries),
                        "initialBackoff": "0.01s",
                        "maxBackoff": "0.2s",
                        "backoffMultiplier": 2,
                        "retryableStatusCodes": ["UNAVAILABLE"],
                    },
                }
            ]
        }
    )


def connect_timeout_ms(cfg: ClientConfig) -> int:
    """How long one connection attempt may take: at least every configured deadline."""
    longest = max(20.0, cfg.timeout_s, cfg.lookup_timeout_s, cfg.transfer_timeout_s)
    return int(longest * 1000)


def open_channel(cfg: ClientConfig) -> grpc.Channel:
    """A channel to ``cfg.target``: plaintext on ``unix:`` sockets (the daemon's
    peer-credential gate admits the caller), mutual TLS on ``tcp://``."""
    options: list[tuple[str, Any]] = [
        ("grpc.enable_retries", 1 if cfg.retries > 1 else 0),
        ("grpc.service_config", service_config(cfg.retries)),
        # Reconnect quickly after a daemon restart instead of gRPC's
        # default back-off of up to 2 minutes.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        # Despite its name, gRPC uses this as the *minimum connect timeout*: a
        # connection attempt (socket connect plus the HTTP/2 handshake) is
        # abandoned after it, and queued calls then fail UNAVAILABLE early. So it
        # must cover the longest deadline a call is given (and never be below
        # gRPC's own 20 s default): every call then waits up to its own deadline
        # for a connection that is being made. A refused connection (no daemon)
        # still fails at once, and the back-off above still applies.
        ("grpc.min_reconnect_backoff_ms", connect_timeout_ms(cfg)),
    ]
    if cfg.target.startswith("unix:"):
        return grpc.insecure_channel(cfg.target, options=options)
    if cfg.tls_server_name:
        options.append(("grpc.ssl_target_name_override", cfg.tls_server_name))
    creds = grpc.ssl_channel_credentials(cfg.tls_root_ca, cfg.tls_key, cfg.tls_cert)
    return grpc.secure_channel(cfg.target.removeprefix("tcp://"), creds, options=options)


def trace_metadata() -> tuple[tuple[str, str], ...] | None:
    """W3C trace context of the caller's current span, when the engine uses
    OpenTelemetry (an optional import: the client does not depend on it)."""
    try:
        from opentelemetry import propagate  # noqa: PLC0415
    except ImportError:
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items()) or None
