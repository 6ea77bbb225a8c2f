"""Errors of the sealed store tier (:mod:`kvseal.server.store`).

Every message is safe to log: it names paths, lengths, modes, HTTP statuses and
object names (keyed digests), never a byte of key material or plaintext, and
never echoes text a key could have been pasted into (see ``keysource``).

Not :class:`~kvseal.server.errors.KVSealError` subclasses: the store is a
library; the daemon's store tier (``kvseal.server.cache.storetier``) maps
them onto gRPC statuses and the ``--on-integrity-failure`` policy
(docs/store.md, "In the daemon").
"""

from __future__ import annotations


class StoreError(Exception):
    """Base class of every error the store raises."""


class KeySourceError(StoreError):
    """The deployment key could not be obtained (unreadable or unsafe file, a
    malformed key, the confidential-data-hub refused or is unreachable).

    ``retryable`` is True where trying again later may succeed (connection
    refused, a timeout, an HTTP 5xx): the CDH starts beside the daemon and may
    not be up yet."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class StoreLayoutError(StoreError):
    """The store directory cannot be used as configured (its layout file
    disagrees with the configuration, or the capacity is too small)."""


class ObjectTooLarge(StoreError):
    """A put larger than the configured ``max_object_bytes``; nothing written."""


class ScopeChanged(StoreError):
    """A tenant's store epoch changed (dropped, or its marker replaced) while a
    put or get of it ran: nothing was published or served. The caller treats it
    as a miss."""


class StoreIntegrityError(StoreError):
    """An object (or a tenant's scope marker) in the store failed a check: it
    was tampered with, moved, truncated or replaced by something that is not
    ours. Never returned as data; the object has been removed.

    The daemon maps this onto its ``--on-integrity-failure`` policy, exactly
    like an authentication failure of a block in the host region."""


class RecordFormatError(StoreIntegrityError):
    """The bytes are not a well-formed record (checked before any cipher)."""


class RecordTruncated(RecordFormatError):
    """Fewer bytes than the header, or than the header announces."""


class BadMagic(RecordFormatError):
    """The first bytes are not a kvseal store record's magic."""


class UnsupportedVersion(StoreError):
    """A record format version this code does not read. Not an integrity
    failure: a newer replica sharing the store may have written it, so the
    store treats it as a miss (and leaves it in place)."""


class WrongKind(RecordFormatError):
    """A block object where a scope marker was expected, or the reverse, or an
    unknown kind."""


class LengthMismatch(RecordFormatError):
    """The record's length field disagrees with its size (trailing bytes), or it
    exceeds what the store accepts."""


class NotARegularFile(RecordFormatError):
    """Something that is not a regular file sits at an object's name (a FIFO, a
    directory, a symlink): never opened for reading beyond ``O_NONBLOCK``."""


class ForeignKey(StoreIntegrityError):
    """The record names another deployment key than this store's. Names are
    keyed by the deployment key, so a record of another key never sits at one
    of our names unless it was moved there."""


class RecordAuthenticationFailed(StoreIntegrityError):
    """AES-GCM authentication failed: the ciphertext, tag, header or binding
    (namespace, tenant, epoch, block hash) do not match. Says nothing more."""


class StoreUnavailable(OSError):
    """A remote backend (an S3 server) is down, slow, refusing, or answered
    something that is not its protocol. An ``OSError``, so the daemon treats it
    as a filesystem error: a miss or a skipped spill, never a stall and never
    an integrity failure. Carries the operation and the service's error code,
    never a credential."""
