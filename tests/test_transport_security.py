"""Control-plane security: owner-only Unix socket, SO_PEERCRED allow list,
TCP only with mutual TLS, and a daemon process that cannot dump core."""

from __future__ import annotations

import datetime
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from kvseal.client import ClientConfig, KVSealClient, KVSealRpcError

from .conftest import DaemonProc, until


def test_socket_is_owner_only(daemon: DaemonProc) -> None:
    st = os.stat(daemon.socket)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert st.st_uid == os.geteuid()
    sock_dir = Path(daemon.socket).parent
    assert stat.S_IMODE(sock_dir.stat().st_mode) == 0o700  # created by the daemon
    # Owner-only: gRPC listens on this socket itself (the kernel's check on the
    # 0600 socket is the uid check); no other socket reaches gRPC.
    assert sorted(p.name for p in sock_dir.iterdir()) == ["kvseal.sock", "kvseal.sock.lock"]
    assert "no relay" in daemon.log()


def test_relayed_socket_keeps_grpc_in_a_private_directory(
    daemon_factory: Callable[..., DaemonProc],
) -> None:
    d = daemon_factory("--allow-uid", str(os.getuid()), "--allow-uid", str(os.getuid() + 4242))
    with d.client() as c:
        assert c.health() == "SERVING"
    sock_dir = Path(d.socket).parent
    private = [p for p in sock_dir.iterdir() if p.name.startswith(".kvseal-")]
    assert len(private) == 1 and stat.S_IMODE(private[0].stat().st_mode) == 0o700
    assert [p.name for p in private[0].iterdir()] == ["grpc.sock"]
    admitted = f"admitted connection from pid {os.getpid()} uid {os.getuid()}"
    until(lambda: admitted in d.log(), "the admission in the daemon log")


def test_peer_uid_not_allowed_is_refused(daemon_factory: Callable[..., DaemonProc]) -> None:
    # Not an operator either (operators are admitted; tests/__init__.py makes
    # this uid one by default).
    d = daemon_factory(
        "--allow-uid", str(os.getuid() + 4242), wait=False, env={"KVSEAL_OPERATOR_UIDS": ""}
    )
    for _ in range(200):
        if os.path.exists(d.socket):
            break
        time.sleep(0.05)
    with (
        KVSealClient(ClientConfig(target=d.target, timeout_s=0.5, retries=1)) as c,
        pytest.raises(KVSealRpcError) as e,
    ):
        c.health()
    assert e.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert d.proc.poll() is None
    # The gate logs the refusal on its own thread; the client may have given up first.
    refused = f"uid {os.getuid()}: uid not in the allow list"
    until(lambda: refused in d.log(), "the refusal in the daemon log")


def test_allowed_uid_list_admits(daemon_factory: Callable[..., DaemonProc]) -> None:
    d = daemon_factory("--allow-uid", "4242", "--allow-uid", str(os.getuid()))
    with d.client() as c:
        assert c.health() == "SERVING"


def test_no_core_dumps(daemon: DaemonProc) -> None:
    limits = Path(f"/proc/{daemon.proc.pid}/limits").read_text()
    core = next(line for line in limits.splitlines() if line.startswith("Max core file size"))
    assert core.split()[4:6] == ["0", "0"]
    status = Path(f"/proc/{daemon.proc.pid}/status")
    # PR_SET_DUMPABLE=0 makes the kernel hand /proc/<pid> to root.
    assert status.stat().st_uid == 0


# ----------------------------------------------------------------- mTLS


def _cert(
    name: str,
    issuer_key: ec.EllipticCurvePrivateKey | None = None,
    issuer: x509.Certificate | None = None,
    ca: bool = False,
    san: list[x509.GeneralName] | None = None,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer.subject if issuer else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
    cert = b.sign(issuer_key or key, hashes.SHA256())
    return key, cert


def _pem(obj: object) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    assert isinstance(obj, ec.EllipticCurvePrivateKey)
    return obj.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_tcp_requires_mutual_tls(tmp_path: Path) -> None:
    import ipaddress

    ca_key, ca = _cert("kvseal-test-ca", ca=True)
    srv_key, srv = _cert(
        "kvseal",
        ca_key,
        ca,
        san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
    )
    cli_key, cli = _cert("engine", ca_key, ca)
    rogue_ca_key, rogue_ca = _cert("rogue-ca", ca=True)
    rogue_key, rogue = _cert("engine", rogue_ca_key, rogue_ca)
    files = {}
    for name, obj in {"ca": ca, "srv": srv, "srv_key": srv_key}.items():
        files[name] = tmp_path / f"{name}.pem"
        files[name].write_bytes(_pem(obj))
    port = _free_port()
    log = tmp_path / "daemon.log"
    args = [
        sys.executable,
        "-m",
        "kvseal.server",
        "--listen",
        f"tcp://127.0.0.1:{port}",
        "--backend",
        "cpu",
        "--host-bytes",
        "16MiB",
        "--tls-cert",
        str(files["srv"]),
        "--tls-key",
        str(files["srv_key"]),
        "--tls-client-ca",
        str(files["ca"]),
    ]
    with open(log, "wb") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT)
    try:

        def client(key: object | None, cert: object | None) -> KVSealClient:
            return KVSealClient(
                ClientConfig(
                    target=f"tcp://127.0.0.1:{port}",
                    timeout_s=2.0,
                    retries=1,
                    tls_root_ca=_pem(ca),
                    tls_key=_pem(key) if key else None,
                    tls_cert=_pem(cert) if cert else None,
                )
            )

        good = client(cli_key, cli)
        deadline = time.monotonic() + 20
        while True:
            try:
                assert good.health() == "SERVING"
                break
            except KVSealRpcError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise AssertionError(log.read_text()) from None
                time.sleep(0.1)
        good.close()
        for key, cert in ((None, None), (rogue_key, rogue)):
            with client(key, cert) as bad, pytest.raises(KVSealRpcError) as e:
                bad.health()
            assert e.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        proc.terminate()
        proc.wait(10)


def test_plaintext_tcp_is_refused(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvseal.server", "--listen", "tcp://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2
    assert "requires mutual TLS" in r.stderr


@pytest.mark.parametrize("relay", [False, True], ids=["owner-only", "relay"])
def test_pod_style_shared_directories_are_accepted(tmp_path: Path, relay: bool) -> None:
    """In a Kubernetes pod the socket volume and /tmp are emptyDirs (mode
    0777, no sticky bit, reachable only from the pod): the daemon must still
    start there. Owner-only, gRPC's own socket is the public one (0600); with
    the relay, its internal socket goes in a fresh 0700 directory."""
    from .conftest import start_daemon

    work = tmp_path / "pod"
    run, tmp = work / "run", work / "tmp"
    run.mkdir(parents=True)
    tmp.mkdir()
    os.chmod(run, 0o777)
    os.chmod(tmp, 0o777)
    flags = ["--allow-uid", str(os.getuid()), "--allow-uid", str(os.getuid() + 4242)]
    d = start_daemon(work, *(flags if relay else []), env={"TMPDIR": str(tmp)})
    try:
        with d.client() as c:
            assert c.health() == "SERVING"
        private = [p for p in run.iterdir() if p.name.startswith(".kvseal-")]
        if relay:
            assert len(private) == 1 and stat.S_IMODE(private[0].stat().st_mode) == 0o700
        else:
            assert not private
            assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o600
        assert "writable by others" in d.log()
    finally:
        d.stop()
