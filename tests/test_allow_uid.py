"""``--allow-uid`` admits other uids for real: the socket's mode and group follow
the allow list (or ``--socket-group``), and SO_PEERCRED stays the gate.

The clients run as other uids (``setpriv``; the tests need root) and do real
work: a pool in shared memory they own, offload, restore, compare. When the
interpreter lives where another uid cannot read it (e.g. under /root), the
client gets CAP_DAC_READ_SEARCH only, which lets it *read* files but not
connect to a socket it has no write permission on: the socket's mode is still
what decides, and the directory's search bit is checked with stat.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import start_daemon

ADMITTED, REFUSED, OUTSIDER = 23456, 23457, 23458
GROUP = 23400
SALT = "allow-uid-test-salt-3f9c"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root and setpriv to run clients as other uids",
)

CLIENT = r"""
import os, sys
import grpc
from kvseal.client import ClientConfig, KVSealClient, KVSealRpcError, chain_block_hashes, tenant_digest
from kvseal.client.shm import KVShape, SharedKVPool

target, mode = sys.argv[1], sys.argv[2]
print("PID", os.getpid(), flush=True)
if mode == "refused":
    with KVSealClient(ClientConfig(target=target, timeout_s=2, retries=1)) as c:
        try:
            c.health()
        except KVSealRpcError as e:
            print("REFUSED", e.code.name, flush=True)
            sys.exit(0)
    print("ADMITTED?!")
    sys.exit(1)
shape = KVShape(num_pages=4, tokens_per_page=4, num_layers=2, num_kv_heads=2, head_dim=16)
with SharedKVPool(shape, "vllm_per_layer", name_prefix="kvseal-test-uid") as pool, KVSealClient(
    ClientConfig(target=target, timeout_s=10)
) as c:
    assert c.health() == "SERVING"
    data = [os.urandom(shape.block_bytes) for _ in range(2)]
    for p, d in enumerate(data):
        pool.write_block(p, d)
    tenant = tenant_digest(sys.argv[3])
    hashes = chain_block_hashes(list(os.urandom(8)), 4, cache_salt=sys.argv[3].encode())
    h = c.register_pool("uid-engine", b"fp", pool.geometry())
    assert c.offload(h.pool_id, tenant, hashes, [0, 1]).stored_blocks == 2
    pool.fill_page(2, 0); pool.fill_page(3, 0)
    assert c.restore(h.pool_id, tenant, hashes, [2, 3]).restored_blocks == 2
    assert [pool.read_block(2), pool.read_block(3)] == data
    print("TENANT", tenant.hex(), flush=True)
    print("HASHES", *[x.hex() for x in hashes], flush=True)
    from kvseal.client.liveness import daemon_gone
    print("GONE", daemon_gone(target), flush=True)  # the lock file is readable: False
    print("ROUNDTRIP", os.getuid(), flush=True)
"""


def _setpriv(uid: int, gid: int, caps: bool) -> list[str]:
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
    if caps:
        cmd += ["--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search"]
    return cmd


def _needs_caps() -> bool:
    """Whether another uid needs CAP_DAC_READ_SEARCH to run this interpreter."""
    for caps in (False, True):
        r = subprocess.run(
            [*_setpriv(ADMITTED, ADMITTED, caps), sys.executable, "-c", "import kvseal.client"],
            capture_output=True,
            timeout=60,
        )
        if r.returncode == 0:
            return caps
    pytest.skip("no interpreter another uid can run")


def as_uid(
    uid: int, target: str, mode: str, gid: int | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *_setpriv(uid, uid if gid is None else gid, _CAPS[0]),
            sys.executable,
            "-c",
            CLIENT,
            target,
            mode,
            SALT,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/"},
        cwd="/",
    )


_CAPS: list[bool] = []


@pytest.fixture
def base() -> Iterator[Path]:
    """A work directory every uid can traverse (pytest's own tmp is root-only)."""
    if not _CAPS:
        _CAPS.append(_needs_caps())
    d = Path(tempfile.mkdtemp(prefix="kvseal-allow-uid-"))
    d.chmod(0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _pid(out: str) -> int:
    return int(next(line.split()[1] for line in out.splitlines() if line.startswith("PID")))


def test_listed_uid_admitted_unlisted_refused(base: Path) -> None:
    (base / "d" / "run").mkdir(parents=True, mode=0o700)  # an existing owner-only directory
    d = start_daemon(base / "d", "--allow-uid", str(ADMITTED), "--allow-uid", str(os.getuid()))
    try:
        st = os.stat(d.socket)
        assert stat.S_IMODE(st.st_mode) == 0o666  # who may try; SO_PEERCRED decides
        sock_dir = os.stat(os.path.dirname(d.socket))
        assert stat.S_IMODE(sock_dir.st_mode) & 0o001 and not sock_dir.st_mode & 0o066
        assert stat.S_IMODE(os.stat(d.socket + ".lock").st_mode) == 0o644

        ok = as_uid(ADMITTED, d.target, "admitted")
        assert ok.returncode == 0, ok.stdout + ok.stderr
        assert f"ROUNDTRIP {ADMITTED}" in ok.stdout
        assert "GONE False" in ok.stdout
        no = as_uid(REFUSED, d.target, "refused")
        assert no.returncode == 0, no.stdout + no.stderr
        assert "REFUSED" in no.stdout

        with d.client() as c:  # the daemon's own uid is still admitted
            assert c.health() == "SERVING"
        log = d.log()
        assert f"admitted connection from pid {_pid(ok.stdout)} uid {ADMITTED}" in log
        assert (
            f"refused connection from pid {_pid(no.stdout)} uid {REFUSED}: uid not in the allow list"
            in log
        )
        # Ids only: neither the cache salt, the tenant digest nor block hashes.
        secrets = [SALT]
        for line in ok.stdout.splitlines():
            if line.startswith(("TENANT", "HASHES")):
                secrets += line.split()[1:]
        for s in secrets:
            assert s not in log
    finally:
        assert d.stop() == 0


def test_default_socket_stays_owner_only(base: Path) -> None:
    d = start_daemon(base / "d")
    try:
        assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(d.socket)).st_mode) == 0o700
        no = as_uid(ADMITTED, d.target, "refused")
        assert "REFUSED" in no.stdout, no.stdout + no.stderr
        assert f"uid {ADMITTED}" not in d.log()  # it could not even reach the gate
    finally:
        d.stop()


def test_socket_group_narrows_who_can_connect(base: Path) -> None:
    d = start_daemon(
        base / "d",
        "--allow-uid",
        str(ADMITTED),
        "--allow-uid",
        str(REFUSED),
        "--allow-uid",
        str(os.getuid()),  # root: passes any mode; lets the fixture see SERVING
        "--socket-group",
        str(GROUP),
    )
    try:
        st = os.stat(d.socket)
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == GROUP
        sock_dir = os.stat(os.path.dirname(d.socket))
        assert sock_dir.st_gid == GROUP and stat.S_IMODE(sock_dir.st_mode) == 0o710
        # Listed and in the group: admitted.
        ok = as_uid(ADMITTED, d.target, "admitted", gid=GROUP)
        assert f"ROUNDTRIP {ADMITTED}" in ok.stdout, ok.stdout + ok.stderr
        # In the group but not listed: reaches the gate, which refuses it.
        out = as_uid(OUTSIDER, d.target, "refused", gid=GROUP)
        assert "REFUSED" in out.stdout, out.stdout + out.stderr
        # Listed but not in the group: the socket's mode keeps it out.
        lone = as_uid(REFUSED, d.target, "refused")
        assert "REFUSED" in lone.stdout, lone.stdout + lone.stderr
        log = d.log()
        assert f"admitted connection from pid {_pid(ok.stdout)} uid {ADMITTED}" in log
        assert f"refused connection from pid {_pid(out.stdout)} uid {OUTSIDER}" in log
        assert f"from pid {_pid(lone.stdout)} " not in log
    finally:
        assert d.stop() == 0


def test_unknown_socket_group_is_refused(base: Path) -> None:
    d = start_daemon(base / "d", "--socket-group", "no-such-group-kvseal", wait=False)
    assert d.wait_exit() == 2
    assert "--socket-group no-such-group-kvseal: no such group" in d.log()
