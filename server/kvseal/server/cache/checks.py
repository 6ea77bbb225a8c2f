"""Request validation of the cache: each check raises before anything changes,
so bad input leaves the cache exactly as it was (``tests/test_bad_input.py``)."""

from __future__ import annotations

from collections.abc import Sequence

from kvseal.server.errors import BadRequest, ObserverPoolTransfer, PageOutOfRange
from kvseal.server.pools import Pool
from kvseal.server.sealing import HASH_BYTES, TENANT_BYTES


def check_tenant(tenant: bytes) -> None:
    """BadRequest unless ``tenant`` is a tenant digest."""
    if len(tenant) != TENANT_BYTES:
        raise BadRequest(
            f"tenant must be a {TENANT_BYTES}-byte digest of the cache salt, "
            f"got {len(tenant)} bytes"
        )


def check_hashes(hashes: Sequence[bytes], max_blocks: int) -> None:
    """BadRequest unless ``hashes`` are 1 to ``max_blocks`` distinct block hashes."""
    if not hashes:
        raise BadRequest("block_hashes is empty")
    if len(hashes) > max_blocks:
        raise BadRequest(f"{len(hashes)} blocks in one request (limit {max_blocks}); split it")
    for i, h in enumerate(hashes):
        if len(h) != HASH_BYTES:
            raise BadRequest(f"block_hashes[{i}] has {len(h)} bytes; hashes are {HASH_BYTES} bytes")
    if len(set(hashes)) != len(hashes):
        seen: set[bytes] = set()
        for i, h in enumerate(hashes):
            if h in seen:
                raise BadRequest(f"block_hashes[{i}] repeats an earlier hash in the request")
            seen.add(h)


def check_pages(pool: Pool, hashes: Sequence[bytes], pages: Sequence[int], max_bytes: int) -> None:
    """A transfer's pages: one per hash, distinct, in the pool, at most
    ``max_bytes`` in all; an observer pool moves none (ObserverPoolTransfer)."""
    if pool.observer:  # first: every transfer on an observer fails the same way
        raise ObserverPoolTransfer(
            f"pool {pool.pool_id!r} is an observer pool (no memory): Offload and Restore "
            "go through the pool that registered the KV memory"
        )
    if len(pages) != len(hashes):
        raise BadRequest(f"{len(hashes)} block_hashes but {len(pages)} page_ids")
    for i, p in enumerate(pages):
        if not 0 <= p < pool.num_pages:
            raise PageOutOfRange(
                f"page_ids[{i}]={p} is out of range: "
                f"pool {pool.pool_id!r} has {pool.num_pages} pages"
            )
    if len(set(pages)) != len(pages):
        seen: set[int] = set()
        for i, p in enumerate(pages):
            if p in seen:
                raise BadRequest(f"page_ids[{i}]={p} repeats an earlier page in the request")
            seen.add(p)
    total = len(pages) * pool.block_bytes
    if total > max_bytes:
        raise BadRequest(f"request moves {total} bytes (limit {max_bytes}); split it")


def check_event(wait_event: bytes | None, backend_kind: str) -> None:
    """Validated before anything is reserved: a rejected request changes nothing."""
    if not wait_event:
        return
    if backend_kind != "cuda":
        raise BadRequest("cuda_event_ipc_handle is only meaningful on the CUDA backend")
    if len(wait_event) != 64:
        raise BadRequest(f"cuda_event_ipc_handle must be 64 bytes, got {len(wait_event)}")
