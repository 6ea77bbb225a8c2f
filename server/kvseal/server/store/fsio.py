"""The store's directory: shards, atomic publish, bounded reads, eviction.

No cryptography here: this module moves opaque records (already sealed) in
and out of a directory that belongs to the host (a local disk or a volume
every replica mounts), and keeps its size bounded without a central index.

Layout::

    <root>/kvseal-store        "kvseal-store 1 fanout=<n>": written once, by the
                               first opener (link, never replace); later openers
                               must agree
    <root>/<xx>/               ``fanout`` shard directories (a power of two up
                               to 256), ``xx`` = the name's first byte mod fanout
    <root>/<xx>/<64 hex>       a block object
    <root>/<xx>/<64 hex>.scope a tenant's scope marker or floor (:mod:`.scopes`)
    <root>/<xx>/.tmp-<16 hex>  a record being written

Rules each function keeps (and why):

- **Atomic publish.** A record is written to a unique temporary name *in its
  shard* (the same filesystem, so the rename is atomic), ``fsync``ed when the
  store is ``durable``, then ``rename``d over its name (or ``link``ed, for
  first-writer-wins markers). A reader opens a name and gets the old inode or
  the new one, whole, never a partial one. Concurrent writers of one name
  each publish a complete record; the last rename wins and both are valid.
- **fsync of the file; of the directory only for markers.** After a power
  loss or a VM crash a published name must never point at a torn record:
  that is indistinguishable from tampering and would trip the integrity
  policy. The data is therefore flushed before the rename. For a block
  object the directory is not: a rename lost in a crash is a missing object
  (a miss), and its temporary file is swept (below). For a scope marker it
  is (``sync_dir``): a lost marker rename would bring the *previous* marker
  back, undoing a tenant drop, so a drop is durable before it returns.
  ``durable=False`` skips every flush for stores that do not outlive the VM
  anyway (tmpfs, an emptyDir in memory); there a crash loses the whole
  store, never half an object.
- **Page cache, not O_DIRECT.** Records carry a 64-byte header, so O_DIRECT's
  alignment rules (offsets, lengths and buffers in 512 B to 4 KiB units) would
  need padding in the format; tmpfs refuses it and NFS/FUSE filesystems give
  it varied meanings; it gives no atomicity or durability by itself (the
  fsync and the rename do that); and it forgoes readahead on the sequential
  multi-MiB reads a restore does. The page cache of a confidential VM is
  private guest memory and only ever holds ciphertext, so caching costs
  memory, not confidentiality. (``make bench``'s store rows measure this
  choice against a plain file copy: docs/store.md, "Benchmark".)
- **No symlinks below the root.** Shards are opened relative to the root's
  descriptor with ``O_NOFOLLOW``, records with ``O_NOFOLLOW | O_NONBLOCK``, and
  only regular files are read: the host cannot redirect a write outside the
  store or hang a read on a FIFO. Reads are bounded by the largest record the
  store accepts and snapshot the bytes into private memory before anything
  parses them.
- **Bounded size without a central index.** Each shard may hold
  ``capacity // fanout`` bytes (its records and temporary files, each counted
  as the larger of its size and its allocated blocks, so many tiny markers
  are not undercounted). Before writing into a shard a writer lists that
  shard alone and removes the block objects with the oldest modification time
  (a hit touches an object) until its own record fits; scope markers go only
  when no object is left to remove (a marker is ~120 bytes, and removing one
  orphans every object of its tenant). Names are keyed-hash uniform, so shards fill evenly and
  the sum of the shard bounds is the capacity. Two writers racing in one
  shard may both make room for one record and both publish: each shard then
  exceeds its share by at most one record per concurrent writer, until the
  next put into it. Stated tolerance: at any moment the store holds at most
  ``capacity + 2 * W * max_record`` bytes, ``W`` the number of puts in flight
  at once (one published record over and one temporary file each), and at most
  ``capacity + W * max_record`` once they finish. Files that are not ours in a
  shard are neither counted nor removed.
- **Crashes.** A writer that dies leaves at most a temporary file; a
  temporary file not modified for ``stale_temp_s`` (a live writer writes to
  it continuously) is removed by any opener and by any eviction scan of its
  shard. Nothing else is ever half-done: the store is usable at any point.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvseal.server.store.backend import Evicted, Ident, Usage
from kvseal.server.store.errors import (
    NotARegularFile,
    StoreError,
    StoreIntegrityError,
    StoreLayoutError,
)

LAYOUT_FILE = "kvseal-store"
LAYOUT_VERSION = 1
MAX_FANOUT = 256
TEMP_PREFIX = ".tmp-"
MARKER_SUFFIX = ".scope"
_OBJECT = re.compile(r"[0-9a-f]{64}")
_MARKER = re.compile(r"[0-9a-f]{64}\.scope")
_LAYOUT = re.compile(rb"kvseal-store (\d+) fanout=(\d+)\n")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# A file vanished under us: deleted locally (ENOENT) or on another NFS client (ESTALE).
_GONE = (errno.ENOENT, errno.ESTALE)

FileIdent = tuple[int, int]  # (st_dev, st_ino): which inode a read snapshot came from


def _pread_all(fd: int, view: memoryview) -> int:
    """Read from offset 0 until ``view`` is full or the file ends (it shrank
    since fstat: the parser then sees a truncated record); bytes read."""
    n = 0
    while n < len(view):
        got = os.preadv(fd, [view[n:]], n)
        if got == 0:
            break
        n += got
    return n


@dataclass(slots=True)
class _Shard:
    """What a scan of one shard found."""

    objects: list[tuple[int, int, str]] = field(default_factory=list)  # (mtime_ns, size, name)
    markers: list[tuple[int, int, str]] = field(default_factory=list)
    record_bytes: int = 0
    temps: int = 0
    temp_bytes: int = 0
    swept: int = 0


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class StoreDir:
    """One store directory (see the module docstring): the directory backend
    (:class:`~.backend.StoreBackend`). Thread-safe: every method works on
    descriptors it opens and closes itself, and the filesystem serialises the
    renames, links and unlinks that races come down to."""

    def __init__(
        self,
        path: str,
        *,
        fanout: int | None,
        durable: bool,
        stale_temp_s: float,
        default_fanout: int = MAX_FANOUT,
    ):
        """Open (creating if needed, mode 0700) the store at ``path``. The
        layout file fixes the fanout: ``fanout`` None adopts it (or
        ``default_fanout`` for a new store), a different number is refused
        (:class:`StoreLayoutError`). Stale temporary files are swept."""
        if fanout is not None and not (is_power_of_two(fanout) and fanout <= MAX_FANOUT):
            raise StoreLayoutError(f"fanout must be a power of two up to {MAX_FANOUT}")
        self.path = path
        self.durable = durable
        self.stale_temp_ns = int(stale_temp_s * 1e9)
        os.makedirs(path, mode=0o700, exist_ok=True)
        # The root itself may be a symlink (the operator's choice of path).
        self._root = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            # Allocation unit: an incoming record is counted as it will be on disk.
            self._unit = max(1, os.fstatvfs(self._root).f_frsize)
            self.fanout = self._layout(fanout if fanout is not None else default_fanout, fanout)
            self.sweep_temps()
        except BaseException:
            os.close(self._root)
            raise

    @property
    def location(self) -> str:
        return self.path

    def close(self) -> None:
        if self._root >= 0:
            os.close(self._root)
            self._root = -1

    # ------------------------------------------------------------ layout

    def _layout(self, default: int, wanted: int | None) -> int:
        for _ in range(3):
            try:
                fd = os.open(LAYOUT_FILE, _READ_FLAGS, dir_fd=self._root)
            except FileNotFoundError:
                text = f"kvseal-store {LAYOUT_VERSION} fanout={default}\n".encode()
                if self._publish_in(self._root, LAYOUT_FILE, text, replace=False):
                    return default
                continue  # another opener created it first: read theirs
            try:
                raw = os.read(fd, 256)
            finally:
                os.close(fd)
            m = _LAYOUT.fullmatch(raw)
            if m is None or int(m[1]) != LAYOUT_VERSION:
                raise StoreLayoutError(f"{self.path}/{LAYOUT_FILE} is not a v1 layout file")
            fanout = int(m[2])
            if not (is_power_of_two(fanout) and fanout <= MAX_FANOUT):
                raise StoreLayoutError(f"{self.path}/{LAYOUT_FILE} names fanout {fanout}")
            if wanted is not None and wanted != fanout:
                raise StoreLayoutError(
                    f"{self.path} was created with fanout {fanout}, not {wanted}: every "
                    "replica sharing a store must use the same"
                )
            return fanout
        raise StoreLayoutError(f"{self.path}/{LAYOUT_FILE} keeps disappearing")

    # ------------------------------------------------------------ shards

    def shard_of(self, name: str) -> str:
        return f"{int(name[:2], 16) % self.fanout:02x}"

    def _shard_fd(self, shard: str, *, create: bool) -> int | None:
        try:
            return os.open(shard, _DIR_FLAGS, dir_fd=self._root)
        except FileNotFoundError:
            if not create:
                return None
        except OSError as e:
            # Only a planted symlink or file is the host's doing (tampering).
            # EACCES, EIO, ESTALE, EMFILE ... are the filesystem's or ours: an
            # OSError the caller treats as a miss or a skipped spill, never as
            # an integrity failure (which may stop the daemon for good).
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise StoreIntegrityError(
                    f"shard {shard} is not a directory ({e.strerror})"
                ) from None
            raise
        try:
            os.mkdir(shard, 0o700, dir_fd=self._root)
        except FileExistsError:
            pass
        return os.open(shard, _DIR_FLAGS, dir_fd=self._root)

    def path_of(self, name: str) -> str:
        """Where the record ``name`` lives (for tests and operators)."""
        return os.path.join(self.path, self.shard_of(name), name)

    # ------------------------------------------------------------ records

    def read(
        self, name: str, max_bytes: int, scratch: bytearray | None = None
    ) -> tuple[bytearray | memoryview, FileIdent] | None:
        """A private snapshot of the record ``name`` and the inode it came
        from; None if there is none, and None (unread) for a record over
        ``max_bytes``: a replica configured for larger blocks may share the
        store, so an oversized record is a miss, not tampering (it is left in
        place; eviction reclaims it). Raises :class:`NotARegularFile` without
        reading. ``scratch``: the caller's buffer to read into when the record
        fits (a view of it is returned, valid until the caller reuses it):
        fresh memory faults in page by page, a reused buffer does not."""
        sfd = self._shard_fd(self.shard_of(name), create=False)
        if sfd is None:
            return None
        try:
            try:
                fd = os.open(name, _READ_FLAGS, dir_fd=sfd)
            except OSError as e:
                if e.errno in _GONE:
                    return None
                if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
                    raise NotARegularFile(f"record {name} is not a regular file") from None
                raise
        finally:
            os.close(sfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotARegularFile(f"record {name} is not a regular file")
            if st.st_size > max_bytes:
                return None
            size = st.st_size
            if scratch is not None and len(scratch) >= size:
                view = memoryview(scratch)[:size]
                return view[: _pread_all(fd, view)], (st.st_dev, st.st_ino)
            buf = bytearray(size)
            with memoryview(buf) as view:
                n = _pread_all(fd, view)
            if n < len(buf):
                del buf[n:]
            return buf, (st.st_dev, st.st_ino)
        except OSError as e:
            if e.errno in _GONE:
                return None
            raise
        finally:
            os.close(fd)

    def exists(self, name: str) -> bool:
        """Whether a regular file sits at ``name`` (nothing is read)."""
        sfd = self._shard_fd(self.shard_of(name), create=False)
        if sfd is None:
            return False
        try:
            st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
        except OSError as e:
            if e.errno in _GONE:
                return False
            raise
        finally:
            os.close(sfd)
        return stat.S_ISREG(st.st_mode)

    def prefetch(self, name: str) -> None:
        """Ask the kernel to start reading ``name`` into the page cache
        (``POSIX_FADV_WILLNEED``), so that a later :meth:`read` overlaps the
        device with the caller's work on earlier records. Advice only: a
        record that is gone, or any error, is ignored (the read decides)."""
        sfd = self._shard_fd(self.shard_of(name), create=False)
        if sfd is None:
            return
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=sfd)
        except OSError:
            return
        finally:
            os.close(sfd)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        except OSError:
            pass
        finally:
            os.close(fd)

    def touch(self, name: str) -> None:
        """Mark ``name`` as just used (its mtime orders eviction); a record
        that is gone is ignored."""
        sfd = self._shard_fd(self.shard_of(name), create=False)
        if sfd is None:
            return
        try:
            os.utime(name, dir_fd=sfd, follow_symlinks=False)
        except OSError as e:
            if e.errno not in _GONE:
                raise
        finally:
            os.close(sfd)

    def remove_planted(self, name: str) -> bool:
        """Unlink whatever sits at ``name`` unless it is a regular file: the
        FIFO, symlink or device node that :meth:`read` refused with
        :class:`NotARegularFile` (a regular file there now was published since,
        and is read on its own merits next time). A directory is not ours to
        remove and stays. True if something was removed."""
        sfd = self._shard_fd(self.shard_of(name), create=False)
        if sfd is None:
            return False
        try:
            st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
                return False
            os.unlink(name, dir_fd=sfd)  # a symlink itself, never its target
            return True
        except OSError as e:
            if e.errno in (*_GONE, errno.EISDIR, errno.EPERM):
                return False
            raise
        finally:
            os.close(sfd)

    def remove(self, name: str, ident: Ident | None = None) -> bool:
        """Unlink ``name``; with ``ident``, only if it is still that inode (a
        record found bad is removed, not a good one published since). True if
        something was removed."""
        sfd = self._shard_fd(self.shard_of(name), create=False)
        if sfd is None:
            return False
        try:
            if ident is not None:
                st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
                if (st.st_dev, st.st_ino) != ident:
                    return False
            os.unlink(name, dir_fd=sfd)
            return True
        except OSError as e:
            if e.errno in (*_GONE, errno.EISDIR, errno.EPERM):
                return False
            raise
        finally:
            os.close(sfd)

    def publish(
        self, name: str, data: bytes | bytearray, *, replace: bool, sync_dir: bool = False
    ) -> bool:
        """Publish ``data`` as ``name`` atomically (see the module docstring).
        ``replace=False``: only if no record has that name (first writer
        wins); returns False when one had. ``sync_dir`` (scope markers): on a
        durable store the shard directory is fsynced after the rename, so the
        new name survives a crash. The temporary file never outlives the
        call, whatever fails."""
        sfd = self._shard_fd(self.shard_of(name), create=True)
        assert sfd is not None  # created on demand
        try:
            done = self._publish_in(sfd, name, data, replace=replace)
            if done and sync_dir and self.durable:
                os.fsync(sfd)
            return done
        finally:
            os.close(sfd)

    def _publish_in(self, dfd: int, name: str, data: bytes | bytearray, *, replace: bool) -> bool:
        tmp = TEMP_PREFIX + secrets.token_hex(8)
        fd = os.open(tmp, _WRITE_FLAGS, 0o600, dir_fd=dfd)
        linked = False
        try:
            try:
                with memoryview(data) as view:
                    done = 0
                    while done < len(view):
                        done += os.write(fd, view[done:])
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            if replace:
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                linked = True
                return True
            try:
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
            except FileExistsError:
                return False
            return True
        finally:
            if not linked:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except FileNotFoundError:
                    pass

    # ------------------------------------------------------------ capacity

    def make_room(self, name: str, incoming: int, shard_cap: int) -> Evicted:
        """Remove the least recently used records of ``name``'s shard until
        ``incoming`` more bytes fit in ``shard_cap`` (and stale temporary
        files). Records removed by someone else meanwhile count as removed."""
        if incoming > shard_cap:
            raise StoreError(f"a {incoming}-byte record cannot fit a {shard_cap}-byte shard")
        incoming = min(-(-incoming // self._unit) * self._unit, shard_cap)
        sfd = self._shard_fd(self.shard_of(name), create=True)
        assert sfd is not None
        try:
            shard = self._scan(sfd, sweep=True)
            used = shard.record_bytes + shard.temp_bytes
            if used + incoming <= shard_cap:
                return Evicted(temp_files=shard.swept)
            n = freed = 0
            gone: list[str] = []
            for _mtime, size, victim in [*sorted(shard.objects), *sorted(shard.markers)]:
                if used + incoming <= shard_cap:
                    break
                try:
                    os.unlink(victim, dir_fd=sfd)
                    n += 1
                    freed += size
                    gone.append(victim)
                except OSError as e:
                    if e.errno not in _GONE:
                        raise
                used -= size
            return Evicted(n, freed, shard.swept, tuple(gone))
        finally:
            os.close(sfd)

    def _scan(self, sfd: int, *, sweep: bool) -> _Shard:
        """One shard's records and temporary files (stale ones removed first
        when ``sweep``)."""
        shard = _Shard()
        now = time.time_ns()
        with os.scandir(sfd) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError as e:
                    if e.errno in _GONE:
                        continue
                    raise
                if not stat.S_ISREG(st.st_mode):
                    continue
                size = max(st.st_size, st.st_blocks * 512)
                if entry.name.startswith(TEMP_PREFIX):
                    if sweep and now - st.st_mtime_ns > self.stale_temp_ns:
                        try:
                            os.unlink(entry.name, dir_fd=sfd)
                            shard.swept += 1
                            continue
                        except OSError as e:
                            if e.errno in _GONE:
                                continue
                            raise
                    shard.temps += 1
                    shard.temp_bytes += size
                elif _OBJECT.fullmatch(entry.name):
                    shard.objects.append((st.st_mtime_ns, size, entry.name))
                    shard.record_bytes += size
                elif _MARKER.fullmatch(entry.name):
                    shard.markers.append((st.st_mtime_ns, size, entry.name))
                    shard.record_bytes += size
        return shard

    def sweep_temps(self) -> int:
        """Remove every stale temporary file (on open); returns how many."""
        return sum(self._scan(sfd, sweep=True).swept for sfd in self._each_shard())

    def usage(self) -> Usage:
        """A full scan: every record and temporary file of every shard."""
        shards = [self._scan(sfd, sweep=False) for sfd in self._each_shard()]
        return Usage(
            sum(len(s.objects) for s in shards),
            sum(len(s.markers) for s in shards),
            sum(s.record_bytes for s in shards),
            sum(s.temps for s in shards),
            sum(s.temp_bytes for s in shards),
        )

    def _each_shard(self) -> Iterator[int]:
        """A descriptor of each existing shard in turn (closed after use)."""
        for i in range(self.fanout):
            sfd = self._shard_fd(f"{i:02x}", create=False)
            if sfd is None:
                continue
            try:
                yield sfd
            finally:
                os.close(sfd)
