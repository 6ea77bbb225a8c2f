"""The Mooncake Store backend: the sealed store's records as objects of a
Mooncake Store cluster (a master plus the memory segments its clients mount).

``--store mooncake://MASTER_HOST:PORT?local=HOST&metadata=SERVER&segment=
SIZE&buffer=SIZE&prefix=P&timeout=S&backoff=S`` (:meth:`MooncakeLocation.parse`).
Through Mooncake's own Python client (``mooncake.store.MooncakeDistributedStore``,
kvseal-server's ``mooncake`` extra), never a hand-written protocol. Every
object is already sealed and named by a keyed hash (:mod:`.record`,
:mod:`.keys`): the master, the segments' hosts and the network see
ciphertext under names that reveal nothing, and the store library
authenticates everything it reads back.

Layout: ``PREFIX`` + ``kvseal-store`` (the layout record, as on S3), and
``PREFIX`` + the record's name for every block object and scope record.
Mooncake is a flat key space: ``fanout`` is kept only so every opener agrees.

What Mooncake gives, and what it does not (docs/store.md, "Mooncake Store"):

- **Atomic publish**: an object is visible only once its put completed (the
  master's PutEnd); a reader gets the old object or the new one, whole.
  ``replace=True`` is ``upsert``.
- **No conditional write, no versions.** ``replace=False`` (scope markers,
  the layout record) is a ``put``, which Mooncake 0.3 turns into a no-op
  when the key exists, followed by a read-back: the writer whose bytes are
  there won. An honest master makes that first-writer-wins; a master that
  lies (or evicts the marker between the put and the read-back) can make two
  writers each believe they won: two epochs, which the scope rules answer
  with one more rotation, never a wrong serve. ``remove(name, ident)`` (a
  record found bad) re-reads and compares the bytes before removing: a good
  record published over the bad one in the window of that one request can
  be removed (a miss, never a wrong serve).
- **Leases.** The master leases an object to each reader for
  ``--default_kv_lease_ttl`` and refuses a plain remove meanwhile (-706), so
  a record removed right after it was read (found bad) would stay. Removal is
  therefore forced: safe because every read is authenticated, so a reader
  racing the removal gets a miss or a verification failure.
- **Capacity is Mooncake's**: objects live in the segments the cluster's
  clients mount (this daemon mounts ``segment`` bytes of its own memory; 0
  mounts none); the master evicts (leases expired, least recently used first)
  above its high watermark, and a put it cannot place fails (a skipped
  spill). Scope records are put soft-pinned, so the master evicts them after
  block objects. :meth:`make_room` removes nothing; :meth:`usage` counts what
  this process published (Mooncake has no listing; the master's metrics have
  the cluster's totals).
- **Durability**: none beyond memory. A master restart, or the exit of the
  client whose segment held an object, loses it (a miss; a lost marker drops
  its tenant's reachable blocks, a lost floor weakens the drop rule as a
  deleted floor does on a directory).

Failure model: every call runs on a small pool of worker threads and is
waited for at most ``timeout`` seconds (1 s by default): Mooncake's own RPC
timeout is 30 s, and a master that is stopped, slow or answering garbage must
cost a miss, not a stall. A timed-out call, an RPC failure (-900, -901) or a
worker pool full of calls still stuck in the client raises
:class:`~.errors.StoreUnavailable`, and every call then fails at once for
``backoff`` seconds (2 by default), so a Lookup naming many blocks pays one
timeout per window. Mooncake's client reconnects by itself (it pings the
master and remounts its segment after a master restart).

Network: ``local`` is the address this daemon's transfer engine serves its
segment on and is required (Mooncake would otherwise pick an interface of
its own choosing). ``metadata`` is ``P2PHANDSHAKE`` (the default) or the
metadata server's ``http://HOST:PORT/metadata``.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import re
import socket
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from kvseal.server.config import parse_size
from kvseal.server.store.backend import BackendOpener, Evicted, Ident, Usage
from kvseal.server.store.errors import StoreError, StoreLayoutError, StoreUnavailable
from kvseal.server.store.fsio import (
    _LAYOUT,
    LAYOUT_FILE,
    LAYOUT_VERSION,
    MAX_FANOUT,
    is_power_of_two,
)
from kvseal.server.store.record import HEADER_BYTES, TAG_BYTES

_PARAMS = frozenset(
    {"local", "metadata", "segment", "buffer", "protocol", "device", "prefix", "timeout", "backoff"}
)
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")
_PREFIX = re.compile(r"[A-Za-z0-9_.-]{0,64}/?")
# Mooncake's error codes (mooncake-store/include/types.h) that this backend reads.
_NOT_FOUND = -704
_HAS_LEASE = -706
_INVALID_PARAMS = -600  # get_into: the object does not fit the buffer given
_RPC = frozenset({-900, -901})  # RPC_FAIL, RPC_TIMEOUT: the master is not answering
_T = TypeVar("_T")
_USAGE_NAMES = 1 << 16  # records usage() remembers (about 100 bytes each)


@dataclass(frozen=True, slots=True)
class MooncakeLocation:
    """A parsed ``--store mooncake://...`` URL."""

    master: str  # HOST:PORT of the master's RPC service
    local: str  # this node's address for the transfer engine
    metadata: str  # "P2PHANDSHAKE" | http://HOST:PORT/PATH
    segment_bytes: int  # memory this daemon mounts into the cluster (0: none)
    buffer_bytes: int  # the client's local transfer buffer (bounds one read)
    protocol: str  # "tcp" | "rdma"
    device: str  # RDMA device names ("" for tcp)
    prefix: str  # prepended to every key
    timeout_s: float = 1.0
    backoff_s: float = 2.0

    @classmethod
    def parse(cls, url: str) -> MooncakeLocation:
        """Parse ``mooncake://HOST:PORT?local=HOST[&metadata=P2PHANDSHAKE|
        http://HOST:PORT/PATH&segment=SIZE&buffer=SIZE&protocol=tcp|rdma&
        device=NAMES&prefix=P&timeout=S&backoff=S]``; :class:`StoreLayoutError`
        naming what is wrong for anything else."""
        u = urllib.parse.urlsplit(url)
        if u.scheme != "mooncake":
            raise StoreLayoutError("a Mooncake store is mooncake://MASTER_HOST:PORT?local=HOST")
        if "@" in u.netloc:
            raise StoreLayoutError("a Mooncake store URL takes no user or password")
        host, _, port = u.netloc.rpartition(":")
        if not _HOST.fullmatch(host) or not port.isdigit() or not 0 < int(port) < 65536:
            raise StoreLayoutError(f"mooncake://{u.netloc}: the master must be HOST:PORT")
        if u.path not in ("", "/"):
            raise StoreLayoutError("a Mooncake store URL has no path (use prefix=)")
        q = urllib.parse.parse_qs(u.query, keep_blank_values=True)
        unknown = set(q) - _PARAMS
        if unknown:
            raise StoreLayoutError(
                f"unknown Mooncake store parameter(s): {', '.join(sorted(unknown))}"
            )
        if any(len(v) != 1 for v in q.values()):
            raise StoreLayoutError("each Mooncake store parameter may be given once")
        one = {k: v[0] for k, v in q.items()}
        local = one.get("local", "")
        if not _HOST.fullmatch(local.rpartition(":")[0] if local.count(":") == 1 else local):
            raise StoreLayoutError(
                "local= is required: the address (HOST or HOST:PORT) this node's transfer "
                "engine serves on (Mooncake would otherwise choose an interface itself)"
            )
        metadata = one.get("metadata", "P2PHANDSHAKE")
        if metadata != "P2PHANDSHAKE":
            m = urllib.parse.urlsplit(metadata)
            if m.scheme != "http" or not m.hostname or "@" in m.netloc:
                raise StoreLayoutError("metadata= must be P2PHANDSHAKE or http://HOST:PORT/PATH")
        protocol = one.get("protocol", "tcp")
        if protocol not in ("tcp", "rdma"):
            raise StoreLayoutError("protocol= must be tcp or rdma")
        prefix = one.get("prefix", "kvseal/")
        if not _PREFIX.fullmatch(prefix):
            raise StoreLayoutError("prefix= is up to 64 of [A-Za-z0-9_.-], optionally ending in /")
        try:
            segment = parse_size(one.get("segment", "1GiB"))
            buffer = parse_size(one.get("buffer", "64MiB"))
            timeout_s = float(one.get("timeout", "1"))
            backoff_s = float(one.get("backoff", "2"))
        except ValueError as e:
            raise StoreLayoutError(
                f"segment=/buffer= take sizes, timeout=/backoff= seconds: {e}"
            ) from None
        if not 0.05 <= timeout_s <= 60:  # also refuses NaN
            raise StoreLayoutError("timeout= must be in [0.05, 60] seconds")
        if not 0 <= backoff_s <= 600:
            raise StoreLayoutError("backoff= must be in [0, 600] seconds")
        if buffer < 1 << 20:
            raise StoreLayoutError(
                "buffer= must be at least 1MiB (it bounds the largest record read)"
            )
        return cls(
            u.netloc, local, metadata, segment, buffer, protocol, one.get("device", ""), prefix,
            timeout_s, backoff_s,
        )  # fmt: skip

    def describe(self) -> str:
        return f"mooncake://{self.master}/{self.prefix} (local {self.local})"


def _probe(what: str, hostport: str, timeout_s: float) -> None:
    """One TCP connect to ``hostport``; StoreUnavailable when it fails."""
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port or 80)), timeout=timeout_s):
            pass
    except (OSError, ValueError) as e:
        raise StoreUnavailable(f"Mooncake {what} {hostport}: {type(e).__name__}") from None


class MooncakeBackend:
    """The store's records in a Mooncake Store cluster (see the module
    docstring): a :class:`~.backend.StoreBackend`. Thread-safe: calls go
    through a bounded worker pool, each waited for at most ``timeout``."""

    def __init__(
        self,
        loc: MooncakeLocation,
        *,
        fanout: int | None,
        default_fanout: int = MAX_FANOUT,
        workers: int = 8,
    ) -> None:
        """Set the client up (mounting ``segment`` bytes) and read or create
        the layout record. Raises :class:`StoreLayoutError` (another fanout,
        the extra missing) and :class:`StoreUnavailable` (the master or the
        metadata server cannot be reached)."""
        if fanout is not None and not (is_power_of_two(fanout) and fanout <= MAX_FANOUT):
            raise StoreLayoutError(f"fanout must be a power of two up to {MAX_FANOUT}")
        try:
            # An optional extra (kvseal-server[mooncake]): imported only for a mooncake:// store.
            from mooncake.store import (  # noqa: PLC0415
                MooncakeDistributedStore,
                ReplicateConfig,
                SoftPinAction,
            )
        except ImportError:
            raise StoreLayoutError(
                "a mooncake:// store needs Mooncake's client: install kvseal-server[mooncake]"
            ) from None
        self.loc = loc
        self._lock = threading.Lock()
        self._down_until = 0.0  # monotonic: calls fail at once until then
        self._closed = False
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, "kvseal-mooncake")
        # A call stuck in Mooncake's client holds its worker for up to its 30 s
        # RPC timeout: a slot is taken per call and refused when none is free.
        self._slots = threading.BoundedSemaphore(workers)
        # name -> size of what this process published, for usage(); bounded
        # (the master evicts without telling: an estimate, not an inventory).
        self._published: OrderedDict[str, int] = OrderedDict()
        # Registered read buffers by size (get_into's targets; _read_key).
        self._free: dict[int, list[tuple[bytearray, int]]] = {}
        self._pinned = ReplicateConfig()
        self._pinned.soft_pin_action = SoftPinAction.ENABLE
        self._plain = ReplicateConfig()
        self._store: Any = MooncakeDistributedStore()
        try:
            # Mooncake's setup holds the GIL while it retries an absent master
            # (about 90 s): no deadline of ours could end it. A connect first.
            _probe("master", loc.master, loc.timeout_s)
            if loc.metadata != "P2PHANDSHAKE":
                _probe("metadata server", urllib.parse.urlsplit(loc.metadata).netloc, loc.timeout_s)
            rc = self._run(
                "setup",
                lambda: self._store.setup(
                    loc.local,
                    loc.metadata,
                    loc.segment_bytes,
                    loc.buffer_bytes,
                    loc.protocol,
                    loc.device,
                    loc.master,
                ),
                timeout_s=max(10.0, loc.timeout_s),
            )
            if rc != 0:
                raise StoreUnavailable(f"Mooncake setup with {loc.describe()}: error {rc}")
            self.fanout = self._layout(fanout if fanout is not None else default_fanout, fanout)
        except BaseException:
            self.close()
            raise

    @property
    def location(self) -> str:
        return self.loc.describe()

    # ------------------------------------------------------------ calls

    def _run(
        self,
        op: str,
        fn: Callable[[], _T],
        timeout_s: float | None = None,
        on_abandon: Callable[[], None] | None = None,
    ) -> _T:
        """``fn`` on a worker, waited for at most ``timeout_s`` (the URL's
        timeout); StoreUnavailable (and the back-off) when it is late, the
        pool is full of stuck calls, or the store is closed or backing off.
        ``on_abandon``: whenever this raises, run once ``fn`` has ended (at
        once if it has, or never started): what ``fn`` writes into stays out
        of use until it has stopped writing, and is never lost."""
        refused = None
        if self._closed:
            refused = StoreUnavailable("the Mooncake store is closed")
        elif time.monotonic() < self._down_until:
            refused = StoreUnavailable(f"Mooncake {op}: the master failed recently (backing off)")
        elif not self._slots.acquire(blocking=False):
            refused = StoreUnavailable(f"Mooncake {op}: every worker is waiting on the master")
        if refused is not None:
            if on_abandon is not None:
                on_abandon()
            raise refused

        def job() -> _T:
            try:
                return fn()
            finally:
                self._slots.release()

        try:
            fut = self._pool.submit(job)
        except RuntimeError:  # the pool was shut down by close()
            self._slots.release()
            if on_abandon is not None:
                on_abandon()
            raise StoreUnavailable("the Mooncake store is closed") from None
        try:
            try:
                return fut.result(
                    timeout=timeout_s if timeout_s is not None else self.loc.timeout_s
                )
            except BaseException:
                if on_abandon is not None:
                    fut.add_done_callback(lambda _f: on_abandon())
                raise
        except concurrent.futures.TimeoutError:
            self._down()
            raise StoreUnavailable(f"Mooncake {op}: no answer in time") from None
        except Exception as e:  # the client raised: the answer was not Mooncake's
            self._down()
            raise StoreUnavailable(f"Mooncake {op}: {type(e).__name__}") from None

    def _down(self) -> None:
        self._down_until = time.monotonic() + self.loc.backoff_s

    def _rc(self, op: str, rc: int) -> int:
        """``rc`` unless it says the master is not answering (then back off)."""
        if rc in _RPC:
            self._down()
            raise StoreUnavailable(f"Mooncake {op}: error {rc} (the master is not answering)")
        return rc

    def _key(self, name: str) -> str:
        return self.loc.prefix + name

    def path_of(self, name: str) -> str:
        return f"mooncake://{self.loc.master}/{self._key(name)}"

    # ------------------------------------------------------------ layout

    def _layout(self, default: int, wanted: int | None) -> int:
        text = f"kvseal-store {LAYOUT_VERSION} fanout={default}\n".encode()
        for _ in range(3):
            got = self._read_key(LAYOUT_FILE, 256)
            if got is None:
                self._put_new(LAYOUT_FILE, text, pinned=True)
                continue  # read whichever layout won
            m = _LAYOUT.fullmatch(bytes(got[0]))
            if m is None or int(m[1]) != LAYOUT_VERSION:
                raise StoreLayoutError(f"{self.path_of(LAYOUT_FILE)} is not a v1 layout record")
            fanout = int(m[2])
            if not (is_power_of_two(fanout) and fanout <= MAX_FANOUT):
                raise StoreLayoutError(f"{self.path_of(LAYOUT_FILE)} names fanout {fanout}")
            if wanted is not None and wanted != fanout:
                raise StoreLayoutError(
                    f"{self.location} was created with fanout {fanout}, not {wanted}: every "
                    "replica sharing a store must use the same"
                )
            return fanout
        raise StoreLayoutError(f"{self.location}: the layout record keeps disappearing")

    # ------------------------------------------------------------ records

    def _buffer(self, size: int) -> tuple[bytearray, int]:
        """A registered buffer of exactly ``size`` bytes from the free list
        (a new one registered when none is free). At most one per call in
        flight, and calls in flight are bounded by the worker slots."""
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
        buf = bytearray(size)
        addr = ctypes.addressof((ctypes.c_char * size).from_buffer(buf))
        rc = int(self._store.register_buffer(addr, size))
        if rc != 0:
            raise StoreUnavailable(f"Mooncake register_buffer: error {rc}")
        return buf, addr

    def _give(self, size: int, entry: tuple[bytearray, int], keep: bool) -> None:
        """Back to the free list, or (``keep`` False: a size the host chose,
        read once to remove a bad record) unregistered and dropped, so what
        the host stores cannot grow what is kept: the sizes kept are the
        few the code reads with (layout, scope records, blocks)."""
        if keep:
            with self._lock:
                self._free.setdefault(size, []).append(entry)
        else:
            self._store.unregister_buffer(entry[1])

    def _read_key(
        self, name: str, max_bytes: int, scratch: bytearray | None = None, *, keep: bool = True
    ) -> tuple[bytearray | memoryview, Ident] | None:
        """One ``get_into`` of at most ``max_bytes`` (and the client's
        buffer) into a registered buffer of that size, then a copy into
        ``scratch`` (when it fits) or a new private bytearray. None when
        absent or larger: Mooncake refuses an object that does not fit the
        buffer given (-600) before transferring it, and leaves it in place.
        One request to the master instead of ``get_size`` + ``get``, no
        bytes object allocated per read. The registered buffer returns to
        the free list only once the call has stopped writing into it (a
        call abandoned at its timeout gives it back when it ends), so the
        snapshot returned is never written to after it was taken.

        The ident is the record's header (its salt, nonce and generation are
        fresh for every seal), its tag and its length: whatever another
        writer publishes at the name since differs in it; bytes forged to
        match it only let a removal remove them."""
        key = self._key(name)
        size = min(max_bytes, self.loc.buffer_bytes)
        if size <= 0:
            return None  # nothing fits (and Mooncake holds no empty object)
        entry = self._buffer(size)
        buf, addr = entry
        # A call that raises or is abandoned gives the buffer back once it
        # has ended (on_abandon); one that returned gives it back below.
        rc = self._run(
            "get_into",
            lambda: int(self._store.get_into(key, addr, size)),
            on_abandon=lambda: self._give(size, entry, keep),
        )
        try:
            n = self._rc("get_into", rc)
            if n in (_NOT_FOUND, _INVALID_PARAMS) or n == 0:
                return None  # absent, or larger than max_bytes (left in place)
            if n < 0 or n > size:
                raise StoreUnavailable(f"Mooncake get_into: error {n}")
            if scratch is not None and len(scratch) >= n:
                out: bytearray | memoryview = memoryview(scratch)[:n]
                out[:] = memoryview(buf)[:n]
            else:
                out = bytearray(memoryview(buf)[:n])
            ident = (n, bytes(out[:HEADER_BYTES]), bytes(out[-TAG_BYTES:]))
            return out, ident
        finally:
            self._give(size, entry, keep)

    def read(
        self, name: str, max_bytes: int, scratch: bytearray | None = None
    ) -> tuple[bytearray | memoryview, Ident] | None:
        """See :meth:`.backend.StoreBackend.read` (and :meth:`_read_key`:
        the ident, what ``scratch`` is used for)."""
        return self._read_key(name, max_bytes, scratch)

    def exists(self, name: str) -> bool:
        key = self._key(name)
        rc = self._rc("is_exist", self._run("is_exist", lambda: int(self._store.is_exist(key))))
        if rc < 0:
            raise StoreUnavailable(f"Mooncake is_exist: error {rc}")
        return rc == 1

    def prefetch(self, name: str) -> None:
        """Nothing: a get is one transfer either way (advice only)."""

    def touch(self, name: str) -> None:
        """Nothing: the master orders eviction by its own record of use."""

    def _put_new(self, name: str, data: bytes | bytearray, *, pinned: bool) -> bool:
        """put (a no-op when the key exists), then read back: True when our
        bytes are there (module docstring: first writer wins on an honest master)."""
        key, body = self._key(name), bytes(data)
        cfg = self._pinned if pinned else self._plain
        rc = self._rc("put", self._run("put", lambda: int(self._store.put(key, body, cfg))))
        if rc != 0:
            raise StoreUnavailable(f"Mooncake put: error {rc}")
        got = self._read_key(name, len(body))
        return got is not None and bytes(got[0]) == body

    def publish(
        self, name: str, data: bytes | bytearray, *, replace: bool, sync_dir: bool = False
    ) -> bool:
        """``replace=True``: upsert; ``replace=False``: put and read back.
        Scope records soft-pinned. A full cluster (the put cannot be placed)
        raises StoreUnavailable: the spill is skipped."""
        pinned = name.endswith(".scope")
        if replace:
            # ``data`` is not copied (the client takes a bytearray): the
            # caller never changes it after the call (FsStore.put publishes
            # seal()'s fresh record), so a call abandoned at its timeout
            # still reads whole bytes.
            key, body = self._key(name), data
            cfg = self._pinned if pinned else self._plain
            rc = self._rc(
                "upsert", self._run("upsert", lambda: int(self._store.upsert(key, body, cfg)))
            )
            if rc != 0:
                raise StoreUnavailable(f"Mooncake upsert: error {rc}")
            won = True
        else:
            won = self._put_new(name, data, pinned=pinned)
        if won:
            with self._lock:
                self._published[name] = len(data)
                self._published.move_to_end(name)
                if len(self._published) > _USAGE_NAMES:
                    self._published.popitem(last=False)
        return won

    def remove(self, name: str, ident: Ident | None = None) -> bool:
        """Forced remove (the module docstring: leases); with ``ident``, only
        if a re-read still finds the bytes read then (the ident)."""
        key = self._key(name)
        if ident is not None:
            size = self._rc(
                "get_size", self._run("get_size", lambda: int(self._store.get_size(key)))
            )
            fits = 0 < size <= self.loc.buffer_bytes
            got = self._read_key(name, size, keep=False) if fits else None
            if got is None or got[1] != ident:
                return False
        rc = self._rc("remove", self._run("remove", lambda: int(self._store.remove(key, True))))
        if rc == _HAS_LEASE:  # an older client without force: the lease runs out soon
            return False
        with self._lock:
            self._published.pop(name, None)
        if rc == _NOT_FOUND:
            return False
        if rc != 0:
            raise StoreUnavailable(f"Mooncake remove: error {rc}")
        return True

    def remove_planted(self, name: str) -> bool:
        """Nothing to do: every Mooncake object is a byte string, read on its merits."""
        return False

    # ------------------------------------------------------------ capacity

    def make_room(self, name: str, incoming: int, shard_cap: int) -> Evicted:
        """Nothing is removed: the master evicts (module docstring)."""
        if incoming > shard_cap:
            raise StoreError(f"a {incoming}-byte record cannot fit a {shard_cap}-byte shard")
        return Evicted()

    def usage(self) -> Usage:
        """What this process published and has not removed, of its latest
        :data:`_USAGE_NAMES` records (Mooncake has no listing; the master may
        have evicted some of it)."""
        with self._lock:
            sizes = dict(self._published)
        markers = sum(1 for n in sizes if n.endswith(".scope"))
        return Usage(len(sizes) - markers, markers, sum(sizes.values()), 0, 0)

    def close(self) -> None:
        """Unmount and disconnect (bounded: a master that does not answer
        leaves the client to Mooncake's own timeouts on a worker). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        store = self._store
        fut = self._pool.submit(store.close)
        try:
            fut.result(timeout=max(5.0, self.loc.timeout_s))
        except Exception:  # noqa: S110 - a master gone: nothing more to release
            pass
        self._pool.shutdown(wait=False, cancel_futures=True)


def open_mooncake(url: str) -> BackendOpener:
    """A :data:`~.backend.BackendOpener` for ``url`` (parsed now: a bad URL
    fails before anything connects)."""
    loc = MooncakeLocation.parse(url)

    def opener(fanout: int | None, default_fanout: int) -> MooncakeBackend:
        return MooncakeBackend(loc, fanout=fanout, default_fanout=default_fanout)

    return opener
