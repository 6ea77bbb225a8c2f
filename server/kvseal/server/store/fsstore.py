"""A sealed block store on a directory, shared by replicas and restarts.

:class:`FsStore` keeps sealed KV blocks in a directory that belongs to the
host (a local disk, or a ReadWriteMany volume every replica mounts), or in
another backend of :mod:`.backend` (an S3 bucket: :mod:`.s3`), under a
*deployment key* the replicas share (:mod:`.keysource`). The daemon's store
tier (``kvseal.server.cache.storetier``, ``--store-dir``) is built on it;
it also has its own tests (docs/store.md).

Contract:

- ``put(ns, tenant, block_hash, plaintext)`` seals the block under its
  tenant's current store epoch (:mod:`.scopes`) into a self-contained record
  (:mod:`.record`) and publishes it atomically at its keyed name
  (:mod:`.fsio`), after making room in its shard. A block already present is
  touched, not rewritten (False), and so is a block another thread of this
  process is putting right now. Concurrent puts of one block from several
  processes are harmless: each publishes a whole valid record and the last
  rename wins.
- ``get(...)`` returns the plaintext (a new ``bytearray``) only after the
  whole record, read into private memory, has authenticated against what the
  caller asked for; ``None`` for a miss. Every check that fails raises a
  :class:`~.errors.StoreIntegrityError` subclass, after the object has been
  removed (never quarantined: a quarantine the host can fill is a second
  capacity to bound). Misses, not errors: no object, no scope marker, a
  scope whose epoch changed while the get ran, a record larger than this
  store's ``max_object_bytes`` or of a record version this code does not
  read (a replica configured or built differently may share the store: left
  in place), and a replay this process can recognise (below). A different
  deployment key computes different names, so it sees only misses; it never
  gets another key's bytes.
- Filesystem failures that are not tampering (EIO, EACCES, ESTALE, EMFILE,
  ENOSPC, ...) propagate as ``OSError``; the caller treats them as a miss or
  a skipped spill. Only a symlink or file planted where a shard directory
  belongs is an integrity failure (``fsio``).
- ``delete(ns, tenant, block_hash)``: removes one block's object in the
  tenant's current epoch.
- ``contains(...)``: whether an object sits at the block's name (the
  object is not read or verified: a later ``get`` may still fail or miss).
  The tenant's scope marker and floor are read (at most once per
  ``scope_ttl_s``) and one failing its checks raises, as in ``get``.
- ``delete_tenant(ns, tenant)``: the tenant's store epoch is replaced
  (:meth:`.scopes.ScopeTable.rotate`): none of its earlier objects is served
  again by this process, whatever the host restores, nor by any replica
  that has seen a later epoch or reads the floor the drop wrote (within
  ``scope_ttl_s``). Their bytes stay until eviction reaches them. What this
  does and does not erase: :mod:`.scopes` and docs/store.md, "Tenants,
  drops and erasure".

Replay. The associated data binds namespace, tenant, epoch and block hash,
so an object moved to any other block, tenant, namespace or epoch fails
authentication, and a dropped tenant's old objects are unreachable by name.
What is left is an *older object of the same block in the same epoch* (the
host keeps a copy, the block is evicted and written again, the host puts the
copy back). Without a trusted index nothing can tell the two apart: both are
authentic seals of that block's KV under that tenant's key, and a block's KV
is a function of its hash (the prefix and the model), so serving the older
one returns the right bytes. This process remembers the generation of the
objects it wrote or served (``replay_memory`` names, LRU); an authentic
object older than that is a replay it can see: counted, removed, a miss
(not an integrity failure: writers' clocks are not ordered, and two
replicas writing one block at once may publish in the other order than they
drew generations, so a legitimate rewrite can look the same; the cost of
such a false replay is one miss).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields

from kvseal.server.store.backend import BackendOpener, StoreBackend, Usage
from kvseal.server.store.errors import (
    ObjectTooLarge,
    ScopeChanged,
    StoreIntegrityError,
    StoreLayoutError,
    UnsupportedVersion,
)
from kvseal.server.store.fsio import MAX_FANOUT, StoreDir
from kvseal.server.store.keys import StoreKeys
from kvseal.server.store.keysource import DeploymentKey, wipe
from kvseal.server.store.record import (
    KIND_BLOCK,
    Binding,
    RecordHeader,
    next_generation,
    open_record,
    record_bytes,
    seal,
)
from kvseal.server.store.scopes import ScopeHandle, ScopeTable

# A shard must hold at least this many of the largest records, or uneven
# filling of shards (names are uniform, counts are not) wastes capacity.
MIN_RECORDS_PER_SHARD = 8


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """One store's settings. Every replica sharing a directory must use the
    same ``capacity_bytes`` (each enforces its own on the shards it writes)
    and the same fanout (the layout file enforces that)."""

    path: str  # the directory; with another backend, its location (logs only)
    capacity_bytes: int
    # The largest plaintext a put accepts (the block size of the pools served).
    max_object_bytes: int
    # Shard directories: a power of two up to 256; None: the store's layout
    # file, or for a new store the largest that keeps MIN_RECORDS_PER_SHARD
    # of the largest records per shard.
    fanout: int | None = None
    durable: bool = True  # fsync each record before publishing (fsio)
    scope_ttl_s: float = 2.0  # how stale a cached scope marker may be
    stale_temp_s: float = 600.0  # a temporary file untouched this long is a crash's
    max_scopes: int = 4096  # scope keys kept (LRU; more are re-derived on use)
    replay_memory: int = 65536  # object generations remembered (replay detection)

    def __post_init__(self) -> None:
        if self.max_object_bytes < 0 or self.capacity_bytes <= 0:
            raise StoreLayoutError("capacity must be positive and max_object_bytes >= 0")
        if self.scope_ttl_s < 0 or self.stale_temp_s <= 0:
            raise StoreLayoutError("scope_ttl_s must be >= 0 and stale_temp_s > 0")
        if self.max_scopes < 1 or self.replay_memory < 0:
            raise StoreLayoutError("max_scopes must be >= 1 and replay_memory >= 0")

    def auto_fanout(self) -> int:
        fanout = MAX_FANOUT
        need = MIN_RECORDS_PER_SHARD * record_bytes(self.max_object_bytes)
        while fanout > 1 and self.capacity_bytes // fanout < need:
            fanout //= 2
        return fanout


@dataclass(slots=True)
class StoreStats:
    """Counters of one FsStore (this process's view of a shared store)."""

    puts: int = 0  # records published
    put_present: int = 0  # puts of a block already there (touched)
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # records removed to make room (by this process)
    evicted_bytes: int = 0
    temp_files_swept: int = 0
    integrity_failures: int = 0
    replays: int = 0
    scope_rollbacks: int = 0  # replaced scope markers seen again (rotated)
    tenant_drops: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class FsStore:
    """A sealed block store on a directory (see the module docstring).

    Takes ownership of the deployment key (``close`` wipes it) and of the
    backend (``close`` closes it). Thread-safe. Identifiers (namespace,
    tenant, block hash) are 32 bytes each, as in the host tier's format.

    ``backend``: opens the storage (:mod:`.backend`), called once with the
    configured fanout (or None) and the fanout for a new store; None: the
    directory at ``config.path`` (:class:`~.fsio.StoreDir`). Everything above
    the backend (records, names, scopes, erasure, replay) is the same for all.
    """

    def __init__(
        self, config: StoreConfig, key: DeploymentKey, backend: BackendOpener | None = None
    ) -> None:
        self.config = config
        self._keys = StoreKeys(key, max_scope_keys=config.max_scopes)
        try:
            opener = backend if backend is not None else self._open_dir
            self._dir: StoreBackend = opener(config.fanout, config.auto_fanout())
        except BaseException:
            self._keys.close()
            raise
        self.fanout = self._dir.fanout
        self.shard_capacity = config.capacity_bytes // self.fanout
        self._max_record = record_bytes(config.max_object_bytes)
        if self._max_record > self.shard_capacity:
            self.close()
            raise StoreLayoutError(
                f"capacity {config.capacity_bytes} over {self.fanout} shards leaves "
                f"{self.shard_capacity} bytes per shard, less than one {self._max_record}-byte "
                "record: raise the capacity or lower the fanout"
            )
        self._scopes = ScopeTable(
            self._keys, self._dir, ttl_s=config.scope_ttl_s, max_scopes=config.max_scopes
        )
        self._lock = threading.Lock()
        # Called (on the putting thread, under no lock of the store's) with the
        # names of the records a put evicted to make room: the daemon's event
        # stream retracts the blocks it announced (cache.storeevents).
        self.on_evict: Callable[[tuple[str, ...]], None] | None = None
        self._seen: OrderedDict[str, int] = OrderedDict()
        # Each reading thread's record buffer: the largest record it read (a
        # record that did not fit is read into a new one, which is kept).
        self._local = threading.local()
        self._inflight: set[str] = set()
        self._stats = StoreStats()

    def _open_dir(self, fanout: int | None, default_fanout: int) -> StoreBackend:
        return StoreDir(
            self.config.path,
            fanout=fanout,
            durable=self.config.durable,
            stale_temp_s=self.config.stale_temp_s,
            default_fanout=default_fanout,
        )

    def __repr__(self) -> str:
        return f"<FsStore {self._dir.location} fanout={self.fanout} key={self._keys!r}>"

    @property
    def location(self) -> str:
        """Where the records are (the directory, or the bucket and prefix)."""
        return self._dir.location

    @property
    def key_id(self) -> bytes:
        """The deployment key's public id (in every record's header)."""
        return self._keys.key_id

    def stats(self) -> StoreStats:
        """A snapshot of the counters."""
        with self._lock:
            snap = StoreStats(**self._stats.as_dict())
        snap.scope_rollbacks = self._scopes.rollbacks
        return snap

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, n in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + n)

    # ------------------------------------------------------------ operations

    def put(
        self,
        namespace: bytes,
        tenant: bytes,
        block_hash: bytes,
        plaintext: bytes | bytearray | memoryview,
    ) -> bool:
        """Seal and publish one block; False if it was already present (then
        only touched). Raises :class:`ObjectTooLarge` over
        ``max_object_bytes``, :class:`ScopeChanged` if the tenant was dropped
        while this ran (nothing published), :class:`StoreIntegrityError` if
        the tenant's scope marker failed its checks (it was removed)."""
        if len(plaintext) > self.config.max_object_bytes:
            raise ObjectTooLarge(
                f"a {len(plaintext)}-byte block; this store takes at most "
                f"{self.config.max_object_bytes}"
            )
        scope = self._scope(namespace, tenant, create=True)
        assert scope is not None  # created on demand
        name = self._keys.object_name(namespace, tenant, scope.epoch_id, block_hash)
        with self._lock:
            # One put per name at a time in this process: a second one would
            # seal the same block again, and its rename could land before the
            # first's, leaving an older generation than the one remembered.
            busy = name in self._inflight
            if not busy:
                self._inflight.add(name)
        if busy:
            self._count(put_present=1)
            return False
        try:
            if self._dir.exists(name):
                self._dir.touch(name)
                self._count(put_present=1)
                return False
            header = RecordHeader.fresh(
                KIND_BLOCK, self._keys.key_id, next_generation(), len(plaintext)
            )
            binding = Binding(namespace, tenant, scope.epoch_id, block_hash)
            data = seal(self._scopes.record_key(scope, header.salt), header, binding, plaintext)
            evicted = self._dir.make_room(name, len(data), self.shard_capacity)
            try:
                self._dir.publish(name, data, replace=True)
            finally:  # what make_room removed is gone even if the publish failed
                if evicted.names and self.on_evict is not None:
                    self.on_evict(evicted.names)
            self._remember(name, header.generation)
        finally:
            with self._lock:
                self._inflight.discard(name)
        self._count(
            puts=1,
            evictions=evicted.records,
            evicted_bytes=evicted.bytes,
            temp_files_swept=evicted.temp_files,
        )
        return True

    def get(
        self, namespace: bytes, tenant: bytes, block_hash: bytes, out: bytearray | None = None
    ) -> bytearray | None:
        """The block's plaintext, authenticated, or None (a miss). Raises a
        :class:`StoreIntegrityError` subclass when the object (or the scope
        marker) fails a check; the failing file has been removed. ``out``:
        the caller's buffer to decrypt into (returned; a record of another
        size is a miss, left in place, ``out`` untouched); None: a new one.
        The record is read into this thread's reused buffer (it holds
        ciphertext only), so a restore faults in no fresh pages for it."""
        try:
            scope = self._scope(namespace, tenant, create=False)
        except ScopeChanged:
            scope = None
        if scope is None:
            self._count(misses=1)
            return None
        name = self._keys.object_name(namespace, tenant, scope.epoch_id, block_hash)
        try:
            got = self._dir.read(name, self._max_record, getattr(self._local, "buf", None))
        except StoreIntegrityError:
            self._dir.remove(name)
            self._count(integrity_failures=1)
            raise
        if got is None:
            self._count(misses=1)
            return None
        data, ident = got
        if isinstance(data, bytearray):  # did not fit this thread's buffer: the new one
            self._local.buf = data
        try:
            header = RecordHeader.parse(data, max_ct_len=self.config.max_object_bytes)
            header.expect(KIND_BLOCK, self._keys.key_id)
            rkey = self._scopes.record_key(scope, header.salt)
            binding = Binding(namespace, tenant, scope.epoch_id, block_hash)
            wrong_size = out is not None and len(out) != header.ct_len
            # Authenticated whatever its size (a record resized by the host is
            # tampering, not a miss): another size goes to a scratch buffer.
            plaintext = open_record(rkey, data, header, binding, None if wrong_size else out)
        except (ScopeChanged, UnsupportedVersion):
            # A newer replica's record format is not tampering: a miss, kept.
            self._count(misses=1)
            return None
        except StoreIntegrityError:
            self._dir.remove(name, ident)
            self._count(integrity_failures=1)
            raise
        if wrong_size:  # an authentic block of another geometry: not this caller's
            wipe(plaintext)
            self._count(misses=1)
            return None
        try:
            if self._is_replay(name, header.generation):
                wipe(plaintext)
                self._dir.remove(name, ident)
                self._count(replays=1, misses=1)
                return None
            self._dir.touch(name)
        except BaseException:
            wipe(plaintext)  # an OSError here (EIO, EACCES) is a miss: no plaintext left
            raise
        self._count(hits=1)
        return plaintext

    def contains(self, namespace: bytes, tenant: bytes, block_hash: bytes) -> bool:
        """Whether an object sits at the block's name in the tenant's current
        epoch (the object is neither read nor verified). Raises
        :class:`StoreIntegrityError` when the tenant's scope marker or floor,
        which this reads, fails its checks (it was removed), as :meth:`get`."""
        try:
            scope = self._scope(namespace, tenant, create=False)
        except ScopeChanged:
            return False
        if scope is None:
            return False
        name = self._keys.object_name(namespace, tenant, scope.epoch_id, block_hash)
        try:
            return self._dir.exists(name)
        except StoreIntegrityError:
            # A planted shard symlink: nothing is read here, so no policy runs
            # (a get of the block meets it and applies the policy).
            return False

    def delete(self, namespace: bytes, tenant: bytes, block_hash: bytes) -> bool:
        """Remove the block's object in the tenant's current epoch (a
        ``Drop(block_hashes)``); True if one was there. Objects of other
        epochs are unreachable already. Raises ``OSError`` and
        :class:`StoreIntegrityError` (a failing scope marker, removed)."""
        try:
            scope = self._scope(namespace, tenant, create=False)
        except ScopeChanged:
            return False
        if scope is None:
            return False
        return self._dir.remove(
            self._keys.object_name(namespace, tenant, scope.epoch_id, block_hash)
        )

    def delete_tenant(self, namespace: bytes, tenant: bytes) -> None:
        """Drop the (namespace, tenant) scope: its stored blocks are never
        served again (see the module docstring and docs/store.md)."""
        self._scopes.rotate(namespace, tenant)
        self._count(tenant_drops=1)

    def usage(self) -> Usage:
        """Records and bytes in the whole directory (a full scan: every
        replica's records, not only this process's)."""
        return self._dir.usage()

    # ------------------------------------------------------------ for tests and operators

    def prefetch(self, namespace: bytes, tenant: bytes, hashes: list[bytes]) -> None:
        """Start reading these blocks' objects from the device (advice: the
        gets that follow overlap their decryption with the reads; nothing
        is verified or returned here, filesystem errors are ignored). Raises
        :class:`StoreIntegrityError` as :meth:`get` would when the tenant's
        scope marker fails its checks (it has been removed)."""
        try:
            scope = self._scope(namespace, tenant, create=False)
        except (ScopeChanged, OSError):
            return
        if scope is None:
            return
        for h in hashes:
            self._dir.prefetch(self._keys.object_name(namespace, tenant, scope.epoch_id, h))

    def name_of(self, namespace: bytes, tenant: bytes, block_hash: bytes) -> str | None:
        """The block's object name in the tenant's current epoch (None: the
        tenant has no scope marker). Nothing is read but the marker."""
        try:
            scope = self._scope(namespace, tenant, create=False)
        except (ScopeChanged, StoreIntegrityError):
            return None
        if scope is None:
            return None
        return self._keys.object_name(namespace, tenant, scope.epoch_id, block_hash)

    def object_path(self, namespace: bytes, tenant: bytes, block_hash: bytes) -> str | None:
        """Where the block's object lives in the tenant's current epoch (None:
        the tenant has no scope marker)."""
        scope = self._scope(namespace, tenant, create=False)
        if scope is None:
            return None
        name = self._keys.object_name(namespace, tenant, scope.epoch_id, block_hash)
        return self._dir.path_of(name)

    def marker_name(self, namespace: bytes, tenant: bytes) -> str:
        """The backend name of the tenant's scope marker."""
        return self._scopes.marker_name(namespace, tenant)

    def floor_name(self, namespace: bytes, tenant: bytes) -> str:
        """The backend name of the tenant's scope floor record."""
        return self._scopes.floor_name(namespace, tenant)

    def scope_path(self, namespace: bytes, tenant: bytes) -> str:
        """Where the tenant's scope marker lives."""
        return self._dir.path_of(self._scopes.marker_name(namespace, tenant))

    def floor_path(self, namespace: bytes, tenant: bytes) -> str:
        """Where the tenant's scope floor record lives."""
        return self._dir.path_of(self._scopes.floor_name(namespace, tenant))

    # ------------------------------------------------------------ internals

    def _scope(self, namespace: bytes, tenant: bytes, *, create: bool) -> ScopeHandle | None:
        try:
            return self._scopes.current(namespace, tenant, create=create)
        except StoreIntegrityError:
            self._count(integrity_failures=1)
            raise

    def _remember(self, name: str, generation: int) -> None:
        if self.config.replay_memory == 0:
            return
        with self._lock:
            if generation >= self._seen.get(name, 0):
                self._seen[name] = generation
            self._seen.move_to_end(name)
            while len(self._seen) > self.config.replay_memory:
                self._seen.popitem(last=False)

    def _is_replay(self, name: str, generation: int) -> bool:
        """True if this process already wrote or served a newer object at
        ``name``; otherwise remembers ``generation``."""
        with self._lock:
            newest = self._seen.get(name)
        if newest is not None and generation < newest:
            return True
        self._remember(name, generation)
        return False

    def close(self) -> None:
        """Wipe every key and close the directory. Idempotent."""
        scopes = getattr(self, "_scopes", None)
        if scopes is not None:
            scopes.close()
        self._keys.close()
        self._dir.close()

    def __enter__(self) -> FsStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
