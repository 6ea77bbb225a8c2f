"""Format v1 of a sealed block: sizes, the associated data, the record the
trusted index keeps, and the errors of sealing. No cipher here (that is
:mod:`kvseal.server.sealing`, which re-exports all of this); the CUDA kernels
produce the same bytes (docs/gpu-kernels.md).

- ciphertext: exactly the plaintext's size (AES-256-GCM, 12-byte nonce).
- associated data (112 bytes = 7 AES blocks): ``b"KVSEAL" || u16 version ||
  namespace(32) || tenant(32) || block_hash(32) || u64 generation`` (big
  endian). A ciphertext moved to another block, tenant, model/geometry
  namespace, or replayed from an older generation fails authentication.
- the 16-byte tag is returned to the caller (the trusted index keeps it); it
  is never read back from host memory.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvseal.server.errors import BlockNotPresent, CapacityExhausted

FORMAT_VERSION = 1
NONCE_BYTES = 12
TAG_BYTES = 16
HASH_BYTES = 32
TENANT_BYTES = 32
NAMESPACE_BYTES = 32
AAD_BYTES = 112
_AAD_MAGIC = b"KVSEAL" + struct.pack(">H", FORMAT_VERSION)

KeyScope = tuple[bytes, bytes]  # (namespace, tenant)


class SealingError(Exception):
    """Misuse of the sealing API (wrong sizes, unknown epoch)."""


class AuthenticationFailed(Exception):
    """The ciphertext, tag, nonce or associated data do not authenticate.

    Deliberately says nothing more: which byte or field was wrong is not
    knowable and must not be guessed at.
    """


class KeyDestroyed(BlockNotPresent, SealingError):
    """The block's key was destroyed: its scope was dropped (crypto-erase) before
    or while this seal/open ran. Not an integrity failure (nobody tampered); the
    block is gone, like a block that is not present (NOT_FOUND), and nothing
    sealed or opened under the wiped key is used."""


class KeysExhausted(CapacityExhausted, SealingError):
    """No key slot left for a new key epoch (``max_keys`` live keys)."""


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

    @property
    def scope(self) -> KeyScope:
        """The key scope the block is sealed under."""
        return (self.namespace, self.tenant)


@dataclass(frozen=True, slots=True)
class SealRecord:
    """What the trusted index must keep to open a block again."""

    epoch: int
    nonce: bytes
    tag: bytes
