"""Tenant scopes in the store: each (namespace, tenant) has a current *epoch*,
announced by a sealed *scope marker*, and dropping a tenant starts a new
epoch that no replaced one can come back over.

Two records per scope, both sealed under the marker key and bound to
(namespace, tenant) and to their kind (so neither passes for the other, nor
for another scope's), at names keyed like every other (``.scope`` files):

- the **marker** (kind 2): a random 32-byte *seed*, a random 8-byte *epoch
  id*, and the scope's **lineage**: the epoch ids it replaced, newest first
  (up to ``LINEAGE`` of them). The scope's block key is derived from the
  deployment key *and* the seed (:mod:`.keys`), and every object name
  includes the epoch id.
- the **floor** (kind 3): the epoch id and lineage of the newest epoch its
  writer began, without the seed. It is written after the marker whenever an
  epoch begins (a first put, a drop, a rollback answered), and it survives
  the marker: it is what a restarted daemon or another replica has to go on
  when the host restores an old marker over the current one.

An epoch is only ever *adopted* (served, written) by a process when its
marker is newer than everything that process knows of the scope:

1. **consistent with the floor**: the floor names the marker's epoch, or an
   epoch the marker's lineage lists (the marker was written after that
   floor), or there is no floor;
2. **linked to what this process knows**: this process's latest epoch of the
   scope (``_known``: the epoch it last adopted or began) is the marker's, or
   is in the marker's lineage.

A marker that fails either test is a **rollback**: counted, never adopted,
and answered by a rotation (a fresh epoch whose lineage lists the refused
epoch, the floor's and this process's, so every replica holding one of them
accepts it). An old marker can never pass: its lineage was written before
the epochs that replaced it existed, and epoch ids are random. That holds
however many times the host restores it (there is no list of retired ids to
outrun), whether or not a marker was visible when the drop ran (the drop's
marker and floor name a fresh epoch; the hidden one is in neither lineage,
so it fails test 1 against the floor and test 2 against the dropping
process), and for a process whose first contact with the scope is the drop.

What each party trusts, and so what holds (docs/store.md, "Tenants, drops
and erasure"; docs/threat-model.md):

- **The dropping process**, for its life: its own memory. It never adopts a
  pre-drop epoch again, whatever the host deletes or restores. The scopes it
  dropped are remembered unbounded (``_pinned``; drops are rare); others in
  an LRU of ``16 * max_scopes``.
- **A replica that has adopted a post-drop epoch**: the same, from its memory.
- **A restarted process, or a replica that knows nothing newer**: the floor.
  A restored old marker fails against it. A host that *also* deletes the
  floor, or puts an old floor back (deletion and restoration of records it
  holds; it cannot forge one), shows such a process a consistent pre-drop
  state it cannot tell from the real one: it then serves that tenant's
  pre-drop blocks *to that tenant* (authentic bytes of the right blocks,
  never another tenant's), until it meets any post-drop record. Without
  trusted monotonic state shared by replicas (a vTPM NV counter, the KBS)
  nothing closes that; rotating the deployment key does.

Concurrent epochs (two replicas dropping at once, or one dropping while
another begins the scope) leave a marker and a floor of different epochs
only briefly: whoever reads that refuses it and rotates once more, and the
next marker's lineage lists both. A replica that slept through two drops
elsewhere may find its epoch out of the new lineage only when more than
``LINEAGE`` drops passed; it then rotates once (its tenant's cache is lost,
never wrongly served).

Other rules, as before: a replica re-reads marker and floor when its cached
copy is older than ``ttl_s`` (and touches both: eviction removes ``.scope``
files only when no object is left in their shard); markers are created
first-writer-wins (``link``) so replicas starting a scope together agree on
one epoch; a missing marker means the scope has no reachable objects (a get
misses; the next put begins an epoch, linked to the floor). Thread-safe: one
lock guards the table; record I/O runs under it (records are tiny, and a
refresh happens once per scope per ``ttl_s``).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvseal.server.keyarena import KeySlot, fill_random
from kvseal.server.store.backend import StoreBackend
from kvseal.server.store.errors import (
    LengthMismatch,
    NotARegularFile,
    ScopeChanged,
    StoreIntegrityError,
    UnsupportedVersion,
)
from kvseal.server.store.fsio import MARKER_SUFFIX
from kvseal.server.store.keys import EPOCH_ID_BYTES, SEED_BYTES, StoreKeys
from kvseal.server.store.keysource import wipe
from kvseal.server.store.record import (
    KIND_BLOCK,
    KIND_FLOOR,
    KIND_SCOPE,
    Binding,
    RecordHeader,
    next_generation,
    open_record,
    record_bytes,
    seal,
)

LINEAGE = 8  # replaced epoch ids a marker and a floor carry
_LINEAGE_BYTES = LINEAGE * EPOCH_ID_BYTES
_NO_EPOCH = bytes(EPOCH_ID_BYTES)  # an empty lineage slot (ids are never zero)
MARKER_PAYLOAD = SEED_BYTES + EPOCH_ID_BYTES + _LINEAGE_BYTES  # 104
FLOOR_PAYLOAD = EPOCH_ID_BYTES + _LINEAGE_BYTES  # 72
MARKER_BYTES = record_bytes(MARKER_PAYLOAD)  # a marker's file size
FLOOR_BYTES = record_bytes(FLOOR_PAYLOAD)  # a floor's file size
ScopeKey = tuple[bytes, bytes]  # (namespace, tenant)


@dataclass(eq=False, slots=True)
class ScopeHandle:
    """A scope's current epoch as this process knows it. ``slot`` holds its
    key until the epoch is replaced or the entry is evicted (then None: a
    put or get still holding the handle gets :class:`ScopeChanged`)."""

    namespace: bytes
    tenant: bytes
    epoch_id: bytes
    slot: KeySlot | None
    checked_at: float

    def __repr__(self) -> str:
        return f"<scope epoch {self.epoch_id.hex()}{'' if self.slot else ' (gone)'}>"


@dataclass(slots=True)
class _Marker:
    epoch_id: bytes
    seed: bytearray  # wiped by the reader once adopted or refused
    lineage: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class _Floor:
    epoch_id: bytes
    lineage: tuple[bytes, ...]


def _pack_lineage(ids: list[bytes]) -> bytes:
    ids = ids[:LINEAGE]
    return b"".join(ids) + _NO_EPOCH * (LINEAGE - len(ids))


def _unpack_lineage(raw: bytes) -> tuple[bytes, ...]:
    ids = (raw[i : i + EPOCH_ID_BYTES] for i in range(0, len(raw), EPOCH_ID_BYTES))
    return tuple(i for i in ids if i != _NO_EPOCH)


class ScopeTable:
    """The scopes this process uses: their epochs, keys and known lineage."""

    def __init__(
        self, keys: StoreKeys, sdir: StoreBackend, *, ttl_s: float, max_scopes: int
    ) -> None:
        self._keys = keys
        self._dir = sdir
        self._ttl = ttl_s
        self._max = max_scopes
        self._lock = threading.Lock()
        self._live: OrderedDict[ScopeKey, ScopeHandle] = OrderedDict()
        # The latest epoch this process adopted or began, per scope: kept for
        # more scopes than keys are (an id is 8 bytes, a key an arena slot);
        # for the scopes it dropped, for its whole life.
        self._known: OrderedDict[ScopeKey, bytes] = OrderedDict()
        self._max_known = max_scopes * 16
        self._pinned: dict[ScopeKey, bytes] = {}
        self.rollbacks = 0
        self.rotations = 0

    # ------------------------------------------------------------ lookups

    def marker_name(self, namespace: bytes, tenant: bytes) -> str:
        """The file name of the scope's marker in the store directory."""
        return self._keys.scope_name(namespace, tenant) + MARKER_SUFFIX

    def floor_name(self, namespace: bytes, tenant: bytes) -> str:
        """The file name of the scope's floor record in the store directory."""
        return self._keys.floor_name(namespace, tenant) + MARKER_SUFFIX

    def current(self, namespace: bytes, tenant: bytes, *, create: bool) -> ScopeHandle | None:
        """The scope's current epoch; None when it has no marker and
        ``create`` is False. Re-reads marker and floor when the cached epoch
        is older than ``ttl_s``; a marker that is not newer than what this
        process and the floor know is refused and replaced (see the module
        docstring). Raises :class:`StoreIntegrityError` (after removing it)
        for a marker or floor that fails any check."""
        key = (namespace, tenant)
        with self._lock:
            handle = self._live.get(key)
            now = time.monotonic()
            if handle is not None and now - handle.checked_at < self._ttl:
                self._live.move_to_end(key)
                return handle
            return self._refresh(key, handle, create=create, now=now)

    def record_key(self, handle: ScopeHandle, salt: bytes) -> bytearray:
        """A record key of ``handle``'s epoch (the caller wipes it after one
        seal or open); :class:`ScopeChanged` if the epoch is gone meanwhile."""
        with self._lock:
            if handle.slot is None:
                raise ScopeChanged("the tenant's store epoch changed; nothing was done")
            return self._keys.record_key(handle.slot, KIND_BLOCK, salt)

    def rotate(self, namespace: bytes, tenant: bytes) -> None:
        """Drop the scope: begin a fresh epoch (marker, then floor, each
        durable before this returns) whose lineage lists every epoch known
        here (the marker's and the floor's, if readable, and this process's),
        and remember it for this process's life. Works the same when no
        marker or floor is visible: whatever was hidden is in no lineage."""
        key = (namespace, tenant)
        with self._lock:
            handle = self._live.pop(key, None)
            if handle is not None:
                self._forget(key, handle)
            # Remembered for this process's life from here on (_learn keeps it).
            self._pinned[key] = self._known.pop(key, b"") or self._pinned.get(key, _NO_EPOCH)
            marker = floor = None
            try:
                marker = self._read_marker(key)
            except StoreIntegrityError:
                pass  # removed; replaced below anyway
            try:
                floor = self._read_floor(key)
            except StoreIntegrityError:
                pass
            try:
                self.rotations += 1
                self._new_epoch(key, marker, floor, replace=True, now=time.monotonic())
            finally:
                if marker is not None:
                    wipe(marker.seed)

    def close(self) -> None:
        """Forget every scope (their keys are wiped with the store's arena)."""
        with self._lock:
            for handle in self._live.values():
                handle.slot = None
            self._live.clear()

    # ------------------------------------------------------------ internals

    def _latest(self, key: ScopeKey) -> bytes | None:
        known = self._pinned.get(key) or self._known.get(key)
        return None if known == _NO_EPOCH else known

    def _learn(self, key: ScopeKey, epoch_id: bytes) -> None:
        if key in self._pinned:
            self._pinned[key] = epoch_id
            return
        self._known[key] = epoch_id
        self._known.move_to_end(key)
        while len(self._known) > self._max_known:
            self._known.popitem(last=False)

    def _acceptable(self, key: ScopeKey, marker: _Marker, floor: _Floor | None) -> bool:
        """Whether ``marker`` is newer than the floor and than what this
        process knows of the scope (the module docstring's tests 1 and 2)."""
        newer = (marker.epoch_id, *marker.lineage)
        known = self._latest(key)
        return (floor is None or floor.epoch_id in newer) and (known is None or known in newer)

    def _refresh(
        self, key: ScopeKey, handle: ScopeHandle | None, *, create: bool, now: float
    ) -> ScopeHandle | None:
        for _ in range(3):  # a marker created or removed between our read and link
            marker = self._read_marker(key)
            try:
                floor = self._read_floor(key)
                if marker is None:
                    if handle is not None:
                        self._forget(key, handle)  # evicted or deleted: nothing reachable
                        handle = None
                    if not create:
                        return None
                    made = self._new_epoch(key, None, floor, replace=False, now=now)
                    if made is not None:
                        return made
                    continue
                if not self._acceptable(key, marker, floor):
                    # An epoch older than the floor or than one this process
                    # saw: the host restored an old copy (or two epochs began
                    # at once). Never adopt it; begin a newer one.
                    self.rollbacks += 1
                    if handle is not None:
                        self._forget(key, handle)
                    return self._new_epoch(key, marker, floor, replace=True, now=now)
                self._dir.touch(self.marker_name(*key))
                if floor is not None:
                    self._dir.touch(self.floor_name(*key))
                if handle is not None and handle.epoch_id == marker.epoch_id:
                    handle.checked_at = now
                    self._live.move_to_end(key)
                    return handle
                if handle is not None:  # dropped elsewhere: adopt the new epoch
                    self._forget(key, handle)
                return self._adopt(key, marker.epoch_id, marker.seed, now)
            finally:
                if marker is not None:
                    wipe(marker.seed)
        raise ScopeChanged("the tenant's scope marker kept changing; nothing was done")

    def _open(self, name: str, kind: int, payload_bytes: int, key: ScopeKey) -> bytearray | None:
        """The payload of the scope record ``name`` (None: absent, or a newer
        writer's format); removes it and raises on any failed check."""
        try:
            got = self._dir.read(name, record_bytes(payload_bytes))
        except NotARegularFile:
            # Refused before a byte was read; removed like any failed record, or
            # every later Lookup of the tenant would meet it again (DATA_LOSS,
            # and under ``abort`` an exit of every daemon that reads it).
            self._dir.remove_planted(name)
            raise
        if got is None:
            return None
        data, ident = got
        try:
            try:
                header = RecordHeader.parse(data, max_ct_len=payload_bytes)
            except UnsupportedVersion:
                return None  # a newer writer's record: nothing this code can use
            header.expect(kind, self._keys.key_id)
            if header.ct_len != payload_bytes:
                raise LengthMismatch(
                    f"a scope record holds {header.ct_len} bytes, not {payload_bytes}"
                )
            rkey = self._keys.record_key(None, kind, header.salt)
            return open_record(rkey, data, header, Binding(*key))
        except StoreIntegrityError:
            self._dir.remove(name, ident)
            raise

    def _read_marker(self, key: ScopeKey) -> _Marker | None:
        payload = self._open(self.marker_name(*key), KIND_SCOPE, MARKER_PAYLOAD, key)
        if payload is None:
            return None
        seed = bytearray(SEED_BYTES)
        seed[:] = memoryview(payload)[:SEED_BYTES]
        epoch_id = bytes(payload[SEED_BYTES : SEED_BYTES + EPOCH_ID_BYTES])
        lineage = _unpack_lineage(bytes(payload[SEED_BYTES + EPOCH_ID_BYTES :]))
        wipe(payload)
        return _Marker(epoch_id, seed, lineage)

    def _read_floor(self, key: ScopeKey) -> _Floor | None:
        payload = self._open(self.floor_name(*key), KIND_FLOOR, FLOOR_PAYLOAD, key)
        if payload is None:
            return None
        return _Floor(bytes(payload[:EPOCH_ID_BYTES]), _unpack_lineage(bytes(payload[8:])))

    def _seal(self, key: ScopeKey, kind: int, payload: bytearray) -> bytearray:
        header = RecordHeader.fresh(kind, self._keys.key_id, next_generation(), len(payload))
        rkey = self._keys.record_key(None, kind, header.salt)
        return seal(rkey, header, Binding(*key), payload)

    def _new_epoch(
        self, key: ScopeKey, marker: _Marker | None, floor: _Floor | None, *,
        replace: bool, now: float,
    ) -> ScopeHandle | None:  # fmt: skip
        """Begin a fresh epoch: publish its marker (``replace=False``: only if
        the scope has none; None when another writer won), adopt it, then
        publish its floor. Its lineage lists the epochs of ``marker``,
        ``floor`` and this process's latest, then their lineages."""
        seed = bytearray(SEED_BYTES)
        payload = bytearray(MARKER_PAYLOAD)
        try:
            fill_random((ctypes.c_char * SEED_BYTES).from_buffer(seed))
            epoch_id = _NO_EPOCH
            while epoch_id == _NO_EPOCH:
                epoch_id = os.urandom(EPOCH_ID_BYTES)
            lineage: list[bytes] = []
            for e in (
                marker.epoch_id if marker else None,
                floor.epoch_id if floor else None,
                self._latest(key),
                *(marker.lineage if marker else ()),
                *(floor.lineage if floor else ()),
            ):
                if e is not None and e != epoch_id and e not in lineage:
                    lineage.append(e)
            packed = _pack_lineage(lineage)
            payload[:SEED_BYTES] = seed
            payload[SEED_BYTES:] = epoch_id + packed
            data = self._seal(key, KIND_SCOPE, payload)
            # sync_dir: a marker rename lost in a crash would undo a drop.
            if not self._dir.publish(self.marker_name(*key), data, replace=replace, sync_dir=True):
                return None
            handle = self._adopt(key, epoch_id, seed, now)
        finally:
            wipe(seed)
            wipe(payload)
        # After the marker: between the two, a reader finds the old floor in
        # the new marker's lineage (accepted), never an old marker over a new floor.
        floor_data = self._seal(key, KIND_FLOOR, bytearray(epoch_id + packed))
        self._dir.publish(self.floor_name(*key), floor_data, replace=True, sync_dir=True)
        return handle

    def _adopt(self, key: ScopeKey, epoch_id: bytes, seed: bytearray, now: float) -> ScopeHandle:
        old = self._live.pop(key, None)
        if old is not None:
            self._forget(key, old)
        slot = self._keys.take_scope_slot(key[0], key[1], epoch_id, seed)
        handle = ScopeHandle(key[0], key[1], epoch_id, slot, now)
        self._live[key] = handle
        self._learn(key, epoch_id)
        while len(self._live) > self._max:
            evicted_key, evicted = self._live.popitem(last=False)
            self._forget(evicted_key, evicted)
        return handle

    def _forget(self, key: ScopeKey, handle: ScopeHandle) -> None:
        """Drop a handle's key (not its epoch: it may still be current)."""
        if self._live.get(key) is handle:
            del self._live[key]
        slot, handle.slot = handle.slot, None
        if slot is not None:
            self._keys.give_slot(slot)
