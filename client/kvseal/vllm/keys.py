"""How vLLM's identities become kvseal's: block hashes, tenants, models, pool names.

Nothing here imports vLLM (the functions take plain values), so the mapping is
testable on its own and the same on the scheduler and the worker side.

- **Block hashes.** vLLM's manager sees ``OffloadKey`` = vLLM's block hash ‖ a
  4-byte KV-group index. kvseal indexes 32-byte hashes. vLLM's own hashes are
  used (its chain is rooted differently from :func:`kvseal.client.chain_block_hashes`
  and already mixes ``cache_salt`` into the first block), mapped by
  :func:`kvseal_hash`: a 32-byte hash is used as it is, a shorter one is padded
  with its length in the last byte (injective), a longer one is hashed with
  SHA-256. The KV group is *not* in the 32 bytes: it goes into the model
  fingerprint, so blocks of different groups live in different namespaces and
  can never be confused.
- **Tenants.** vLLM's per-request ``cache_salt`` becomes kvseal's tenant through
  :func:`kvseal.client.tenant_digest`; the salt itself never leaves the engine.
- **Models.** :func:`model_fingerprint` binds model name/path, revision, KV dtype,
  layer geometry, hash algorithm, KV group and TP rank: another model, another
  rank's shard or another group never restores these blocks (the daemon derives
  the namespace from the fingerprint and the pool geometry).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import struct
from collections.abc import Iterable

from kvseal.client.hashing import deployment_identity as client_identity
from kvseal.v1 import kvseal_pb2 as pb

HASH_BYTES = 32
OFFLOAD_GROUP_BYTES = 4  # vLLM's OffloadKey suffix: the KV-group index, big endian
_NAME_OK = re.compile(r"[^A-Za-z0-9._:-]")


def kvseal_hash(vllm_block_hash: bytes) -> bytes:
    """The 32-byte kvseal hash of one vLLM block hash (see module doc)."""
    n = len(vllm_block_hash)
    if n == HASH_BYTES:
        return bytes(vllm_block_hash)
    if 0 < n < HASH_BYTES:
        return bytes(vllm_block_hash) + b"\x00" * (HASH_BYTES - 1 - n) + bytes([n])
    return hashlib.sha256(b"kvseal/vllm-hash/v1\x00" + bytes(vllm_block_hash)).digest()


def split_offload_key(key: bytes) -> tuple[bytes, int]:
    """(vLLM block hash, KV-group index) of an ``OffloadKey``."""
    if len(key) <= OFFLOAD_GROUP_BYTES:
        raise ValueError("an OffloadKey is a block hash followed by a 4-byte group index")
    return key[:-OFFLOAD_GROUP_BYTES], int.from_bytes(key[-OFFLOAD_GROUP_BYTES:], "big")


def make_offload_key(vllm_block_hash: bytes, group: int) -> bytes:
    return bytes(vllm_block_hash) + group.to_bytes(OFFLOAD_GROUP_BYTES, "big")


def model_fingerprint(
    *,
    model: str,
    revision: str | None,
    kv_dtype: str,
    tokens_per_block: int,
    layer_names: Iterable[str],
    bytes_per_block: int,
    kv_cache_layout: str | None,
    hash_algo: str,
    group: int,
    tp_rank: int,
    tp_size: int,
    pp_rank: int = 0,
) -> bytes:
    """A 32-byte fingerprint of everything the bytes of one block depend on."""
    h = hashlib.sha256(b"kvseal/vllm-model/v1\x00")
    parts = [
        model,
        revision or "",
        kv_dtype,
        str(tokens_per_block),
        ",".join(layer_names),
        str(bytes_per_block),
        kv_cache_layout or "",
        hash_algo,
        f"group={group}",
        f"tp={tp_rank}/{tp_size}",
        f"pp={pp_rank}",
    ]
    for p in parts:
        raw = p.encode()
        h.update(struct.pack(">I", len(raw)) + raw)
    return h.digest()


def pool_name(engine_id: str, dp_index: int, rank: int, role: str) -> str:
    """A pool name unique per engine, data-parallel replica, rank, role and process.

    The daemon *replaces* a pool registered under an existing name, so two
    engines (or the scheduler's probe pool and the worker's KV pool) must never
    share one; the pid separates a restarted engine from its predecessor whose
    hold the daemon has not noticed yet, and a random tag two instances in one
    process (each call gives a new name).
    """
    raw = f"vllm.{engine_id}.dp{dp_index}.r{rank}.{role}.{os.getpid()}.{secrets.token_hex(3)}"
    return _NAME_OK.sub("_", raw)[-128:]


# vLLM's NONE_HASH seed rule (vllm.v1.core.kv_cache_utils.resolve_none_hash_seed,
# 0.32 and 0.33): PYTHONHASHSEED if set; otherwise a fixed default for the
# cryptographic algorithms and a random per-process seed for the others.
_DEFAULT_SEED = "vllm-none-hash"
_NON_CRYPTO = ("xxhash", "xxhash_cbor")


def deployment_identity(
    label: str, hash_algo: str, tenant_key: bytes | None
) -> pb.DeploymentIdentity:
    """This vLLM engine's ``DeploymentIdentity`` (kvseal.client.deployment_identity)
    with vLLM's prefix-hash seed, as vLLM resolves it."""
    seed = os.environ.get("PYTHONHASHSEED")
    return client_identity(
        label,
        hash_algo,
        tenant_key,
        hash_seed=seed if seed is not None else _DEFAULT_SEED,
        hash_seed_random=seed is None and hash_algo in _NON_CRYPTO,
    )
