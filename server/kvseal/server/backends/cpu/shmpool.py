"""An engine's CPU KV pool as the daemon reaches it: POSIX shared-memory
objects held open by fd and read and written with ``preadv``/``pwritev``,
never mapped, so nothing the engine does to its objects (shrinking one in
the middle of a copy included) can raise a signal in the daemon.

Names of engines that are gone: an object whose creator holds a shared
``flock`` on it when the daemon opens it is *owner-locked* (the engine side:
``kvseal.client.shm.create_owner_locked``, vLLM's KV cache). The kernel
drops that lock however the engine ends, so when the daemon closes such a
pool (unregistered, replaced, the engine's hold gone, the daemon stopping)
and finds the lock free, the engine is dead and will never unlink its name:
the daemon unlinks it (if it still names the object the daemon opened, and
if the daemon's uid may: ``/dev/shm`` is sticky). A lock still held at the
close is looked at again in the background for 2 s: a dying engine's
connection can close a moment before the kernel drops its lock. A live engine's name is
never touched (it needs it to register again after a daemon restart), nor a
name that was not owner-locked.

Used by the CPU backend (:mod:`kvseal.server.backends.cpu.backend`), which owns the
private memory the bytes go to and come from.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence

from kvseal.server.errors import HandleUnusable
from kvseal.server.pools import BufferMemory, PoolSpec, check_disjoint

SHM_DIR = "/dev/shm"  # noqa: S108 - POSIX shm objects live here on Linux
log = logging.getLogger("kvseal.cpu")
_IOV_MAX = 1024  # Linux UIO_MAXIOV: buffers per preadv/pwritev
# One read of a chunk: (fd, file offset of page 0, page stride, offset in the
# chunk, bytes, object name); a chunk: (start in the block, bytes, its reads).
Read = tuple[int, int, int, int, int, str]
Chunk = tuple[int, int, tuple[Read, ...]]
# The same with each read's destination bound: (fd, offset, stride, iovec, bytes, name).
BoundRead = tuple[int, int, int, tuple[memoryview], int, str]
BoundChunk = tuple[int, int, tuple[BoundRead, ...]]


class CpuMappedPool:
    """A pool whose buffers live in POSIX shared memory (``/dev/shm``).

    The daemon opens each shared-memory object once, read-write, and never
    maps it: :meth:`read_chunk` and :meth:`write_pages` are
    ``os.preadv``/``os.pwritev`` on the object's fd (they release the GIL).
    So the engine's memory can never raise a signal in the daemon: an object
    the engine shrinks, even while a copy runs, makes the read come back
    short, which fails that request with HandleUnusable (nothing sealed from
    it is published), and a write past its end extends the engine's own
    object. Other pools are not affected.

    Whose memory: the daemon opens objects with its own privileges, so it
    accepts only objects owned by an allowed peer uid (else engine A could
    name engine B's pool: a confused deputy), and never its own ciphertext
    region. Names are resolved to the object behind them (``st_dev``,
    ``st_ino``), and :func:`~kvseal.server.pools.check_disjoint` refuses a
    geometry in which two (segment, page) pairs share a byte of one object,
    whatever names the buffers use (the same name twice, hard links,
    overlapping ranges): a restore into one page never writes another.
    """

    def __init__(
        self,
        spec: PoolSpec,
        allowed_uids: frozenset[int] = frozenset(),
        forbidden: frozenset[tuple[int, int]] = frozenset(),
    ) -> None:
        self.spec = spec
        self._allowed = allowed_uids
        self._forbidden = forbidden
        self._fds: dict[str, int] = {}
        self._sizes: dict[str, int] = {}  # each object's size when it was opened
        self._owner_locked: set[str] = set()  # names whose engine holds a flock (module doc)
        # Per page, the reads/writes of one block: (fd, file offset of page 0,
        # stride, offset in the block, bytes, object name); consecutive
        # segments that are adjacent in one object are merged into one run.
        self._runs: list[tuple[int, int, int, int, int, str]] = []
        self._plans: dict[int, tuple[Chunk, ...]] = {}
        self._bound: dict[tuple[int, int], tuple[memoryview, tuple[BoundChunk, ...]]] = {}
        self._cache_lock = threading.Lock()  # sealing threads share the pool
        g = spec.geometry
        # The geometry sums its segments on every read of block_bytes (128 of
        # them for a 64-layer model): once here, not once per write call.
        self._block_bytes = g.block_bytes
        try:
            memory = []
            for i, b in enumerate(g.buffers):
                if b.shm_name is None:  # pragma: no cover - validated at registration
                    raise HandleUnusable(f"geometry.buffers[{i}] has no shm_name")
                if b.shm_name not in self._fds:
                    self._open(b.shm_name)
                st = os.fstat(self._fds[b.shm_name])
                size = self._sizes[b.shm_name]
                if b.offset + b.size > size:
                    raise HandleUnusable(
                        f"geometry.buffers[{i}] spans bytes [{b.offset}, {b.offset + b.size}) "
                        f"but shared memory {b.shm_name!r} has {size} bytes"
                    )
                memory.append(BufferMemory((st.st_dev, st.st_ino), b.offset, b.size))
            check_disjoint(memory, g.segments, g.num_pages)
            self._confirm_owner_locks()
        except BaseException:
            self.close()
            raise
        pos = 0
        for s in g.segments:
            b = g.buffers[s.buffer]
            assert b.shm_name is not None
            fd = self._fds[b.shm_name]
            stride = s.page_stride if g.num_pages > 1 else 0
            at = b.offset + s.offset
            if self._runs:
                pfd, pat, pstride, ppos, pn, name = self._runs[-1]
                if pfd == fd and pstride == stride and pat + pn == at:
                    self._runs[-1] = (pfd, pat, pstride, ppos, pn + s.bytes, name)
                    pos += s.bytes
                    continue
            self._runs.append((fd, at, stride, pos, s.bytes, b.shm_name))
            pos += s.bytes

    def _open(self, name: str) -> None:
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise HandleUnusable(f"cannot open shared memory {name!r}: {e.strerror}") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
                raise HandleUnusable(f"shared memory {name!r} is empty or not a memory object")
            if self._allowed and st.st_uid not in self._allowed:
                raise HandleUnusable(
                    f"shared memory {name!r} is owned by uid {st.st_uid}, which is not an "
                    "allowed peer (--allow-uid): the engine must own its pool"
                )
            if (st.st_dev, st.st_ino) in self._forbidden:
                raise HandleUnusable(f"{name!r} is kvseal's own ciphertext region")
        except BaseException:
            os.close(fd)
            raise
        self._fds[name] = fd
        self._sizes[name] = st.st_size
        if _locked_by_other(fd):
            self._owner_locked.add(name)  # provisional: rechecked by _confirm_owner_locks

    def _confirm_owner_locks(self) -> None:
        """Keep as owner-locked only the objects whose lock is still held a
        moment later. A lock seen once may be another process's probe (an
        engine's ``sweep_orphans`` holds an exclusive lock for microseconds);
        an engine's owner lock lasts as long as the engine. Counting a probe as
        an owner lock would unlink a live object's name at the close. One wait
        for the whole pool, only when some object looked locked."""
        if not self._owner_locked:
            return
        time.sleep(_PROBE_RECHECK_S)
        for name in list(self._owner_locked):
            if not _locked_by_other(self._fds[name]):
                self._owner_locked.discard(name)

    def check(self) -> None:
        """Raise HandleUnusable if an object shrank since it was opened (an
        early, clear refusal; a shrink during the batch is caught by the
        short read itself). The size is ``lseek(SEEK_END)``, a quarter of an
        ``fstat``'s cost (no stat record built), for every object of the pool
        (64 for a 64-layer model); nothing here reads or writes at the fd's
        offset (every copy is positional), so moving it is harmless."""
        for name, fd in self._fds.items():
            size = os.lseek(fd, 0, os.SEEK_END)
            if size < self._sizes[name]:
                raise HandleUnusable(
                    f"shared memory {name!r} shrank to {size} bytes while registered: "
                    "register the pool again"
                )

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def segment_runs(self) -> int:
        """How many reads or writes make one page (adjacent segments merged)."""
        return len(self._runs)

    def chunks(self, size: int) -> tuple[Chunk, ...]:
        """A block cut into chunks of at most ``size`` bytes, in block order:
        ``(start in the block, bytes, reads)``, each read ``(fd, file offset
        of page 0, page stride, offset in the chunk, bytes, object name)``.
        Computed once per chunk size."""
        plan = self._plans.get(size)
        if plan is None:
            out = []
            for c0 in range(0, self.block_bytes, size):
                c1 = min(self.block_bytes, c0 + size)
                reads = []
                for fd, at, stride, pos, n, name in self._runs:
                    lo, hi = max(pos, c0), min(pos + n, c1)
                    if lo < hi:
                        reads.append((fd, at + lo - pos, stride, lo - c0, hi - lo, name))
                out.append((c0, c1 - c0, tuple(reads)))
            plan = self._plans[size] = tuple(out)
        return plan

    def bound(self, size: int, dst: memoryview) -> tuple[BoundChunk, ...]:
        """:meth:`chunks` with each read's destination taken in ``dst`` (one
        caller-private buffer of at least ``size`` bytes, reused for every
        chunk): ``(start in the block, bytes, reads)``, each read ``(fd, file
        offset of page 0, page stride, iovec, bytes, object name)``. Cached
        per ``dst`` (a bounce buffer lives as long as its thread), so the copy
        loop allocates nothing."""
        key = (size, id(dst))
        with self._cache_lock:
            hit = self._bound.get(key)
            if hit is None or hit[0] is not dst:
                if len(self._bound) >= 16:
                    del self._bound[next(iter(self._bound))]
                plan = tuple(
                    (
                        c0,
                        n,
                        tuple(
                            (fd, at, st, (dst[p : p + k],), k, nm) for fd, at, st, p, k, nm in rd
                        ),
                    )
                    for c0, n, rd in self.chunks(size)
                )
                hit = self._bound[key] = (dst, plan)
        return hit[1]

    def read_chunk(self, page: int, chunk: BoundChunk) -> None:
        """Read one chunk (from :meth:`bound`) of page ``page`` (checked by the
        caller) into its private destination, each byte once. Raises
        HandleUnusable if the engine's object ends early or cannot be read;
        the destination is then partly filled and must not be used."""
        read = None
        try:
            for read in chunk[2]:
                fd, at, stride, iov, n, _ = read
                if os.preadv(fd, iov, at + page * stride) != n:
                    _read_rest(fd, iov[0], at + page * stride)
        except (OSError, _ShortRead) as e:
            assert read is not None
            raise HandleUnusable(
                f"reading page {page} of shared memory {read[5]!r} failed ({_why(e)}): "
                "the engine shrank or broke its pool; register it again"
            ) from e

    def write_pages(
        self,
        pages: Sequence[int],
        src: memoryview,
        starts: Sequence[int],
        check: Callable[[], None],
        rotate: int = 0,
    ) -> None:
        """Write whole blocks: page ``pages[j]`` gets the block at
        ``src[starts[j]:]``. Pages that follow each other in the pool go out
        together: a segment of consecutive pages is one ``pwritev`` of at
        most one block's bytes. ``check`` runs before the first write call
        and again before any call that would take the bytes written since
        the last check past one block, so each touch after a check is at
        most one block long (a check per block, not per segment: a 64-layer
        block is 128 writes). ``rotate`` starts at another segment: threads
        writing parts of one batch then work on different objects instead of
        queueing on one object's lock. Raises HandleUnusable if a write fails
        (e.g. no space to re-extend an object the engine shrank); the pages
        are then partly written."""
        groups: list[tuple[int, int]] = []  # (first j, count) of consecutive pages
        j = 0
        while j < len(pages):
            k = 1
            while j + k < len(pages) and pages[j + k] == pages[j] + k:
                k += 1
            groups.append((j, k))
            j += k
        runs = self._runs
        r = rotate % len(runs)
        block = self._block_bytes
        since = block  # bytes written since the last check: check before the first write
        run = None
        try:
            if len(pages) == 1:  # one block: one check, then a write per run, nothing else
                check()
                base, page = starts[0], pages[0]
                for run in runs[r:] + runs[:r]:
                    fd, at, stride, pos, n, _ = run
                    view = src[base + pos : base + pos + n]
                    done = os.pwrite(fd, view, at + page * stride)
                    if done != n:
                        _write_rest(fd, view[done:], at + page * stride + done)
                return
            for run in runs[r:] + runs[:r]:
                fd, at, stride, pos, n, _ = run
                per_call = max(1, min(_IOV_MAX, block // n)) if stride == n else 1
                for j0, count in groups:
                    for c in range(j0, j0 + count, per_call):
                        m = min(per_call, j0 + count - c)
                        if since + n * m > block:
                            check()
                            since = 0
                        since += n * m
                        if m == 1:
                            s0 = starts[c] + pos
                            iov = [src[s0 : s0 + n]]
                        else:
                            iov = [
                                src[starts[x] + pos : starts[x] + pos + n] for x in range(c, c + m)
                            ]
                        done = os.pwritev(fd, iov, at + pages[c] * stride)
                        if done != n * m:
                            _write_rest_iov(fd, iov, at + pages[c] * stride, done)
        except (OSError, _ShortRead) as e:
            assert run is not None
            raise HandleUnusable(
                f"writing shared memory {run[5]!r} failed ({_why(e)}): register the pool again"
            ) from e

    def close(self) -> None:
        """Close the objects; unlink the name of each owner-locked object whose
        engine is gone (module doc). Never raises for an unlink."""
        self._runs = []
        self._bound.clear()
        for name, fd in self._fds.items():
            if name in self._owner_locked and not _unlink_if_orphaned(fd, name):
                _recheck_later(fd, name)
            os.close(fd)
        self._fds.clear()


# The daemon's own probes (_locked_by_other and _unlink_if_orphaned) each take
# an exclusive flock for a moment. Two at once on one object (two pools over
# the same object registered together, or one closing while another opens)
# would each take the other's probe for an engine's owner lock, and a plain
# object taken for owner-locked has its live name unlinked when that pool
# closes. So this process probes one object at a time. A probe by another
# process is absorbed by CpuMappedPool._confirm_owner_locks (looked at again
# after _PROBE_RECHECK_S).
_probe_lock = threading.Lock()
_PROBE_RECHECK_S = 0.005


def _locked_by_other(fd: int) -> bool:
    """Whether another open file description holds a flock on the object."""
    with _probe_lock:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError:
            return False
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False


# A dying engine's socket may close (its hold ends, the daemon drops the pool)
# a moment before the kernel closes the fd that holds its owner lock: a pool
# closed while its lock is held is looked at again for this long.
_RECHECK_S = 2.0


def _recheck_later(fd: int, name: str) -> None:
    """Look at the object again (a duplicate of ``fd``) for up to _RECHECK_S in
    a background thread, and unlink its name if its lock comes free meanwhile;
    a live engine's lock stays held and the thread ends with nothing done."""
    try:
        dup = os.dup(fd)
    except OSError:
        return

    def run() -> None:
        try:
            deadline = time.monotonic() + _RECHECK_S
            while time.monotonic() < deadline:
                time.sleep(0.1)
                if _unlink_if_orphaned(dup, name):
                    return
        finally:
            os.close(dup)

    threading.Thread(target=run, name="kvseal-shm-recheck", daemon=True).start()


def _unlink_if_orphaned(fd: int, name: str) -> bool:
    """Unlink ``/dev/shm/<name>`` if nobody holds the object's lock and the name
    still names the object open as ``fd``. The exclusive lock is held until the
    name is gone, as the engines' own sweep does. False only while the lock is
    held (the engine lives); True when there is nothing more to do."""
    with _probe_lock:
        return _unlink_if_orphaned_locked(fd, name)


def _unlink_if_orphaned_locked(fd: int, name: str) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # its engine lives and keeps the name
        return False
    except OSError:
        return True
    path = os.path.join(SHM_DIR, name)
    try:
        st, now = os.fstat(fd), os.stat(path, follow_symlinks=False)
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            os.unlink(path)
            log.info("unlinked shared memory %r: the engine that created it is gone", name)
    except FileNotFoundError:
        pass  # unlinked already (the engine at exit, or a sweep)
    except OSError as e:
        log.warning(
            "cannot unlink shared memory %r of an engine that is gone (%s); the next "
            "engine of its uid removes it",
            name,
            e.strerror,
        )
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
    return True


class _ShortRead(Exception):
    """The object ended before the bytes a page needs."""


def _why(e: BaseException) -> str:
    return e.strerror or str(e) if isinstance(e, OSError) else str(e)


def _read_rest(fd: int, view: memoryview, at: int) -> None:
    """Finish a read that came back short: a regular file reads short only at
    its end, so this normally finds the end and raises _ShortRead."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, (view[done:],), at + done)
        if got == 0:
            raise _ShortRead(f"object ends before byte {at + len(view)}")
        done += got


def _write_rest_iov(fd: int, iov: list[memoryview], at: int, done: int) -> None:
    """Finish a ``pwritev`` that wrote only ``done`` bytes of ``iov``."""
    for view in iov:
        if done >= len(view):
            done -= len(view)
        else:
            _write_rest(fd, view[done:], at + done)
            done = 0
        at += len(view)


def _write_rest(fd: int, view: memoryview, at: int) -> None:
    done = 0
    while done < len(view):
        put = os.pwritev(fd, (view[done:],), at + done)
        if put == 0:
            raise _ShortRead("write made no progress")
        done += put
