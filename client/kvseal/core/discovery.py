"""Discovery: blocks a daemon held before the scheduler's mirror subscribed.

The mirror (:mod:`kvseal.core.mirror`) hears of a block from the daemon's event
stream or from this engine's own store reports; a block stored before it
subscribed (by this engine's previous incarnation, say) is news to it. The
manager then asks :meth:`Discovery.discover` once per such block: a background
thread of its own looks the blocks up in batches (every call off the scheduler
thread) and the answer lands in the mirror, unless the mirror heard of the
block since (a later fact wins). A block found absent, or whose lookup failed,
is remembered as absent (:meth:`Discovery.known_absent`), so it is asked about
once, until the set is reset (a resync, the daemon gone, or it grew past
:data:`MAX_ABSENT`).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from kvseal.client import KVSealRpcError
from kvseal.v1 import kvseal_pb2 as pb

log = logging.getLogger("kvseal.core")

MAX_ABSENT = 1 << 20  # known-absent blocks remembered before starting over
BATCH = 1024  # hashes per discovery Lookup (below the daemon's batch limit)

Key = tuple[bytes, bytes]  # (tenant, hash)


class Discovery:
    """The discovery state of one :class:`~kvseal.core.mirror.DaemonMirror`.

    ``known_absent`` and ``discover`` are called from the scheduler thread and
    never block; ``absent`` is replaced (never cleared in place) by
    :meth:`forget_all`, so readers need no lock. The thread starts with the
    first ``discover`` and ends with the mirror (its ``_stop`` event)."""

    def __init__(self, mirror: Any) -> None:
        # A kvseal.core.mirror.DaemonMirror (not imported: the mirror imports
        # this module, and the client distribution has no import cycle).
        self._m = mirror
        self.absent: set[Key] = set()  # checked absent (or the lookup failed)
        self._asked: set[Key] = set()  # queued or in flight
        self._q: queue.SimpleQueue[Key] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def known_absent(self, tenant: bytes, h: bytes) -> bool:
        return (tenant, h) in self.absent

    def discover(self, tenant: bytes, h: bytes) -> bool:
        """Ask the daemon, in the background, whether it holds a block the mirror
        has no word of. False when the mirror cannot ask now (not subscribed):
        treat the block as a miss. Each block is asked about once; the answer
        (or a failed call, taken as absent) lands in the mirror."""
        if not self._m.synced.is_set():
            return False
        k = (tenant, h)
        if k not in self._asked:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"kvseal-discover-{self._m.rank}", daemon=True
                )
                self._thread.start()
            self._asked.add(k)
            self._q.put(k)
        return True

    def reask(self, tenant: bytes, h: bytes) -> bool:
        """Forget that one block was found absent, so :meth:`discover` asks
        about it again (a handoff whose publish may still be in flight; the
        caller bounds how long). False when the mirror cannot ask now."""
        if not self._m.synced.is_set():
            return False
        self.absent.discard((tenant, h))
        return True

    def forget_all(self) -> None:
        """Start over: blocks known absent may be present again."""
        self.absent = set()

    def _run(self) -> None:
        m = self._m
        while not m._stop.is_set():
            try:
                first = self._q.get(timeout=0.2)
            except queue.Empty:
                continue
            batch = [first]
            while len(batch) < BATCH:
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            by_tenant: dict[bytes, list[bytes]] = {}
            for tenant, h in batch:
                by_tenant.setdefault(tenant, []).append(h)
            for tenant, hashes in by_tenant.items():
                ready: list[bool] = []
                pool_id = m.pool_id
                watch = m._watch_begin()
                try:
                    if pool_id is not None:
                        states = m._client.lookup(pool_id, tenant, hashes).states
                        ready = [st == pb.BLOCK_READY for st in states]
                except KVSealRpcError as e:
                    log.info("kvseal mirror %d: discovery lookup failed: %s", m.rank, e)
                finally:
                    m._watch_end(watch)
                if ready:  # only adds: a discovered block, unless something newer came
                    m._answer(tenant, hashes, ready, watch, drop=False)
                got = {h for h, r in zip(hashes, ready, strict=False) if r}
                for h in hashes:
                    if h not in got:
                        self.absent.add((tenant, h))  # absent, or unknown: a miss
                    self._asked.discard((tenant, h))
            if len(self.absent) > MAX_ABSENT:
                self.forget_all()
