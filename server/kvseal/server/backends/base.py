"""The backend interface: what the cache asks of a data path, and the types
both backends (``cpu/``, ``cuda/``) share.

A backend moves block bytes between an engine pool and the host region,
sealing on the way out and verifying on the way in. The contract every
backend keeps:

- ``seal_blocks`` gathers each block's pages, seals them with the shared
  :class:`~kvseal.server.sealing.BlockSealer` format, and publishes only
  ciphertext to its host extent. It returns one record per block (nonce, tag,
  epoch) for the trusted index, or raises (then the records are discarded and
  no extent is used; :func:`note_written` tells the cache which extents it may
  have written, so that it reinstates the eviction victims no write touched).
- ``open_blocks`` snapshots each block's ciphertext into private memory,
  authenticates *every* block, and only if all of them authenticate scatters
  the plaintext into the destination pages. It returns the indices of blocks
  that failed; if any failed, not one byte was written to the engine's pool.

Both take a :class:`~kvseal.server.deadline.Deadline` and call its ``check``
before every block they read from or write to the pool (each touch is one
block, so bounded); when it raises they stop, wait for every thread or stream
they started, and raise it: a request that failed touches no page afterwards
(the engine contract, ``kvseal.server.deadline``).

Page ids and extents are validated by the caller before these are called.
``tests/test_backend_interface.py`` checks that both backend classes (and
their regions) have exactly these members and signatures; mypy checks the
same structurally where the daemon builds them (``make_backend``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvseal.server.deadline import NO_DEADLINE, Deadline
from kvseal.server.hostregion import Extent
from kvseal.server.pools import MappedPool, PoolSpec
from kvseal.server.sealing import BlockAD, SealRecord

_WRITTEN_ATTR = "kvseal_written_blocks"


def note_written(exc: BaseException, blocks: set[int]) -> None:
    """Record on a ``seal_blocks`` failure which blocks (indices into its
    ``blocks``) may have had bytes written to their extents; the cache
    reinstates eviction victims that no such write can have touched."""
    prior: set[int] = getattr(exc, _WRITTEN_ATTR, set())
    setattr(exc, _WRITTEN_ATTR, prior | blocks)


def written_positions(exc: BaseException, n: int) -> set[int]:
    """The blocks a failed ``seal_blocks`` may have written: what the backend
    noted, else (it could not tell) all ``n``."""
    noted: set[int] | None = getattr(exc, _WRITTEN_ATTR, None)
    return set(range(n)) if noted is None else noted


@dataclass(frozen=True, slots=True)
class BlockIO:
    """One block of a batch: where it lives in the pool and in the region."""

    page: int
    extent: Extent
    ad: BlockAD
    size: int


@runtime_checkable
class Region(Protocol):
    """The host region as the cache and the stats see it. ``HostRegion`` is
    the CPU backend's; the CUDA backend brings pinned host memory of its own
    with the same surface (and the same rule: only ciphertext goes in)."""

    capacity: int
    description: str

    def write(self, offset: int, data: memoryview) -> None: ...

    def read_into(self, offset: int, out: memoryview) -> int: ...

    def close(self) -> None: ...


@runtime_checkable
class Backend(Protocol):
    """See the module docstring for the contract of each method.

    ``wait_event`` is the engine's CUDA IPC event handle (CUDA backend only):
    the backend polls it on the host until it has completed before the first
    work that reads (seal) or writes (open) the pool's pages is queued; it never
    queues a GPU-side wait on it (an event that never completes would block the
    backend's streams for every later request).
    """

    kind: str  # "cpu" | "cuda"
    detail: str
    # Set when the daemon stops serving (shutdown, integrity abort): a request
    # in flight must not write to an engine pool after it is set.
    stopping: threading.Event

    def make_region(self, capacity: int, path: str | None) -> Region: ...

    def map_pool(self, spec: PoolSpec) -> MappedPool: ...

    def seal_blocks(
        self,
        pool: MappedPool,
        blocks: Sequence[BlockIO],
        region: Region,
        wait_event: bytes | None = None,
        deadline: Deadline = NO_DEADLINE,
    ) -> list[SealRecord]: ...

    def open_blocks(
        self,
        pool: MappedPool,
        blocks: Sequence[BlockIO],
        records: Sequence[SealRecord],
        region: Region,
        wait_event: bytes | None = None,
        deadline: Deadline = NO_DEADLINE,
    ) -> list[int]: ...

    def retire_keys(self) -> None:
        """Wipe every copy the backend holds of keys the sealer destroyed (a
        crypto-erasing drop): called right after ``BlockSealer.destroy_scope``.
        May wait for a request in flight; never raises."""
        ...

    def check_device(self) -> None:
        """The daemon's periodic device check, every ``--device-check-interval``
        seconds while it serves. A backend whose device can no longer serve (the
        CUDA context was lost while idle) reports it as a failure inside a request
        does (the CUDA backend's ``set_on_broken`` callback: health NOT_SERVING,
        exit 4), never by raising. Cheap, never waits for a request in flight; a
        no-op where there is no device (CPU)."""
        ...

    def close(self) -> None: ...
