"""What the typed calls of :class:`kvseal.client.client.KVSealClient` return:
plain frozen dataclasses, so callers never handle proto replies (except
``stats``, whose reply is the proto itself)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PoolHandle:
    pool_id: str
    namespace: bytes
    block_bytes: int
    server_instance: str
    # Proves this registration's ownership of its name (RegisterPool's owner_token);
    # not secret from the engine, but no business of logs.
    owner_token: bytes = field(default=b"", repr=False)
    # RegisterPoolReply.warnings: why this pool's blocks may never meet another
    # replica's (the daemon compared the request's DeploymentIdentity).
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class LookupResult:
    hit_blocks: int
    states: list[int]  # kvseal.v1.BlockState values


@dataclass(frozen=True)
class OffloadResult:
    outcomes: list[int]  # kvseal.v1.OffloadOutcome values
    stored_blocks: int
    stored_bytes: int
    evicted_blocks: int


@dataclass(frozen=True)
class RestoreResult:
    restored_blocks: int
    restored_bytes: int
