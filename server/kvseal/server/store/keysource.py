"""Where the store's deployment key comes from, chosen once at start.

A *deployment key* is 32 bytes every replica of a deployment shares; the
store's names and block keys are derived from it (:mod:`.keys`). Three
sources (:func:`parse_key_source` takes the operator's spelling):

- ``local`` (the default): 32 fresh bytes from ``getrandom(2)``, per daemon.
  Nothing outlives the process, so the store serves only this daemon's
  lifetime (a restart or another replica finds nothing it can name).
- ``file:<path>``: a Kubernetes secret, or in Confidential Containers a
  sealed secret the pod's confidential-data-hub unsealed after attestation.
  The file holds exactly 32 raw bytes, or 64 hex digits, or base64 of 32
  bytes (standard or URL-safe alphabet, 43 characters, or 44 with one ``=``);
  surrounding whitespace is ignored for the text forms. The decoded 32 bytes
  must look random (:func:`placeholder_reason`: not text, at least 16
  distinct byte values, two different halves). Refused: not a
  regular file; any access for *others*; *group write*; an owner other than
  root or the daemon's uid (whoever owns it can swap the key). *Group read*
  is allowed on purpose: a Kubernetes secret volume with ``fsGroup`` is
  ``root:<fsGroup>`` mode 0440, the only way a non-root container reads it
  (``defaultMode: 0400`` with a root daemon is tighter and also accepted).
- ``cdh:<repo>/<type>/<tag>``: ``GET http://127.0.0.1:8006/cdh/resource/
  <repo>/<type>/<tag>`` from the confidential-data-hub inside the pod, which
  asks a Trustee KBS to release the resource; the KBS releases it only to a
  VM whose attestation its policy accepts. The body follows the file rules.
  Standard library only (``http.client``), plain HTTP to the pod's loopback
  written as a literal address (the CDH's own API; no name is resolved), no
  redirects, one deadline per attempt over connect, headers and body,
  optional retries while the CDH is not up yet.

Key hygiene: a source reads the key into a ``bytearray`` it wipes before it
returns, decodes hex and base64 by hand into another ``bytearray`` (no
immutable ``bytes`` or ``str`` copy of the key is ever made by this module;
``http.client``'s socket buffer is the one copy outside it), and hands the
32 bytes to a :class:`DeploymentKey`, which keeps them in a slot of an
``mlock``ed :class:`~kvseal.server.keyarena.KeyArena` page (out of core dumps,
wiped in a forked child) until :meth:`DeploymentKey.close` zeroes it. No
message, ``repr`` or log line shows key bytes; an unknown source spelling is
not echoed (an operator may have pasted the key itself into the flag).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import http.client
import io
import ipaddress
import os
import re
import socket
import stat
import time
import urllib.parse
from collections.abc import Callable
from typing import Any, Protocol

from kvseal.server.keyarena import KEY_BYTES, KeyArena, KeySlot, fill_random
from kvseal.server.store.errors import KeySourceError

DEFAULT_CDH_ENDPOINT = "http://127.0.0.1:8006"
DEFAULT_CDH_TIMEOUT_S = 5.0
# A key file or CDH body is a few dozen bytes; anything near this is not a key.
MAX_KEY_SOURCE_BYTES = 4096
_WHITESPACE = b" \t\r\n"
_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HEX = {c: i for i, c in enumerate(b"0123456789abcdef")} | {
    c: 10 + i for i, c in enumerate(b"ABCDEF")
}
_B64_STD = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
_B64_URL = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
# A key with fewer distinct byte values is a pattern, not 32 random bytes: a
# random key has about 30 (P(fewer than 16) ~ 3e-17).
MIN_DISTINCT_KEY_BYTES = 16
_TEXT_BYTES = frozenset(range(0x20, 0x7F)) | frozenset(b"\t\n\v\f\r")


def wipe(buf: bytearray) -> None:
    """Zero ``buf`` in place (same-length slice assignment never reallocates)."""
    if buf:
        ctypes.memset((ctypes.c_char * len(buf)).from_buffer(buf), 0, len(buf))


class DeploymentKey:
    """The 32-byte deployment key, in a slot of its own ``mlock``ed arena page.

    :meth:`view` lends the bytes (a memoryview of the slot, never a copy) to
    key derivation; :meth:`close` zeroes the slot and unlocks the page, after
    which :meth:`view` raises. ``source`` is the safe description of where the
    key came from (``local``, ``file:/path``, ``cdh:repo/type/tag``). Not
    thread-safe on its own: its owner (:class:`~.keys.StoreKeys`) serialises
    derivations against ``close``.
    """

    __slots__ = ("_arena", "_slot", "source")

    def __init__(self, material: bytearray | None, source: str) -> None:
        """Copy ``material`` (exactly 32 bytes) into the slot and wipe it; with
        ``None``, fill the slot from ``getrandom(2)`` (the ``local`` source)."""
        self.source = source
        self._arena = KeyArena(1)
        slot = self._arena.take()
        self._slot: KeySlot | None = slot
        try:
            if material is None:
                fill_random(slot)
            else:
                if len(material) != KEY_BYTES:
                    raise KeySourceError(f"a deployment key is {KEY_BYTES} bytes")
                ctypes.memmove(slot, (ctypes.c_char * KEY_BYTES).from_buffer(material), KEY_BYTES)
        except BaseException:
            self.close()
            raise
        finally:
            if material is not None:
                wipe(material)

    def view(self) -> memoryview:
        """The key bytes (a view of the slot; valid until :meth:`close`)."""
        if self._slot is None:
            raise KeySourceError("the deployment key was closed (wiped)")
        return memoryview(self._slot).cast("B")

    @property
    def closed(self) -> bool:
        return self._slot is None

    def close(self) -> None:
        """Zero the slot and the arena page. Idempotent."""
        slot, self._slot = self._slot, None
        if slot is not None:
            self._arena.give(slot)
        self._arena.close()

    def __enter__(self) -> DeploymentKey:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:  # never the key; the source is a path or a resource name
        return f"<DeploymentKey from {self.source}{' (closed)' if self._slot is None else ''}>"

    def __reduce__(self) -> str | tuple[object, ...]:
        raise TypeError("a DeploymentKey cannot be pickled")


# ---------------------------------------------------------------- decoding


def _strip(raw: bytearray) -> tuple[int, int]:
    start, end = 0, len(raw)
    while start < end and raw[start] in _WHITESPACE:
        start += 1
    while end > start and raw[end - 1] in _WHITESPACE:
        end -= 1
    return start, end


def _decode_hex(raw: bytearray, start: int, out: bytearray) -> bool:
    for i in range(KEY_BYTES):
        hi = _HEX.get(raw[start + 2 * i])
        lo = _HEX.get(raw[start + 2 * i + 1])
        if hi is None or lo is None:
            return False
        out[i] = hi << 4 | lo
    return True


def _decode_base64(raw: bytearray, start: int, end: int, out: bytearray) -> bool:
    """43 characters (or 44 with one ``=``) of one alphabet -> 32 bytes; the two
    bits past the key must be zero (one spelling per key)."""
    if end - start == 44:
        if raw[end - 1] != ord("="):
            return False
        end -= 1
    if end - start != 43:
        return False
    for alphabet in (_B64_STD, _B64_URL):
        acc = bits = n = 0
        for pos in range(start, end):
            v = alphabet.find(raw[pos])
            if v < 0:
                break
            acc = (acc << 6 | v) & 0xFFFF
            bits += 6
            if bits >= 8:
                bits -= 8
                out[n] = (acc >> bits) & 0xFF
                n += 1
        else:
            if n == KEY_BYTES and acc & ((1 << bits) - 1) == 0:
                return True
    return False


def placeholder_reason(key: bytearray) -> str | None:
    """Why the 32 decoded bytes ``key`` are obviously not a random key, or
    None. The rule (every test is on the decoded bytes, whatever the spelling):

    - all zero;
    - every byte printable ASCII or whitespace: a password or placeholder
      (``'changeme' * 4``, ``'0' * 32``) sitting in a raw 32-byte file; a
      random key is all text with probability (100/256)^32 ~ 1e-13;
    - fewer than ``MIN_DISTINCT_KEY_BYTES`` (16) distinct byte values: a
      repeated byte or short pattern (~3e-17 for a random key);
    - its two 16-byte halves equal: a 16-byte key doubled (2^-128).

    The reason names the rule only, never a byte of the key. The scratch
    table is wiped; iterating yields the interpreter's shared small ints, so
    no copy of the key is made."""
    if not any(key):
        return "an all-zero key (a placeholder?)"
    seen = bytearray(256)
    try:
        distinct = 0
        text = True
        for b in key:
            if not seen[b]:
                seen[b] = 1
                distinct += 1
            if b not in _TEXT_BYTES:
                text = False
    finally:
        wipe(seen)
    if text:
        return "a key of printable text (a password or placeholder?), not 32 random bytes"
    if distinct < MIN_DISTINCT_KEY_BYTES:
        return (
            f"a key of fewer than {MIN_DISTINCT_KEY_BYTES} distinct byte values (a repeated "
            "pattern?), not 32 random bytes"
        )
    half = KEY_BYTES // 2
    if all(key[i] == key[i + half] for i in range(half)):
        return "a key whose two halves are equal, not 32 random bytes"
    return None


def decode_key_material(raw: bytearray, what: str) -> bytearray:
    """The 32 key bytes that ``raw`` spells (a new bytearray the caller must
    wipe); ``raw`` is left as it is (its owner wipes it). ``what`` names the
    source in errors. Refuses anything but exactly 32 raw bytes, 64 hex
    digits or base64 of 32 bytes, and, after decoding, a key that is
    obviously not random (:func:`placeholder_reason`); the error gives
    lengths and the rule only."""
    out = bytearray(KEY_BYTES)
    ok = False
    try:
        if len(raw) == KEY_BYTES:
            out[:] = raw
            ok = True
        else:
            start, end = _strip(raw)
            if end - start == 2 * KEY_BYTES:
                ok = _decode_hex(raw, start, out)
            elif end - start in (43, 44):
                ok = _decode_base64(raw, start, end, out)
        if not ok:
            raise KeySourceError(
                f"{what} holds {len(raw)} bytes that are not a deployment key: expected "
                f"exactly {KEY_BYTES} raw bytes, {2 * KEY_BYTES} hex digits, or base64 of "
                f"{KEY_BYTES} bytes (43 characters, or 44 with '=')"
            )
        reason = placeholder_reason(out)
        if reason is not None:
            ok = False
            raise KeySourceError(
                f"{what} holds {reason}; refused (make one with "
                "'head -c 32 /dev/urandom' or 'openssl rand -hex 32')"
            )
        return out
    finally:
        if not ok:
            wipe(out)


def _load_from(raw: bytearray, what: str, source: str) -> DeploymentKey:
    """Decode ``raw`` into a DeploymentKey; wipes ``raw`` and every copy."""
    try:
        return DeploymentKey(decode_key_material(raw, what), source)
    finally:
        wipe(raw)


# ---------------------------------------------------------------- sources


class KeySource(Protocol):
    """A deployment key source chosen at start."""

    def describe(self) -> str:
        """Where the key comes from, safe to log (no key bytes)."""
        ...

    def load(self) -> DeploymentKey:
        """Obtain the key (a fresh DeploymentKey the caller owns and closes).
        Raises :class:`KeySourceError` with a message safe to log."""
        ...


class LocalKeySource:
    """32 random bytes per call: a store only this process can read."""

    def describe(self) -> str:
        return "local"

    def load(self) -> DeploymentKey:
        return DeploymentKey(None, "local")


class FileKeySource:
    """A key file (see the module docstring for the accepted forms and modes)."""

    def __init__(self, path: str) -> None:
        if not path:
            raise KeySourceError("file: needs a path (file:/run/secrets/kvseal-store-key)")
        self.path = path

    def describe(self) -> str:
        return f"file:{self.path}"

    def load(self) -> DeploymentKey:
        what = f"key file {self.path}"
        try:
            # Follows symlinks on purpose: Kubernetes mounts secrets as
            # key -> ..data/key. O_NONBLOCK: a FIFO planted there cannot hang us.
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
        except OSError as e:
            raise KeySourceError(f"cannot open {what}: {os.strerror(e.errno or 0)}") from None
        raw = bytearray(MAX_KEY_SOURCE_BYTES + 1)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise KeySourceError(f"{what} is not a regular file")
            mode = stat.S_IMODE(st.st_mode)
            if mode & stat.S_IRWXO or mode & stat.S_IWGRP:
                raise KeySourceError(
                    f"{what} has mode {mode:04o}: others must have no access and the group "
                    "no write (Kubernetes: defaultMode 0400, or 0440 with fsGroup)"
                )
            if st.st_uid not in (0, os.geteuid()):
                raise KeySourceError(
                    f"{what} is owned by uid {st.st_uid}: only root or the daemon's uid "
                    f"({os.geteuid()}) may own the deployment key"
                )
            n = _read_into(lambda b: os.readv(fd, [b]), raw)
            if n > MAX_KEY_SOURCE_BYTES:
                raise KeySourceError(f"{what} is larger than {MAX_KEY_SOURCE_BYTES} bytes")
            body = bytearray(n)
            body[:] = memoryview(raw)[:n]
        except OSError as e:
            raise KeySourceError(f"cannot read {what}: {os.strerror(e.errno or 0)}") from None
        finally:
            wipe(raw)
            os.close(fd)
        return _load_from(body, what, self.describe())


class CdhKeySource:
    """A resource of the Confidential Containers confidential-data-hub.

    ``endpoint`` is ``http://host:port`` (the CDH's API; tests point it at a
    local server). ``timeout_s`` is one deadline per attempt over connect,
    request, headers and body together (a server that drips its answer
    cannot stretch an attempt past it); ``retry_for_s`` keeps retrying
    retryable failures (connection refused, timeouts, 5xx) for that long,
    with a short backoff (0: one try).
    401/403/404 are never retried: the KBS answered, and the answer is no.

    The endpoint must be a literal loopback address (``127.0.0.0/8``,
    ``[::1]``): the CDH runs inside the confidential VM and answers over
    plain HTTP, so a key fetched from any other host crosses a network the
    host controls, in the clear. No name is accepted, ``localhost`` included:
    it resolves through ``/etc/hosts``, which the host writes in Kata/CoCo
    pods, so the host could point it at a server of its own and hand out a
    key of its choosing. ``allow_remote`` (the operator's explicit
    ``--store-cdh-insecure-endpoint``) lifts that, for tests and for
    deployments that protect the path some other way.
    """

    def __init__(
        self,
        resource: str,
        *,
        endpoint: str = DEFAULT_CDH_ENDPOINT,
        timeout_s: float = DEFAULT_CDH_TIMEOUT_S,
        retry_for_s: float = 0.0,
        allow_remote: bool = False,
    ) -> None:
        parts = resource.split("/")
        if len(parts) != 3 or not all(_SEGMENT.fullmatch(p) and p != ".." for p in parts):
            raise KeySourceError(
                "cdh: needs <repository>/<type>/<tag>, three segments of letters, digits, "
                "'.', '_' or '-' (e.g. cdh:default/kvseal/store-key)"
            )
        try:
            url = urllib.parse.urlsplit(endpoint)
            host = url.hostname
        except ValueError:  # e.g. an unclosed '[' of an IPv6 address
            host = None
        if not host or url.scheme != "http" or url.path not in ("", "/") or url.query:
            raise KeySourceError(
                "the CDH endpoint (--store-cdh-endpoint) must be http://host:port (no path)"
            )
        try:
            port = url.port
        except ValueError:  # out of 0-65535, or not a number
            port = 0
        if port == 0 or (port is None and url.netloc.endswith(":")):
            raise KeySourceError(
                "the CDH endpoint's port (--store-cdh-endpoint) must be a number in 1-65535"
            )
        if not allow_remote and not _is_loopback(host):
            raise KeySourceError(
                "the CDH endpoint (--store-cdh-endpoint) must be a literal loopback address "
                "of this guest (127.0.0.0/8 or [::1]; no name, not even localhost, which the "
                "host's /etc/hosts may point elsewhere): the key would cross the host's "
                "network in plaintext; --store-cdh-insecure-endpoint allows another host"
            )
        if not 0 < timeout_s <= 600 or not 0 <= retry_for_s <= 3600:
            raise KeySourceError("CDH timeout must be in (0, 600] s and retries in [0, 3600] s")
        self.resource = resource
        self.endpoint = endpoint.rstrip("/")
        self._host = host
        self._port = port or 80
        self.timeout_s = timeout_s
        self.retry_for_s = retry_for_s

    @property
    def path(self) -> str:
        return "/cdh/resource/" + self.resource

    def describe(self) -> str:
        return f"cdh:{self.resource}"

    def load(self) -> DeploymentKey:
        give_up = time.monotonic() + self.retry_for_s
        pause = 0.1
        while True:
            try:
                body = self._fetch_once()
            except KeySourceError as e:
                left = give_up - time.monotonic()
                if not e.retryable or left <= 0:
                    raise
                time.sleep(min(pause, left))
                pause = min(pause * 2, 2.0)
                continue
            return _load_from(body, f"CDH resource {self.resource}", self.describe())

    def _fetch_once(self) -> bytearray:
        where = f"the confidential-data-hub at {self.endpoint} (resource {self.resource})"
        deadline = time.monotonic() + self.timeout_s
        conn = _DeadlineConnection(self._host, self._port, deadline)
        raw = bytearray(MAX_KEY_SOURCE_BYTES + 1)
        resp: http.client.HTTPResponse | None = None
        try:
            conn.request("GET", self.path, headers={"Accept": "application/octet-stream"})
            resp = conn.getresponse()
            status = resp.status
            if status != 200:
                raise _status_error(status, where)
            n = _read_into(resp.readinto, raw, deadline)
            if n > MAX_KEY_SOURCE_BYTES:
                raise KeySourceError(f"{where} answered more than {MAX_KEY_SOURCE_BYTES} bytes")
            body = bytearray(n)
            body[:] = memoryview(raw)[:n]
            return body
        except KeySourceError:
            raise
        except TimeoutError:
            raise KeySourceError(
                f"{where} did not answer in full within {self.timeout_s:g} s (deadline exceeded)",
                retryable=True,
            ) from None
        except ConnectionRefusedError:
            raise KeySourceError(
                f"{where}: connection refused (is the confidential-data-hub running in this "
                "pod? Confidential Containers starts it beside the workload)",
                retryable=True,
            ) from None
        except (http.client.HTTPException, OSError) as e:
            name = errno.errorcode.get(getattr(e, "errno", None) or 0, type(e).__name__)
            raise KeySourceError(f"{where}: request failed ({name})", retryable=True) from None
        finally:
            wipe(raw)
            if resp is not None:
                resp.close()  # and the reader's socket
            conn.close()


class _DeadlineReader(io.RawIOBase):
    """A socket's receive side under one absolute deadline: each ``recv``
    waits at most until ``deadline`` (``time.monotonic``), then TimeoutError.
    ``http.client`` reads the status line, headers and body through a
    buffered file over this, so the deadline bounds all of them together (a
    socket timeout alone restarts with every byte a dripping server sends).

    It reads through its own duplicate of the socket, closed with it: the
    connection closes its socket right after the headers of an answer that
    ends the connection (HTTP/1.0), and the body is read after that (what
    ``socket.makefile`` does with its reference count)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        super().__init__()
        self._sock = sock.dup()
        self._deadline = deadline

    def close(self) -> None:
        if not self.closed:
            self._sock.close()
        super().close()

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline exceeded")
        self._sock.settimeout(left)
        return self._sock.recv_into(b)


class _DeadlineSocket:
    """What :class:`http.client.HTTPResponse` is given instead of the socket:
    it only calls ``makefile`` (once, in its constructor)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def makefile(self, mode: str) -> io.BufferedReader:
        assert mode == "rb"
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))


class _DeadlineResponse(http.client.HTTPResponse):
    def __init__(
        self,
        sock: socket.socket,
        debuglevel: int = 0,
        method: str | None = None,
        url: str | None = None,
        *,
        deadline: float,
    ) -> None:
        fake: Any = _DeadlineSocket(sock, deadline)
        super().__init__(fake, debuglevel, method, url)


class _DeadlineConnection(http.client.HTTPConnection):
    """An HTTPConnection whose connect, request and whole response share one
    absolute ``deadline``."""

    def __init__(self, host: str, port: int, deadline: float) -> None:
        super().__init__(host, port, timeout=max(deadline - time.monotonic(), 1e-3))
        self._deadline = deadline
        self.response_class = functools.partial(  # type: ignore[assignment]
            _DeadlineResponse, deadline=deadline
        )

    def connect(self) -> None:
        super().connect()
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline exceeded")
        self.sock.settimeout(left)  # the request's send


def _read_into(
    read: Callable[[memoryview], int | None], buf: bytearray, deadline: float | None = None
) -> int:
    """Fill ``buf`` from ``read`` until EOF or full (the caller sizes it one byte
    past the limit to see an oversized source); TimeoutError past ``deadline``."""
    n = 0
    with memoryview(buf) as view:
        while n < len(buf):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError
            got = read(view[n:])
            if not got:
                break
            n += got
    return n


def _status_error(status: int, where: str) -> KeySourceError:
    """The error for a non-200 answer (the body is never read or echoed)."""
    if status in (401, 403):
        return KeySourceError(
            f"{where} refused with HTTP {status}: the KBS did not release the key to this "
            "VM (its attestation was not accepted, or the resource policy denies it)"
        )
    if status == 404:
        return KeySourceError(
            f"{where} answered HTTP 404: no such resource at the KBS (check the "
            "repository/type/tag)"
        )
    if 500 <= status <= 599:
        return KeySourceError(f"{where} failed with HTTP {status}", retryable=True)
    return KeySourceError(f"{where} answered an unexpected HTTP {status}")


def _is_loopback(host: str) -> bool:
    """Whether ``host`` (a URL's hostname) is a literal loopback address. A
    name never is, ``localhost`` included: names resolve through
    ``/etc/hosts`` and DNS, both of which the host may write or answer."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_key_source(
    spec: str,
    *,
    cdh_endpoint: str = DEFAULT_CDH_ENDPOINT,
    cdh_timeout_s: float = DEFAULT_CDH_TIMEOUT_S,
    cdh_retry_for_s: float = 0.0,
    cdh_allow_remote: bool = False,
) -> KeySource:
    """The source an operator named: ``local``, ``file:<path>`` or
    ``cdh:<repo>/<type>/<tag>``. An unknown spelling is refused without
    echoing it (it might be the key itself). ``cdh_allow_remote``: see
    :class:`CdhKeySource` (a non-loopback endpoint is refused without it)."""
    if spec == "local":
        return LocalKeySource()
    if spec.startswith("file:"):
        return FileKeySource(spec[len("file:") :])
    if spec.startswith("cdh:"):
        return CdhKeySource(
            spec[len("cdh:") :],
            endpoint=cdh_endpoint,
            timeout_s=cdh_timeout_s,
            retry_for_s=cdh_retry_for_s,
            allow_remote=cdh_allow_remote,
        )
    raise KeySourceError(
        f"unknown store key source ({len(spec)} characters, not shown): expected local, "
        "file:<path> or cdh:<repository>/<type>/<tag>"
    )
