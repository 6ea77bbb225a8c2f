"""The operator CLI against a real daemon, and the daemon's own CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

from google.protobuf.descriptor import FieldDescriptor
from kvseal.client import tenant_digest
from kvseal.client.shm import KVShape, SharedKVPool
from kvseal.v1 import kvseal_pb2 as pb

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


INTEGERS = {
    FieldDescriptor.CPPTYPE_INT32,
    FieldDescriptor.CPPTYPE_INT64,
    FieldDescriptor.CPPTYPE_UINT32,
    FieldDescriptor.CPPTYPE_UINT64,
}


def test_stats_json_integers_are_numbers(daemon: DaemonProc) -> None:
    """Every integer of ``stats --json`` is a JSON number, the 64-bit counters
    too (protobuf's JSON mapping writes those as strings), so a script can
    subtract two snapshots."""
    before = json.loads(_kvseal("--socket", daemon.socket, "stats", "--json").stdout)
    with SharedKVPool(KVShape(4, 4, 2, 2, 16), "vllm_per_layer") as pool, daemon.client() as c:
        h = c.register_pool("stats-json", b"model:stats-json", pool.geometry())
        c.offload(h.pool_id, tenant_digest(None), [bytes([i]) * 32 for i in (1, 2)], [0, 1])
        r = _kvseal("--socket", daemon.socket, "stats", "--json")
    assert r.returncode == 0, r.stderr
    after = json.loads(r.stdout)
    integers = [f.name for f in pb.StatsReply.DESCRIPTOR.fields if f.cpp_type in INTEGERS]
    assert "offloaded_bytes" in integers and "pools" in integers
    for doc in (before, after):
        assert set(integers) <= set(doc)
        for name in integers:
            assert type(doc[name]) is int, (name, doc[name])
    assert after["offloaded_blocks"] - before["offloaded_blocks"] == 2
    assert after["pools"] - before["pools"] == 1
    assert after["offloaded_bytes"] - before["offloaded_bytes"] == 2 * pool.shape.block_bytes
    assert after["scope"] == "STATS_SCOPE_DAEMON"  # enums stay names


def test_stats_without_operator_rights_says_why_the_counts_are_zero(
    daemon_factory: Callable[..., DaemonProc],
) -> None:
    """The quick start's ``kvseal stats`` against a daemon without
    --operator-uid: the configuration and zeros, and a note on stderr saying
    how to see the counts; an operator gets no note."""
    plain = daemon_factory(env={"KVSEAL_OPERATOR_UIDS": ""})
    r = _kvseal("--socket", plain.socket, "stats")
    assert r.returncode == 0, r.stderr
    assert "STATS_SCOPE_FACTS" in r.stdout
    assert "--operator-uid" in r.stderr and "--pool" in r.stderr
    r = _kvseal("--socket", plain.socket, "stats", "--json")  # stdout stays pure JSON
    assert json.loads(r.stdout)["scope"] == "STATS_SCOPE_FACTS"
    op = daemon_factory()  # the suite's operator uid
    r = _kvseal("--socket", op.socket, "stats")
    assert "STATS_SCOPE_DAEMON" in r.stdout and r.stderr == ""


def test_selftest_real_geometry(daemon: DaemonProc) -> None:
    # A loaded CI machine can take seconds per 16 MiB request: the deadline is generous.
    r = _kvseal("--socket", daemon.socket, "--timeout", "60", "selftest", "--blocks", "4")
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


def test_stats_says_that_engines_lookups_are_not_counted(daemon: DaemonProc) -> None:
    """An engine's prefix hits are answered by its mirror of the tier, with no
    Lookup call: a user who watched restores grow beside ``lookups 0`` was
    misled. The text output says so on the two lookup lines; after a real
    offload, lookup and restore the counts are still the daemon's numbers, and
    --json carries no note."""
    with SharedKVPool(KVShape(4, 4, 2, 2, 16), "vllm_per_layer") as pool, daemon.client() as c:
        h = c.register_pool("stats-note", b"model:stats-note", pool.geometry())
        hashes = [bytes([i]) * 32 for i in (1, 2)]
        c.offload(h.pool_id, tenant_digest(None), hashes, [0, 1])
        c.restore(h.pool_id, tenant_digest(None), hashes, [2, 3])
        r = _kvseal("--socket", daemon.socket, "stats")
        js = _kvseal("--socket", daemon.socket, "stats", "--json")
    assert r.returncode == 0, r.stderr
    lines = {line.split()[0]: line for line in r.stdout.splitlines()}
    assert lines["lookups"].split()[1] == "0"  # no Lookup call was made ...
    assert lines["restored_blocks"].split()[1] == "2"  # ... while blocks were restored
    assert "mirror" in lines["lookups"] and "restored_blocks" in lines["lookups"]
    assert "Lookup calls" in lines["lookup_hit_blocks"]
    assert "mirror" not in js.stdout and json.loads(js.stdout)["lookups"] == 0
