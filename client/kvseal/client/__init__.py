"""Engine-side client for the kvseal sidecar.

- :class:`KVSealClient` — typed calls with deadlines and bounded retries;
  raises :class:`KVSealRpcError` (code + stable reason) on failure.
- :class:`EnginePool` — the hot-path wrapper an engine uses: never raises,
  never blocks past its deadline; a daemon that is down, slow or restarting
  turns lookups into misses and offloads into no-ops, and the pool is
  re-registered automatically when the daemon comes back.
- :mod:`kvseal.client.hashing` — chained block hashes and tenant digests.
- :mod:`kvseal.client.shm` — KV pools in POSIX shared memory (CPU backend).

Where each part lives: ``config`` (ClientConfig), ``errors`` (KVSealRpcError),
``results`` (what calls return), ``channel`` and ``health`` (the gRPC channel
and its settings), ``transfer`` (the client's side of the engine contract),
``hold`` (PoolHold), ``client`` (KVSealClient), ``engine_pool`` (EnginePool),
``liveness`` (is the daemon gone).

Importing this package imports neither server code nor torch.
"""

from kvseal.client.client import KVSealClient
from kvseal.client.config import ClientConfig
from kvseal.client.engine_pool import EnginePool
from kvseal.client.errors import KVSealRpcError
from kvseal.client.hashing import (
    NONE_HASH,
    chain_block_hashes,
    deployment_identity,
    load_tenant_key,
    tenant_digest,
)
from kvseal.client.hold import PoolHold
from kvseal.client.results import LookupResult, OffloadResult, PoolHandle, RestoreResult

__all__ = [
    "NONE_HASH",
    "ClientConfig",
    "EnginePool",
    "KVSealClient",
    "KVSealRpcError",
    "LookupResult",
    "OffloadResult",
    "PoolHandle",
    "PoolHold",
    "RestoreResult",
    "chain_block_hashes",
    "load_tenant_key",
    "tenant_digest",
    "deployment_identity",
]
