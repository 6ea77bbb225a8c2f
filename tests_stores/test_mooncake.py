"""What is Mooncake's own in the Mooncake Store backend, against a real
``mooncake_master`` in netns.sh's private network namespace: its eviction
keeps the store within the memory the clients mount; a record removed right
after it was read (its lease still running) is removed; a master that is
down, stopped or answering garbage costs misses (``OSError``), the next calls
fail at once for the back-off, and the backend finds a restarted master by
itself. The URL is checked before anything connects. The guarantees every
backend shares (tampering, replay, drops) are test_backends.py's.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvseal.server.store.errors import StoreLayoutError, StoreUnavailable
from kvseal.server.store.fsstore import FsStore, StoreConfig
from kvseal.server.store.keysource import DeploymentKey
from kvseal.server.store.mooncake import MooncakeBackend, MooncakeLocation, open_mooncake

from tests.conftest import until

from .conftest import MC_MASTER_IP, Master, MooncakeHost, need_mooncake, new_master
from .test_backends import KEY, NS, T1, get_or_none, h, kv

GOOD = "mooncake://10.199.0.1:50051?local=10.199.0.2"


def store(url: str, **kw: object) -> FsStore:
    cfg: dict[str, object] = {"capacity_bytes": 64 << 20, "max_object_bytes": 256 << 10, **kw}
    return FsStore(
        StoreConfig(url, **cfg),  # type: ignore[arg-type]
        DeploymentKey(bytearray(KEY), "test"),
        open_mooncake(url),
    )


# ---------------------------------------------------------------- the URL (no master needed)


def test_the_url_is_checked_before_anything_connects() -> None:
    loc = MooncakeLocation.parse(
        GOOD + "&metadata=http://10.199.0.1:50052/metadata&segment=64MiB&timeout=0.5"
    )
    assert (loc.master, loc.local, loc.segment_bytes, loc.timeout_s) == (
        "10.199.0.1:50051", "10.199.0.2", 64 << 20, 0.5,
    )  # fmt: skip
    assert loc.metadata == "http://10.199.0.1:50052/metadata" and loc.prefix == "kvseal/"
    assert MooncakeLocation.parse(GOOD).metadata == "P2PHANDSHAKE"
    for bad, why in [
        ("mooncake://10.199.0.1?local=10.199.0.2", "HOST:PORT"),
        ("mooncake://10.199.0.1:99999?local=10.199.0.2", "HOST:PORT"),
        ("mooncake://10.199.0.1:50051", "local= is required"),
        ("mooncake://10.199.0.1:50051?local=", "local= is required"),
        ("mooncake://u:p@10.199.0.1:50051?local=10.199.0.2", "no user or password"),
        ("mooncake://10.199.0.1:50051/path?local=10.199.0.2", "no path"),
        (GOOD + "&colour=blue", "unknown Mooncake store parameter"),
        (GOOD + "&local=10.199.0.3", "given once"),
        (GOOD + "&metadata=etcd://x:1", "metadata="),
        (GOOD + "&protocol=udp", "protocol="),
        (GOOD + "&segment=lots", "sizes"),
        (GOOD + "&timeout=nan", "timeout="),
        (GOOD + "&backoff=-1", "backoff="),
        (GOOD + "&buffer=4096", "buffer="),
        (GOOD + "&prefix=../x", "prefix="),
        ("s3://bucket/p", "mooncake://"),
    ]:
        with pytest.raises(StoreLayoutError, match=why):
            open_mooncake(bad)


def test_the_store_flag_and_a_shared_store_is_remote_by_default() -> None:
    from kvseal.server.daemon.cli import config_from_args

    cfg = config_from_args(["--store", GOOD])
    assert cfg.store_url == GOOD and cfg.store_dir is None
    assert cfg.store_locality == "remote", "every replica's store: remote to each (llm-d)"
    s3 = config_from_args(["--store", "s3://kvseal-test/p?endpoint=http://127.0.0.1:9"])
    assert s3.store_locality == "remote"
    assert config_from_args(["--store", "dir:///srv/kv"]).store_locality == "local"
    assert config_from_args(["--store-dir", "/srv/kv"]).store_locality == "local"
    explicit = config_from_args(["--store", GOOD, "--store-locality", "local"])
    assert explicit.store_locality == "local", "the flag still wins"
    with pytest.raises(ValueError, match="mooncake://"):
        config_from_args(["--store", "redis://x:1"])


# ---------------------------------------------------------------- against a real master


@pytest.fixture
def own_master(tmp_path: Path) -> Iterator[Master]:
    """A master of this test's own (it is stopped and restarted)."""
    m = new_master(tmp_path, 50061)
    m.lease_ms = 5000  # a lease that outlives the test's next call
    m.start()
    yield m
    m.stop()


def test_a_record_removed_right_after_it_was_read_is_removed(own_master: Master) -> None:
    prefix = f"l-{secrets.token_hex(4)}/"
    backend = MooncakeBackend(MooncakeLocation.parse(own_master.url(prefix)), fanout=1)
    host = MooncakeHost(own_master, prefix)
    try:
        name = "cd" * 32
        assert backend.publish(name, b"sealed bytes", replace=True)
        got = backend.read(name, 1 << 10)
        assert got is not None and bytes(got[0]) == b"sealed bytes"
        other = "ef" * 32
        backend.publish(other, b"x", replace=True)
        assert host.get(other) == b"x"
        assert host.client.remove(prefix + other) == -706, "the premise: a read leases it"
        assert backend.remove(name, got[1]) is True, "removed despite the reader's lease"
        assert host.get(name) is None and backend.read(name, 1 << 10) is None
        assert backend.read(other, 0) is None, "larger than max_bytes: a miss ..."
        assert host.get(other) == b"x", "... left in place"
    finally:
        host.close()
        backend.close()


def test_capacity_is_the_mounted_memory(mooncake_master: Master) -> None:
    prefix = f"c-{secrets.token_hex(4)}/"
    # One 16 MiB segment (the URL's), nobody else's: ~64 records of 256 KiB fit.
    s = store(mooncake_master.url(prefix))
    try:
        block = 200 << 10
        stored = 0
        for i in range(160):
            try:
                stored += bool(s.put(NS, T1, h(f"b{i}"), kv(f"b{i}", block)))
            except OSError:
                pass  # the master could not place it yet: a skipped spill
        held = [k for k in mooncake_master.held_keys() if k.startswith(prefix)]
        assert stored > 64, "puts kept succeeding: the master evicted to make room"
        assert len(held) * block <= 16 << 20, "never more than the mounted memory"
        assert len(held) < stored

        def stored_last() -> bool:  # the master evicts in the background: room comes
            try:
                s.put(NS, T1, h("last"), kv("last", block))
            except OSError:
                return False
            return s.get(NS, T1, h("last")) == kv("last", block)

        until(stored_last, "a put finds room again", 60)
        assert s.stats().integrity_failures == 0
    finally:
        s.close()


def _garbage_server(port: int, stop: threading.Event) -> threading.Thread:
    """Answers every connection on the master's port with bytes that are not
    Mooncake's protocol."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((MC_MASTER_IP, port))
    srv.listen(16)
    srv.settimeout(0.2)

    def serve() -> None:
        with srv:
            while not stop.is_set():
                try:
                    conn, _ = srv.accept()
                except OSError:
                    continue
                with conn:
                    try:
                        conn.recv(65536)
                        conn.sendall(os.urandom(512))
                    except OSError:
                        pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


def test_a_master_down_stopped_or_answering_garbage_costs_misses(own_master: Master) -> None:
    s = store(own_master.url("down/", timeout="0.5", backoff="3"), scope_ttl_s=3600.0)
    try:
        s.put(NS, T1, h("b"), kv("b"))
        assert s.get(NS, T1, h("b")) == kv("b")

        assert own_master.proc is not None
        own_master.proc.send_signal(signal.SIGSTOP)  # accepts, never answers
        try:
            with pytest.raises(StoreUnavailable, match="no answer in time"):
                s.get(NS, T1, h("b"))
            with pytest.raises(StoreUnavailable, match="backing off"):
                s.contains(NS, T1, h("b"))  # not one more wait on the master
        finally:
            own_master.proc.send_signal(signal.SIGCONT)
        until(lambda: get_or_none(s) == kv("b"), "answers again once resumed", 60)

        own_master.stop()  # down: refused
        until(lambda: get_or_none(s) is None, "a miss", 60)
        with pytest.raises(OSError):
            s.put(NS, T1, h("c"), kv("c"))

        stop = threading.Event()
        garbage = _garbage_server(own_master.port, stop)
        try:
            for _ in range(3):
                assert get_or_none(s) is None  # never a stall, never a crash
        finally:
            stop.set()
            garbage.join(10)

        own_master.start()  # a new master: the old one's objects are gone
        until(lambda: _put_and_get(s) == kv("c"), "the backend finds the new master by itself", 90)
        assert s.stats().integrity_failures == 0
    finally:
        s.close()


def _put_and_get(s: FsStore) -> bytes | None:
    try:
        s.put(NS, T1, h("c"), kv("c"))
        got = s.get(NS, T1, h("c"))
    except OSError:
        return None
    return None if got is None else bytes(got)


def test_a_master_that_is_not_there_fails_the_open(tmp_path: Path) -> None:
    need_mooncake()
    url = f"mooncake://{MC_MASTER_IP}:50071?local={MC_MASTER_IP.rsplit('.', 1)[0]}.2&timeout=0.5"
    with pytest.raises(StoreUnavailable):
        store(url)


def test_a_daemon_with_a_malformed_mooncake_url_says_why_in_one_line_and_exits_2(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable, "-m", "kvseal.server", "--backend", "cpu",
            "--listen", f"unix://{tmp_path / 's.sock'}",
            "--store", "mooncake://10.199.0.1:50051?metadata=P2PHANDSHAKE",
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if "kvseal-server" in line]
    assert len(lines) == 1 and "local= is required" in lines[0], r.stderr
