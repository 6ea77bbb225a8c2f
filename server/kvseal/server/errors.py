"""Domain errors of the daemon and the single table that maps them to gRPC.

Every error raised for a request is a :class:`KVSealError`; its ``reason`` is
one of the proto's ``ErrorReason`` names, sent to the client in trailing
metadata (``kvseal-error``) next to the status code, so that clients can act on
it (e.g. re-register on ``UNKNOWN_POOL``) without parsing messages.
"""

from __future__ import annotations

import grpc

ERROR_METADATA_KEY = "kvseal-error"
# Bounds on what a reply may carry back. gRPC sends the status message as the
# ``grpc-message`` trailer, percent-encoding every byte outside printable ASCII,
# and a trailer block over its limit (8 KiB by default) turns the reply into a
# transport error (RESOURCE_EXHAUSTED): an input must never decide the status.
MAX_ECHO_CHARS = 64  # of one echoed user value
MAX_MESSAGE_CHARS = 1024  # of a whole status message, after escaping


def _printable(text: str) -> str:
    """``text`` with every character outside printable ASCII backslash-escaped
    (so a message can neither forge log lines nor grow when percent-encoded)."""
    if text.isascii() and text.isprintable():
        return text
    return "".join(c if " " <= c <= "~" else ascii(c)[1:-1] for c in text)


def echo(value: str | bytes) -> str:
    """A user-supplied value as an error message may quote it: quoted, escaped to
    printable ASCII, at most ``MAX_ECHO_CHARS`` characters of it, then
    ``...(N bytes)`` when it was longer. Bytes are shown as hex."""
    if isinstance(value, bytes):
        head = value[: MAX_ECHO_CHARS // 2].hex()
        size = len(value)
        cut = size > MAX_ECHO_CHARS // 2
    else:
        head = ascii(value[:MAX_ECHO_CHARS])
        size = len(value.encode("utf-8", "surrogatepass"))
        cut = len(value) > MAX_ECHO_CHARS
    return f"{head}...({size} bytes)" if cut else head


def bound_message(message: str) -> str:
    """``message`` escaped to printable ASCII and cut to ``MAX_MESSAGE_CHARS``."""
    total = len(message)
    text = _printable(message[:MAX_MESSAGE_CHARS])
    if total <= MAX_MESSAGE_CHARS and len(text) <= MAX_MESSAGE_CHARS:
        return text
    suffix = f"...({total} chars)"
    return text[: MAX_MESSAGE_CHARS - len(suffix)] + suffix


class KVSealError(Exception):
    """Base class. ``message`` is safe to send to the client and to log: it is
    bounded and printable ASCII whatever the caller passed (see :func:`echo`
    for quoting user values, which every raiser should use)."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: str = "ERROR_REASON_UNSPECIFIED"

    def __init__(self, message: str) -> None:
        message = bound_message(message)
        super().__init__(message)
        self.message = message


class BadRequest(KVSealError):
    """The request is malformed; nothing was changed."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "BAD_REQUEST"


class PageOutOfRange(BadRequest):
    """A page id is outside the pool; checked before any byte is copied."""

    reason = "PAGE_OUT_OF_RANGE"


class UnknownPool(KVSealError):
    """The pool id was never registered, or was unregistered/replaced."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "UNKNOWN_POOL"


class PoolNameTaken(KVSealError):
    """RegisterPool under a name whose pool another engine holds (an open
    HoldPool stream) without that registration's owner token: nothing was
    mapped or replaced; the holder's pool is untouched."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "POOL_NAME_TAKEN"


class BlockNotPresent(KVSealError):
    """A block to restore is not READY in the host tier (absent or pending)."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "BLOCK_NOT_PRESENT"


class TenantDropped(KVSealError):
    """An Offload lost a race with a Drop of its tenant: the keys its blocks
    were sealed under were destroyed while it ran, so nothing was stored (the
    drop wins, as if it came after the offload). A concurrency outcome, not a
    malformed request: a retry seals under the tenant's fresh keys."""

    code = grpc.StatusCode.ABORTED
    reason = "TENANT_DROPPED"


class CapacityExhausted(KVSealError):
    """The host tier cannot make room without evicting pinned/pending blocks."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "CAPACITY_EXHAUSTED"


class HandleUnusable(KVSealError):
    """A pool buffer handle cannot be mapped (missing, too small, refused)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "HANDLE_UNUSABLE"


class BackendMismatch(KVSealError):
    """The pool was registered for a backend this daemon does not run."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "BACKEND_MISMATCH"


class ObserverPoolTransfer(KVSealError):
    """Offload or Restore on an observer pool, which has no memory to move
    bytes from or to; nothing was read, written or reserved."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "OBSERVER_POOL"


class IntegrityFailure(KVSealError):
    """A sealed block failed authentication: the host altered, swapped,
    replayed or removed it. The block is never served."""

    code = grpc.StatusCode.DATA_LOSS
    reason = "INTEGRITY_FAILURE"


class ShuttingDown(KVSealError):
    """The daemon is draining or has stopped serving after an integrity abort."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "SHUTTING_DOWN"


class StoreUnavailable(KVSealError):
    """The store tier could not do its part (a filesystem error, not
    tampering); what the host tier had to do was done."""

    code = grpc.StatusCode.UNAVAILABLE


class EngineNotReady(KVSealError):
    """The engine's CUDA event (``cuda_event_ipc_handle``) did not complete in time:
    nothing was read from or written to its pool."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "ENGINE_NOT_READY"


class DeadlinePassed(KVSealError):
    """The request's cutoff (its deadline less the client's grace) passed: the
    daemon stopped before touching another page and published nothing it read
    for the request (see ``kvseal.server.deadline``)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "DEADLINE_PASSED"


class RequestCancelled(KVSealError):
    """The call ended early (cancelled, or its connection dropped): the daemon
    stopped at its next page touch and published nothing for the request."""

    code = grpc.StatusCode.CANCELLED
    reason = "CANCELLED"


class EventsOverflow(KVSealError):
    """A WatchEvents subscriber fell behind; it must resubscribe and resync."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "CAPACITY_EXHAUSTED"
