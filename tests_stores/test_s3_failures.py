"""An S3 server that is down, slow, or answering garbage costs misses
(``OSError``: the daemon's miss or skipped spill), within the URL's timeout,
and the store reconnects by itself once the server is back. The URL and the
credentials are checked before anything connects. Real servers on the
loopback: SeaweedFS, and plain sockets that never answer or answer nonsense.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvseal.server.store.errors import StoreLayoutError, StoreUnavailable
from kvseal.server.store.fsstore import FsStore, StoreConfig
from kvseal.server.store.keysource import DeploymentKey

from tests.conftest import until

from .conftest import BUCKET, new_weed
from .test_backends import KEY, NS, T1, get_or_none, h, kv

pytest.importorskip("boto3")
from kvseal.server.store.s3 import S3Location, open_s3


def store(url: str, **kw: object) -> FsStore:
    cfg: dict[str, object] = {"capacity_bytes": 4 << 20, "max_object_bytes": 64 << 10, **kw}
    return FsStore(
        StoreConfig(url, **cfg),  # type: ignore[arg-type]
        DeploymentKey(bytearray(KEY), "test"),
        open_s3(url),
    )


def test_a_server_that_goes_down_costs_misses_and_is_found_again(
    tmp_path: Path, credentials_file: Path
) -> None:
    weed = new_weed(tmp_path)
    weed.start()
    try:
        url = (
            f"s3://{BUCKET}/down/?endpoint={weed.endpoint}&credentials=file:{credentials_file}"
            "&timeout=1&retries=0&backoff=5"
        )
        s = store(url, scope_ttl_s=3600.0)
        try:
            s.put(NS, T1, h("b"), kv("b"))
            assert s.get(NS, T1, h("b")) == kv("b")
            weed.stop()
            with pytest.raises(OSError) as err:  # StoreUnavailable: the daemon's miss
                s.get(NS, T1, h("b"))
            assert isinstance(err.value, StoreUnavailable)
            # Within the backoff window the next calls fail without contacting it.
            with pytest.raises(StoreUnavailable, match="backing off"):
                s.put(NS, T1, h("c"), kv("c"))
            assert not _contains_or_error(s)
            weed.start()  # same data, same port
            until(lambda: get_or_none(s) == kv("b"), "reconnected by itself", 60)
            assert s.put(NS, T1, h("c"), kv("c")) and s.get(NS, T1, h("c")) == kv("c")
            assert s.stats().integrity_failures == 0
        finally:
            s.close()
    finally:
        weed.stop()


def _contains_or_error(s: FsStore) -> bool:
    try:
        return s.contains(NS, T1, h("b"))
    except OSError:
        return False


@pytest.fixture
def bad_server() -> Iterator[tuple[int, list[str]]]:
    """A loopback TCP server; ``mode[0]``: 'silent' (accepts, never answers)
    or 'garbage' (answers with bytes that are not HTTP)."""
    mode = ["silent"]
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    stop = threading.Event()
    held: list[socket.socket] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            held.append(conn)
            if mode[0] == "garbage":
                try:
                    conn.recv(65536)
                    conn.sendall(b"\x00\xffnot http at all\r\n\r\n" * 8)
                    conn.close()
                except OSError:
                    pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()[1], mode
    stop.set()
    t.join(5)
    for c in held:
        c.close()
    srv.close()


@pytest.mark.parametrize("behaviour", ["silent", "garbage", "refused"])
def test_a_server_that_is_slow_or_answers_garbage_fails_within_the_timeout(
    bad_server: tuple[int, list[str]], behaviour: str, credentials_file: Path
) -> None:
    port, mode = bad_server
    mode[0] = behaviour
    if behaviour == "refused":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # nothing listens there once closed
    url = (
        f"s3://{BUCKET}/x/?endpoint=http://127.0.0.1:{port}&credentials=file:{credentials_file}"
        "&timeout=0.5&retries=0"
    )
    done = threading.Event()
    raised: list[BaseException] = []

    def opening() -> None:
        try:
            store(url).close()
        except BaseException as e:
            raised.append(e)
        done.set()

    threading.Thread(target=opening, daemon=True).start()
    # Generous against a loaded machine; the point is "returns", not a speed.
    assert done.wait(60), "a silent server stalled the caller"
    assert len(raised) == 1 and isinstance(raised[0], StoreUnavailable), raised
    assert "kvsealtest" not in str(raised[0])


def test_the_url_is_checked_and_never_carries_credentials(credentials_file: Path) -> None:
    loc = S3Location.parse("s3://my-bucket/a/b?endpoint=http://127.0.0.1:9&region=eu-west-1")
    assert (loc.bucket, loc.prefix, loc.endpoint, loc.region) == (
        "my-bucket", "a/b/", "http://127.0.0.1:9", "eu-west-1"
    )  # fmt: skip
    assert loc.credentials == "env" and S3Location.parse("s3://my-bucket").prefix == ""
    for bad, why in [
        ("s3://AKIAXXXX:S3CR3TVALUE@my-bucket/p", "credentials never go"),
        ("s3://my-bucket/p?endpoint=http://u:S3CR3TVALUE@127.0.0.1:9", "no userinfo"),
        ("s3://my-bucket/p?endpoint=http://127.0.0.1:9/t/S3CR3TVALUE", "no userinfo, path"),
        ("s3://my-bucket/p?endpoint=http%3A%2F%2F127.0.0.1%3A9%2F%3Ft%3DS3CR3TVALUE", "or query"),
        ("s3://my-bucket/p?secret_key=S3CR3TVALUE", "unknown S3 store parameter"),
        ("s3://my-bucket/../p", "'..'"),
        ("s3://My_Bucket/p", "not a valid bucket"),
        ("s3://my-bucket/p?timeout=0", "timeout"),
        ("s3://my-bucket/p?retries=9", "retries"),
        ("s3://my-bucket/p?backoff=-1", "backoff"),
        ("s3://my-bucket/p?credentials=AKIAXXXX", "credentials= must be"),
    ]:
        with pytest.raises(StoreLayoutError, match=why) as err:
            S3Location.parse(bad)
        assert "S3CR3TVALUE" not in str(err.value) and "AKIA" not in str(err.value)
    credentials_file.chmod(0o644)
    with pytest.raises(StoreLayoutError, match="others may access"):
        store(f"s3://{BUCKET}/p?endpoint=http://127.0.0.1:9&credentials=file:{credentials_file}")


def test_wrong_credentials_cost_misses_not_a_crash(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    weed = request.getfixturevalue("weed")
    bad = tmp_path / "bad-credentials"
    bad.write_text("nobody\nwrong-secret\n")
    bad.chmod(0o600)
    url = f"s3://{BUCKET}/wrong/?endpoint={weed.endpoint}&credentials=file:{bad}&retries=0"
    with pytest.raises(StoreUnavailable) as err:  # refused (403): the daemon's exit 2 at start
        store(url)
    assert "wrong-secret" not in str(err.value)


def test_the_store_flag() -> None:
    from kvseal.server.daemon.cli import config_from_args

    assert config_from_args(["--store", "dir:///srv/kv"]).store_dir == "/srv/kv"
    cfg = config_from_args(["--store", f"s3://{BUCKET}/p?endpoint=http://127.0.0.1:9"])
    assert cfg.store_dir is None and cfg.store_url is not None
    for bad in (
        ["--store", "dir://relative"],
        ["--store", "ftp://x/y"],
        ["--store", "dir:///a", "--store-dir", "/b"],
    ):
        with pytest.raises(ValueError):
            config_from_args(bad)


def test_a_daemon_with_a_bad_store_url_says_why_in_one_line_and_exits_2(tmp_path: Path) -> None:
    import subprocess
    import sys

    r = subprocess.run(
        [
            sys.executable, "-m", "kvseal.server", "--backend", "cpu",
            "--listen", f"unix://{tmp_path / 's.sock'}",
            "--store", f"s3://AKIAXXXX:S3CR3TVALUE@{BUCKET}/p",
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "credentials never go in the store URL" in r.stderr
    assert "S3CR3TVALUE" not in r.stderr + r.stdout
