"""Sealing of KV blocks with AES-256-GCM: the one module that owns the cipher.

Nothing else in kvseal imports an AES primitive. Callers never choose or see a
key, and never choose a nonce: :meth:`BlockSealer.seal_into` (a whole block)
and :meth:`BlockSealer.begin_seal` (a block a chunk at a time) allocate one.
Beside it: :mod:`~kvseal.server.sealformat` (the byte format, the record, the
errors; re-exported here) and :mod:`~kvseal.server.keyarena` (where key bytes
live).

Format v1 (shared byte-for-byte with the GPU kernels, see docs/gpu-kernels.md):

- key scopes: every *(namespace, tenant)* pair (the model/geometry namespace
  of a pool, and the tenant digest: exactly what a ``Drop(all_of_tenant)``
  names) has keys of its own, independent random keys, never derived from a
  secret that outlives them. :meth:`BlockSealer.destroy_scope` wipes every key
  of a scope at once (crypto-erase): its ciphertext can never be opened again,
  whoever kept a copy of it and of its nonces and tags, while every other
  scope (another tenant, or the same tenant in another model's pool) keeps its
  keys and blocks.
- key epochs: a scope's key lives in a *key epoch*: 32 random bytes from the
  OS CSPRNG (``getrandom``) written straight into a slot of an ``mlock``ed
  arena (never an immutable ``bytes``); the slot is wiped when the epoch ends.
  It is never logged, returned, or written anywhere outside the process,
  except to the GPU by the CUDA backend (``export_key_to``). A daemon restart
  therefore means new keys and an empty cache. Epoch ids are unique across
  scopes and never reused (a record names its epoch by id alone).
- nonce (12 bytes): a random 4-byte prefix drawn per epoch || a 64-bit
  big-endian counter. Unique under a key by construction (the counter never
  repeats within an epoch, and each epoch has its own key); the prefix is
  defence in depth only.
- rekey: after ``rekey_after`` seals under one key (default 2**32, far below
  the 2**64 counter space and at the SP 800-38D invocation bound for other IV
  constructions) the scope starts a new epoch with a new key. Blocks sealed
  under an old epoch still open; an epoch's key is destroyed when its last
  block is forgotten, and a scope with no block left is destroyed whole (its
  next seal starts a fresh key): a key lives exactly as long as some block, or
  a seal in flight, needs it.
- associated data and tag: see :mod:`~kvseal.server.sealformat`.

Contract on buffers: ``seal_into``/``open_into`` and the streams' ``update``
read and write only the buffers passed in, which must be *private* memory.
Sealing straight into the hostile host region would let the host change
ciphertext between the write and the GHASH pass (a valid tag over bytes it
chose); opening straight from it would let the host change bytes between
verification and decryption. The callers therefore stage through private
buffers (see ``backend``). A stream produces the same bytes as the one-shot
calls (GCM is a stream cipher with a running GHASH), so chunking never shows
in the format; what an :class:`OpenStream` decrypted is unauthenticated until
its ``finish`` returns.

Destroyed while in use: a scope may be destroyed while a seal or open under
it runs (a drop races an offload or restore of the same tenant). Such a call
raises :class:`KeyDestroyed` (never :class:`AuthenticationFailed`: it is not
tampering), also when the cipher call itself completed, so nothing sealed or
opened under a key that was wiped meanwhile is ever used.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import threading
from collections.abc import Iterable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from kvseal.server.keyarena import KEY_BYTES, ArenaFull, KeySlot
from kvseal.server.keyarena import KeyArena as _KeyArena
from kvseal.server.keyarena import fill_random as _fill_random
from kvseal.server.sealformat import (
    AAD_BYTES,
    FORMAT_VERSION,
    HASH_BYTES,
    NAMESPACE_BYTES,
    NONCE_BYTES,
    TAG_BYTES,
    TENANT_BYTES,
    AuthenticationFailed,
    BlockAD,
    KeyDestroyed,
    KeyScope,
    KeysExhausted,
    SealingError,
    SealRecord,
)
from kvseal.server.sealstream import OpenStream, SealStream

__all__ = [
    "AAD_BYTES",
    "DEFAULT_MAX_KEYS",
    "DEFAULT_REKEY_AFTER",
    "FORMAT_VERSION",
    "HASH_BYTES",
    "KEY_BYTES",
    "NAMESPACE_BYTES",
    "NONCE_BYTES",
    "TAG_BYTES",
    "TENANT_BYTES",
    "AuthenticationFailed",
    "BlockAD",
    "BlockSealer",
    "KeyDestroyed",
    "KeyScope",
    "KeysExhausted",
    "OpenStream",
    "SealRecord",
    "SealStream",
    "SealingError",
    "aes256gcm_encrypt_for_kat",
    "self_test",
]

DEFAULT_REKEY_AFTER = 2**32
# Live keys at most (one per live epoch): 32 MiB of arena. Every live epoch has
# a block in the index or a seal in flight, so the region bounds this long before.
DEFAULT_MAX_KEYS = 1 << 20
_COUNTER_LIMIT = 2**64

log = logging.getLogger("kvseal.sealing")


class _Epoch:
    """One key of one scope, and its nonce counter.

    The key lives in an arena slot owned by the epoch, never in an immutable
    Python ``bytes``; it is handed to ``AESGCM`` and to each streamed block's
    context (:meth:`context`) and, for the GPU backend, written into a
    caller's buffer by :meth:`BlockSealer.export_key_to`.

    ``AESGCM`` (cryptography >= 42 on OpenSSL >= 3.2) keeps no reference to
    the buffer: its constructor expands the key into two OpenSSL cipher
    contexts on the heap (encrypt and decrypt: round keys and the GHASH key
    H), and every call works on a heap copy of one that it frees on return;
    ``EVP_CIPHER_CTX_free`` cleanses each. (With an older OpenSSL it keeps a
    reference to the buffer instead and builds a context per call: a call
    running when the slot is wiped, or reused by another key, then computes
    garbage, which the ``destroyed`` check after every call discards.) So
    ``destroy`` wipes the slot *and* drops the epoch's ``AESGCM``: its
    contexts are freed and cleansed then, or as soon as a call already running
    on it returns, instead of whenever the epoch object is collected.
    """

    __slots__ = (
        "_arena",
        "_slot",
        "aead",
        "counter",
        "destroyed",
        "index",
        "live",
        "prefix",
        "scope",
    )

    def __init__(self, index: int, scope: _Scope, arena: _KeyArena, slot: KeySlot) -> None:
        self._arena = arena
        self._slot: KeySlot | None = slot
        self.aead: AESGCM | None = None
        self.destroyed = False
        self.index = index
        self.scope = scope
        self.prefix = os.urandom(4)
        self.counter = 0
        self.live = 0

    def start(self) -> None:
        """Build the cipher over the key the slot now holds."""
        assert self._slot is not None
        # A view of the slot, not a copy (and never released: with an older
        # OpenSSL the AESGCM keeps it to rebuild a context per call).
        self.aead = AESGCM(memoryview(self._slot).cast("B"))

    def context(self, nonce: bytes, tag: bytes | None) -> Cipher[modes.GCM]:
        """A one-block GCM cipher over the key the slot holds *now* (caller
        holds the sealer's lock, so the slot cannot be wiped or reused by
        another key meanwhile): OpenSSL expands the key into each context it
        builds from this, and never reads the slot again."""
        if self._slot is None:
            raise KeyDestroyed(f"key epoch {self.index} is destroyed")
        return Cipher(algorithms.AES(memoryview(self._slot).cast("B")), modes.GCM(nonce, tag))

    def copy_key_to(self, dst: ctypes.Array[ctypes.c_char]) -> None:
        if len(dst) < KEY_BYTES:
            raise SealingError("key destination must hold 32 bytes")
        if self._slot is None:
            raise KeyDestroyed(f"key epoch {self.index} is destroyed")
        ctypes.memmove(dst, self._slot, KEY_BYTES)

    def cipher(self) -> AESGCM:
        """The epoch's cipher; KeyDestroyed once the epoch is destroyed."""
        aead = self.aead
        if aead is None:
            raise KeyDestroyed(
                f"key epoch {self.index} was destroyed (its tenant was dropped); "
                "nothing was sealed or restored"
            )
        return aead

    def destroy(self) -> None:
        """Mark destroyed, drop the cipher (and with it OpenSSL's expanded key
        schedules, cleansed when freed), wipe and release the slot. Idempotent.
        The flag is set first: a call that sees it clear after its cipher call
        returned ran entirely before the wipe."""
        self.destroyed = True
        self.aead = None
        slot, self._slot = self._slot, None
        if slot is not None:
            self._arena.give(slot)

    @property
    def slot_address(self) -> int:
        """Address of the key slot (tests read it to check the wipe); 0 once gone."""
        return ctypes.addressof(self._slot) if self._slot is not None else 0

    def __repr__(self) -> str:  # never show key material
        return f"<key epoch {self.index}: {self.counter} seals, {self.live} live>"


class _Scope:
    """The epochs of one (namespace, tenant): the current one, which new seals
    draw nonces from, and older ones that still have blocks."""

    __slots__ = ("current", "epochs", "key", "live")

    def __init__(self, key: KeyScope) -> None:
        self.key = key
        self.current: _Epoch | None = None
        self.epochs: dict[int, _Epoch] = {}
        self.live = 0  # blocks (and seals in flight) over all its epochs

    def __repr__(self) -> str:  # the scope key is a digest, but keep reprs terse
        return f"<key scope: {len(self.epochs)} epochs, {self.live} live>"


class BlockSealer:
    """Seals and opens blocks under per-scope rings of per-epoch keys.

    Thread-safe: nonce allocation and epoch/scope bookkeeping are under one
    lock; the AES work runs outside it (``cryptography`` releases the GIL), so
    several threads seal in parallel. Per block the lock does two dict lookups
    and a counter increment: the key schedule is per scope and epoch, never per
    block, so throughput does not depend on the number of tenants.
    """

    def __init__(
        self, rekey_after: int = DEFAULT_REKEY_AFTER, *, max_keys: int = DEFAULT_MAX_KEYS
    ) -> None:
        if not 1 <= rekey_after <= _COUNTER_LIMIT:
            raise SealingError("rekey_after must be in [1, 2**64]")
        if max_keys < 1:
            raise SealingError("max_keys must be positive")
        self.rekey_after = rekey_after
        self._lock = threading.Lock()
        self._arena = _KeyArena(max_keys)
        self._scopes: dict[KeyScope, _Scope] = {}
        self._epochs: dict[int, _Epoch] = {}  # every live epoch, by (global) id
        self._next_epoch = 0
        self._closed = False

    def __repr__(self) -> str:
        return f"<BlockSealer scopes={len(self._scopes)} live_epochs={len(self._epochs)}>"

    # ------------------------------------------------------------ key generation

    def _generate_key(self, epoch_index: int, dst: KeySlot) -> None:
        """Write a new key for epoch ``epoch_index`` into ``dst`` (an arena
        slot). Fresh randomness for every epoch of every scope: no key is derived
        from anything that outlives it. (Tests override this with known keys.)"""
        _fill_random(dst)

    def _new_epoch(self, scope: _Scope) -> _Epoch:
        """A new current epoch for ``scope`` (lock held). KeysExhausted when no
        slot is left; nothing changes then."""
        try:
            slot = self._arena.take()
        except ArenaFull as e:
            raise KeysExhausted(str(e)) from None
        epoch = _Epoch(self._next_epoch, scope, self._arena, slot)
        try:
            self._generate_key(epoch.index, slot)
            epoch.start()
        except BaseException:
            epoch.destroy()
            raise
        self._next_epoch += 1
        self._epochs[epoch.index] = epoch
        scope.epochs[epoch.index] = epoch
        scope.current = epoch
        return epoch

    # ------------------------------------------------------------ introspection

    @property
    def current_epoch(self) -> int:
        """Id of the newest key epoch of any scope (0 before the first seal),
        saturating at 2**32 - 1 (the Stats field is 32 bits; ids keep counting)."""
        return min(max(0, self._next_epoch - 1), 2**32 - 1)

    @property
    def seals_under_current_key(self) -> int:
        """The most seals drawn under any scope's current key (how close the
        busiest key is to ``rekey_after``)."""
        with self._lock:
            return max(
                (s.current.counter for s in self._scopes.values() if s.current is not None),
                default=0,
            )

    @property
    def live_epochs(self) -> int:
        return len(self._epochs)

    @property
    def live_scopes(self) -> int:
        return len(self._scopes)

    def live_epoch_ids(self) -> frozenset[int]:
        """Epochs whose key still exists."""
        with self._lock:
            return frozenset(self._epochs)

    def scope_epoch_ids(self, namespace: bytes, tenant: bytes) -> frozenset[int]:
        """The live epochs of one scope (empty if it has none)."""
        with self._lock:
            scope = self._scopes.get((namespace, tenant))
            return frozenset(scope.epochs) if scope is not None else frozenset()

    # ------------------------------------------------------------ nonces

    def _draw(self, key: KeyScope, n: int) -> _Epoch:
        """The epoch of scope ``key`` to draw ``n`` nonces from, with the nonces
        counted (caller holds the lock)."""
        if self._closed:
            raise SealingError("the sealer is closed: its keys are wiped")
        scope = self._scopes.get(key)
        if scope is None:
            if len(key[0]) != NAMESPACE_BYTES or len(key[1]) != TENANT_BYTES:
                raise SealingError("a key scope is a 32-byte namespace and a 32-byte tenant")
            if n > self.rekey_after:
                raise SealingError(f"cannot draw {n} nonces under one key (rekey_after)")
            scope = _Scope(key)
            epoch = self._new_epoch(scope)  # KeysExhausted: the scope is not kept
            self._scopes[key] = scope
        else:
            epoch = scope.current  # type: ignore[assignment]  # set while the scope lives
            if epoch.counter + n > self.rekey_after:
                if n > self.rekey_after:
                    raise SealingError(f"cannot draw {n} nonces under one key (rekey_after)")
                old = epoch
                epoch = self._new_epoch(scope)
                if old.live == 0:
                    self._drop_epoch(old)
        epoch.counter += n
        epoch.live += n
        scope.live += n
        return epoch

    def _drop_epoch(self, epoch: _Epoch) -> None:
        """Destroy one epoch and unlink it (lock held)."""
        self._epochs.pop(epoch.index, None)
        epoch.scope.epochs.pop(epoch.index, None)
        epoch.destroy()

    def allocate_for_device(self, n: int, scope: KeyScope) -> tuple[int, list[bytes]]:
        """Draw ``n`` fresh nonces under one epoch of ``scope`` (namespace,
        tenant) for a device-side seal: a device batch is single-scope.

        Counts them as ``n`` live blocks of that epoch: the caller must call
        :meth:`forget` once for each nonce whose block is not kept (a failed
        seal burns its nonces; they are never drawn again).
        """
        if n < 1:
            raise SealingError("n must be positive")
        with self._lock:
            epoch = self._draw(scope, n)
            first = epoch.counter - n
            return epoch.index, [epoch.prefix + struct.pack(">Q", first + i) for i in range(n)]

    def _gone(self, epoch_index: int) -> SealingError:
        if 0 <= epoch_index < self._next_epoch:
            return KeyDestroyed(
                "the block's key was destroyed (its tenant was dropped, or the daemon is "
                "stopping); nothing was sealed or restored"
            )
        return SealingError(f"key epoch {epoch_index} never existed")

    def export_key_to(self, epoch_index: int, dst: ctypes.Array[ctypes.c_char]) -> None:
        """Write the epoch's 32-byte key into ``dst`` (caller-owned private
        memory, e.g. a ctypes buffer about to be uploaded to the GPU). The
        caller must wipe ``dst`` as soon as it is done. Only the CUDA backend
        calls this; the key never leaves the process and the GPU.
        KeyDestroyed if the epoch is gone."""
        with self._lock:
            epoch = self._epochs.get(epoch_index)
            if epoch is None:
                raise self._gone(epoch_index)
            epoch.copy_key_to(dst)

    def require_live(self, epoch_ids: Iterable[int]) -> None:
        """Raise KeyDestroyed if any of the epochs is gone. A restore calls this
        right before it writes the first page: a drop that destroyed the keys
        before that point makes the restore fail, never serve."""
        with self._lock:
            for i in epoch_ids:
                if i not in self._epochs:
                    raise self._gone(i)

    # ------------------------------------------------------------ seal / open

    def seal_into(self, plaintext: memoryview, ad: BlockAD, out: memoryview) -> SealRecord:
        """Encrypt ``plaintext`` into ``out`` (``len(plaintext) + 16`` bytes:
        ciphertext then the tag, which is also returned in the record) under
        the current key of the scope ``(ad.namespace, ad.tenant)``.
        ``plaintext`` may be exactly ``out[:len(plaintext)]`` (in place); any
        other overlap is undefined.

        ``out`` must be private memory (see module docstring). The caller owns
        both buffers; on exception nothing is recorded and the nonce is
        burnt, never reused. KeyDestroyed if the scope was destroyed while
        this ran: ``out`` must then not be published.
        """
        if len(out) != len(plaintext) + TAG_BYTES:
            raise SealingError("out must be exactly len(plaintext) + 16 bytes")
        aad = ad.encode()
        with self._lock:
            epoch = self._draw((ad.namespace, ad.tenant), 1)
            nonce = epoch.prefix + struct.pack(">Q", epoch.counter - 1)
        try:
            epoch.cipher().encrypt_into(nonce, plaintext, aad, out)
            if epoch.destroyed:  # wiped while it ran: the output is not to be used
                raise KeyDestroyed(
                    "the tenant's keys were destroyed (dropped) while its block was "
                    "sealed; nothing was stored"
                )
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
        Raises :class:`AuthenticationFailed` if anything does not match, and
        :class:`KeyDestroyed` if the record's key is gone or was destroyed
        while this ran; the contents of ``out`` are then unspecified and must
        not be used.
        """
        if len(sealed) != len(out) + TAG_BYTES:
            raise SealingError("sealed must be exactly len(out) + 16 bytes")
        with self._lock:
            epoch = self._epochs.get(record.epoch)
            if epoch is None:
                raise self._gone(record.epoch)
        try:
            epoch.cipher().decrypt_into(record.nonce, sealed, ad.encode(), out)
        except InvalidTag:
            if epoch.destroyed:  # a wipe during the call (older OpenSSL), not tampering
                raise self._gone(record.epoch) from None
            raise AuthenticationFailed("authentication failed") from None
        if epoch.destroyed:
            raise self._gone(record.epoch)

    def begin_seal(self, ad: BlockAD, size: int) -> SealStream:
        """Start sealing one block of ``size`` bytes a chunk at a time (the same
        nonce, key and bytes as :meth:`seal_into`). The nonce is drawn now and
        counts as a live block of its epoch until the stream is aborted (then
        it is burnt). See :class:`SealStream`."""
        if size < 0:
            raise SealingError("size must not be negative")
        aad = ad.encode()
        with self._lock:
            epoch = self._draw((ad.namespace, ad.tenant), 1)
            nonce = epoch.prefix + struct.pack(">Q", epoch.counter - 1)
            try:
                ctx = epoch.context(nonce, None).encryptor()
            except BaseException:
                self._forget_locked(epoch.index)
                raise
        stream = SealStream(ctx, epoch, nonce, size, self.forget)
        try:
            ctx.authenticate_additional_data(aad)
        except BaseException:
            stream.abort()
            raise
        return stream

    def begin_open(self, record: SealRecord, ad: BlockAD, size: int) -> OpenStream:
        """Start authenticating and decrypting one block of ``size`` bytes of
        ciphertext (its tag is ``record.tag``, from the trusted index) a chunk
        at a time. KeyDestroyed if the record's key is gone. See
        :class:`OpenStream`."""
        if size < 0:
            raise SealingError("size must not be negative")
        aad = ad.encode()
        with self._lock:
            epoch = self._epochs.get(record.epoch)
            if epoch is None:
                raise self._gone(record.epoch)
            ctx = epoch.context(record.nonce, record.tag).decryptor()
        ctx.authenticate_additional_data(aad)
        return OpenStream(ctx, epoch, size, self._gone)

    # ------------------------------------------------------------ lifetime

    def retain(self, epoch_index: int) -> bool:
        """Count one more live user of ``epoch_index`` (a copy of a block the
        store tier will open after the host tier let it go), so that its key
        outlives the block; the caller must :meth:`forget` it exactly once.
        False (nothing counted) if the epoch is gone. A drop still destroys it."""
        with self._lock:
            epoch = self._epochs.get(epoch_index)
            if epoch is None:
                return False
            epoch.live += 1
            epoch.scope.live += 1
            return True

    def forget(self, epoch_index: int) -> None:
        """One block sealed under ``epoch_index`` is gone (or a drawn nonce is
        burnt): drop the epoch's key when it has no live blocks and is not its
        scope's current one, and the whole scope when it has no live block at
        all. Unknown or destroyed epochs are ignored."""
        with self._lock:
            self._forget_locked(epoch_index)

    def _forget_locked(self, epoch_index: int) -> None:
        epoch = self._epochs.get(epoch_index)
        if epoch is None:
            return
        scope = epoch.scope
        if epoch.live > 0:
            epoch.live -= 1
            scope.live -= 1
        if scope.live <= 0:
            self._destroy_scope_locked(scope)
        elif epoch.live == 0 and epoch is not scope.current:
            self._drop_epoch(epoch)

    def _destroy_scope_locked(self, scope: _Scope) -> int:
        if self._scopes.get(scope.key) is scope:
            del self._scopes[scope.key]
        epochs = list(scope.epochs.values())
        for epoch in epochs:
            self._drop_epoch(epoch)
        scope.current = None
        scope.live = 0
        return len(epochs)

    def destroy_scope(self, namespace: bytes, tenant: bytes) -> int:
        """Crypto-erase: wipe every key of the scope now and drop its ciphers,
        whatever blocks or calls still use them. Every record of the scope stops
        opening for good (KeyDestroyed); a seal or open running on it fails the
        same way. The next seal of the scope starts a fresh random key. Returns
        how many epochs were destroyed (0: the scope had no key). Other scopes
        are untouched. Device copies (CUDA key contexts) are the backend's to
        wipe: it prunes every epoch this no longer lists as live."""
        with self._lock:
            scope = self._scopes.get((namespace, tenant))
            if scope is None:
                return 0
            return self._destroy_scope_locked(scope)

    def close(self) -> None:
        """Wipe every key and drop every cipher (shutdown, once no seal or open
        runs). Afterwards every seal and open raises SealingError."""
        with self._lock:
            self._closed = True
            for epoch in list(self._epochs.values()):
                epoch.destroy()
            self._epochs.clear()
            self._scopes.clear()
            self._arena.close()

    @property
    def key_pages(self) -> tuple[int, int]:
        """(pages of key arena, of which not locked): diagnostics."""
        with self._lock:
            return self._arena.pages, self._arena.unlocked_pages


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
