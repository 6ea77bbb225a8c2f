"""Everything the store derives from the deployment key, and where it lives.

From the 32-byte deployment key ``K`` (:class:`~.keysource.DeploymentKey`),
HKDF-SHA256 (RFC 5869, via ``cryptography``) with a distinct ``info`` label
for each use, so no two uses ever share a key:

========================  ====================================================
``kvseal/store/v1/name``  the *name key*: object and marker names are
                          ``hex(HMAC-SHA256(name key, domain || inputs))``
                          (32 bytes, 64 hex digits), so a name reveals no
                          block hash, tenant, namespace or epoch, and names of
                          the same block under two keys or two epochs are
                          unrelated
``kvseal/store/v1/scope`` the *marker key*: seals each tenant's scope marker
                          (its epoch id, random seed and lineage) and floor
                          record (:mod:`.scopes`)
``kvseal/store/v1/key-id`` an 8-byte public *key id* written into every record,
                          so a record of another key is named as such
``kvseal/store/v1/block`` a *scope key* per (namespace, tenant, epoch):
  ``|| ns || tenant ||``  ``HKDF(ikm = K || seed, info = label || ns || tenant
  ``epoch id``            || epoch id)``, where ``seed`` is 32 random bytes
                          drawn when the epoch began and kept only inside the
                          sealed marker: knowing ``K`` alone does not give an
                          epoch's key once its marker is gone
``kvseal/store/v1/record`` a *record key* per object: ``HKDF(ikm = scope key,
  ``|| kind || salt``     info = label || kind || 16-byte random salt)``, so
                          the 96-bit random GCM nonce never meets the same key
                          twice however many replicas write under one scope
                          for however long (a (key, nonce) pair repeats with
                          probability about n^2 / 2^225, not n^2 / 2^97)
========================  ====================================================

Key bytes live in slots of one ``mlock``ed :class:`~kvseal.server.keyarena.
KeyArena` per store (never in a Python ``bytes``); ``cryptography`` writes
derived keys straight into them (``derive_into``). The one transient copy is
the 64-byte ``K || seed`` input, a ``bytearray`` wiped as soon as the scope
key is derived, and each record key, a ``bytearray`` the caller wipes after
its one seal or open.
"""

from __future__ import annotations

import struct
import threading

from cryptography.hazmat.primitives import hashes, hmac
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from kvseal.server.keyarena import KEY_BYTES, KeyArena, KeySlot
from kvseal.server.store.errors import KeySourceError, StoreError
from kvseal.server.store.keysource import DeploymentKey, wipe

KEY_ID_BYTES = 8
EPOCH_ID_BYTES = 8
SEED_BYTES = 32
SALT_BYTES = 16
NAME_HEX_CHARS = 64
ID_BYTES = 32  # namespace, tenant and block hash, as in the host tier's format
_LABEL = b"kvseal/store/v1/"
_OBJECT_DOMAIN = b"object\x00"
# Markers moved to a new name with the scope lineage (format of 2026-12):
# an earlier build's markers (40-byte payload) are never read, nor are ours by it.
_SCOPE_DOMAIN = b"scope/2\x00"
_FLOOR_DOMAIN = b"floor\x00"


def _hkdf(info: bytes, length: int = KEY_BYTES) -> HKDF:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=_LABEL + info)


def _check_ids(**ids: bytes) -> None:
    for name, value in ids.items():
        want = EPOCH_ID_BYTES if name == "epoch_id" else ID_BYTES
        if len(value) != want:
            raise StoreError(f"{name} must be {want} bytes")


def slot_view(slot: KeySlot) -> memoryview:
    """The bytes of an arena slot (a view, never a copy)."""
    return memoryview(slot).cast("B")


class StoreKeys:
    """The deployment key and the keys derived from it, for one store.

    Takes ownership of ``deployment``: :meth:`close` wipes it with every
    derived key. Thread-safe: one lock serialises derivations and slot
    bookkeeping against :meth:`close` (each derivation is a few HMACs).
    """

    def __init__(self, deployment: DeploymentKey, *, max_scope_keys: int = 4096) -> None:
        self._lock = threading.Lock()
        self._deployment = deployment
        # The name and marker keys, plus one slot per cached scope key.
        self._arena = KeyArena(max_scope_keys + 2)
        self._closed = False
        try:
            k = deployment.view()
            self._name_key = self._arena.take()
            _hkdf(b"name").derive_into(k, slot_view(self._name_key))
            self._marker_key = self._arena.take()
            _hkdf(b"scope").derive_into(k, slot_view(self._marker_key))
            key_id = bytearray(KEY_ID_BYTES)
            _hkdf(b"key-id", KEY_ID_BYTES).derive_into(k, key_id)
            self.key_id = bytes(key_id)  # public: written into every record
            del k
        except BaseException:
            self._arena.close()
            deployment.close()
            raise
        self.source = deployment.source

    def __repr__(self) -> str:
        return f"<StoreKeys key_id={self.key_id.hex()} from {self.source}>"

    # ------------------------------------------------------------ names

    def _name(self, domain: bytes, *parts: bytes) -> str:
        with self._lock:
            self._check_open()
            mac = hmac.HMAC(slot_view(self._name_key), hashes.SHA256())
        mac.update(domain)
        for p in parts:
            mac.update(p)
        return mac.finalize().hex()

    def object_name(
        self, namespace: bytes, tenant: bytes, epoch_id: bytes, block_hash: bytes
    ) -> str:
        """The name of a block's object in one scope epoch (64 hex digits)."""
        _check_ids(namespace=namespace, tenant=tenant, epoch_id=epoch_id, block_hash=block_hash)
        return self._name(_OBJECT_DOMAIN, namespace, tenant, epoch_id, block_hash)

    def scope_name(self, namespace: bytes, tenant: bytes) -> str:
        """The name of a (namespace, tenant) scope's marker (64 hex digits)."""
        _check_ids(namespace=namespace, tenant=tenant)
        return self._name(_SCOPE_DOMAIN, namespace, tenant)

    def floor_name(self, namespace: bytes, tenant: bytes) -> str:
        """The name of a (namespace, tenant) scope's floor record (64 hex digits)."""
        _check_ids(namespace=namespace, tenant=tenant)
        return self._name(_FLOOR_DOMAIN, namespace, tenant)

    # ------------------------------------------------------------ keys

    def take_scope_slot(
        self, namespace: bytes, tenant: bytes, epoch_id: bytes, seed: bytearray
    ) -> KeySlot:
        """A new arena slot holding the scope key of (namespace, tenant, epoch)
        derived from ``K || seed``. The caller gives it back with
        :meth:`give_slot`; ``seed`` is left for its owner to wipe."""
        _check_ids(namespace=namespace, tenant=tenant, epoch_id=epoch_id)
        if len(seed) != SEED_BYTES:
            raise StoreError(f"a scope seed is {SEED_BYTES} bytes")
        ikm = bytearray(KEY_BYTES + SEED_BYTES)
        try:
            with self._lock:
                self._check_open()
                slot = self._arena.take()
                try:
                    ikm[:KEY_BYTES] = self._deployment.view()
                    ikm[KEY_BYTES:] = seed
                    info = b"block" + namespace + tenant + epoch_id
                    _hkdf(info).derive_into(ikm, slot_view(slot))
                except BaseException:
                    self._arena.give(slot)
                    raise
                return slot
        finally:
            wipe(ikm)

    def give_slot(self, slot: KeySlot) -> None:
        """Wipe a scope key's slot and make it reusable."""
        with self._lock:
            if not self._closed:
                self._arena.give(slot)

    def record_key(self, key: KeySlot | None, kind: int, salt: bytes) -> bytearray:
        """A fresh 32-byte record key (the caller wipes it after one seal or
        open) from a scope key slot, or from the marker key when ``key`` is
        None. The slot must be one this store handed out and not yet given
        back: the caller's lock (:mod:`.scopes`) guarantees that."""
        if len(salt) != SALT_BYTES:
            raise StoreError(f"a record salt is {SALT_BYTES} bytes")
        out = bytearray(KEY_BYTES)
        with self._lock:
            self._check_open()
            src = self._marker_key if key is None else key
            _hkdf(b"record" + struct.pack(">H", kind) + salt).derive_into(slot_view(src), out)
        return out

    # ------------------------------------------------------------ lifetime

    def _check_open(self) -> None:
        if self._closed:
            raise KeySourceError("the store's keys were closed (wiped)")

    def close(self) -> None:
        """Wipe every key (derived and deployment). Idempotent; afterwards
        every method raises :class:`KeySourceError`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._arena.close()
            self._deployment.close()
