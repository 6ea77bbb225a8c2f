"""The operator CLI against a real daemon, and the daemon's own CLI."""

from __future__ import annotations

import json
import subprocess
import sys

from .conftest import DaemonProc


def _kvseal(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvseal.client.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_health_and_stats(daemon: DaemonProc) -> None:
    r = _kvseal("--socket", daemon.socket, "health")
    assert r.returncode == 0 and r.stdout.strip() == "SERVING"
    r = _kvseal("--socket", daemon.socket, "stats", "--json")
    assert r.returncode == 0
    doc = json.loads(r.stdout)
    assert doc["backend"] == "BACKEND_CPU" and doc["integrity_policy"] == "abort"
    assert int(doc["host_bytes_capacity"]) == 256 * 1024 * 1024


def test_selftest_real_geometry(daemon: DaemonProc) -> None:
    r = _kvseal("--socket", daemon.socket, "selftest", "--blocks", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "every byte identical" in r.stdout and r.stdout.strip().endswith("PASS")
    assert "4194304" in r.stdout  # real Qwen3-32B block size
    # It cleaned up after itself.
    r = _kvseal("--socket", daemon.socket, "stats", "--json")
    doc = json.loads(r.stdout)
    assert int(doc.get("blocks_ready", 0)) == 0 and int(doc.get("pools", 0)) == 0


def test_unreachable_exit_code(tmp_path: object) -> None:
    r = _kvseal("--socket", "/nonexistent/kvseal.sock", "--timeout", "1", "health")
    assert r.returncode == 2 and "UNREACHABLE" in r.stderr


def test_server_help_documents_flags() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvseal.server", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0
    for flag in (
        "--listen",
        "--backend",
        "--host-bytes",
        "--host-region",
        "--on-integrity-failure",
        "--allow-uid",
        "--tls-cert",
        "--metrics-address",
    ):
        assert flag in r.stdout


def test_bad_flag_values_exit_2(tmp_path: object) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvseal.server", "--host-bytes", "lots"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "not a size" in r.stderr


def test_a_relative_socket_path_works(daemon: DaemonProc) -> None:
    """``--socket`` relative to the working directory (gRPC's ``unix://`` takes
    absolute paths only: the CLI must not pass the relative one through)."""
    import os

    sock_dir, name = os.path.split(daemon.socket)
    r = subprocess.run(
        [sys.executable, "-m", "kvseal.client.cli", "--socket", name, "health"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=sock_dir,
    )
    assert r.returncode == 0 and r.stdout.strip() == "SERVING", r.stderr[-2000:]
