"""A block sealed or opened a chunk at a time (format v1, the same bytes as
the one-shot calls): what :meth:`BlockSealer.begin_seal` and
:meth:`BlockSealer.begin_open` in :mod:`kvseal.server.sealing` return.

The cipher contexts are built there, under the sealer's lock, from the
epoch's key; this module only drives them and keeps the rules of use.
Streaming lets a caller run AES-GCM over a cache-sized private buffer while
the rest of a block is still being read or written.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import AEADDecryptionContext, AEADEncryptionContext
from kvseal.server.sealformat import (
    AuthenticationFailed,
    KeyDestroyed,
    SealingError,
    SealRecord,
)


class Epoch(Protocol):
    """What a stream reads of its key epoch (``sealing._Epoch``)."""

    @property
    def index(self) -> int: ...

    @property
    def destroyed(self) -> bool: ...


class SealStream:
    """One block being sealed a chunk at a time, in place, in private memory.

    Call :meth:`update` on consecutive chunks of the block's plaintext (each
    becomes ciphertext where it lies, so the GHASH reads only memory the host
    cannot touch), then :meth:`finish` once all ``size`` bytes went through.
    A chunk's ciphertext may be published as soon as ``update`` returns; the
    block is valid only once ``finish`` returned its record. On any failure,
    the stream's own or the caller's, call :meth:`abort` (idempotent): the
    nonce stays burnt and the epoch's reference goes, as with a failed
    ``BlockSealer.seal_into``. A scope destroyed meanwhile makes
    ``finish`` raise KeyDestroyed (the ciphertext must then not be kept).
    Not thread-safe: one stream, one thread.
    """

    __slots__ = ("_ctx", "_epoch", "_forget", "_left", "_nonce")

    def __init__(
        self,
        ctx: AEADEncryptionContext,
        epoch: Epoch,
        nonce: bytes,
        size: int,
        forget: Callable[[int], None],
    ) -> None:
        self._forget: Callable[[int], None] | None = forget
        self._epoch = epoch
        self._nonce = nonce
        self._ctx: AEADEncryptionContext | None = ctx
        self._left = size

    def update(self, chunk: memoryview) -> None:
        """Encrypt ``chunk`` (the next bytes of the block) in place."""
        ctx = self._ctx
        if ctx is None:
            raise SealingError("the stream is finished or aborted")
        if len(chunk) > self._left:
            self.abort()
            raise SealingError("more bytes than the block has")
        try:
            ctx.update_into(chunk, chunk)
        except BaseException:
            self.abort()
            raise
        self._left -= len(chunk)

    def finish(self) -> SealRecord:
        """The block's record (tag from the running GHASH). SealingError if
        bytes are missing; KeyDestroyed if the scope was destroyed meanwhile."""
        ctx = self._ctx
        if ctx is None:
            raise SealingError("the stream is finished or aborted")
        try:
            if self._left:
                raise SealingError(f"{self._left} bytes of the block were never sealed")
            ctx.finalize()
            tag = ctx.tag
            if self._epoch.destroyed:  # wiped while it ran: not to be used
                raise KeyDestroyed(
                    "the tenant's keys were destroyed (dropped) while its block was "
                    "sealed; nothing was stored"
                )
        except BaseException:
            self.abort()
            raise
        self._ctx = None  # its expanded key is freed (cleansed) with it
        self._forget = None
        return SealRecord(self._epoch.index, self._nonce, tag)

    def abort(self) -> None:
        """Give up the block: burn its nonce, release the epoch reference."""
        self._ctx = None
        forget, self._forget = self._forget, None
        if forget is not None:
            forget(self._epoch.index)


class OpenStream:
    """One block being authenticated and decrypted a chunk at a time, in
    place, in private memory (a snapshot the caller took of the ciphertext).

    What :meth:`update` leaves in its chunks is **unauthenticated** plaintext
    until :meth:`finish` returns: the caller must keep it private and unused
    until then, and drop it if ``finish`` raises AuthenticationFailed
    (tampering) or KeyDestroyed (the scope was destroyed: not tampering). No
    chunk may be fed twice or skipped. Not thread-safe: one stream, one thread.
    """

    __slots__ = ("_ctx", "_epoch", "_gone", "_left")

    def __init__(
        self,
        ctx: AEADDecryptionContext,
        epoch: Epoch,
        size: int,
        gone: Callable[[int], Exception],
    ) -> None:
        self._gone = gone
        self._epoch = epoch
        self._ctx: AEADDecryptionContext | None = ctx
        self._left = size

    def update(self, chunk: memoryview) -> None:
        """Decrypt ``chunk`` (the next ciphertext bytes) in place."""
        ctx = self._ctx
        if ctx is None:
            raise SealingError("the stream is finished or aborted")
        if len(chunk) > self._left:
            self.abort()
            raise SealingError("more bytes than the block has")
        ctx.update_into(chunk, chunk)
        self._left -= len(chunk)

    def finish(self) -> None:
        """Check the tag: returns only if every byte fed authenticated under
        the record's nonce, tag and the block's AAD."""
        ctx, self._ctx = self._ctx, None
        if ctx is None:
            raise SealingError("the stream is finished or aborted")
        if self._left:
            raise SealingError(f"{self._left} bytes of the block were never opened")
        try:
            ctx.finalize()
        except InvalidTag:
            if self._epoch.destroyed:
                raise self._gone(self._epoch.index) from None
            raise AuthenticationFailed("authentication failed") from None
        if self._epoch.destroyed:
            raise self._gone(self._epoch.index)

    def abort(self) -> None:
        """Give up (the plaintext produced so far must not be used)."""
        self._ctx = None
