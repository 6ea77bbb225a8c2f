"""How SGLang's identities become kvseal's: page hashes, tenants, models.

Nothing here imports SGLang or torch.

- **Block hashes.** SGLang names a page by its storage hash: a SHA-256 chain
  over the page's tokens and the previous page's hash, hex-encoded, whose root
  is seeded by the request's namespace (``extra_key``, ``cache_salt``;
  ``sglang.srt.mem_cache.utils.storage_namespace_seed``). kvseal uses the 32
  bytes as they are (:func:`kvseal_hash`); any other form is hashed into 32.
- **Tenants.** The request's ``cache_salt`` becomes kvseal's tenant through
  :func:`kvseal.client.tenant_digest` (keyed by ``KVSEAL_TENANT_KEY_FILE`` when
  set); no salt is the shared tenant. The salt also seeds SGLang's chain, so a
  page of one salt never has the hash of another's: two fences, as in vLLM.
- **Models.** :func:`model_fingerprint` binds the model path, revision, the
  page geometry, the hash scheme and the TP/PP rank.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import struct

from kvseal.client import deployment_identity, load_tenant_key, tenant_digest
from kvseal.v1 import kvseal_pb2 as pb

HASH_BYTES = 32
HASH_SCHEME = "sglang-storage-sha256-chain/v1"
_NAME_OK = re.compile(r"[^A-Za-z0-9._:-]")


def kvseal_hash(sglang_key: str) -> bytes:
    """The 32-byte kvseal hash of one SGLang storage key (module doc)."""
    if len(sglang_key) == 2 * HASH_BYTES:
        try:
            return bytes.fromhex(sglang_key)
        except ValueError:
            pass
    return hashlib.sha256(b"kvseal/sglang-key/v1\x00" + sglang_key.encode()).digest()


class Tenants:
    """cache_salt -> tenant digest, with the deployment's tenant key read once."""

    def __init__(self, key: bytes | None = None, *, from_env: bool = True) -> None:
        self._key = key if key is not None or not from_env else load_tenant_key()
        self.shared = tenant_digest(None, key=self._key)
        self._cache: dict[str, bytes] = {}

    def identity(self, label: str) -> pb.DeploymentIdentity:
        """This engine's ``DeploymentIdentity`` (docs/store.md): SGLang's
        storage-key chain has no seed; the tenant key's check value."""
        return deployment_identity(label, HASH_SCHEME, self._key)

    def of(self, cache_salt: str | None) -> bytes:
        if not cache_salt:
            return self.shared
        t = self._cache.get(cache_salt)
        if t is None:
            if len(self._cache) > 1 << 16:  # bounded: digests are cheap to recompute
                self._cache.clear()
            t = self._cache[cache_salt] = tenant_digest(cache_salt, key=self._key)
        return t


def model_fingerprint(
    *,
    model: str,
    revision: str | None,
    dtype: str,
    page_size: int,
    num_layers: int,
    start_layer: int,
    heads: int,
    head_dim: int,
    v_head_dim: int,
    block_bytes: int,
    tp_rank: int,
    tp_size: int,
    pp_rank: int,
    component: str = "kv",
    kind: str = "mha",
    layout: str = "sglang-page:v1",
    rank_replicated: bool = False,
) -> bytes:
    """A 32-byte fingerprint of everything the bytes of one block depend on.

    The component (SGLang's pool name: kv, swa, mamba), its kind (mha, mla,
    mamba) and staging layout are bound too, so each component is its own
    namespace; an MHA ``kv`` pool in the first layout keeps the first
    version's fingerprint. A rank-replicated pool (MLA: the latent is the same
    on every TP rank) binds the TP size but not the rank, so ranks that share
    a daemon share its blocks."""
    h = hashlib.sha256(b"kvseal/sglang-model/v1\x00")
    parts = [
        model,
        revision or "",
        dtype,
        f"page={page_size}",
        f"layers={start_layer}+{num_layers}",
        f"heads={heads}x{head_dim}/{v_head_dim}",
        f"block={block_bytes}",
        HASH_SCHEME,
        f"tp=replicated/{tp_size}" if rank_replicated else f"tp={tp_rank}/{tp_size}",
        f"pp={pp_rank}",
    ]
    if (component, kind, layout) != ("kv", "mha", "sglang-page:v1"):
        parts.append(f"component={component};kind={kind};layout={layout}")
    for p in parts:
        raw = p.encode()
        h.update(struct.pack(">I", len(raw)) + raw)
    return h.digest()


def pool_name(tag: str, tp_rank: int, pp_rank: int, role: str) -> str:
    """A pool name unique per engine process, rank and role (see
    :func:`kvseal.vllm.keys.pool_name` for why every instance gets a new one)."""
    raw = f"sglang.{tag}.tp{tp_rank}.pp{pp_rank}.{role}.{os.getpid()}.{secrets.token_hex(3)}"
    return _NAME_OK.sub("_", raw)[-128:]
