"""FsStore's errors that are not tampering, on a real directory: filesystem
failures stay ``OSError`` (a miss or a skipped spill for the caller, never an
integrity failure that may stop the daemon), records of a larger limit or a
newer format are misses left in place, plaintext is wiped when a get fails
late, a marker publish fsyncs its shard directory, and ``delete`` removes one
block. Planted shard symlinks stay integrity failures (``test_store_fs``)."""

from __future__ import annotations

import errno
import hashlib
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kvseal.server.store import fsio, fsstore, keysource
from kvseal.server.store.errors import StoreIntegrityError
from kvseal.server.store.fsstore import FsStore, StoreConfig
from kvseal.server.store.keysource import DeploymentKey

KEY = bytes(range(7, 39))
NS, T1 = hashlib.sha256(b"ns").digest(), hashlib.sha256(b"t1").digest()
MakeStore = Callable[..., FsStore]


def h(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[MakeStore]:
    stores: list[FsStore] = []

    def make(max_object_bytes: int = 64 << 10, **kw: Any) -> FsStore:
        s = FsStore(
            StoreConfig(
                str(tmp_path / "store"),
                capacity_bytes=4 << 20,
                max_object_bytes=max_object_bytes,
                scope_ttl_s=0.0,
                **kw,
            ),
            DeploymentKey(bytearray(KEY), "test"),
        )
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()


@pytest.mark.parametrize("code", [errno.EACCES, errno.EIO, errno.ESTALE, errno.EMFILE])
def test_shard_open_errors_stay_oserror(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    s = make_store(fanout=1)
    s.put(NS, T1, h("b"), b"x" * 100)
    real = os.open

    def failing(path: Any, flags: int, *a: Any, **kw: Any) -> int:
        if flags & os.O_DIRECTORY and kw.get("dir_fd") is not None:
            raise OSError(code, os.strerror(code))
        return real(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", failing)
    with pytest.raises(OSError) as e:
        s.get(NS, T1, h("b"))
    assert not isinstance(e.value, StoreIntegrityError) and e.value.errno == code
    with pytest.raises(OSError):
        s.put(NS, T1, h("c"), b"y" * 100)
    assert s.stats().integrity_failures == 0
    monkeypatch.undo()
    assert s.get(NS, T1, h("b")) == bytearray(b"x" * 100), "nothing was removed"


def test_records_of_a_larger_limit_or_a_newer_version_are_misses(
    make_store: MakeStore, tmp_path: Path
) -> None:
    big = make_store(max_object_bytes=64 << 10)
    big.put(NS, T1, h("big"), b"B" * (32 << 10))
    big.put(NS, T1, h("newer"), b"n" * 100)
    big.close()
    small = make_store(max_object_bytes=16 << 10)  # another replica's --store-max-block-bytes
    assert small.get(NS, T1, h("big")) is None
    newer = Path(small.object_path(NS, T1, h("newer")) or "")
    data = bytearray(newer.read_bytes())
    data[8:10] = struct.pack(">H", 2)  # record format version 2
    newer.write_bytes(data)
    assert small.get(NS, T1, h("newer")) is None
    st = small.stats()
    assert st.integrity_failures == 0 and st.misses == 2
    assert Path(small.object_path(NS, T1, h("big")) or "").exists() and newer.exists(), "kept"


def test_a_late_get_failure_wipes_the_plaintext(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = make_store()
    s.put(NS, T1, h("b"), b"secret" * 100)
    wiped: list[bytearray] = []
    real_wipe = keysource.wipe

    def spy(buf: bytearray) -> None:
        wiped.append(buf)
        real_wipe(buf)

    real_touch = s._dir.touch

    def eio(name: str) -> None:
        if name.endswith(fsio.MARKER_SUFFIX):
            return real_touch(name)
        raise OSError(errno.EIO, "touch failed")

    monkeypatch.setattr(fsstore, "wipe", spy)  # the name fsstore calls
    monkeypatch.setattr(s._dir, "touch", eio)
    with pytest.raises(OSError):
        s.get(NS, T1, h("b"))
    assert any(len(b) == 600 and not any(b) for b in wiped), "the plaintext was wiped"


@pytest.mark.parametrize("durable", [True, False])
def test_marker_publish_fsyncs_the_shard_directory(
    make_store: MakeStore, monkeypatch: pytest.MonkeyPatch, durable: bool
) -> None:
    """A marker rename lost in a crash would bring the previous epoch back
    (an undone drop): a durable store fsyncs the directory after it, and
    after the floor's."""
    s = make_store(durable=durable)
    s.put(NS, T1, h("b"), b"x" * 100)
    synced_dirs: list[int] = []
    real = os.fsync

    def spy(fd: int) -> None:
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            synced_dirs.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    s.delete_tenant(NS, T1)
    assert len(synced_dirs) == (2 if durable else 0)  # the marker's, the floor's
    synced_dirs.clear()
    s.put(NS, T1, h("c"), b"y" * 100)  # a block object: no directory fsync
    assert synced_dirs == []


def test_delete_removes_one_block_of_the_current_epoch(make_store: MakeStore) -> None:
    s = make_store()
    for x in "abc":
        s.put(NS, T1, h(x), x.encode() * 100)
    assert s.delete(NS, T1, h("b")) is True
    assert s.delete(NS, T1, h("b")) is False
    assert s.get(NS, T1, h("b")) is None and not s.contains(NS, T1, h("b"))
    assert s.get(NS, T1, h("a")) == bytearray(b"a" * 100)
    assert s.get(NS, T1, h("c")) == bytearray(b"c" * 100)
    assert s.delete(NS, h("nobody"), h("a")) is False


def test_contains_meets_a_planted_shard_symlink_as_a_miss(
    make_store: MakeStore, tmp_path: Path
) -> None:
    """A Lookup's name check reads nothing, so it never runs the integrity
    policy (before: the StoreIntegrityError escaped the Lookup); a get of the
    block meets the symlink and raises it."""
    s = make_store(fanout=4)
    assert s.put(NS, T1, h("0"), b"0")
    # Not a shard of the tenant's scope records (reading those is not a name check).
    scope_shards = {Path(s.scope_path(NS, T1)).parent, Path(s.floor_path(NS, T1)).parent}
    block = next(h(str(i)) for i in range(1, 64) if s.put(NS, T1, h(str(i)), b"x") and (
        Path(s.object_path(NS, T1, h(str(i))) or "").parent not in scope_shards
    ))  # fmt: skip
    shard = Path(s.object_path(NS, T1, block) or "").parent
    (tmp_path / "elsewhere").mkdir()
    for p in shard.iterdir():
        p.unlink()
    shard.rmdir()
    shard.symlink_to(tmp_path / "elsewhere")
    assert s.contains(NS, T1, block) is False
    with pytest.raises(StoreIntegrityError, match="not a directory"):
        s.get(NS, T1, block)
