"""The store's guarantees on every backend: the same attacks as
tests/test_store_fs.py (tamper, truncate, swap, replay, another key, a dropped
tenant's markers restored or hidden), run through FsStore's own API on a
directory, on a real S3 server (SeaweedFS on the loopback) and on a real
Mooncake Store master (in netns.sh's private network namespace). The host's
moves go through :class:`Host`: files for the directory, the host's own
boto3 client for S3, its own Mooncake client. Real AES-GCM, real S3 requests, no mocks.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest
from kvseal.server.store.errors import (
    RecordAuthenticationFailed,
    StoreIntegrityError,
)
from kvseal.server.store.fsio import StoreDir
from kvseal.server.store.fsstore import FsStore, StoreConfig
from kvseal.server.store.keysource import DeploymentKey
from kvseal.server.store.record import record_bytes

from .conftest import BUCKET, Master, MooncakeHost, Weed, s3_client

KEY = bytes(range(7, 39))
OTHER_KEY = bytes(range(50, 82))
BLOCK = 4096


def h(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


NS, NS2 = h("model-a"), h("model-b")
T1, T2 = h("tenant-1"), h("tenant-2")


def kv(label: str, size: int = BLOCK) -> bytes:
    seed = hashlib.sha256(label.encode()).digest()
    return (seed * (size // 32 + 1))[:size]


class Host(Protocol):
    """What the host can do to the stored records (it holds the storage)."""

    def get(self, name: str) -> bytes | None: ...
    def put(self, name: str, data: bytes) -> None: ...
    def delete(self, name: str) -> None: ...
    def records(self) -> dict[str, bytes]: ...  # every record by its key


class DirHost:
    def __init__(self, root: Path, fanout: Callable[[], int]) -> None:
        self.root, self.fanout = root, fanout

    def _path(self, name: str) -> Path:
        return self.root / f"{int(name[:2], 16) % self.fanout():02x}" / name

    def get(self, name: str) -> bytes | None:
        p = self._path(name)
        return p.read_bytes() if p.exists() else None

    def put(self, name: str, data: bytes) -> None:
        p = self._path(name)
        p.parent.mkdir(exist_ok=True)
        tmp = p.with_name(p.name + ".host")
        tmp.write_bytes(data)
        tmp.replace(p)  # a new inode, as a publish makes

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)

    def records(self) -> dict[str, bytes]:
        return {
            str(p.relative_to(self.root)): p.read_bytes()
            for p in self.root.rglob("*") if p.is_file() and p.name != "kvseal-store"
        }  # fmt: skip


class S3Host:
    def __init__(self, client: Any, prefix: str, fanout: Callable[[], int]) -> None:
        self.client, self.prefix, self.fanout = client, prefix, fanout

    def _key(self, name: str) -> str:
        return f"{self.prefix}{int(name[:2], 16) % self.fanout():02x}/{name}"

    def get(self, name: str) -> bytes | None:
        try:
            return bytes(self.client.get_object(Bucket=BUCKET, Key=self._key(name))["Body"].read())
        except self.client.exceptions.NoSuchKey:
            return None

    def put(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=BUCKET, Key=self._key(name), Body=data)

    def delete(self, name: str) -> None:
        self.client.delete_object(Bucket=BUCKET, Key=self._key(name))

    def records(self) -> dict[str, bytes]:
        out = {}
        page = self.client.list_objects_v2(Bucket=BUCKET, Prefix=self.prefix)
        for obj in page.get("Contents", ()):
            if not obj["Key"].endswith("kvseal-store"):
                body = self.client.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read()
                out[obj["Key"]] = bytes(body)
        return out


MakeStore = Callable[..., FsStore]


@pytest.fixture(params=["dir", "s3", "mooncake"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return str(request.param)


@pytest.fixture
def env(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest, credentials_file: Path
) -> Iterator[tuple[MakeStore, Host]]:
    """A store factory (every store it makes shares one storage: replicas)
    and the host's hands on that storage."""
    stores: list[FsStore] = []
    fanout = [1]
    if backend == "dir":
        root = tmp_path / "store"
        host: Host = DirHost(root, lambda: fanout[0])
        opener = None
        location = str(root)
    elif backend == "mooncake":
        master: Master = request.getfixturevalue("mooncake_master")
        prefix = f"t-{secrets.token_hex(6)}/"
        location = master.url(prefix)
        from kvseal.server.store.mooncake import open_mooncake

        opener = open_mooncake(location)
        host = MooncakeHost(master, prefix)
    else:
        weed: Weed = request.getfixturevalue("weed")
        prefix = f"t-{secrets.token_hex(6)}/"
        location = (
            f"s3://{BUCKET}/{prefix}?endpoint={weed.endpoint}&credentials=file:{credentials_file}"
        )
        from kvseal.server.store.s3 import open_s3

        opener = open_s3(location)
        host = S3Host(s3_client(weed.endpoint), prefix, lambda: fanout[0])

    def make(key: bytes = KEY, **kw: object) -> FsStore:
        cfg: dict[str, object] = {
            "capacity_bytes": 4 << 20,
            "max_object_bytes": 64 << 10,
            "scope_ttl_s": 0.0,
            "fanout": 4,
            **kw,
        }
        s = FsStore(
            StoreConfig(location, **cfg),  # type: ignore[arg-type]
            DeploymentKey(bytearray(key), "test"),
            opener,
        )
        fanout[0] = s.fanout
        stores.append(s)
        return s

    yield make, host
    for s in stores:
        s.close()
    if isinstance(host, MooncakeHost):
        host.close()


Env = tuple[MakeStore, Host]


def _name(s: FsStore, *ident: bytes) -> str:
    name = s.name_of(*ident)  # type: ignore[arg-type]
    assert name is not None
    return name


# ---------------------------------------------------------------- contract


def test_put_get_and_names_that_reveal_nothing(env: Env) -> None:
    make, host = env
    s = make()
    assert s.get(NS, T1, h("b0")) is None
    blocks = {f"b{i}": kv(f"b{i}") for i in range(6)}
    for label, data in blocks.items():
        assert s.put(NS, T1, h(label), data)
        s.put(NS, T2, h(label), data)
    assert s.put(NS, T1, h("b0"), kv("b0")) is False, "present: not rewritten"
    for label, data in blocks.items():
        assert s.get(NS, T1, h(label)) == data and s.contains(NS, T1, h(label))
    records = host.records()
    assert len(records) == 12 + 4  # objects + a marker and a floor per tenant
    revealing = [x.hex()[:16] for x in (NS, T1, T2, *(h(n) for n in blocks))]
    for key, body in records.items():
        assert not any(r in key for r in revealing)
        assert not any(data[:64] in body for data in blocks.values()), "ciphertext only"
    a, b = host.get(_name(s, NS, T1, h("b0"))), host.get(_name(s, NS, T2, h("b0")))
    assert a and b and a[64:] != b[64:]
    u = s.usage()
    assert (u.objects, u.markers) == (12, 4)


ATTACKS: dict[str, Callable[[bytes], bytes]] = {
    "flip-body": lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:],
    "flip-header": lambda b: b[:20] + bytes([b[20] ^ 0x80]) + b[21:],
    "truncate": lambda b: b[:-17],
    "extend": lambda b: b + b"\0" * 16,
    "zero": lambda b: bytes(len(b)),
    "garbage": lambda b: os.urandom(len(b)),
    "empty": lambda b: b"",
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_tampered_object_is_never_served_and_is_removed(env: Env, attack: str) -> None:
    make, host = env
    s = make()
    s.put(NS, T1, h("victim"), kv("victim"))
    s.put(NS, T1, h("bystander"), kv("bystander"))
    name = _name(s, NS, T1, h("victim"))
    original = host.get(name)
    assert original is not None
    host.put(name, ATTACKS[attack](original))
    with pytest.raises(StoreIntegrityError):
        s.get(NS, T1, h("victim"))
    assert s.stats().integrity_failures == 1
    assert host.get(name) is None, "removed, not kept"
    assert s.get(NS, T1, h("victim")) is None, "afterwards: a miss"
    assert s.get(NS, T1, h("bystander")) == kv("bystander")


@pytest.mark.parametrize(
    "moved_to",
    [(NS, T1, h("other-block")), (NS, T2, h("victim")), (NS2, T1, h("victim"))],
    ids=["another-block", "another-tenant", "another-namespace"],
)
def test_object_swapped_onto_another_name_fails(
    env: Env, moved_to: tuple[bytes, bytes, bytes]
) -> None:
    make, host = env
    s = make()
    s.put(NS, T1, h("victim"), kv("victim"))
    s.put(*moved_to, kv("the right bytes"))
    victim = host.get(_name(s, NS, T1, h("victim")))
    assert victim is not None
    host.put(_name(s, *moved_to), victim)
    with pytest.raises(RecordAuthenticationFailed):
        s.get(*moved_to)
    assert s.get(NS, T1, h("victim")) == kv("victim")


def test_replay_of_an_older_object_of_the_same_block(env: Env) -> None:
    make, host = env
    s = make()
    s.put(NS, T1, h("b"), kv("b"))
    name = _name(s, NS, T1, h("b"))
    old = host.get(name)
    assert old is not None
    host.delete(name)  # evicted ...
    s.put(NS, T1, h("b"), kv("b"))  # ... and written again: a newer generation
    assert host.get(name) != old
    host.put(name, old)  # the host puts the older copy back
    assert s.get(NS, T1, h("b")) is None, "the writer sees the replay: a miss"
    assert s.stats().replays == 1 and host.get(name) is None
    # The documented limit: a process without that memory serves the same bytes.
    host.put(name, old)
    assert make().get(NS, T1, h("b")) == kv("b")


def test_another_deployment_key_sees_only_misses(env: Env) -> None:
    make, host = env
    mine, other = make(), make(key=OTHER_KEY)
    mine.put(NS, T1, h("b"), kv("b"))
    assert other.get(NS, T1, h("b")) is None and not other.contains(NS, T1, h("b"))
    other.put(NS, T1, h("b"), kv("theirs"))
    theirs = host.get(_name(other, NS, T1, h("b")))
    assert theirs is not None
    host.put(_name(mine, NS, T1, h("b")), theirs)
    with pytest.raises(StoreIntegrityError, match="deployment key id"):
        mine.get(NS, T1, h("b"))


@pytest.mark.parametrize("attack", ["flip", "truncate", "swap-tenants", "garbage"])
def test_tampered_scope_marker(env: Env, attack: str) -> None:
    make, host = env
    s = make()
    s.put(NS, T1, h("b"), kv("b"))
    s.put(NS, T2, h("b"), kv("b2"))
    marker = s.marker_name(NS, T1)
    body = host.get(marker)
    assert body is not None
    if attack == "flip":
        host.put(marker, body[:70] + bytes([body[70] ^ 1]) + body[71:])
    elif attack == "truncate":
        host.put(marker, body[:50])
    elif attack == "swap-tenants":
        host.put(marker, host.get(s.marker_name(NS, T2)) or b"")
    else:
        host.put(marker, os.urandom(len(body)))
    with pytest.raises(StoreIntegrityError):
        s.get(NS, T1, h("b"))
    assert host.get(marker) is None
    assert s.get(NS, T1, h("b")) is None, "the scope is gone: its blocks are misses"
    assert s.get(NS, T2, h("b")) == kv("b2")


# ---------------------------------------------------------------- tenant drops


def test_a_drop_cannot_be_undone_by_restoring_old_objects(env: Env) -> None:
    make, host = env
    s = make()
    for b in "ab":
        s.put(NS, T1, h(b), kv(b))
        s.put(NS, T2, h(b), kv(b))
    old = {b: (_name(s, NS, T1, h(b)), host.get(_name(s, NS, T1, h(b)))) for b in "ab"}
    s.delete_tenant(NS, T1)
    for b in "ab":
        assert s.get(NS, T1, h(b)) is None
        assert s.get(NS, T2, h(b)) == kv(b), "other tenants keep theirs"
    s.put(NS, T1, h("a"), kv("a"))
    assert _name(s, NS, T1, h("a")) != old["a"][0], "a new epoch: new names"
    host.put(_name(s, NS, T1, h("b")), old["b"][1] or b"")  # old object on the new name
    with pytest.raises(RecordAuthenticationFailed):
        s.get(NS, T1, h("b"))


def test_a_drop_reaches_a_replica_and_restored_markers_do_not_undo_it(env: Env) -> None:
    make, host = env
    a, b = make(), make()  # two replicas, one storage, one key
    a.put(NS, T1, h("x"), kv("x"))
    assert b.get(NS, T1, h("x")) == kv("x"), "a replica reads what another stored"
    marker, floor = a.marker_name(NS, T1), a.floor_name(NS, T1)
    before = host.get(marker), host.get(floor)
    a.delete_tenant(NS, T1)
    assert b.get(NS, T1, h("x")) is None, "the drop reaches the replica"
    host.put(marker, before[0] or b"")  # the host restores the pre-drop marker
    assert make().get(NS, T1, h("x")) is None, "a new replica: the floor refuses it"
    assert a.get(NS, T1, h("x")) is None and b.get(NS, T1, h("x")) is None
    host.delete(marker)  # hiding the current marker instead
    assert a.get(NS, T1, h("x")) is None and make().get(NS, T1, h("x")) is None
    # Marker and floor both restored: the dropping process never serves it
    # (its memory), whatever a replica that knows nothing newer does
    # (docs/store.md, "Tenants, drops and erasure").
    host.put(marker, before[0] or b"")
    host.put(floor, before[1] or b"")
    assert a.get(NS, T1, h("x")) is None
    assert a.stats().scope_rollbacks >= 1


def test_create_only_publish_has_one_winner(env: Env) -> None:
    """Scope markers are created first-writer-wins: on S3 that is a
    conditional PUT (If-None-Match: *), which the server must refuse."""
    make, host = env
    s = make()
    backend = s._dir  # the store's backend, as FsStore and ScopeTable use it
    name = "ab" * 32 + ".scope"
    assert backend.publish(name, b"first", replace=False) is True
    assert backend.publish(name, b"second", replace=False) is False
    assert host.get(name) == b"first"
    assert backend.publish(name, b"third", replace=True) is True
    assert host.get(name) == b"third"


def test_a_bad_record_is_removed_not_a_good_one_published_since(env: Env) -> None:
    make, host = env
    s = make()
    s.put(NS, T1, h("b"), kv("b"))
    name = _name(s, NS, T1, h("b"))
    backend = s._dir
    got = backend.read(name, 1 << 20)
    assert got is not None
    _, ident = got
    host.put(name, b"published since")  # another version at the same name
    assert backend.remove(name, ident) is False
    assert host.get(name) == b"published since"
    assert backend.remove(name) is True and host.get(name) is None


# ---------------------------------------------------------------- capacity


def test_eviction_keeps_the_bound(env: Env, backend: str) -> None:
    if backend == "mooncake":
        pytest.skip("Mooncake's master evicts: tests_stores/test_mooncake.py")
    make, _ = env
    rec = record_bytes(BLOCK)
    cap = 12 * 8192  # room for the marker, the floor and about ten records
    s = make(capacity_bytes=cap, max_object_bytes=BLOCK, fanout=1)
    for i in range(24):
        s.put(NS, T1, h(f"b{i}"), kv(f"b{i}"))
    u = s.usage()
    assert u.total_bytes <= cap
    assert s.stats().evictions > 0 and u.objects < 24
    assert u.markers == 2, "scope records go last"
    assert s.get(NS, T1, h("b23")) == kv("b23"), "the newest stays"
    assert rec <= 8192


def test_a_store_too_small_or_of_another_fanout_is_refused(env: Env) -> None:
    make, _ = env
    from kvseal.server.store.errors import StoreLayoutError

    make(fanout=4)
    with pytest.raises(StoreLayoutError, match="fanout 4, not 8"):
        make(fanout=8)
    assert make(fanout=None).fanout == 4, "None adopts the store's"


def test_the_directory_backend_is_the_default(tmp_path: Path) -> None:
    s = FsStore(
        StoreConfig(str(tmp_path / "d"), capacity_bytes=1 << 20, max_object_bytes=BLOCK),
        DeploymentKey(bytearray(KEY), "test"),
    )
    try:
        assert isinstance(s._dir, StoreDir)
    finally:
        s.close()


def get_or_none(s: FsStore) -> bytes | None:
    """Block ``b`` of T1 as the store serves it now; None when it answers a
    miss or fails (a server down or answering garbage: the failure-mode tests
    poll this until the store has reconnected by itself)."""
    try:
        got = s.get(NS, T1, h("b"))
    except OSError:
        return None
    return None if got is None else bytes(got)
