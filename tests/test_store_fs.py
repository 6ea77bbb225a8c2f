"""FsStore on a real directory, in one process: the API's contract, the host's
attacks on the files (read, flip, truncate, swap, replay, plant), tenant
drops, eviction, layout and crash leftovers. Real files, real AES-GCM.

Two processes sharing a store (the bound, crashes, replicas) are in
``test_store_procs.py``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kvseal.server.store.errors import (
    LengthMismatch,
    NotARegularFile,
    ObjectTooLarge,
    RecordAuthenticationFailed,
    RecordFormatError,
    RecordTruncated,
    StoreError,
    StoreIntegrityError,
    StoreLayoutError,
)
from kvseal.server.store.fsio import TEMP_PREFIX
from kvseal.server.store.fsstore import FsStore, StoreConfig
from kvseal.server.store.keysource import DeploymentKey, LocalKeySource
from kvseal.server.store.record import record_bytes

KEY = bytes(range(7, 39))
OTHER_KEY = bytes(range(50, 82))
BLOCK = 4096


def h(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


NS, NS2 = h("model-a"), h("model-b")
T1, T2 = h("tenant-1"), h("tenant-2")


def kv(label: str, size: int = BLOCK) -> bytes:
    """A block's KV bytes: a function of its identity, as real KV is of its hash."""
    seed = hashlib.sha256(label.encode()).digest()
    return (seed * (size // 32 + 1))[:size]


MakeStore = Callable[..., FsStore]


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[MakeStore]:
    stores: list[FsStore] = []

    def make(key: bytes = KEY, path: Path | None = None, **kw: object) -> FsStore:
        cfg: dict[str, object] = {
            "capacity_bytes": 4 << 20,
            "max_object_bytes": 64 << 10,
            "scope_ttl_s": 0.0,  # every lookup re-reads the marker (a drop shows at once)
            **kw,
        }
        s = FsStore(
            StoreConfig(str(path or tmp_path / "store"), **cfg),  # type: ignore[arg-type]
            DeploymentKey(bytearray(key), "test"),
        )
        stores.append(s)
        return s

    yield make
    for s in stores:
        s.close()


def files_of(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != "kvseal-store")


# ---------------------------------------------------------------- contract


def test_put_get_contains(make_store: MakeStore) -> None:
    s = make_store()
    assert s.get(NS, T1, h("b0")) is None
    assert not s.contains(NS, T1, h("b0"))
    assert s.put(NS, T1, h("b0"), kv("b0")) is True
    assert s.put(NS, T1, h("b0"), kv("b0")) is False, "present: touched, not rewritten"
    assert s.contains(NS, T1, h("b0"))
    assert s.get(NS, T1, h("b0")) == kv("b0")
    assert s.get(NS, T1, h("b1")) is None
    assert s.put(NS, T1, h("empty"), b"") and s.get(NS, T1, h("empty")) == b""
    st = s.stats()
    assert (st.puts, st.put_present, st.hits, st.integrity_failures) == (2, 1, 2, 0)
    assert st.misses == 2


def test_too_large_and_bad_ids(make_store: MakeStore) -> None:
    s = make_store(max_object_bytes=1000)
    with pytest.raises(ObjectTooLarge):
        s.put(NS, T1, h("b"), bytes(1001))
    with pytest.raises(StoreError):
        s.put(NS, T1, b"short", bytes(10))
    with pytest.raises(StoreError):
        s.get(NS[:31], T1, h("b"))
    assert s.usage().objects == 0


def test_the_directory_holds_ciphertext_under_names_that_reveal_nothing(
    make_store: MakeStore, tmp_path: Path
) -> None:
    s = make_store()
    blocks = {f"b{i}": kv(f"b{i}") for i in range(8)}
    for name, data in blocks.items():
        s.put(NS, T1, h(name), data)
        s.put(NS, T2, h(name), data)
    files = files_of(tmp_path / "store")
    assert len(files) == 16 + 4  # objects + one marker and one floor per tenant
    assert len({p.name for p in files}) == 20
    revealing = [x.hex() for x in (NS, T1, T2, *(h(n) for n in blocks))]
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
        assert not any(r[:16] in p.name for r in revealing)
        body = p.read_bytes()
        for data in blocks.values():
            assert data[:64] not in body
    # Two tenants storing the same block: unrelated names and ciphertexts.
    a, b = s.object_path(NS, T1, h("b0")), s.object_path(NS, T2, h("b0"))
    assert a and b and a != b
    assert Path(a).read_bytes()[64:] != Path(b).read_bytes()[64:]


def test_concurrent_puts_of_one_block_are_harmless(make_store: MakeStore, tmp_path: Path) -> None:
    """Four replicas (store instances on one directory), two threads each."""
    stores = [make_store() for _ in range(4)]
    go = threading.Barrier(8)
    errors: list[BaseException] = []

    def put(s: FsStore) -> None:
        try:
            go.wait()
            s.put(NS, T1, h("hot"), kv("hot"))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=put, args=(stores[i % 4],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert make_store().get(NS, T1, h("hot")) == kv("hot")
    for s in stores:  # a writer whose rename lost may see a (documented) false replay: a miss
        assert s.get(NS, T1, h("hot")) in (kv("hot"), None)
        assert s.stats().integrity_failures == 0
    assert stores[0].usage().temp_files == 0
    assert not list((tmp_path / "store").rglob(TEMP_PREFIX + "*"))


# ---------------------------------------------------------------- the host's attacks


def _flip(p: Path, at: int) -> None:
    b = bytearray(p.read_bytes())
    b[at % len(b)] ^= 0x01
    p.write_bytes(b)


ATTACKS: dict[str, tuple[Callable[[Path], None], type[StoreIntegrityError]]] = {
    "flip-magic": (lambda p: _flip(p, 0), RecordFormatError),
    "flip-key-id": (lambda p: _flip(p, 12), StoreIntegrityError),
    "flip-generation": (lambda p: _flip(p, 27), RecordAuthenticationFailed),
    "flip-nonce": (lambda p: _flip(p, 50), RecordAuthenticationFailed),
    "flip-ciphertext": (lambda p: _flip(p, 2000), RecordAuthenticationFailed),
    "flip-tag": (lambda p: _flip(p, -1), RecordAuthenticationFailed),
    "truncate-to-0": (lambda p: p.write_bytes(b""), RecordTruncated),
    "truncate-header": (lambda p: p.write_bytes(p.read_bytes()[:40]), RecordTruncated),
    "truncate-1": (lambda p: p.write_bytes(p.read_bytes()[:-1]), RecordTruncated),
    "append": (lambda p: p.write_bytes(p.read_bytes() + b"\0"), LengthMismatch),
    "zero": (lambda p: p.write_bytes(bytes(p.stat().st_size)), RecordFormatError),
    "fifo": (lambda p: (p.unlink(), os.mkfifo(p, 0o600)), NotARegularFile),
    "symlink": (lambda p: (p.unlink(), p.symlink_to("/etc/hostname")), NotARegularFile),
    "directory": (lambda p: (p.unlink(), p.mkdir()), NotARegularFile),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_tampered_object_is_never_served_and_is_removed(make_store: MakeStore, attack: str) -> None:
    s = make_store()
    s.put(NS, T1, h("victim"), kv("victim"))
    s.put(NS, T1, h("bystander"), kv("bystander"))
    path = Path(s.object_path(NS, T1, h("victim")) or "")
    do, error = ATTACKS[attack]
    do(path)
    with pytest.raises(error):
        s.get(NS, T1, h("victim"))
    assert s.stats().integrity_failures == 1
    if attack != "directory":  # a planted directory is not ours to rmdir
        assert not path.exists() and not path.is_symlink(), "removed, not kept"
        assert s.get(NS, T1, h("victim")) is None, "afterwards: a miss"
    assert s.get(NS, T1, h("bystander")) == kv("bystander")


@pytest.mark.parametrize(
    "moved_to",
    [(NS, T1, h("other-block")), (NS, T2, h("victim")), (NS2, T1, h("victim"))],
    ids=["another-block", "another-tenant", "another-namespace"],
)
def test_object_swapped_onto_another_name_fails(
    make_store: MakeStore, moved_to: tuple[bytes, bytes, bytes]
) -> None:
    s = make_store()
    s.put(NS, T1, h("victim"), kv("victim"))
    s.put(*moved_to, kv("the right bytes"))
    src = Path(s.object_path(NS, T1, h("victim")) or "")
    dst = Path(s.object_path(*moved_to) or "")
    shutil.copyfile(src, dst)
    with pytest.raises(RecordAuthenticationFailed):
        s.get(*moved_to)
    assert s.get(NS, T1, h("victim")) == kv("victim")


def test_two_objects_exchanged(make_store: MakeStore) -> None:
    s = make_store()
    s.put(NS, T1, h("a"), kv("a"))
    s.put(NS, T1, h("b"), kv("b"))
    pa, pb = (Path(s.object_path(NS, T1, h(x)) or "") for x in "ab")
    a, b = pa.read_bytes(), pb.read_bytes()
    pa.write_bytes(b)
    pb.write_bytes(a)
    for x in "ab":
        with pytest.raises(RecordAuthenticationFailed):
            s.get(NS, T1, h(x))


def test_replay_of_an_older_object_of_the_same_block(make_store: MakeStore) -> None:
    """What a shared store without a central index can and cannot detect."""
    s = make_store()
    s.put(NS, T1, h("b"), kv("b"))
    path = Path(s.object_path(NS, T1, h("b")) or "")
    old = path.read_bytes()
    path.unlink()  # evicted ...
    s.put(NS, T1, h("b"), kv("b"))  # ... and written again: a newer generation
    assert path.read_bytes() != old
    path.write_bytes(old)  # the host puts the older copy back
    # This process wrote a newer one: the replay is seen (a miss, removed).
    assert s.get(NS, T1, h("b")) is None
    assert s.stats().replays == 1 and not path.exists()
    # A process without that memory (another replica, a restart) cannot see it:
    # it is an authentic seal of the same block, and serves the same bytes.
    path.write_bytes(old)
    fresh = make_store()
    assert fresh.get(NS, T1, h("b")) == kv("b")
    assert fresh.stats().replays == 0


def test_another_deployment_key_sees_only_misses(make_store: MakeStore, tmp_path: Path) -> None:
    mine = make_store()
    mine.put(NS, T1, h("b"), kv("b"))
    other = make_store(key=OTHER_KEY)
    assert other.key_id != mine.key_id
    assert other.get(NS, T1, h("b")) is None
    assert not other.contains(NS, T1, h("b"))
    other.put(NS, T1, h("b"), kv("theirs"))
    assert other.get(NS, T1, h("b")) == kv("theirs")
    assert mine.get(NS, T1, h("b")) == kv("b")
    assert mine.stats().integrity_failures == other.stats().integrity_failures == 0
    # Another key's record moved onto one of our names: named as such, removed.
    shutil.copyfile(other.object_path(NS, T1, h("b")) or "", mine.object_path(NS, T1, h("b")) or "")
    with pytest.raises(StoreIntegrityError, match="deployment key id"):
        mine.get(NS, T1, h("b"))


@pytest.mark.parametrize("attack", ["flip", "truncate", "swap-tenants", "garbage"])
def test_tampered_scope_marker(make_store: MakeStore, attack: str) -> None:
    s = make_store()
    s.put(NS, T1, h("b"), kv("b"))
    s.put(NS, T2, h("b"), kv("b2"))
    marker = Path(s.scope_path(NS, T1))
    if attack == "flip":
        _flip(marker, 70)
    elif attack == "truncate":
        marker.write_bytes(marker.read_bytes()[:50])
    elif attack == "swap-tenants":
        shutil.copyfile(s.scope_path(NS, T2), marker)
    else:
        marker.write_bytes(os.urandom(120))
    with pytest.raises(StoreIntegrityError):
        s.get(NS, T1, h("b"))
    assert not marker.exists()
    assert s.get(NS, T1, h("b")) is None, "the scope is gone: its blocks are misses"
    assert s.get(NS, T2, h("b")) == kv("b2")


def test_planted_shard_symlink_writes_nothing_outside(
    make_store: MakeStore, tmp_path: Path
) -> None:
    s = make_store(fanout=1)
    s.put(NS, T1, h("b"), kv("b"))
    shard = tmp_path / "store" / "00"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(shard)
    shard.symlink_to(elsewhere)
    with pytest.raises(StoreIntegrityError, match="not a directory"):
        s.put(NS, T1, h("c"), kv("c"))
    assert list(elsewhere.iterdir()) == []


# ---------------------------------------------------------------- tenant drops


def test_delete_tenant(make_store: MakeStore) -> None:
    s = make_store()
    for b in ("a", "b"):
        s.put(NS, T1, h(b), kv(b))
        s.put(NS, T2, h(b), kv(b))
        s.put(NS2, T1, h(b), kv(b))
    old_paths = [Path(s.object_path(NS, T1, h(b)) or "") for b in "ab"]
    s.delete_tenant(NS, T1)
    for b in "ab":
        assert s.get(NS, T1, h(b)) is None
        assert not s.contains(NS, T1, h(b))
        assert s.get(NS, T2, h(b)) == kv(b), "other tenants keep theirs"
        assert s.get(NS2, T1, h(b)) == kv(b), "the scope is per namespace"
    # The old objects are unreachable, not deleted: eviction reclaims them.
    assert all(p.exists() for p in old_paths)
    s.put(NS, T1, h("a"), kv("a"))
    new_path = Path(s.object_path(NS, T1, h("a")) or "")
    assert new_path not in old_paths
    # An old-epoch object copied onto the new epoch's name does not open.
    target = Path(s.object_path(NS, T1, h("b")) or "")
    target.parent.mkdir(exist_ok=True)
    shutil.copyfile(old_paths[1], target)
    with pytest.raises(RecordAuthenticationFailed):
        s.get(NS, T1, h("b"))
    assert s.stats().tenant_drops == 1


def test_a_drop_reaches_another_replica_and_it_cannot_undo_it(make_store: MakeStore) -> None:
    a, b = make_store(), make_store()  # two replicas, one directory, one key
    a.put(NS, T1, h("x"), kv("x"))
    assert b.get(NS, T1, h("x")) == kv("x"), "a replica reads what another stored"
    a.delete_tenant(NS, T1)
    assert b.get(NS, T1, h("x")) is None, "re-read marker: the old epoch is gone"
    b.put(NS, T1, h("x"), kv("x"))  # b writes under the new epoch, never the old one
    assert a.get(NS, T1, h("x")) == kv("x")
    assert b.stats().scope_rollbacks == 0


def test_a_drop_shows_on_a_replica_within_its_ttl(make_store: MakeStore) -> None:
    """With a long TTL a replica keeps its cached epoch: the documented window."""
    a, b = make_store(), make_store(scope_ttl_s=3600.0)
    a.put(NS, T1, h("x"), kv("x"))
    assert b.get(NS, T1, h("x")) == kv("x")
    a.delete_tenant(NS, T1)
    assert a.get(NS, T1, h("x")) is None
    assert b.get(NS, T1, h("x")) == kv("x"), "inside the window: served (same tenant)"


def test_rollback_of_a_dropped_tenants_marker(make_store: MakeStore) -> None:
    s = make_store()
    s.put(NS, T1, h("x"), kv("x"))
    marker, floor = Path(s.scope_path(NS, T1)), Path(s.floor_path(NS, T1))
    before_drop = marker.read_bytes()
    s.delete_tenant(NS, T1)
    marker.write_bytes(before_drop)  # the host restores the pre-drop marker
    # The floor the drop wrote refuses it, for a replica that starts now too.
    assert make_store().get(NS, T1, h("x")) is None
    assert s.get(NS, T1, h("x")) is None
    assert marker.read_bytes() != before_drop
    # The documented limit (docs/store.md, "Tenants, drops and erasure"): with
    # the floor deleted as well, a replica that knows nothing newer cannot
    # tell; it serves the tenant's pre-drop block, to that tenant, with the
    # right bytes. The dropping process never does: it rotates again, and
    # that new epoch reaches the late replica too.
    marker.write_bytes(before_drop)
    floor.unlink()
    late = make_store()
    assert late.get(NS, T1, h("x")) == kv("x")
    assert s.get(NS, T1, h("x")) is None
    # The first restore was answered by the replica that met it first (s then
    # adopted its newer epoch, which lists s's); the second by s.
    assert s.stats().scope_rollbacks == 1
    assert late.get(NS, T1, h("x")) is None, "the new rotation reaches the late replica too"


def test_concurrent_drops_converge_on_one_epoch(make_store: MakeStore) -> None:
    """Two replicas dropping at once can leave the marker of one and the floor
    of the other (their renames interleaved): whoever reads that rotates once
    more, and every replica then adopts that epoch (its lineage lists both)."""
    a, b = make_store(), make_store()
    a.put(NS, T1, h("x"), kv("x"))
    marker, floor = Path(a.scope_path(NS, T1)), Path(a.floor_path(NS, T1))
    read_by_both = marker.read_bytes(), floor.read_bytes()
    a.delete_tenant(NS, T1)
    floor_a = floor.read_bytes()
    marker.write_bytes(read_by_both[0])  # b read the same records as a did...
    floor.write_bytes(read_by_both[1])
    b.delete_tenant(NS, T1)
    floor.write_bytes(floor_a)  # ...and a's floor landed after b's marker
    assert b.get(NS, T1, h("x")) is None  # b meets the mismatch: one more rotation
    assert b.stats().scope_rollbacks == 1
    b.put(NS, T1, h("y"), kv("y"))
    c = make_store()
    for s in (a, b, c):
        assert s.get(NS, T1, h("y")) == kv("y"), "one epoch for every replica"
        assert s.get(NS, T1, h("x")) is None, "never the pre-drop block"
    assert a.stats().scope_rollbacks == 0 and c.stats().scope_rollbacks == 0


# ---------------------------------------------------------------- capacity


def test_eviction_keeps_the_bound_and_removes_the_least_recently_used(
    make_store: MakeStore, tmp_path: Path
) -> None:
    rec = record_bytes(BLOCK)  # 4176 bytes: two 4 KiB blocks on disk
    s = make_store(capacity_bytes=13 * 8192, max_object_bytes=BLOCK, fanout=1)
    for i in range(10):
        s.put(NS, T1, h(f"b{i}"), kv(f"b{i}"))
    # Distinct ages (the filesystem clock is coarse): b0 oldest ... b9 newest.
    for i in range(10):
        os.utime(s.object_path(NS, T1, h(f"b{i}")) or "", ns=(10**18 + i, 10**18 + i))
    assert s.get(NS, T1, h("b0")) == kv("b0")  # a hit makes b0 the newest
    for i in range(10, 14):
        s.put(NS, T1, h(f"b{i}"), kv(f"b{i}"))
    usage = s.usage()
    assert usage.total_bytes <= s.config.capacity_bytes
    # Room for the marker and the floor (a 4 KiB block each) and 12 objects:
    # 14 puts, 2 evictions.
    assert s.stats().evictions == 2
    present = {i for i in range(14) if s.contains(NS, T1, h(f"b{i}"))}
    assert present == {0, *range(3, 14)}, "b1 and b2 (the oldest) went, b0 (hit) stayed"
    assert usage.markers == 2 and rec <= 8192  # the marker and the floor


def test_markers_go_only_after_every_object_of_their_shard(make_store: MakeStore) -> None:
    s = make_store(capacity_bytes=10 * 8192, max_object_bytes=BLOCK, fanout=1)
    marker = Path(s.scope_path(NS, T1)) if s.put(NS, T1, h("first"), kv("first")) else None
    assert marker is not None
    os.utime(marker, ns=(1, 1))  # the oldest file in the shard by far
    for i in range(40):
        s.put(NS, T1, h(f"b{i}"), kv(f"b{i}"))
    assert marker.exists()
    assert s.get(NS, T1, h("b39")) == kv("b39")
    assert s.usage().total_bytes <= s.config.capacity_bytes


def test_capacity_and_layout_checks(make_store: MakeStore, tmp_path: Path) -> None:
    with pytest.raises(StoreLayoutError, match="less than one"):
        make_store(capacity_bytes=100 << 10, max_object_bytes=64 << 10, fanout=4)
    cfg = StoreConfig(str(tmp_path / "auto"), capacity_bytes=64 << 20, max_object_bytes=64 << 10)
    assert cfg.auto_fanout() == 64
    s = make_store(path=tmp_path / "fixed", fanout=4)
    assert s.fanout == 4
    with pytest.raises(StoreLayoutError, match="fanout 4, not 8"):
        make_store(path=tmp_path / "fixed", fanout=8)
    assert make_store(path=tmp_path / "fixed").fanout == 4, "None adopts the store's"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "kvseal-store").write_text("something else\n")
    with pytest.raises(StoreLayoutError, match="not a v1 layout"):
        make_store(path=tmp_path / "bad")
    for bad in ({"capacity_bytes": 0}, {"scope_ttl_s": -1.0}, {"max_scopes": 0}):
        with pytest.raises(StoreLayoutError):
            StoreConfig(str(tmp_path), **{"capacity_bytes": 1 << 20, "max_object_bytes": 1, **bad})  # type: ignore[arg-type]


def test_stale_temporary_files_are_swept_on_open(make_store: MakeStore, tmp_path: Path) -> None:
    s = make_store(fanout=2)
    s.put(NS, T1, h("b"), kv("b"))
    shard = Path(s.object_path(NS, T1, h("b")) or "").parent
    stale, live = shard / (TEMP_PREFIX + "0" * 16), shard / (TEMP_PREFIX + "1" * 16)
    stale.write_bytes(b"half a record")
    live.write_bytes(b"being written")
    os.utime(stale, ns=(10**9, 10**9))  # untouched since 1970: its writer is gone
    again = make_store(fanout=2)
    assert not stale.exists() and live.exists()
    assert again.get(NS, T1, h("b")) == kv("b")
    assert again.usage().temp_files == 1


def test_closed_store_refuses(make_store: MakeStore) -> None:
    s = make_store()
    s.put(NS, T1, h("b"), kv("b"))
    s.close()
    with pytest.raises(StoreError):
        s.get(NS, T1, h("b"))
    assert "key_id=" in repr(s) and KEY.hex() not in repr(s)


def test_the_local_key_source_serves_only_its_own_lifetime(tmp_path: Path) -> None:
    """``local`` (the default): a restart draws a new key and finds nothing."""
    cfg = StoreConfig(str(tmp_path / "s"), capacity_bytes=1 << 20, max_object_bytes=BLOCK)
    with FsStore(cfg, LocalKeySource().load()) as first:
        first.put(NS, T1, h("b"), kv("b"))
        assert first.get(NS, T1, h("b")) == kv("b")
    with FsStore(cfg, LocalKeySource().load()) as restarted:
        assert restarted.get(NS, T1, h("b")) is None
        assert restarted.stats().integrity_failures == 0


def test_reused_buffers_give_each_block_its_own_bytes(make_store: MakeStore) -> None:
    """Gets of records of several sizes on one thread (its record buffer is
    reused and grows), into a caller's buffer or a new one; a caller's buffer
    of another size is a miss that leaves it untouched; a tampered record read
    into a caller's buffer leaves nothing decrypted there. ``prefetch`` is
    advice: it changes no answer."""
    s = make_store()
    sizes = {"small": 100, "big": 60 << 10, "mid": BLOCK}
    for name, size in sizes.items():
        s.put(NS, T1, h(name), kv(name, size))
    s.prefetch(NS, T1, [h(n) for n in sizes] + [h("absent")])
    for _ in range(2):
        for name, size in sizes.items():
            assert s.get(NS, T1, h(name)) == kv(name, size)
            out = bytearray(size)
            assert s.get(NS, T1, h(name), out) is out and out == kv(name, size)
    wrong = bytearray(b"\x07" * 10)
    assert s.get(NS, T1, h("mid"), wrong) is None and wrong == b"\x07" * 10
    assert s.get(NS, T1, h("mid")) == kv("mid"), "a wrong-sized buffer leaves the record"
    # A tampered record is an integrity failure whatever the caller's size.
    small = s.object_path(NS, T1, h("small"))
    assert small is not None
    _flip(Path(small), -5)
    with pytest.raises(StoreIntegrityError):
        s.get(NS, T1, h("small"), bytearray(BLOCK))
    path = s.object_path(NS, T1, h("mid"))
    assert path is not None
    _flip(Path(path), -20)
    out = bytearray(b"\x05" * BLOCK)
    with pytest.raises(StoreIntegrityError):
        s.get(NS, T1, h("mid"), out)
    assert out == bytes(BLOCK), "wiped: no plaintext of a failed record"


@pytest.mark.parametrize("record", ["marker", "floor"])
@pytest.mark.parametrize("planted", ["fifo", "symlink"])
def test_planted_scope_record_is_refused_once_and_removed(
    make_store: MakeStore, record: str, planted: str
) -> None:
    """A marker or floor the host replaced with a FIFO or a symlink is refused
    (never opened beyond O_NONBLOCK, never followed) and removed like any failed
    record: the next lookup of the tenant does not meet it again."""
    s = make_store()
    s.put(NS, T1, h("b"), kv("b"))
    s.put(NS, T2, h("b"), kv("b2"))
    path = Path(s.scope_path(NS, T1) if record == "marker" else s.floor_path(NS, T1))
    target = path.parent / "elsewhere"
    target.write_bytes(b"not ours")
    path.unlink()
    if planted == "fifo":
        os.mkfifo(path, 0o600)
    else:
        path.symlink_to(target)
    with pytest.raises(NotARegularFile):
        s.get(NS, T1, h("b"))
    assert not path.exists() and not path.is_symlink(), "removed, not kept"
    assert target.read_bytes() == b"not ours", "a symlink's target is never touched"
    # Afterwards the tenant works again: no second integrity failure.
    s.get(NS, T1, h("b"))
    s.put(NS, T1, h("c"), kv("c"))
    assert s.get(NS, T1, h("c")) == kv("c")
    assert s.stats().integrity_failures == 1
    assert s.get(NS, T2, h("b")) == kv("b2")
