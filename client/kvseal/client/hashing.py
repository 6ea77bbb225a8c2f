"""Chained block hashes and tenant digests.

Same idea as vLLM's prefix caching with sha256: block *i*'s hash covers its
own tokens and, through its parent's hash, every token before it, so equal
hashes mean equal prefixes. The engine's per-request ``cache_salt`` is mixed
into the root of the chain (as vLLM does for the first block since
CVE-2025-46570), and separately into the tenant digest that the daemon uses
as an index namespace: two tenants never share or even probe each other's
blocks, whatever their tokens.

The tenant digest should be *keyed*: the daemon hands digests to the peers it
admits (WatchEvents of their own pools) and keeps them in its index, and an
unkeyed SHA-256 of a guessable salt (a user id, a session number) falls to an
offline search. With a deployment secret (``KVSEAL_TENANT_KEY_FILE``, or
``ClientConfig.tenant_key``) the digest is HMAC-SHA256 under it: engines that
should share a cache share the key; a peer without it can neither invert a
digest nor compute one for a salt it guesses.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import struct
from collections.abc import Sequence

from kvseal.v1 import kvseal_pb2 as pb

HASH_BYTES = 32
MIN_TENANT_KEY_BYTES = 32
TENANT_KEY_ENV = "KVSEAL_TENANT_KEY_FILE"
NONE_HASH = hashlib.sha256(b"kvseal/root/v1\x00").digest()


def _salt_bytes(cache_salt: str | bytes | None) -> bytes:
    if cache_salt is None:
        return b""
    return cache_salt.encode() if isinstance(cache_salt, str) else bytes(cache_salt)


def tenant_digest(cache_salt: str | bytes | None, *, key: bytes | None = None) -> bytes:
    """The 32-byte tenant namespace for a cache salt (None: the shared,
    unsalted tenant). The salt itself never leaves the engine.

    With ``key`` (at least 32 bytes, see :func:`load_tenant_key`): HMAC-SHA256
    under it, which a peer without the key cannot compute or search. Without:
    an unkeyed SHA-256 (the default; fine for unguessable salts only). The two
    never coincide, so engines that should share a cache must agree on the key."""
    salt = _salt_bytes(cache_salt)
    if key is None:
        return hashlib.sha256(b"kvseal/tenant/v1\x00" + salt).digest()
    if len(key) < MIN_TENANT_KEY_BYTES:
        raise ValueError(f"a tenant key must have at least {MIN_TENANT_KEY_BYTES} bytes")
    return hmac.new(key, b"kvseal/tenant/v2\x00" + salt, hashlib.sha256).digest()


def load_tenant_key(path: str | None = None) -> bytes | None:
    """The tenant key in ``path`` (default: ``$KVSEAL_TENANT_KEY_FILE``; None when
    neither is set): the file's raw bytes, at least 32 (e.g. ``head -c 32
    /dev/urandom``). Refused (ValueError) when the file is readable or writable
    by group or others, or too short: a key others can read protects nothing."""
    path = path if path is not None else os.environ.get(TENANT_KEY_ENV) or None
    if path is None:
        return None
    with open(path, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"tenant key file {path} must not be accessible to group/others")
        key = f.read(4096)
    if len(key) < MIN_TENANT_KEY_BYTES:
        raise ValueError(
            f"tenant key file {path} holds {len(key)} bytes; at least {MIN_TENANT_KEY_BYTES}"
        )
    return key


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


def deployment_identity(
    label: str,
    hash_algorithm: str,
    tenant_key: bytes | None,
    *,
    hash_seed: str | None = None,
    hash_seed_random: bool = False,
) -> pb.DeploymentIdentity:
    """What replicas sharing a store must agree on (``RegisterPoolRequest.identity``;
    docs/store.md, "Events, Stats and replicas"): ``label`` names the
    deployment (the daemon compares registrations of one label), the engine's
    prefix-hash algorithm, a digest of its seed (``hash_seed``: None for a
    scheme without one; never sent itself: a non-cryptographic hash's
    collision resistance rests on its secrecy) unless it is random per
    process, and a check value of the tenant key (never the key)."""
    seed_check = b""
    if not hash_seed_random:
        h = hashlib.sha256(b"kvseal/hash-seed-check/v1\x00")
        h.update(hash_algorithm.encode() + b"\x00" + (hash_seed or "").encode())
        seed_check = h.digest()[:16]
    key_check = b""
    if tenant_key:
        key_check = hmac.new(tenant_key, b"kvseal/tenant-key-check/v1", "sha256").digest()[:16]
    return pb.DeploymentIdentity(
        label=label[-256:],
        hash_algorithm=hash_algorithm,
        hash_seed_check=seed_check,
        tenant_key_check=key_check,
        hash_seed_random=hash_seed_random,
    )
