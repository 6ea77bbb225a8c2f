"""Chained block hashes and tenant digests.

Same idea as vLLM's prefix caching with sha256: block *i*'s hash covers its
own tokens and, through its parent's hash, every token before it, so equal
hashes mean equal prefixes. The engine's per-request ``cache_salt`` is mixed
into the root of the chain (as vLLM does for the first block since
CVE-2025-46570), and separately into the tenant digest that the daemon uses
as an index namespace: two tenants never share or even probe each other's
blocks, whatever their tokens.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_BYTES = 32
NONE_HASH = hashlib.sha256(b"kvseal/root/v1\x00").digest()


def _salt_bytes(cache_salt: str | bytes | None) -> bytes:
    if cache_salt is None:
        return b""
    return cache_salt.encode() if isinstance(cache_salt, str) else bytes(cache_salt)


def tenant_digest(cache_salt: str | bytes | None) -> bytes:
    """The 32-byte tenant namespace for a cache salt (None: the shared,
    unsalted tenant). The salt itself never leaves the engine."""
    return hashlib.sha256(b"kvseal/tenant/v1\x00" + _salt_bytes(cache_salt)).digest()


def root_hash(cache_salt: str | bytes | None) -> bytes:
    salt = _salt_bytes(cache_salt)
    if not salt:
        return NONE_HASH
    return hashlib.sha256(b"kvseal/root/v1\x00" + salt).digest()


def chain_block_hashes(
    token_ids: Sequence[int],
    tokens_per_page: int,
    *,
    cache_salt: str | bytes | None = None,
    parent_hash: bytes | None = None,
    extra_keys: bytes = b"",
) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids`` (a trailing partial block
    is not hashed: it cannot be cached).

    ``parent_hash`` continues an existing chain (then ``cache_salt`` is not
    used: the parent already carries it). ``extra_keys`` binds anything else
    the KV depends on (e.g. LoRA id, multimodal input hashes) into every block.
    """
    if tokens_per_page <= 0:
        raise ValueError("tokens_per_page must be positive")
    if parent_hash is not None and len(parent_hash) != HASH_BYTES:
        raise ValueError("parent_hash must be 32 bytes")
    prev = parent_hash if parent_hash is not None else root_hash(cache_salt)
    out = []
    full = len(token_ids) // tokens_per_page * tokens_per_page
    for start in range(0, full, tokens_per_page):
        h = hashlib.sha256(b"kvseal/block/v1\x00")
        h.update(prev)
        h.update(
            struct.pack(
                f"<I{tokens_per_page}I",
                tokens_per_page,
                *token_ids[start : start + tokens_per_page],
            )
        )
        h.update(struct.pack("<I", len(extra_keys)) + extra_keys)
        prev = h.digest()
        out.append(prev)
    return out
