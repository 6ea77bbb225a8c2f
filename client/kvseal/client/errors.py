"""The client's one exception, :class:`KVSealRpcError`, and how a failure's
state is named for logs.

A failure carries the gRPC status code and the daemon's stable reason (the
``kvseal-error`` trailing metadata, an ``ErrorReason`` name). The reason is the
daemon's *verdict*: a failure that has one was reported by the daemon itself,
so the request is over on its side; a failure without one (our deadline, a
dropped connection, a closed channel) says nothing about what the daemon is
still doing (see :mod:`kvseal.client.transfer`).
"""

from __future__ import annotations

from typing import Any

import grpc

ERROR_METADATA_KEY = "kvseal-error"


class KVSealRpcError(Exception):
    """A failed call: ``code`` (grpc.StatusCode), ``reason`` (the daemon's
    ErrorReason name, or "" when the daemon was not reached) and ``details``."""

    def __init__(self, code: grpc.StatusCode, reason: str, details: str) -> None:
        super().__init__(f"{code.name}{f' ({reason})' if reason else ''}: {details}")
        self.code = code
        self.reason = reason
        self.details = details
        # False only when the request certainly never left this process
        # (e.g. the client was closed): then the daemon cannot be touching
        # its pages.
        self.sent = True

    @classmethod
    def from_rpc(cls, err: grpc.RpcError) -> KVSealRpcError:
        reason = ""
        call: Any = err
        try:
            for key, value in call.trailing_metadata() or ():
                if key == ERROR_METADATA_KEY:
                    reason = str(value)
        except Exception:  # noqa: S110 - no metadata when the daemon was not reached
            pass
        return cls(call.code(), reason, call.details() or "")


def failure_state(err: KVSealRpcError) -> str:
    """``CODE`` or ``CODE/REASON``: what changes when a failure is worth logging
    again (callers log once per state, not once per call)."""
    return f"{err.code.name}/{err.reason}" if err.reason else err.code.name
