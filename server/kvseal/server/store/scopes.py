"""Tenant scopes in the store: each (namespace, tenant) has a current *epoch*,
announced by a sealed *scope marker* record, and dropping a tenant starts a
new epoch.

A marker is a record of kind 2 at ``keys.scope_name(ns, tenant) + ".scope"``, sealed
under the marker key and bound to (namespace, tenant). Its 40-byte payload is
a random 32-byte *seed* and a random 8-byte *epoch id*. The scope's block key
is derived from the deployment key *and* the seed (:mod:`.keys`), and every
object name includes the epoch id. So:

- **Drop** (:meth:`ScopeTable.rotate`) replaces the marker with a fresh seed
  and epoch id. Objects of the old epoch sit at names nobody computes again:
  no replica that has read the new marker serves them (a miss, never an
  error), and eviction reclaims their bytes, oldest first.
- **Other replicas** re-read the marker when their cached copy is older than
  ``ttl_s`` (and touch it; eviction removes markers only after every object
  of their shard). A drop therefore takes effect everywhere within ``ttl_s``;
  meanwhile a replica may still serve, or write, the old epoch, and what it
  writes is unreachable for the others.
- **Another replica cannot undo a drop:** no code path republishes an epoch
  that has been replaced. A process remembers the epoch ids it saw replaced
  (per scope, bounded); a marker that comes back with one of them (the host
  restored an old copy) is a rollback: counted, and answered by rotating
  again, so that old epoch is never adopted by this process.
- **What the design cannot give** (docs/store.md, "Erasure"): the host holds
  the files and may keep copies. A replica that starts after a drop and is
  shown the pre-drop marker (and objects) cannot tell: it serves that
  tenant's pre-drop blocks *to that tenant* (authentic bytes of the right
  block, never another tenant's). Crypto-erase against someone who later
  learns the deployment key holds only if the old marker is really gone
  (the seed exists nowhere else); against a host that kept it, only
  rotating the deployment key itself erases.
- Markers are created first-writer-wins (``link``): two replicas starting a
  scope at once agree on one epoch. A missing marker (evicted, deleted)
  means the scope has no reachable objects: a get misses; the next put
  starts a new epoch.

Thread-safe: one lock guards the table; marker I/O runs under it (markers
are tiny, and a refresh happens once per scope per ``ttl_s``).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvseal.server.keyarena import KeySlot, fill_random
from kvseal.server.store.errors import (
    LengthMismatch,
    ScopeChanged,
    StoreIntegrityError,
    UnsupportedVersion,
)
from kvseal.server.store.fsio import MARKER_SUFFIX, StoreDir
from kvseal.server.store.keys import EPOCH_ID_BYTES, SEED_BYTES, StoreKeys
from kvseal.server.store.keysource import wipe
from kvseal.server.store.record import (
    KIND_BLOCK,
    KIND_SCOPE,
    Binding,
    RecordHeader,
    next_generation,
    open_record,
    record_bytes,
    seal,
)

_PAYLOAD_BYTES = SEED_BYTES + EPOCH_ID_BYTES
_RETIRED_PER_SCOPE = 16
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


class ScopeTable:
    """The scopes this process uses: their epochs, keys and retired epochs."""

    def __init__(self, keys: StoreKeys, sdir: StoreDir, *, ttl_s: float, max_scopes: int) -> None:
        self._keys = keys
        self._dir = sdir
        self._ttl = ttl_s
        self._max = max_scopes
        self._lock = threading.Lock()
        self._live: OrderedDict[ScopeKey, ScopeHandle] = OrderedDict()
        # Epoch ids seen replaced, per scope; kept for more scopes than keys
        # are (an id is 8 bytes, a key an arena slot).
        self._retired: OrderedDict[ScopeKey, list[bytes]] = OrderedDict()
        self._max_retired = max_scopes * 16
        self.rollbacks = 0
        self.rotations = 0

    # ------------------------------------------------------------ lookups

    def marker_name(self, namespace: bytes, tenant: bytes) -> str:
        """The file name of the scope's marker in the store directory."""
        return self._keys.scope_name(namespace, tenant) + MARKER_SUFFIX

    def current(self, namespace: bytes, tenant: bytes, *, create: bool) -> ScopeHandle | None:
        """The scope's current epoch; None when it has no marker and
        ``create`` is False. Re-reads the marker when the cached one is older
        than ``ttl_s``. Raises :class:`StoreIntegrityError` (after removing it)
        for a marker that fails any check."""
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
        """Drop the scope: retire its current epoch (cached and on disk) and
        publish a marker with a fresh epoch (replacing whatever is there)."""
        key = (namespace, tenant)
        with self._lock:
            handle = self._live.pop(key, None)
            if handle is not None:
                self._retire(key, handle)
            try:
                found = self._read_marker(key)
            except StoreIntegrityError:
                found = None  # removed; replaced below anyway
            if found is not None:
                epoch_id, seed, _ = found
                wipe(seed)
                self._remember_retired(key, epoch_id)
            self.rotations += 1
            self._new_epoch(key, replace=True, now=time.monotonic())

    def close(self) -> None:
        """Forget every scope (their keys are wiped with the store's arena)."""
        with self._lock:
            for handle in self._live.values():
                handle.slot = None
            self._live.clear()

    # ------------------------------------------------------------ internals

    def _refresh(
        self, key: ScopeKey, handle: ScopeHandle | None, *, create: bool, now: float
    ) -> ScopeHandle | None:
        for _ in range(3):  # a marker created or removed between our read and link
            found = self._read_marker(key)
            if found is None:
                if handle is not None:
                    self._forget(key, handle)  # evicted or deleted: nothing reachable
                    handle = None
                if not create:
                    return None
                made = self._new_epoch(key, replace=False, now=now)
                if made is not None:
                    return made
                continue
            epoch_id, seed, _generation = found
            try:
                if epoch_id in self._retired.get(key, ()):
                    # A marker this process saw replaced is back: the host
                    # restored an old copy. Never adopt it; rotate again.
                    self.rollbacks += 1
                    if handle is not None:
                        self._retire(key, handle)
                    return self._new_epoch(key, replace=True, now=now)
                if handle is not None and handle.epoch_id == epoch_id:
                    handle.checked_at = now
                    self._live.move_to_end(key)
                    self._dir.touch(self.marker_name(*key))
                    return handle
                if handle is not None:  # dropped elsewhere: adopt the new epoch
                    self._retire(key, handle)
                self._dir.touch(self.marker_name(*key))
                return self._adopt(key, epoch_id, seed, now)
            finally:
                wipe(seed)
        raise ScopeChanged("the tenant's scope marker kept changing; nothing was done")

    def _read_marker(self, key: ScopeKey) -> tuple[bytes, bytearray, int] | None:
        """(epoch id, seed (caller wipes), generation) of the scope's marker."""
        name = self.marker_name(*key)
        got = self._dir.read(name, record_bytes(_PAYLOAD_BYTES))
        if got is None:
            return None
        data, ident = got
        try:
            try:
                header = RecordHeader.parse(data, max_ct_len=_PAYLOAD_BYTES)
            except UnsupportedVersion:
                return None  # a newer writer's marker: no epoch this code can use
            header.expect(KIND_SCOPE, self._keys.key_id)
            if header.ct_len != _PAYLOAD_BYTES:
                raise LengthMismatch(f"a scope marker holds {header.ct_len} bytes, not 40")
            rkey = self._keys.record_key(None, KIND_SCOPE, header.salt)
            payload = open_record(rkey, data, header, Binding(*key))
        except StoreIntegrityError:
            self._dir.remove(name, ident)
            raise
        seed = bytearray(SEED_BYTES)
        seed[:] = memoryview(payload)[:SEED_BYTES]
        epoch_id = bytes(payload[SEED_BYTES:])
        wipe(payload)
        return epoch_id, seed, header.generation

    def _new_epoch(self, key: ScopeKey, *, replace: bool, now: float) -> ScopeHandle | None:
        """Publish a marker for a fresh epoch and adopt it. ``replace=False``:
        only if the scope has none (None when another writer won)."""
        seed = bytearray(SEED_BYTES)
        payload = bytearray(_PAYLOAD_BYTES)
        try:
            fill_random((ctypes.c_char * SEED_BYTES).from_buffer(seed))
            epoch_id = os.urandom(EPOCH_ID_BYTES)
            payload[:SEED_BYTES] = seed
            payload[SEED_BYTES:] = epoch_id
            header = RecordHeader.fresh(
                KIND_SCOPE, self._keys.key_id, next_generation(), _PAYLOAD_BYTES
            )
            rkey = self._keys.record_key(None, KIND_SCOPE, header.salt)
            data = seal(rkey, header, Binding(*key), payload)
            # sync_dir: a marker rename lost in a crash would undo a drop.
            if not self._dir.publish(self.marker_name(*key), data, replace=replace, sync_dir=True):
                return None
            return self._adopt(key, epoch_id, seed, now)
        finally:
            wipe(seed)
            wipe(payload)

    def _adopt(self, key: ScopeKey, epoch_id: bytes, seed: bytearray, now: float) -> ScopeHandle:
        old = self._live.pop(key, None)
        if old is not None:
            self._forget(key, old)
        slot = self._keys.take_scope_slot(key[0], key[1], epoch_id, seed)
        handle = ScopeHandle(key[0], key[1], epoch_id, slot, now)
        self._live[key] = handle
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

    def _retire(self, key: ScopeKey, handle: ScopeHandle) -> None:
        self._forget(key, handle)
        self._remember_retired(key, handle.epoch_id)

    def _remember_retired(self, key: ScopeKey, epoch_id: bytes) -> None:
        ids = self._retired.setdefault(key, [])
        self._retired.move_to_end(key)
        if epoch_id not in ids:
            ids.append(epoch_id)
            del ids[:-_RETIRED_PER_SCOPE]
        while len(self._retired) > self._max_retired:
            self._retired.popitem(last=False)
