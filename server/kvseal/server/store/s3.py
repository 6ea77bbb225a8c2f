"""The S3 backend: the sealed store's records as objects of one S3 bucket.

``--store s3://BUCKET/PREFIX?endpoint=URL&region=R&credentials=SOURCE``
(:meth:`S3Location.parse`). Through boto3 (kvseal-server's ``s3`` extra),
never hand-written HTTP. Every object is already sealed and named by a keyed
hash (:mod:`.record`, :mod:`.keys`): the bucket, its operator and the network
see ciphertext under names that reveal nothing, exactly as a directory's
host does, and the store library authenticates everything it reads back.

Layout (``PREFIX`` ends in ``/`` or is empty)::

    PREFIX/kvseal-store        "kvseal-store 1 fanout=<n>": created once
                               (If-None-Match: *); later openers must agree
    PREFIX/<xx>/<64 hex>       a block object (``xx`` = first byte mod fanout)
    PREFIX/<xx>/<64 hex>.scope a tenant's scope marker or floor

What S3 gives, and how it is used (docs/store.md, "S3"):

- **Atomic publish**: a PUT is all or nothing; a reader gets the old object
  or the new one, whole. ``replace=False`` (scope markers, the layout object)
  is a conditional PUT with ``If-None-Match: *``: the first writer wins, the
  others get 412 (or 409 while another conditional PUT is in flight) and
  read the winner's. A server that ignores the header would let a second
  marker replace the first: two epochs, which the scope rules answer with
  one more rotation (never a wrong serve). SeaweedFS 4.x and AWS honour it.
- **Conditional removal**: ``remove(name, ident)`` (a record found bad)
  deletes with ``If-Match: <ETag read>``, so a good object published over the
  bad one since stays. A server that ignores If-Match on DELETE leaves a
  window of one request in which such a good object can be removed (a miss).
- **Durability**: a PUT is durable when it returns; ``sync_dir`` has
  nothing more to do.
- **No mtime to touch.** S3 cannot change an object's Last-Modified without
  rewriting it, so :meth:`touch` does nothing and eviction is by write time
  (oldest written first), not by last use. Object versions are not used: a
  versioned bucket keeps every replaced and deleted record (the capacity
  bound would not hold, and "deleted" would not mean gone), so use an
  unversioned bucket.
- **Capacity**: kvseal's own eviction, as on a directory: before a put, the
  shard's prefix is listed and its oldest objects deleted until the record
  fits its shard's share (blocks first, scope records last). A bucket
  lifecycle rule may expire objects too (a missing object is a miss; a
  missing marker drops its tenant's reachable blocks, a missing floor weakens
  the drop rule as a deleted floor does on a directory).

Failure model: every call has a connect timeout and a read timeout
(``timeout``, 1 s by default), at most ``retries`` retries (none by default),
and every body is read against a deadline; a server that is down, slow,
refusing or answering something that is not S3 raises
:class:`~.errors.StoreUnavailable` (an ``OSError``: the daemon's miss or
skipped spill). After such a failure (or a 5xx / SlowDown answer) every call
fails at once for ``backoff`` seconds (2 by default) without contacting the
server, so a Lookup naming many blocks, and every request behind it, pays
one timeout per window, not one per block. Then boto3 reconnects by itself. A body that *is*
returned is the host's like a file's: the store authenticates it.

Credentials: boto3's own chain (``credentials=env``, the default: the
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` environment, a web
identity token such as EKS IRSA, a shared credentials file), or
``credentials=file:PATH``: a file of two lines, access key id and secret
key, refused when others may read it. Never in the URL (a URL with
``user:password@`` is refused) and never logged.
"""

from __future__ import annotations

import os
import re
import stat
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from kvseal.server.store.backend import BackendOpener, Evicted, Ident, Usage
from kvseal.server.store.errors import (
    StoreError,
    StoreLayoutError,
    StoreUnavailable,
)
from kvseal.server.store.fsio import (
    _LAYOUT,
    _MARKER,
    _OBJECT,
    LAYOUT_FILE,
    LAYOUT_VERSION,
    MAX_FANOUT,
    is_power_of_two,
)

_PARAMS = frozenset({"endpoint", "region", "credentials", "timeout", "retries", "backoff"})
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_CHUNK = 1 << 20  # bytes read from a body between two deadline checks
# Codes that mean "not there" (404s) and "someone else's write won" (412, 409).
_ABSENT = frozenset({"NoSuchKey", "404", "NotFound"})
_LOST_RACE = frozenset({"PreconditionFailed", "412", "ConditionalRequestConflict", "409"})
# Answers that mean the server is in trouble, not the request: back off.
_SERVER_TROUBLE = frozenset(
    {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "503", "500"}
)


@dataclass(frozen=True, slots=True)
class S3Location:
    """A parsed ``--store s3://...`` URL (no credential ever in it)."""

    bucket: str
    prefix: str  # "" or ending in "/"
    endpoint: str | None  # None: AWS's own for the region
    region: str
    credentials: str  # "env" | "file:PATH"
    timeout_s: float  # connect and read timeout of each request; also a body's deadline
    retries: int  # extra attempts after a failed request (0 to 3)
    backoff_s: float = 2.0  # after the server failed, calls fail at once for this long

    @classmethod
    def parse(cls, url: str) -> S3Location:
        """Parse ``s3://BUCKET[/PREFIX][?endpoint=URL&region=R&credentials=
        env|file:PATH&timeout=S&retries=N&backoff=S]``. :class:`StoreLayoutError` for
        anything else; the message never repeats a userinfo part."""
        u = urllib.parse.urlsplit(url)
        if u.scheme != "s3":
            raise StoreLayoutError("an S3 store is s3://BUCKET/PREFIX")
        if "@" in u.netloc:
            raise StoreLayoutError(
                "credentials never go in the store URL: use credentials=env (the AWS_* "
                "environment) or credentials=file:PATH"
            )
        if not _BUCKET.fullmatch(u.netloc):
            raise StoreLayoutError(f"s3://{u.netloc}: not a valid bucket name")
        prefix = u.path.strip("/")
        if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
            raise StoreLayoutError("the S3 prefix has an empty, '.' or '..' segment")
        q = urllib.parse.parse_qs(u.query, keep_blank_values=True, strict_parsing=False)
        unknown = set(q) - _PARAMS
        if unknown:
            raise StoreLayoutError(f"unknown S3 store parameter(s): {', '.join(sorted(unknown))}")
        if any(len(v) != 1 for v in q.values()):
            raise StoreLayoutError("each S3 store parameter may be given once")
        one = {k: v[0] for k, v in q.items()}
        endpoint = one.get("endpoint")
        if endpoint is not None:
            e = urllib.parse.urlsplit(endpoint)
            # Nothing but scheme, host and port: the endpoint is logged
            # (describe), and a path, query or fragment could carry a token.
            if (
                e.scheme not in ("http", "https")
                or not e.hostname
                or "@" in e.netloc
                or e.path not in ("", "/")
                or e.query
                or e.fragment
            ):
                raise StoreLayoutError(
                    "endpoint= must be http(s)://HOST[:PORT]: no userinfo, path or query"
                )
        credentials = one.get("credentials", "env")
        if credentials != "env" and not (credentials.startswith("file:") and len(credentials) > 5):
            raise StoreLayoutError("credentials= must be env or file:PATH")
        try:
            timeout_s = float(one.get("timeout", "1"))
            retries = int(one.get("retries", "0"))
            backoff_s = float(one.get("backoff", "2"))
        except ValueError:
            raise StoreLayoutError("timeout= and backoff= take seconds, retries= a count") from None
        if not 0 <= backoff_s <= 600:
            raise StoreLayoutError("backoff= must be in [0, 600] seconds")
        if not 0.05 <= timeout_s <= 60:  # also refuses NaN
            raise StoreLayoutError("timeout= must be in [0.05, 60] seconds")
        if not 0 <= retries <= 3:
            raise StoreLayoutError("retries= must be in [0, 3]")
        return cls(
            u.netloc,
            prefix + "/" if prefix else "",
            endpoint,
            one.get("region", "us-east-1"),
            credentials,
            timeout_s,
            retries,
            backoff_s,
        )

    def describe(self) -> str:
        """For logs: bucket, prefix, endpoint; the credential source's kind only."""
        where = f" at {self.endpoint}" if self.endpoint else f" in {self.region}"
        return f"s3://{self.bucket}/{self.prefix}{where}"


def read_credentials_file(path: str) -> tuple[str, str]:
    """(access key id, secret key) from a two-line file that others cannot
    read or write and that is a regular file (no symlink is followed). The
    values never appear in an error."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise StoreLayoutError(f"credentials file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StoreLayoutError(f"credentials file {path}: not a regular file")
        if st.st_mode & 0o007 or st.st_mode & 0o020:
            raise StoreLayoutError(
                f"credentials file {path}: others may access it or its group may write it"
            )
        raw = os.read(fd, 4096)
    finally:
        os.close(fd)
    lines = [line.strip() for line in raw.decode("utf-8", "replace").splitlines() if line.strip()]
    if len(lines) != 2:
        raise StoreLayoutError(
            f"credentials file {path}: expected two lines (access key id, secret key)"
        )
    return lines[0], lines[1]


def _code(e: BaseException) -> str:
    """The S3 error code of a botocore ClientError ('' for anything else)."""
    response = getattr(e, "response", None)
    if not isinstance(response, dict):
        return ""
    err = response.get("Error", {})
    code = str(err.get("Code", "")) if isinstance(err, dict) else ""
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code or str(status or "")


class S3Backend:
    """The store's records in one bucket under one prefix (see the module
    docstring): a :class:`~.backend.StoreBackend`. Thread-safe (a boto3
    client is; its connection pool holds up to ``pool`` connections)."""

    def __init__(
        self,
        loc: S3Location,
        *,
        fanout: int | None,
        default_fanout: int = MAX_FANOUT,
        pool: int = 16,
        client: Any = None,
    ) -> None:
        """Connect and read (or create) the layout object. ``client``: a boto3
        S3 client to use instead of one built from ``loc`` (tests). Raises
        :class:`StoreLayoutError` (another fanout, bad credentials file) and
        :class:`~.errors.StoreUnavailable` (the server cannot be reached)."""
        if fanout is not None and not (is_power_of_two(fanout) and fanout <= MAX_FANOUT):
            raise StoreLayoutError(f"fanout must be a power of two up to {MAX_FANOUT}")
        self.loc = loc
        self._lock = threading.Lock()
        self._down_until = 0.0  # monotonic: calls fail at once until then
        self._client: Any = client if client is not None else self._connect(loc, pool)
        try:
            self.fanout = self._layout(fanout if fanout is not None else default_fanout, fanout)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _connect(loc: S3Location, pool: int) -> Any:
        try:
            # An optional extra (kvseal-server[s3]): imported only for an s3:// store.
            import boto3  # noqa: PLC0415
            from botocore.config import Config  # noqa: PLC0415
        except ImportError:
            raise StoreLayoutError(
                "an s3:// store needs boto3: install kvseal-server[s3]"
            ) from None
        keys: dict[str, str] = {}
        if loc.credentials.startswith("file:"):
            key_id, secret = read_credentials_file(loc.credentials[5:])
            keys = {"aws_access_key_id": key_id, "aws_secret_access_key": secret}
        config = Config(
            connect_timeout=loc.timeout_s,
            read_timeout=loc.timeout_s,
            # standard mode counts the first attempt: retries=0 is one attempt.
            retries={"max_attempts": loc.retries + 1, "mode": "standard"},
            max_pool_connections=pool,
            s3={"addressing_style": "path"} if loc.endpoint else {},
            # Checksums only where S3 requires them: the records carry their
            # own authentication, and some S3 servers mishandle the trailers.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        return boto3.session.Session(**keys).client(
            "s3", endpoint_url=loc.endpoint, region_name=loc.region, config=config
        )

    @property
    def location(self) -> str:
        return self.loc.describe()

    # ------------------------------------------------------------ helpers

    def shard_of(self, name: str) -> str:
        return f"{int(name[:2], 16) % self.fanout:02x}"

    def _key(self, name: str) -> str:
        return f"{self.loc.prefix}{self.shard_of(name)}/{name}"

    def path_of(self, name: str) -> str:
        return f"s3://{self.loc.bucket}/{self._key(name)}"

    def _call(self, op: str, **kw: Any) -> Any:
        """One S3 request; anything but a ClientError with a code becomes
        StoreUnavailable (connection refused, timeouts, unparsable answers)."""
        client = self._client
        if client is None:
            raise StoreUnavailable("the S3 store is closed")
        if time.monotonic() < self._down_until:
            raise StoreUnavailable(f"S3 {op}: the server failed recently (backing off)")
        try:
            return getattr(client, op)(Bucket=self.loc.bucket, **kw)
        except Exception as e:
            code = _code(e)
            if code and not (code.startswith("5") or code in _SERVER_TROUBLE):
                raise _S3Error(op, code) from None
            self._down_until = time.monotonic() + self.loc.backoff_s
            raise StoreUnavailable(f"S3 {op}: {code or type(e).__name__}") from None

    # ------------------------------------------------------------ layout

    def _layout(self, default: int, wanted: int | None) -> int:
        key = self.loc.prefix + LAYOUT_FILE
        for _ in range(3):
            try:
                raw = self._read_key(key, 256)
            except _S3Error as e:
                raise StoreUnavailable(f"S3 {e.op}: {e.code}") from None
            if raw is None:
                text = f"kvseal-store {LAYOUT_VERSION} fanout={default}\n".encode()
                if self._put(key, text, create_only=True):
                    return default
                continue  # another opener created it first: read theirs
            m = _LAYOUT.fullmatch(bytes(raw[0]))
            if m is None or int(m[1]) != LAYOUT_VERSION:
                raise StoreLayoutError(f"{self.path_of_key(key)} is not a v1 layout object")
            fanout = int(m[2])
            if not (is_power_of_two(fanout) and fanout <= MAX_FANOUT):
                raise StoreLayoutError(f"{self.path_of_key(key)} names fanout {fanout}")
            if wanted is not None and wanted != fanout:
                raise StoreLayoutError(
                    f"{self.location} was created with fanout {fanout}, not {wanted}: every "
                    "replica sharing a store must use the same"
                )
            return fanout
        raise StoreLayoutError(f"{self.location}: the layout object keeps disappearing")

    def path_of_key(self, key: str) -> str:
        return f"s3://{self.loc.bucket}/{key}"

    # ------------------------------------------------------------ records

    def _read_key(
        self, key: str, max_bytes: int, scratch: bytearray | None = None
    ) -> tuple[bytearray | memoryview, Ident] | None:
        """GET of at most ``max_bytes`` + 1 bytes (Range), read against one
        deadline; None when absent or larger than ``max_bytes``."""
        try:
            r = self._call("get_object", Key=key, Range=f"bytes=0-{max_bytes}")
        except _S3Error as e:
            if e.code in _ABSENT:
                return None
            if e.code in ("InvalidRange", "416"):
                # Only an empty object has no byte 0: never a valid record;
                # removed unconditionally (no ETag came back with the 416).
                return bytearray(), None
            raise
        body = r["Body"]
        try:
            total = _total_size(r)
            if total > max_bytes:
                return None  # another replica's larger record: a miss, left in place
            deadline = time.monotonic() + self.loc.timeout_s * 4
            buf = (
                memoryview(scratch)[:total]
                if scratch is not None and len(scratch) >= total
                else bytearray(total)
            )
            n = 0
            while n < total:
                if time.monotonic() > deadline:
                    self._down_until = time.monotonic() + self.loc.backoff_s
                    raise StoreUnavailable("S3 get_object: the body is too slow")
                try:
                    chunk = body.read(min(_CHUNK, total - n))
                except Exception as e:
                    self._down_until = time.monotonic() + self.loc.backoff_s
                    raise StoreUnavailable(f"S3 get_object body: {type(e).__name__}") from None
                if not chunk:
                    break  # shorter than announced: the parser sees a truncated record
                buf[n : n + len(chunk)] = chunk
                n += len(chunk)
            if isinstance(buf, bytearray):
                del buf[n:]
                return buf, r.get("ETag")
            return buf[:n], r.get("ETag")
        finally:
            body.close()

    def read(
        self, name: str, max_bytes: int, scratch: bytearray | None = None
    ) -> tuple[bytearray | memoryview, Ident] | None:
        """See :meth:`.backend.StoreBackend.read`; the ident is the ETag."""
        try:
            return self._read_key(self._key(name), max_bytes, scratch)
        except _S3Error as e:
            raise StoreUnavailable(f"S3 {e.op}: {e.code}") from None

    def _head(self, key: str) -> str | None:
        """The object's ETag; None when absent."""
        try:
            return str(self._call("head_object", Key=key).get("ETag", ""))
        except _S3Error as e:
            if e.code in _ABSENT:
                return None
            raise StoreUnavailable(f"S3 {e.op}: {e.code}") from None

    def exists(self, name: str) -> bool:
        return self._head(self._key(name)) is not None

    def prefetch(self, name: str) -> None:
        """Nothing: a GET is one request either way (advice only)."""

    def touch(self, name: str) -> None:
        """Nothing: S3 cannot renew Last-Modified without a rewrite (the
        module docstring: eviction is by write time)."""

    def _put(self, key: str, data: bytes | bytearray, *, create_only: bool) -> bool:
        kw: dict[str, Any] = {"IfNoneMatch": "*"} if create_only else {}
        try:
            self._call("put_object", Key=key, Body=bytes(data), **kw)
        except _S3Error as e:
            if create_only and e.code in _LOST_RACE:
                return False
            raise StoreUnavailable(f"S3 {e.op}: {e.code}") from None
        return True

    def publish(
        self, name: str, data: bytes | bytearray, *, replace: bool, sync_dir: bool = False
    ) -> bool:
        """One PUT (atomic; durable when it returns); ``replace=False`` is
        conditional (If-None-Match: *)."""
        return self._put(self._key(name), data, create_only=not replace)

    def remove(self, name: str, ident: Ident | None = None) -> bool:
        """HEAD, then DELETE (with ``ident``: If-Match that ETag, and only if
        the HEAD saw it). True if an object was there and the delete went."""
        key = self._key(name)
        etag = self._head(key)
        if etag is None or (ident is not None and etag != ident):
            return False
        kw: dict[str, Any] = {"IfMatch": ident} if isinstance(ident, str) else {}
        try:
            self._call("delete_object", Key=key, **kw)
        except _S3Error as e:
            if e.code in _LOST_RACE or e.code in _ABSENT:
                return False
            raise StoreUnavailable(f"S3 {e.op}: {e.code}") from None
        return True

    def remove_planted(self, name: str) -> bool:
        """Nothing to do: every S3 object is a byte string, read on its merits."""
        return False

    # ------------------------------------------------------------ capacity

    def _list(self, prefix: str) -> list[tuple[float, int, str]]:
        """(Last-Modified, size, name) of every record under ``prefix``."""
        out: list[tuple[float, int, str]] = []
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Prefix": prefix, "MaxKeys": 1000}
            if token:
                kw["ContinuationToken"] = token
            try:
                page = self._call("list_objects_v2", **kw)
            except _S3Error as e:
                raise StoreUnavailable(f"S3 {e.op}: {e.code}") from None
            for obj in page.get("Contents", ()):
                name = str(obj.get("Key", "")).rpartition("/")[2]
                if _OBJECT.fullmatch(name) or _MARKER.fullmatch(name):
                    out.append((obj["LastModified"].timestamp(), int(obj.get("Size", 0)), name))
            if not page.get("IsTruncated"):
                return out
            token = page.get("NextContinuationToken")
            if not token:
                return out

    def make_room(self, name: str, incoming: int, shard_cap: int) -> Evicted:
        """List ``name``'s shard and delete its oldest-written block objects
        (scope records last) until ``incoming`` more bytes fit ``shard_cap``.
        Same tolerance as a directory: writers racing in one shard may each
        exceed its share by one record until the next put into it."""
        if incoming > shard_cap:
            raise StoreError(f"a {incoming}-byte record cannot fit a {shard_cap}-byte shard")
        records = self._list(f"{self.loc.prefix}{self.shard_of(name)}/")
        used = sum(size for _, size, _ in records)
        if used + incoming <= shard_cap:
            return Evicted()
        objects = sorted(r for r in records if _OBJECT.fullmatch(r[2]))
        markers = sorted(r for r in records if _MARKER.fullmatch(r[2]))
        n = freed = 0
        gone: list[str] = []
        for _when, size, victim in [*objects, *markers]:
            if used + incoming <= shard_cap:
                break
            try:
                self._call("delete_object", Key=self._key(victim))
            except _S3Error as e:
                raise StoreUnavailable(f"S3 {e.op}: {e.code}") from None
            n += 1
            freed += size
            gone.append(victim)
            used -= size
        return Evicted(n, freed, 0, tuple(gone))

    def usage(self) -> Usage:
        records = self._list(self.loc.prefix)
        objects = [r for r in records if _OBJECT.fullmatch(r[2])]
        return Usage(
            len(objects),
            len(records) - len(objects),
            sum(size for _, size, _ in records),
            0,
            0,
        )

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: S110 - a pool of dead connections: nothing to release
                pass


class _S3Error(Exception):
    """An S3 error answer with a code (internal: callers map it)."""

    def __init__(self, op: str, code: str) -> None:
        super().__init__(f"S3 {op}: {code}")
        self.op = op
        self.code = code


def _total_size(r: dict[str, Any]) -> int:
    """The object's full size from a ranged GET (Content-Range's total), or
    Content-Length when the server ignored the Range."""
    cr = r.get("ContentRange")
    if isinstance(cr, str) and "/" in cr:
        total = cr.rpartition("/")[2]
        if total.isdigit():
            return int(total)
    return int(r.get("ContentLength", 0))


def open_s3(url: str) -> BackendOpener:
    """A :data:`~.backend.BackendOpener` for ``url`` (parsed now: a bad URL
    fails before anything connects)."""
    loc = S3Location.parse(url)

    def opener(fanout: int | None, default_fanout: int) -> S3Backend:
        return S3Backend(loc, fanout=fanout, default_fanout=default_fanout)

    return opener
