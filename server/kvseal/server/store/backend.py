"""What the sealed store needs from the place its records live.

:class:`~.fsstore.FsStore` and :class:`~.scopes.ScopeTable` keep everything
that makes the store safe (sealing, names, scope markers and floors, the
erasure and replay rules) and talk to storage only through
:class:`StoreBackend`: a flat space of *names* (64 hex digits, or 64 hex
digits + ``.scope`` for a scope marker or floor) holding opaque byte strings
(records, already sealed). Three backends exist: a POSIX directory
(:class:`~.fsio.StoreDir`, ``--store-dir`` / ``--store dir:///path``), an
S3 bucket (:class:`~.s3.S3Backend`, ``--store s3://bucket/prefix``) and a
Mooncake Store cluster (:class:`~.mooncake.MooncakeBackend`, ``--store
mooncake://master:port?local=...``).

The backend is the host's: nothing it returns is trusted. The store library
authenticates every byte it reads, so a backend's duty is narrower:

- **Atomic publish.** A reader sees a name's previous record or the new one,
  whole, never a mix (a partial record would read as tampering).
  ``replace=False`` is "create only": the first writer of a name wins and the
  others get False. Scope markers rely on it so replicas beginning a scope at
  once agree on one epoch; a backend that cannot make it atomic must say so
  (the cost is a second epoch, answered by one more rotation: never a wrong
  serve).
- **Bounded reads.** :meth:`StoreBackend.read` returns at most ``max_bytes``
  bytes (a larger record is a miss, left in place), snapshotted into private
  memory, within a bounded time.
- **Identity of what was read.** ``read`` returns an *ident* (an inode, an
  ETag) that :meth:`StoreBackend.remove` takes, so a record found bad is
  removed and not a good one published over it since (where the backend can
  tell; each says how far it can).
- **Failures are OSError.** Anything that is not "absent" (an I/O error, a
  server down, slow or answering garbage) raises ``OSError`` (a backend's own
  subclass: :class:`~.errors.StoreUnavailable`); the daemon turns it into a
  miss or a skipped spill, never a stall. Only the host's tampering with the
  layout itself (a planted shard symlink) is a
  :class:`~.errors.StoreIntegrityError`.
- **Bounded capacity.** :meth:`StoreBackend.make_room` keeps each shard
  (``name``'s first byte mod ``fanout``) under ``shard_cap`` bytes by removing
  the least recently used block objects first and scope records last.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

# Which stored version a read snapshot came from: (st_dev, st_ino) for a
# directory, the ETag for S3. Only ever compared for equality by its backend.
Ident = Hashable


@dataclass(frozen=True, slots=True)
class Usage:
    """What a full scan found: objects, markers, their bytes (allocation
    counted as in eviction), and temporary files."""

    objects: int
    markers: int
    record_bytes: int
    temp_files: int
    temp_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.record_bytes + self.temp_bytes


@dataclass(frozen=True, slots=True)
class Evicted:
    """What one make-room pass removed."""

    records: int = 0
    bytes: int = 0
    temp_files: int = 0
    names: tuple[str, ...] = ()  # the records removed (object names; markers included)


class StoreBackend(Protocol):
    """The storage under one store (see the module docstring). Every method is
    thread-safe and may be called from several processes sharing the storage."""

    @property
    def fanout(self) -> int:
        """Shards (a power of two up to 256), fixed when the storage was first
        opened; every opener agrees or was refused."""
        ...

    @property
    def location(self) -> str:
        """Where the storage is, for logs (never a credential)."""
        ...

    def read(
        self, name: str, max_bytes: int, scratch: bytearray | None = None
    ) -> tuple[bytearray | memoryview, Ident] | None:
        """A private snapshot of ``name``'s record and its ident; None when it
        is absent or larger than ``max_bytes`` (left in place). ``scratch``: a
        buffer to read into when the record fits (a view of it is returned).
        :class:`~.errors.NotARegularFile` where something other than a record
        sits at the name (nothing was read)."""
        ...

    def exists(self, name: str) -> bool:
        """Whether a record sits at ``name`` (nothing is read)."""
        ...

    def prefetch(self, name: str) -> None:
        """Advice that ``name`` will be read soon; errors are ignored."""
        ...

    def touch(self, name: str) -> None:
        """``name`` was just used (eviction order); absent is ignored."""
        ...

    def publish(
        self, name: str, data: bytes | bytearray, *, replace: bool, sync_dir: bool = False
    ) -> bool:
        """Publish ``data`` at ``name`` atomically; ``replace=False``: only if
        nothing is there (False when something was). ``sync_dir``: the name
        must survive a crash of the writer before this returns."""
        ...

    def remove(self, name: str, ident: Ident | None = None) -> bool:
        """Remove ``name`` (with ``ident``: only if it still holds that
        version); True if something was removed."""
        ...

    def remove_planted(self, name: str) -> bool:
        """Remove a non-record the backend refused with
        :class:`~.errors.NotARegularFile`; True if something was removed."""
        ...

    def make_room(self, name: str, incoming: int, shard_cap: int) -> Evicted:
        """Evict from ``name``'s shard until ``incoming`` more bytes fit in
        ``shard_cap``."""
        ...

    def usage(self) -> Usage:
        """Every record (and temporary file) of the storage: a full scan."""
        ...

    def path_of(self, name: str) -> str:
        """Where ``name`` lives, as an operator would look for it."""
        ...

    def close(self) -> None:
        """Release descriptors and connections. Idempotent."""
        ...


# Opens a store's backend: (fanout the configuration asks for or None,
# fanout for a new store) -> the backend. FsStore calls it once.
BackendOpener = Callable[[int | None, int], StoreBackend]
