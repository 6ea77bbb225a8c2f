"""vLLM's KV events for daemons with a store tier (docs/store.md, "Events,
Stats and replicas").

Such a daemon's event stream names each event's tier (``medium`` ``"cpu"``:
the host tier; ``"storage"``: the store, with its locality), so vLLM's
``OffloadingEvent``s come from it, a medium per tier: a block is announced
stored in a tier once every TP rank's daemon announced it there, and removed
once one rank's no longer holds it there. Each rank's facts are a bit, so a
rank announcing a block twice (a restarted daemon finding the store's blocks
again) changes nothing; a rank whose stream had a gap (a restart, a watcher
cut off for falling behind) is reset: its bits are cleared, and what every
rank held is announced removed (the daemon does not announce again what it
already held, so a block may then go unannounced: an under-report, never a
claim of a block that is gone).

Bounded work per call. The manager calls :meth:`TierEvents.event` and
:meth:`TierEvents.reset` from the mirrors' threads under its lock, which vLLM
0.33's scheduler holds across a whole step's lookups; a reset walks every
tracked block (up to :data:`MAX_BLOCKS`), and one removal event may name as
many (a ``Drop`` of a whole tenant). So a call does at most ``chunk`` units
of work itself (a unit: one hash of an event, one tracked block a reset
visits or forgets, one block retracted beyond the bound): when nothing is
queued, it applies what fits and queues the rest; when work is queued, it
only queues its own (O(1)). A background thread ("kvseal-tier-events",
started on demand, gone once the queue is empty) applies the queue in order,
``chunk`` units at a time, under no lock the scheduler takes. vLLM sees the
events the calls would have produced at once, in the same order (a reset's
removals before any later announcement of the same blocks), only later:
never a stale claim that an immediate call would not have made too.

Thread-safety: the tracked state belongs to the caller while nothing is
queued (under ``_mu``) and to the background thread while something is
(``_busy``); the callbacks (``vllm_hash``, ``forget``) and ``out.put`` may
run on either, so they must be safe from any thread (the manager's are single
dictionary operations and a ``SimpleQueue``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator

from kvseal.v1 import kvseal_pb2 as pb
from kvseal.vllm import keys

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey

log = logging.getLogger(__name__)

MAX_BLOCKS = 1 << 19  # (tier, tenant, block)s tracked; the oldest is retracted beyond
CHUNK = 1024  # units of work (module doc) in one call, or one step of the thread
RECENT_NAMES = 1 << 16  # vLLM names of blocks gone from every tier, kept (_name)
_LOCALITY = {"local": Locality.LOCAL, "remote": Locality.REMOTE}

Key = tuple[str, bytes, bytes]  # (medium, tenant, kvseal hash)


class _EventOp:
    """One event of a rank's stream, applied ``budget`` hashes at a time."""

    def __init__(self, rank: int, ev: pb.BlockEvent) -> None:
        self.bit = 1 << rank
        self.stored = ev.kind == pb.BLOCK_STORED
        self.medium = "storage" if ev.medium == "storage" else "cpu"
        self.locality = _LOCALITY.get(ev.locality)
        self.tenant = bytes(ev.tenant)
        self.hashes = ev.block_hashes  # the message's own list: no copy here
        self.pos = 0

    def step(self, t: TierEvents, budget: int) -> tuple[bool, int]:
        if self.pos == 0 and self.medium == "storage":
            t._locality[self.medium] = self.locality
        held, full, bit = t._held, t._full, self.bit
        changed: list[bytes] = []
        emptied: list[bytes] = []
        used = 0
        end = len(self.hashes)
        while self.pos < end and used + 2 <= budget:  # 2: a hash and its retraction
            h = bytes(self.hashes[self.pos])
            self.pos += 1
            used += 1
            k = (self.medium, self.tenant, h)
            before = held.get(k, 0)
            after = before | bit if self.stored else before & ~bit
            if after:
                if not before and len(held) >= t._max:
                    used += 1  # a new block at the bound: its retraction, below
                held[k] = after
            else:
                held.pop(k, None)
                emptied.append(h)
            if (after == full) != (before == full):
                changed.append(h)
        t._emit(self.medium, self.tenant, changed, removed=not self.stored)
        t._unname(self.tenant, emptied)
        while len(held) > t._max:  # retract the oldest: never claim blindly
            (m, tn, h), was = held.popitem(last=False)  # counted above
            if was == full:
                t._emit(m, tn, [h], removed=True)
            t._unname(tn, [h])
        return self.pos >= end, used


class _ResetOp:
    """A rank's gap: clear its bit on every tracked block (removing what every
    rank held), then forget the blocks no rank holds any more. One walk over
    the tracked blocks, resumed across steps: nothing else changes them while
    the op is queued (module doc), and a value update does not disturb the
    walk."""

    def __init__(self, rank: int) -> None:
        self.bit = 1 << rank
        self.walk: Iterator[tuple[Key, int]] | None = None
        self.walked = False
        self.doomed: list[Key] = []  # bits now 0: deleted after the walk

    def step(self, t: TierEvents, budget: int) -> tuple[bool, int]:
        held, full, bit = t._held, t._full, self.bit
        used = 0
        if not self.walked:
            if self.walk is None:
                self.walk = iter(held.items())
            gone: dict[tuple[str, bytes], list[bytes]] = {}
            for k, was in self.walk:
                used += 1
                if was & bit:
                    held[k] = was & ~bit
                    if not was & ~bit:
                        self.doomed.append(k)
                    if was == full:
                        gone.setdefault(k[:2], []).append(k[2])
                if used >= budget:
                    break
            else:
                self.walked, self.walk = True, None
            for (medium, tenant), hashes in gone.items():
                t._emit(medium, tenant, hashes, removed=True)
        while self.walked and self.doomed and used < budget:
            k = self.doomed.pop()
            used += 1
            del held[k]
            t._unname(k[1], [k[2]])
        return self.walked and not self.doomed, used


_Op = _EventOp | _ResetOp


class TierEvents:
    """``vllm_hash``: the kvseal hash -> the vLLM hash the events must name
    (``forget``: called once a block is in no tier, to drop that mapping).
    ``chunk``: the most units of work (module doc) one call, or one step of
    the background thread, does.

    ``max_section``: the most units any one call or step did (a diagnostic:
    never above ``chunk``). ``deferred``: the calls that left work to the
    background thread."""

    def __init__(
        self,
        world: int,
        group: int,
        out: queue.SimpleQueue[OffloadingEvent],
        vllm_hash: Callable[[bytes], bytes],
        forget: Callable[[bytes], object],
        *,
        max_blocks: int = MAX_BLOCKS,
        chunk: int = CHUNK,
    ) -> None:
        if chunk < 2:
            raise ValueError("chunk must be at least 2")
        self._full = (1 << world) - 1
        self._group = group
        self._out = out
        self._vllm_hash = vllm_hash
        self._forget = forget
        self._max = max_blocks
        self._chunk = chunk
        # (medium, tenant, hash) -> bit per rank that holds it there; oldest
        # first. An OrderedDict: retracting the oldest is O(1) (a plain dict's
        # first item is found by scanning past the slots of the keys deleted
        # before it, thousands of them at the bound).
        self._held: OrderedDict[Key, int] = OrderedDict()
        self._locality: dict[str, Locality | None] = {}  # medium -> as last announced
        # kvseal hash -> vLLM hash, for names the manager no longer has (_name)
        self._pinned: dict[bytes, bytes] = {}
        self._recent: OrderedDict[bytes, bytes] = OrderedDict()
        self._mu = threading.Lock()  # guards _ops and _busy; held by a call's own work
        self._idle = threading.Condition(self._mu)
        self._ops: deque[_Op] = deque()
        self._busy = False  # the background thread owns the state
        self.max_section = 0
        self.deferred = 0

    def __len__(self) -> int:
        return len(self._held)

    def event(self, rank: int, ev: pb.BlockEvent) -> None:
        """One event of rank's stream."""
        self._submit(_EventOp(rank, ev))

    def reset(self, rank: int) -> None:
        """Rank's stream had a gap: forget its facts (module doc)."""
        self._submit(_ResetOp(rank))

    def pending(self) -> int:
        """Calls whose work is still queued."""
        with self._mu:
            return len(self._ops)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no work is queued; False if ``timeout`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._busy, timeout)

    # ------------------------------------------------------------ work

    def _submit(self, op: _Op) -> None:
        with self._mu:
            if self._busy:  # behind what is queued: the order is the streams'
                self._ops.append(op)
                return
            done, used = op.step(self, self._chunk)
            self.max_section = max(self.max_section, used)
            if done:
                return
            self._ops.append(op)
            self._busy = True
            self.deferred += 1
            threading.Thread(target=self._run, name="kvseal-tier-events", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._mu:
                if not self._ops:
                    self._busy = False
                    self._idle.notify_all()
                    return
                op = self._ops[0]
            try:
                done, used = op.step(self, self._chunk)
            except Exception:  # one bad op must not stop the events after it
                log.exception("kvseal: a tier event could not be applied; skipped")
                done, used = True, 0
            self.max_section = max(self.max_section, used)
            if done:
                with self._mu:
                    self._ops.popleft()
            time.sleep(0)  # the GIL to the scheduler between steps

    def _emit(self, medium: str, tenant: bytes, hashes: list[bytes], *, removed: bool) -> None:
        if not hashes:
            return
        okeys = [
            OffloadKey(keys.make_offload_key(self._name(h, removed), self._group)) for h in hashes
        ]
        ev = OffloadingEvent(
            keys=okeys,
            medium=Medium.STORAGE if medium == "storage" else Medium.CPU,
            removed=removed,
        )
        ev.locality = self._locality.get(medium) if medium == "storage" else None
        self._out.put(ev)

    def _name(self, h: bytes, removed: bool) -> bytes:
        """The vLLM hash of ``h``. The manager's name may be gone: a deferred
        removal forgot it after vLLM had already stored the block again (the
        manager learnt it anew before the removal was applied). Names are a
        function of the vLLM hash, so a name this object saw is right forever:
        the recent ones are kept, and a block claimed under one keeps it
        (pinned) until it is in no tier, so that its removal names it too."""
        v = self._vllm_hash(h)
        if v != h:
            return v
        v = self._pinned.get(h) or self._recent.get(h) or h
        if v != h and not removed:
            self._pinned[h] = v
        return v

    def _unname(self, tenant: bytes, hashes: list[bytes]) -> None:
        """Blocks no rank holds in any tier any more: their vLLM names go (to
        the recent ones, :meth:`_name`)."""
        for h in hashes:
            if not any((m, tenant, h) in self._held for m in ("cpu", "storage")):
                v = self._pinned.pop(h, None) or self._vllm_hash(h)
                if v != h:
                    self._recent[h] = v
                    self._recent.move_to_end(h)
                    if len(self._recent) > RECENT_NAMES:
                        self._recent.popitem(last=False)
                self._forget(h)
