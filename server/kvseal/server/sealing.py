"""Sealing of KV blocks with AES-256-GCM: the one module that owns the cipher.

Nothing else in kvseal imports an AES primitive. Callers never choose or see a
key, and never choose a nonce: :meth:`BlockSealer.seal_into` allocates one.

Format v1 (shared byte-for-byte with the GPU kernels, see docs/gpu-kernels.md):

- key: 32 random bytes per *key epoch*, from the OS CSPRNG (``getrandom``)
  written straight into an ``mlock``ed ctypes buffer (never an immutable
  ``bytes``) that is wiped when the epoch ends; it is never logged,
  returned, or written anywhere outside the process, except to the GPU by
  the CUDA backend (``export_key_to``). A daemon restart therefore means a
  new key and an empty cache.
- nonce (12 bytes): a random 4-byte prefix drawn per epoch || a 64-bit
  big-endian counter. Unique under a key by construction (the counter never
  repeats within an epoch, and each epoch has its own key); the prefix is
  defence in depth only.
- rekey: after ``rekey_after`` seals (default 2**32, far below the 2**64
  counter space and at the SP 800-38D invocation bound for other IV
  constructions) a new epoch with a new key starts. Blocks sealed under an old
  epoch still open; an epoch's key is destroyed when its last block is
  forgotten.
- associated data (112 bytes = 7 AES blocks): ``b"KVSEAL" || u16 version ||
  namespace(32) || tenant(32) || block_hash(32) || u64 generation`` (big
  endian). A ciphertext moved to another block, tenant, model/geometry
  namespace, or replayed from an older generation fails authentication.
- the 16-byte tag is returned to the caller (the trusted index keeps it); it
  is never read back from host memory.

Contract on buffers: ``seal_into``/``open_into`` read and write only the
buffers passed in, which must be *private* memory. Sealing straight into the
hostile host region would let the host change ciphertext between the write
and the GHASH pass (a valid tag over bytes it chose); opening straight from it
would let the host change bytes between verification and decryption. The
callers therefore stage through private buffers (see ``backend``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
import threading
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

FORMAT_VERSION = 1
KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
HASH_BYTES = 32
TENANT_BYTES = 32
NAMESPACE_BYTES = 32
AAD_BYTES = 112
DEFAULT_REKEY_AFTER = 2**32
_COUNTER_LIMIT = 2**64
_AAD_MAGIC = b"KVSEAL" + struct.pack(">H", FORMAT_VERSION)


class SealingError(Exception):
    """Misuse of the sealing API (wrong sizes, unknown epoch)."""


class AuthenticationFailed(Exception):
    """The ciphertext, tag, nonce or associated data do not authenticate.

    Deliberately says nothing more: which byte or field was wrong is not
    knowable and must not be guessed at.
    """


@dataclass(frozen=True, slots=True)
class BlockAD:
    """What a sealed block is bound to (all fields go into the AAD)."""

    namespace: bytes
    tenant: bytes
    block_hash: bytes
    generation: int

    def encode(self) -> bytes:
        """The 112-byte associated data of format v1."""
        if len(self.namespace) != NAMESPACE_BYTES:
            raise SealingError("namespace must be 32 bytes")
        if len(self.tenant) != TENANT_BYTES:
            raise SealingError("tenant must be 32 bytes")
        if len(self.block_hash) != HASH_BYTES:
            raise SealingError("block hash must be 32 bytes")
        if not 0 <= self.generation < 2**64:
            raise SealingError("generation out of range")
        return (
            _AAD_MAGIC
            + self.namespace
            + self.tenant
            + self.block_hash
            + struct.pack(">Q", self.generation)
        )


@dataclass(frozen=True, slots=True)
class SealRecord:
    """What the trusted index must keep to open a block again."""

    epoch: int
    nonce: bytes
    tag: bytes


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC  # noqa: PLW0603 - loaded once, on first use
    if _LIBC is None:
        _LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return _LIBC


def _fill_random(buf: ctypes.Array[ctypes.c_char]) -> None:
    """Fill ``buf`` from the kernel CSPRNG without creating a Python bytes."""
    n = len(buf)
    got = _libc().getrandom(buf, ctypes.c_size_t(n), 0)
    if got != n:  # getrandom(2) on a 32-byte request never returns short
        raise OSError(ctypes.get_errno(), "getrandom failed")


class _Epoch:
    """One key and its nonce counter.

    The key lives in a ctypes buffer owned by the epoch, never in an
    immutable Python ``bytes``: it is ``mlock``ed (kept out of swap, which in
    a CVM may be host-backed) where the limit allows, handed to ``AESGCM``
    and, for the GPU backend, written into a caller's buffer by
    :meth:`BlockSealer.export_key_to`.

    ``AESGCM`` (cryptography >= 42 on OpenSSL >= 3.2) keeps no reference to
    the buffer: its constructor expands the key into two OpenSSL cipher
    contexts on the heap (encrypt and decrypt: round keys and the GHASH key
    H), and every call works on a heap copy of one that it frees on return;
    ``EVP_CIPHER_CTX_free`` cleanses each. (With an older OpenSSL it keeps a
    reference to the buffer instead and builds a context per call.) So
    ``destroy`` wipes the buffer *and* drops the epoch's ``AESGCM``: its
    contexts are freed and cleansed then, or as soon as a call already running
    on it returns, instead of whenever the epoch object is collected.
    """

    __slots__ = ("_key", "_locked", "aead", "counter", "index", "live", "prefix")

    def __init__(self, index: int) -> None:
        self._key = (ctypes.c_char * KEY_BYTES)()
        self._locked = _libc().mlock(self._key, ctypes.c_size_t(KEY_BYTES)) == 0
        self.aead: AESGCM | None = None
        try:
            _fill_random(self._key)
            # A view of the buffer, not a copy (and never released: with an older
            # OpenSSL the AESGCM keeps it to rebuild a context per call).
            self.aead = AESGCM(memoryview(self._key).cast("B"))
        except BaseException:
            self.destroy()
            raise
        self.index = index
        self.prefix = os.urandom(4)
        self.counter = 0
        self.live = 0

    def copy_key_to(self, dst: ctypes.Array[ctypes.c_char]) -> None:
        if len(dst) < KEY_BYTES:
            raise SealingError("key destination must hold 32 bytes")
        ctypes.memmove(dst, self._key, KEY_BYTES)

    def cipher(self) -> AESGCM:
        """The epoch's cipher; SealingError once the epoch is destroyed."""
        aead = self.aead
        if aead is None:
            raise SealingError(f"key epoch {self.index} is gone")
        return aead

    def destroy(self) -> None:
        """Wipe the key and drop the cipher (and with it OpenSSL's expanded key
        schedules, cleansed when freed). Idempotent."""
        self.aead = None
        ctypes.memset(self._key, 0, KEY_BYTES)
        if self._locked:
            _libc().munlock(self._key, ctypes.c_size_t(KEY_BYTES))
            self._locked = False

    def __repr__(self) -> str:  # never show key material
        return f"<key epoch {self.index}: {self.counter} seals, {self.live} live>"


class BlockSealer:
    """Seals and opens blocks under a ring of per-epoch keys.

    Thread-safe: nonce allocation and epoch bookkeeping are under one lock;
    the AES work runs outside it (``cryptography`` releases the GIL), so
    several threads seal in parallel.
    """

    def __init__(self, rekey_after: int = DEFAULT_REKEY_AFTER) -> None:
        if not 1 <= rekey_after <= _COUNTER_LIMIT:
            raise SealingError("rekey_after must be in [1, 2**64]")
        self.rekey_after = rekey_after
        self._lock = threading.Lock()
        self._epochs: dict[int, _Epoch] = {}
        self._closed = False
        self._current = self._new_epoch(0)

    def __repr__(self) -> str:
        return f"<BlockSealer epoch={self._current.index} live_epochs={len(self._epochs)}>"

    def _new_epoch(self, index: int) -> _Epoch:
        epoch = _Epoch(index)
        self._epochs[index] = epoch
        return epoch

    @property
    def current_epoch(self) -> int:
        return self._current.index

    @property
    def seals_under_current_key(self) -> int:
        return self._current.counter

    @property
    def live_epochs(self) -> int:
        return len(self._epochs)

    def _rotate_if_needed(self, n: int) -> _Epoch:
        """The epoch to draw ``n`` nonces from (caller holds the lock)."""
        if self._closed:
            raise SealingError("the sealer is closed: its keys are wiped")
        epoch = self._current
        if epoch.counter + n > self.rekey_after:
            if n > self.rekey_after:
                raise SealingError(f"cannot draw {n} nonces under one key (rekey_after)")
            old = epoch
            epoch = self._current = self._new_epoch(old.index + 1)
            if old.live == 0:
                del self._epochs[old.index]
                old.destroy()
        return epoch

    def _allocate(self) -> tuple[_Epoch, bytes]:
        with self._lock:
            epoch = self._rotate_if_needed(1)
            nonce = epoch.prefix + struct.pack(">Q", epoch.counter)
            epoch.counter += 1
            epoch.live += 1
            return epoch, nonce

    def allocate_for_device(self, n: int) -> tuple[int, list[bytes]]:
        """Draw ``n`` fresh nonces under one epoch for a device-side seal.

        Counts them as ``n`` live blocks of that epoch: the caller must call
        :meth:`forget` once for each nonce whose block is not kept (a failed
        seal burns its nonces; they are never drawn again).
        """
        if n < 1:
            raise SealingError("n must be positive")
        with self._lock:
            epoch = self._rotate_if_needed(n)
            first = epoch.counter
            epoch.counter += n
            epoch.live += n
            return epoch.index, [epoch.prefix + struct.pack(">Q", first + i) for i in range(n)]

    def export_key_to(self, epoch_index: int, dst: ctypes.Array[ctypes.c_char]) -> None:
        """Write the epoch's 32-byte key into ``dst`` (caller-owned private
        memory, e.g. a ctypes buffer about to be uploaded to the GPU). The
        caller must wipe ``dst`` as soon as it is done. Only the CUDA backend
        calls this; the key never leaves the process and the GPU."""
        with self._lock:
            epoch = self._epochs.get(epoch_index)
            if epoch is None:
                raise SealingError(f"key epoch {epoch_index} is gone")
            epoch.copy_key_to(dst)

    def live_epoch_ids(self) -> frozenset[int]:
        """Epochs whose key still exists."""
        with self._lock:
            return frozenset(self._epochs)

    def seal_into(self, plaintext: memoryview, ad: BlockAD, out: memoryview) -> SealRecord:
        """Encrypt ``plaintext`` into ``out`` (``len(plaintext) + 16`` bytes:
        ciphertext then the tag, which is also returned in the record).
        ``plaintext`` may be exactly ``out[:len(plaintext)]`` (in place); any
        other overlap is undefined.

        ``out`` must be private memory (see module docstring). The caller owns
        both buffers; on exception nothing is recorded and the nonce is
        burnt, never reused.
        """
        if len(out) != len(plaintext) + TAG_BYTES:
            raise SealingError("out must be exactly len(plaintext) + 16 bytes")
        aad = ad.encode()
        epoch, nonce = self._allocate()
        try:
            epoch.cipher().encrypt_into(nonce, plaintext, aad, out)
        except BaseException:
            self.forget(epoch.index)
            raise
        return SealRecord(epoch.index, nonce, bytes(out[len(plaintext) :]))

    def open_into(
        self, record: SealRecord, ad: BlockAD, sealed: memoryview, out: memoryview
    ) -> None:
        """Authenticate and decrypt ``sealed`` (ciphertext || tag, private
        memory) into ``out`` (``len(sealed) - 16`` bytes, private memory).

        ``out`` may be exactly ``sealed[:len(out)]`` (in place).
        Raises :class:`AuthenticationFailed` if anything does not match; the
        contents of ``out`` are then unspecified and must not be used.
        """
        if len(sealed) != len(out) + TAG_BYTES:
            raise SealingError("sealed must be exactly len(out) + 16 bytes")
        with self._lock:
            epoch = self._epochs.get(record.epoch)
        if epoch is None:
            raise SealingError(f"key epoch {record.epoch} is gone")
        try:
            epoch.cipher().decrypt_into(record.nonce, sealed, ad.encode(), out)
        except InvalidTag:
            raise AuthenticationFailed("authentication failed") from None

    def close(self) -> None:
        """Wipe every epoch's key and drop its cipher (shutdown, once no seal or
        open runs). Afterwards every seal and open raises SealingError."""
        with self._lock:
            self._closed = True
            for epoch in self._epochs.values():
                epoch.destroy()
            self._epochs.clear()

    def forget(self, epoch_index: int) -> None:
        """One block sealed under ``epoch_index`` is gone; drop the epoch's
        key when it has no live blocks and is not current."""
        with self._lock:
            epoch = self._epochs.get(epoch_index)
            if epoch is None:
                return
            epoch.live = max(0, epoch.live - 1)
            if epoch.live == 0 and epoch is not self._current:
                del self._epochs[epoch_index]
                epoch.destroy()


# Power-on known-answer test (the GCM specification's AES-256 test cases 13
# and 14): the daemon refuses to start if the cipher underneath is broken.
_KAT = (
    (bytes(16), bytes.fromhex("cea7403d4d606b6e074ec5d3baf39d18d0d1c8a799996bf0265b98b5d48ab919")),
    (b"", bytes.fromhex("530f8afbc74536b9a963b4f1c4cb738b")),
)


def self_test() -> None:
    """Run the known-answer tests; raise :class:`SealingError` on mismatch."""
    aead = AESGCM(bytes(KEY_BYTES))
    for plaintext, expected in _KAT:
        if aead.encrypt(bytes(NONCE_BYTES), plaintext, None) != expected:
            raise SealingError("AES-256-GCM known-answer test failed")
        if aead.decrypt(bytes(NONCE_BYTES), expected, None) != plaintext:
            raise SealingError("AES-256-GCM known-answer test failed")


def aes256gcm_encrypt_for_kat(key: bytes, nonce: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """Raw AES-256-GCM for known-answer tests only (ciphertext || tag).

    Exists so that published vectors (NIST CAVP) can be run through this
    module's cipher; kvseal's own code never calls it.
    """
    return AESGCM(key).encrypt(nonce, plaintext, aad)
