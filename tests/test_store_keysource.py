"""Deployment key sources of the store tier: local, file:, cdh: (against a real
local HTTP server that speaks the confidential-data-hub's resource endpoint;
the CDH and a Trustee KBS do not install here).

Every error is checked to carry no key bytes, in any spelling.
"""

from __future__ import annotations

import base64
import http.server
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kvseal.server.store.errors import KeySourceError
from kvseal.server.store.keysource import (
    CdhKeySource,
    DeploymentKey,
    FileKeySource,
    LocalKeySource,
    decode_key_material,
    parse_key_source,
)

from .store_helpers import store_flags

KEY = bytes(range(1, 33))
# A key whose URL-safe base64 has both '-' and '_' (drawn once from os.urandom).
URL_KEY = bytes.fromhex("345af1ad9bbe93a4612104c6ab0fbf1e76232d40aa8276cbec7817b6641b7008")


def spellings(key: bytes) -> list[str]:
    """Every way a key could leak into a message."""
    return [
        key.hex(),
        key.hex().upper(),
        base64.b64encode(key).decode(),
        base64.urlsafe_b64encode(key).decode(),
        repr(key),
        key.decode("latin-1"),
    ]


def assert_no_key(text: str, key: bytes = KEY) -> None:
    for s in spellings(key):
        assert s not in text


def key_bytes(k: DeploymentKey) -> bytes:
    return bytes(k.view())


# ---------------------------------------------------------------- decoding


@pytest.mark.parametrize(
    "raw",
    [
        KEY,
        KEY.hex().encode(),
        KEY.hex().upper().encode() + b"\n",
        b"  " + KEY.hex().encode() + b"\r\n",
        base64.b64encode(KEY),
        base64.b64encode(KEY) + b"\n",
        base64.b64encode(KEY).rstrip(b"="),
        base64.urlsafe_b64encode(URL_KEY),
    ],
    ids=["raw", "hex", "HEX-newline", "hex-spaces", "b64", "b64-newline", "b64-nopad", "b64url"],
)
def test_accepted_spellings(raw: bytes) -> None:
    out = decode_key_material(bytearray(raw), "test")
    expected = URL_KEY if b"-" in raw or b"_" in raw else KEY
    assert bytes(out) == expected


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        KEY[:31],
        KEY + b"\n",  # 33 bytes: not raw, and not text
        KEY.hex().encode()[:-1],
        KEY.hex().encode() + b"0",
        b"zz" + KEY.hex().encode()[2:],
        base64.b64encode(KEY)[:-2] + b"!=",
        base64.b64encode(KEY + b"x"),
        # 43 characters whose last two bits are not zero: a second spelling of a key
        base64.b64encode(KEY).rstrip(b"=")[:-1] + b"B",
        bytes(32),  # all-zero placeholder
        b"0" * 64,
    ],
    ids=[
        "empty",
        "31-raw",
        "33-raw",
        "63-hex",
        "65-hex",
        "bad-hex",
        "bad-b64",
        "b64-of-33",
        "b64-noncanonical",
        "zero-raw",
        "zero-hex",
    ],
)
def test_refused_spellings_say_lengths_only(raw: bytes) -> None:
    with pytest.raises(KeySourceError) as e:
        decode_key_material(bytearray(raw), "test source")
    assert "test source" in str(e.value)
    if len(raw) >= 16:
        assert raw.decode("latin-1").strip() not in str(e.value)
    assert_no_key(str(e.value))


# Keys that are obviously not random, each in the spelling it would arrive in
# (the rule applies to the decoded 32 bytes): the three placeholders as
# raw 32-byte files, text that arrives hex- or base64-encoded, a repeated byte
# or short block, a 16-byte key doubled.
PLACEHOLDERS = {
    "zeros-text": (b"0" * 32, "printable text"),
    "changeme": (b"changeme" * 4, "printable text"),
    "x": (b"x" * 32, "printable text"),
    "passphrase-newline": (b"correct horse battery staple 12\n", "printable text"),
    "text-as-hex": ((b"changeme" * 4).hex().encode(), "printable text"),
    "text-as-b64": (base64.b64encode(b"x" * 32), "printable text"),
    "byte-repeated": (bytes([0x01]) * 32, "fewer than 16 distinct"),
    "short-block-hex": ((bytes([0xDE, 0xAD, 0xBE, 0xEF]) * 8).hex().encode(), "fewer than 16"),
    "15-values": (bytes(range(0x80, 0x8F)) * 2 + b"\x80\x81", "fewer than 16 distinct"),
    "half-doubled": (URL_KEY[:16] * 2, "two halves are equal"),
    "half-doubled-b64": (base64.b64encode(URL_KEY[:16] * 2), "two halves are equal"),
}


@pytest.mark.parametrize("name", sorted(PLACEHOLDERS))
def test_placeholder_keys_are_refused_without_showing_them(name: str) -> None:
    raw, said = PLACEHOLDERS[name]
    with pytest.raises(KeySourceError, match=said) as e:
        decode_key_material(bytearray(raw), "test source")
    assert "refused" in str(e.value) and "not 32 random bytes" in str(e.value)
    assert raw.decode("latin-1").strip() not in str(e.value)
    assert_no_key(str(e.value), bytes(decode_raw(raw)))


def decode_raw(raw: bytes) -> bytes:
    """What ``raw`` spells (the test's own decoding, for the no-leak check)."""
    if len(raw) == 32:
        return raw
    text = raw.strip()
    return bytes.fromhex(text.decode()) if len(text) == 64 else base64.b64decode(text)


def test_random_keys_pass_the_placeholder_rule() -> None:
    """The rule refuses a random key with probability ~1e-13 (all text): 2000
    fresh keys, in every spelling, are all accepted."""
    for _ in range(500):
        k = os.urandom(32)
        for raw in (k, k.hex().encode(), base64.b64encode(k), base64.urlsafe_b64encode(k)):
            assert bytes(decode_key_material(bytearray(raw), "test")) == k


# ---------------------------------------------------------------- DeploymentKey


def test_deployment_key_copies_wipes_the_input_and_hides_itself() -> None:
    material = bytearray(KEY)
    k = DeploymentKey(material, "file:/x")
    assert material == bytearray(32), "the source's buffer must be wiped"
    assert key_bytes(k) == KEY
    assert_no_key(repr(k))
    assert repr(k) == "<DeploymentKey from file:/x>"
    with pytest.raises(TypeError):
        import pickle

        pickle.dumps(k)
    slot_view = k.view()
    k.close()
    assert bytes(slot_view) == bytes(32), "close zeroes the slot"
    assert k.closed and "closed" in repr(k)
    with pytest.raises(KeySourceError):
        k.view()
    k.close()  # idempotent


def test_local_source_is_random_per_load() -> None:
    a, b = LocalKeySource().load(), LocalKeySource().load()
    assert key_bytes(a) != key_bytes(b) and any(key_bytes(a))
    assert a.source == "local"
    a.close()
    b.close()


# ---------------------------------------------------------------- file:


def write_key(path: Path, content: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(content)
    path.chmod(mode)
    return path


@pytest.mark.parametrize("mode", [0o400, 0o600, 0o440, 0o640])
def test_file_source_accepts_owner_and_group_read(tmp_path: Path, mode: int) -> None:
    p = write_key(tmp_path / "key", KEY.hex().encode() + b"\n", mode)
    with FileKeySource(str(p)).load() as k:
        assert key_bytes(k) == KEY
        assert k.source == f"file:{p}"


@pytest.mark.parametrize("mode", [0o644, 0o604, 0o660, 0o620, 0o601])
def test_file_source_refuses_others_and_group_write(tmp_path: Path, mode: int) -> None:
    p = write_key(tmp_path / "key", KEY, mode)
    with pytest.raises(KeySourceError, match=f"mode {mode:04o}") as e:
        FileKeySource(str(p)).load()
    assert_no_key(str(e.value))


def test_file_source_follows_a_kubernetes_style_symlink(tmp_path: Path) -> None:
    data = tmp_path / "..data"
    data.mkdir()
    write_key(data / "key", base64.b64encode(KEY), 0o400)
    (tmp_path / "key").symlink_to(Path("..data") / "key")
    with FileKeySource(str(tmp_path / "key")).load() as k:
        assert key_bytes(k) == KEY


def test_file_source_refuses_non_files_without_hanging(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(KeySourceError, match="not a regular file"):
        FileKeySource(str(fifo)).load()  # O_NONBLOCK: no writer, no hang
    with pytest.raises(KeySourceError, match="not a regular file"):
        FileKeySource(str(tmp_path)).load()
    with pytest.raises(KeySourceError, match="cannot open"):
        FileKeySource(str(tmp_path / "missing")).load()


def test_file_source_refuses_oversized_and_malformed(tmp_path: Path) -> None:
    big = write_key(tmp_path / "big", KEY * 200)
    with pytest.raises(KeySourceError, match="larger than 4096") as e:
        FileKeySource(str(big)).load()
    assert_no_key(str(e.value))
    bad = write_key(tmp_path / "bad", KEY + b"\n")
    with pytest.raises(KeySourceError, match="33 bytes") as e:
        FileKeySource(str(bad)).load()
    assert_no_key(str(e.value))


@pytest.mark.parametrize("content", [b"0" * 32, b"changeme" * 4, b"x" * 32, b"x" * 31 + b"\n"])
def test_file_source_refuses_a_placeholder_key(tmp_path: Path, content: bytes) -> None:
    """The issue's placeholders as key files: each used to start the daemon as a
    raw 32-byte key."""
    p = write_key(tmp_path / "key", content)
    with pytest.raises(KeySourceError, match=r"printable text.*not 32 random bytes") as e:
        FileKeySource(str(p)).load()
    assert f"key file {p}" in str(e.value)
    assert content.decode().strip() not in str(e.value)


def test_file_source_checks_owner(tmp_path: Path) -> None:
    p = write_key(tmp_path / "key", KEY)
    st = p.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600
    if os.geteuid() != 0:
        pytest.skip("only root can give a file to another uid")
    os.chown(p, 12345, -1)
    with pytest.raises(KeySourceError, match="owned by uid 12345"):
        FileKeySource(str(p)).load()


# ---------------------------------------------------------------- parse_key_source


def test_parse_key_source_spellings(tmp_path: Path) -> None:
    assert parse_key_source("local").describe() == "local"
    assert parse_key_source(f"file:{tmp_path}/k").describe() == f"file:{tmp_path}/k"
    src = parse_key_source("cdh:default/kvseal/store-key", cdh_endpoint="http://127.0.0.1:1")
    assert isinstance(src, CdhKeySource)
    assert src.path == "/cdh/resource/default/kvseal/store-key"
    for bad in ("file:", "cdh:a/b", "cdh:a/b/c/d", "cdh:../b/c", "cdh:a/b/c%2F", "cdh:a//c"):
        with pytest.raises(KeySourceError):
            parse_key_source(bad)
    for endpoint in ("https://127.0.0.1:8006", "http://127.0.0.1:8006/x", "127.0.0.1:8006"):
        with pytest.raises(KeySourceError, match="endpoint"):
            CdhKeySource("a/b/c", endpoint=endpoint)


@pytest.mark.parametrize(
    "endpoint",
    ["http://127.0.0.1:8006", "http://127.9.9.9:1", "http://[::1]:8006", "http://127.0.0.1"],
)
def test_cdh_endpoint_on_the_loopback_is_accepted(endpoint: str) -> None:
    assert CdhKeySource("a/b/c", endpoint=endpoint).endpoint == endpoint


@pytest.mark.parametrize(
    "endpoint",
    [
        "http://127.0.0.1:99999",
        "http://127.0.0.1:0",
        "http://127.0.0.1:http",
        "http://127.0.0.1:",
        "http://[::1:8006",
    ],
)
def test_cdh_endpoint_with_a_bad_port_is_a_key_source_error(endpoint: str) -> None:
    """Not a ValueError from urllib (a traceback at start): the one-line refusal."""
    with pytest.raises(KeySourceError, match="--store-cdh-endpoint"):
        CdhKeySource("a/b/c", endpoint=endpoint)


@pytest.mark.parametrize(
    "endpoint",
    [
        "http://10.0.0.5:8006",
        "http://cdh.kube-system.svc:8006",
        "http://[2001:db8::1]:8006",
        "http://0.0.0.0:8006",
        "http://127.0.0.1.nip.io:8006",
        "http://[::ffff:10.0.0.5]:8006",
        # Names, even localhost: /etc/hosts is the host's to write in Kata/CoCo
        # pods, so a name could lead to a server of the host's choosing.
        "http://localhost:8006",
        "http://LocalHost:80",
        "http://localhost.:8006",
        "http://ip6-localhost:8006",
        "http://127.1:8006",  # inet_aton would take it; not a literal address here
    ],
)
def test_cdh_endpoint_off_the_loopback_needs_the_insecure_opt_in(endpoint: str) -> None:
    """The CDH answers over plain HTTP: off the guest's loopback the key would
    cross the host's network in the clear."""
    with pytest.raises(KeySourceError, match=r"loopback.*--store-cdh-insecure-endpoint"):
        parse_key_source("cdh:a/b/c", cdh_endpoint=endpoint)
    src = parse_key_source("cdh:a/b/c", cdh_endpoint=endpoint, cdh_allow_remote=True)
    assert isinstance(src, CdhKeySource) and src.endpoint == endpoint


@pytest.mark.parametrize("spec", [KEY.hex(), base64.b64encode(KEY).decode(), "vault:" + KEY.hex()])
def test_unknown_source_is_not_echoed(spec: str) -> None:
    """An operator who pastes the key itself into the flag must not see it in logs."""
    with pytest.raises(KeySourceError, match="unknown store key source") as e:
        parse_key_source(spec)
    assert_no_key(str(e.value))


# ---------------------------------------------------------------- cdh:


@dataclass
class CdhState:
    """What the fake confidential-data-hub answers, and what it was asked."""

    status: int = 200
    body: bytes = KEY
    delay_s: float = 0.0
    fail_first: int = 0  # answer 503 this many times first
    paths: list[str] = field(default_factory=list)
    # Drip the answer one byte every drip_s, in the "headers" or the "body"
    # (a 150-byte answer: 60 s at 0.4 s a byte); dripped counts the bytes sent.
    drip: str = ""
    drip_s: float = 0.4
    dripped: int = 0


class _Handler(http.server.BaseHTTPRequestHandler):
    state: CdhState

    def do_GET(self) -> None:
        st = self.server.state  # type: ignore[attr-defined]
        st.paths.append(self.path)
        if st.delay_s:
            time.sleep(st.delay_s)
        if st.fail_first > 0:
            st.fail_first -= 1
            self._answer(503, b"kbs unavailable")
            return
        if not self.path.startswith("/cdh/resource/"):
            self._answer(404, b"no route")
            return
        if st.drip:
            self._drip(st)
            return
        self._answer(st.status, st.body if st.status == 200 else b"denied: " + KEY.hex().encode())

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _drip(self, st: CdhState) -> None:
        body = b"%d" % DRIP_BYTES + b"\x00" * (DRIP_BYTES - 3)
        head = (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
            b"Content-Length: %d\r\n" % len(body)
        )
        if st.drip == "headers":
            # An endless header drip: X-Pad: aaaa... never ends its line.
            self.wfile.write(head + b"X-Pad: ")
            slow = b"a" * DRIP_BYTES
        else:
            self.wfile.write(head + b"\r\n")
            slow = body
        self.wfile.flush()
        for i in range(len(slow)):
            time.sleep(st.drip_s)
            try:
                self.wfile.write(slow[i : i + 1])
                self.wfile.flush()
            except OSError:  # the client gave up
                return
            st.dripped += 1

    def log_message(self, *args: object) -> None:
        pass


DRIP_BYTES = 150  # at 0.4 s a byte: 60 s


@pytest.fixture
def cdh() -> Iterator[tuple[str, CdhState]]:
    state = CdhState()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.state = state  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "body", [KEY, KEY.hex().encode() + b"\n", base64.b64encode(KEY)], ids=["raw", "hex", "b64"]
)
def test_cdh_releases_the_key(cdh: tuple[str, CdhState], body: bytes) -> None:
    endpoint, state = cdh
    state.body = body
    src = parse_key_source("cdh:default/kvseal/store-key", cdh_endpoint=endpoint)
    with src.load() as k:
        assert key_bytes(k) == KEY
        assert k.source == "cdh:default/kvseal/store-key"
    assert state.paths == ["/cdh/resource/default/kvseal/store-key"]


@pytest.mark.parametrize(
    ("status", "match", "retryable"),
    [
        (401, "HTTP 401.*did not release", False),
        (403, "HTTP 403.*did not release", False),
        (404, "HTTP 404.*no such resource", False),
        (500, "HTTP 500", True),
        (503, "HTTP 503", True),
        (302, "unexpected HTTP 302", False),
    ],
)
def test_cdh_refusals(cdh: tuple[str, CdhState], status: int, match: str, retryable: bool) -> None:
    endpoint, state = cdh
    state.status = status
    with pytest.raises(KeySourceError, match=match) as e:
        CdhKeySource("default/kvseal/store-key", endpoint=endpoint).load()
    assert e.value.retryable is retryable
    assert "denied" not in str(e.value), "the server's body is never echoed"
    assert_no_key(str(e.value))
    assert len(state.paths) == 1, "one try without retry_for_s"


def test_cdh_wrong_length_body(cdh: tuple[str, CdhState]) -> None:
    endpoint, state = cdh
    state.body = KEY[:16]
    with pytest.raises(KeySourceError, match="16 bytes that are not a deployment key") as e:
        CdhKeySource("a/b/c", endpoint=endpoint).load()
    assert_no_key(str(e.value), KEY[:16])
    state.body = KEY * 300
    with pytest.raises(KeySourceError, match="more than 4096"):
        CdhKeySource("a/b/c", endpoint=endpoint).load()


def test_cdh_timeout(cdh: tuple[str, CdhState]) -> None:
    endpoint, state = cdh
    state.delay_s = 1.0
    with pytest.raises(KeySourceError, match=r"did not answer in full within 0\.2 s") as e:
        CdhKeySource("a/b/c", endpoint=endpoint, timeout_s=0.2).load()
    assert e.value.retryable


@pytest.mark.parametrize("where", ["body", "headers"])
def test_cdh_dripped_answer_stops_at_the_deadline(cdh: tuple[str, CdhState], where: str) -> None:
    """A CDH (or whoever answers on its port) that drips its answer one byte
    every 0.4 s must not stretch one attempt past its timeout: the deadline
    covers connect, headers and body together (a socket timeout alone restarts
    with each byte). The answer would take 60 s to send; the attempt gives up
    with the deadline error long before (the server has sent a small part)."""
    endpoint, state = cdh
    state.drip = where
    with pytest.raises(KeySourceError, match=r"within 1 s \(deadline exceeded\)") as e:
        CdhKeySource("a/b/c", endpoint=endpoint, timeout_s=1.0).load()
    assert e.value.retryable
    assert state.dripped < DRIP_BYTES // 2, "the attempt waited for the drip to finish"


def test_cdh_placeholder_key_is_refused(cdh: tuple[str, CdhState]) -> None:
    """The placeholder rule holds for a CDH answer as for a file (raw and hex)."""
    endpoint, state = cdh
    for body in (b"changeme" * 4, (b"x" * 32).hex().encode(), bytes([7]) * 32):
        state.body = body
        with pytest.raises(KeySourceError, match="not 32 random bytes") as e:
            CdhKeySource("a/b/c", endpoint=endpoint).load()
        assert "CDH resource a/b/c" in str(e.value)
        assert body.decode("latin-1") not in str(e.value)


def test_cdh_connection_refused() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(KeySourceError, match=r"connection refused.*confidential-data-hub") as e:
        CdhKeySource("a/b/c", endpoint=f"http://127.0.0.1:{port}", timeout_s=2).load()
    assert e.value.retryable


def test_cdh_retries_until_the_hub_answers(cdh: tuple[str, CdhState]) -> None:
    endpoint, state = cdh
    state.fail_first = 2
    with CdhKeySource("a/b/c", endpoint=endpoint, retry_for_s=30).load() as k:
        assert key_bytes(k) == KEY
    assert len(state.paths) == 3


def test_cdh_does_not_retry_a_refusal(cdh: tuple[str, CdhState]) -> None:
    endpoint, state = cdh
    state.status = 403
    with pytest.raises(KeySourceError, match="403"):
        CdhKeySource("a/b/c", endpoint=endpoint, retry_for_s=30).load()
    assert len(state.paths) == 1


# ---------------------------------------------------------------- the daemon's start


def _start_fails(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvseal.server", "--listen", f"unix://{tmp_path}/run/s.sock",
         "--backend", "cpu", "--host-bytes", "1MiB",
         *store_flags(tmp_path / "store", *flags)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_the_daemon_refuses_steerable_key_sources_in_one_line(tmp_path: Path) -> None:
    """A CDH endpoint with a bad port or a name (localhost), and a placeholder
    key file: each stops the start with one line on stderr, exit 2, no
    traceback, the key never shown."""
    placeholder = write_key(tmp_path / "key", b"changeme" * 4)
    cdh = ("cdh:default/kvseal/store-key", "--store-key-wait", "0", "--store-cdh-endpoint")
    cases = [
        ((*cdh, "http://127.0.0.1:99999"), "port (--store-cdh-endpoint) must be a number"),
        ((*cdh, "http://localhost:8006"), "literal loopback address"),
        ((f"file:{placeholder}",), "printable text"),
    ]
    for flags, said in cases:
        r = _start_fails(tmp_path, *flags)
        assert r.returncode == 2, (flags, r.stderr)
        assert said in r.stderr and "Traceback" not in r.stderr, (flags, r.stderr)
        assert r.stderr.strip().count("\n") == 0, r.stderr
        assert r.stderr.startswith("kvseal-server: --store-key: ")
        assert "changeme" not in r.stderr
