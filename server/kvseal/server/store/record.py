"""Store record format v1: a self-contained sealed object, and its strict parser.

The store package's one user of AES-GCM. (``kvseal.server.sealing`` owns the
host tier's cipher; the store cannot reuse it because its keys are derived
from a shared deployment key and its nonces are random, where the host tier's
keys are random per daemon and its nonces are counters. Wiring may fold the
two behind one recipe module.)

Layout (big endian, 64-byte header, then ciphertext, then the tag)::

    0  magic       8  b"KVSEALST"
    8  version     2  1
   10  kind        2  1 = a block object, 2 = a tenant's scope marker,
                      3 = a tenant's scope floor (:mod:`.scopes`)
   12  key id      8  the deployment key's public id (keys.StoreKeys.key_id)
   20  generation  8  the writer's clock at seal time (ns), strictly increasing
                      per writing process
   28  salt       16  random: selects this record's key (keys.record_key)
   44  nonce      12  random 96-bit GCM nonce, drawn per write
   56  ct length   8  ciphertext bytes (= plaintext bytes)
   64  ciphertext ct length bytes
   ..  tag        16  GCM tag

Associated data: the 64 header bytes exactly as stored || namespace (32) ||
tenant (32) || epoch id (8) || block hash (32). The binding fields are never
stored: the reader supplies them (they are what it looked up, and what the
keyed object name was computed from), so an object moved to another block,
tenant, namespace or epoch, or a header with any byte changed, fails
authentication; the record key itself also depends on the scope and epoch.
A scope marker or floor binds 8 zero bytes of epoch and 32 of block hash, and
its kind (so neither passes for the other).

What is *not* in the record, on purpose: the tenant, namespace, block hash
and epoch id (a store holder could link objects by them). What it shows:
the key id (the same for every object of a deployment), the generation (a
write time, as the file's mtime already does), and the length.

Parsing is strict and happens before any cipher runs: fewer bytes than a
header or than the header announces (:class:`RecordTruncated`), trailing
bytes or a length over the store's limit (:class:`LengthMismatch`), another
magic (:class:`BadMagic`), version (:class:`UnsupportedVersion`) or kind
(:class:`WrongKind`), another deployment key (:class:`ForeignKey`); then any
flipped bit anywhere fails authentication (:class:`RecordAuthenticationFailed`).
"""

from __future__ import annotations

import os
import struct
import threading
import time
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from kvseal.server.store.errors import (
    BadMagic,
    ForeignKey,
    LengthMismatch,
    RecordAuthenticationFailed,
    RecordTruncated,
    StoreError,
    UnsupportedVersion,
    WrongKind,
)
from kvseal.server.store.keys import EPOCH_ID_BYTES, ID_BYTES, KEY_ID_BYTES, SALT_BYTES
from kvseal.server.store.keysource import wipe

MAGIC = b"KVSEALST"
RECORD_VERSION = 1
KIND_BLOCK = 1
KIND_SCOPE = 2
KIND_FLOOR = 3
_KINDS = {KIND_BLOCK: "block object", KIND_SCOPE: "scope marker", KIND_FLOOR: "scope floor"}
NONCE_BYTES = 12
TAG_BYTES = 16
_HEADER = struct.Struct(">8sHH8sQ16s12sQ")
HEADER_BYTES = _HEADER.size  # 64
OVERHEAD_BYTES = HEADER_BYTES + TAG_BYTES
_ZERO_EPOCH = bytes(EPOCH_ID_BYTES)
_ZERO_HASH = bytes(ID_BYTES)


class _Generations:
    """Record generations: the wall clock in ns, made strictly increasing
    within this process (two seals in one clock tick, or a clock stepped
    back, still get distinct, ordered generations). Across processes they
    are only as ordered as the writers' clocks."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = 0

    def next(self) -> int:
        with self._lock:
            self._last = max(time.time_ns(), self._last + 1)
            return self._last


next_generation = _Generations().next


def record_bytes(plaintext_bytes: int) -> int:
    """The size of a record holding ``plaintext_bytes``."""
    return OVERHEAD_BYTES + plaintext_bytes


@dataclass(frozen=True, slots=True)
class Binding:
    """What a record is bound to through its associated data (never stored)."""

    namespace: bytes
    tenant: bytes
    epoch_id: bytes = _ZERO_EPOCH
    block_hash: bytes = _ZERO_HASH

    def encode(self) -> bytes:
        """The 104 bytes appended to the header to form the associated data."""
        if len(self.namespace) != ID_BYTES or len(self.tenant) != ID_BYTES:
            raise StoreError("namespace and tenant must be 32 bytes each")
        if len(self.epoch_id) != EPOCH_ID_BYTES or len(self.block_hash) != ID_BYTES:
            raise StoreError("epoch id must be 8 bytes and the block hash 32")
        return self.namespace + self.tenant + self.epoch_id + self.block_hash


@dataclass(frozen=True, slots=True)
class RecordHeader:
    """The 64-byte header of a record."""

    kind: int
    key_id: bytes
    generation: int
    salt: bytes
    nonce: bytes
    ct_len: int

    @classmethod
    def fresh(cls, kind: int, key_id: bytes, generation: int, ct_len: int) -> RecordHeader:
        """A header for a new record: a random salt and a random nonce."""
        return cls(
            kind, key_id, generation, os.urandom(SALT_BYTES), os.urandom(NONCE_BYTES), ct_len
        )

    def encode(self) -> bytes:
        if self.kind not in _KINDS or len(self.key_id) != KEY_ID_BYTES:
            raise StoreError("bad record kind or key id")
        if len(self.salt) != SALT_BYTES or len(self.nonce) != NONCE_BYTES:
            raise StoreError("bad record salt or nonce")
        if not 0 <= self.generation < 2**64 or not 0 <= self.ct_len < 2**64:
            raise StoreError("record generation or length out of range")
        return _HEADER.pack(
            MAGIC,
            RECORD_VERSION,
            self.kind,
            self.key_id,
            self.generation,
            self.salt,
            self.nonce,
            self.ct_len,
        )

    @classmethod
    def parse(cls, data: bytes | bytearray | memoryview, *, max_ct_len: int) -> RecordHeader:
        """The header of the record ``data`` (the whole record), checked
        strictly against its size: see the module docstring for the errors.
        ``max_ct_len`` is the largest ciphertext the caller accepts."""
        if len(data) < HEADER_BYTES:
            raise RecordTruncated(f"{len(data)} bytes: shorter than a record header")
        magic, version, kind, key_id, generation, salt, nonce, ct_len = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise BadMagic("not a kvseal store record (wrong magic)")
        if version != RECORD_VERSION:
            raise UnsupportedVersion(f"record format version {version}; this code reads 1")
        if kind not in _KINDS:
            raise WrongKind(f"unknown record kind {kind}")
        if ct_len > max_ct_len:
            raise LengthMismatch(f"record announces {ct_len} bytes; at most {max_ct_len}")
        want = HEADER_BYTES + ct_len + TAG_BYTES
        if len(data) < want:
            raise RecordTruncated(f"{len(data)} bytes; the header announces {want}")
        if len(data) > want:
            raise LengthMismatch(f"{len(data)} bytes; the header announces {want}")
        return cls(kind, key_id, generation, salt, nonce, ct_len)

    def expect(self, kind: int, key_id: bytes) -> None:
        """Raise unless this is a record of ``kind`` under the key ``key_id``."""
        if self.kind != kind:
            raise WrongKind(f"a {_KINDS[self.kind]} where a {_KINDS[kind]} belongs")
        if self.key_id != key_id:
            raise ForeignKey(
                f"sealed under deployment key id {self.key_id.hex()}, not this store's "
                f"{key_id.hex()}"
            )


def seal(
    record_key: bytearray,
    header: RecordHeader,
    binding: Binding,
    plaintext: bytes | bytearray | memoryview,
) -> bytearray:
    """The whole record (header, ciphertext, tag) of ``plaintext``, sealed in
    private memory. ``header.ct_len`` must be ``len(plaintext)``. Wipes
    ``record_key`` whatever happens (one key, one record)."""
    try:
        if header.ct_len != len(plaintext):
            raise StoreError("header length and plaintext length differ")
        head = header.encode()
        out = bytearray(HEADER_BYTES + len(plaintext) + TAG_BYTES)
        out[:HEADER_BYTES] = head
        aead = AESGCM(record_key)
        aead.encrypt_into(
            header.nonce, plaintext, head + binding.encode(), memoryview(out)[HEADER_BYTES:]
        )
        return out
    finally:
        wipe(record_key)


def open_record(
    record_key: bytearray,
    data: bytearray | memoryview,
    header: RecordHeader,
    binding: Binding,
    out: bytearray | None = None,
) -> bytearray:
    """Authenticate and decrypt ``data`` (a private snapshot of the whole
    record, parsed into ``header``) into ``out`` (exactly ``ct_len`` bytes;
    None: a new bytearray), which is returned. Raises
    :class:`RecordAuthenticationFailed` on any mismatch (``out`` wiped:
    nothing decrypted is left). Wipes ``record_key`` whatever happens."""
    if out is None:
        out = bytearray(header.ct_len)
    elif len(out) != header.ct_len:
        raise ValueError(f"a {header.ct_len}-byte plaintext into a {len(out)}-byte buffer")
    ok = False
    try:
        view = memoryview(data)
        aad = bytes(view[:HEADER_BYTES]) + binding.encode()
        try:
            AESGCM(record_key).decrypt_into(header.nonce, view[HEADER_BYTES:], aad, out)
        except InvalidTag:
            raise RecordAuthenticationFailed("authentication failed") from None
        ok = True
        return out
    finally:
        wipe(record_key)
        if not ok:
            wipe(out)
