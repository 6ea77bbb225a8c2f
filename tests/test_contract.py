"""Contracts between proto/, the generated code, the server and the client."""

from __future__ import annotations

import inspect
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from kvseal.server.service import KVSealServicer
from kvseal.v1 import kvseal_pb2 as pb
from kvseal.v1 import kvseal_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_matches_proto(tmp_path: Path) -> None:
    """`make proto` output is committed; fail when it drifts from proto/."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            str(ROOT / "proto"),
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            "kvseal/v1/kvseal.proto",
        ],
        check=True,
        cwd=ROOT,
    )
    for name in ("kvseal_pb2.py", "kvseal_pb2.pyi", "kvseal_pb2_grpc.py"):
        fresh = (tmp_path / "kvseal" / "v1" / name).read_text()
        committed = (ROOT / "client" / "kvseal" / "v1" / name).read_text()
        assert fresh == committed, f"client/kvseal/v1/{name} is stale: run `make proto`"


def test_every_rpc_has_exactly_one_handler() -> None:
    service = pb.DESCRIPTOR.services_by_name["KVSeal"]
    rpcs = {m.name for m in service.methods}
    base = pb_grpc.KVSealServicer
    for name in rpcs:
        impl = getattr(KVSealServicer, name)
        assert impl is not getattr(base, name), f"{name} is not implemented"
        assert "context" in inspect.signature(impl).parameters
    # and nothing that looks like a handler is dangling without an RPC
    handlers = {n for n, v in vars(KVSealServicer).items() if n[:1].isupper() and callable(v)}
    assert handlers == rpcs


def test_client_imports_no_server_torch_or_gpu_code() -> None:
    code = (
        "import sys, kvseal.client, kvseal.client.cli, kvseal.client.shm\n"
        "bad = [m for m in sys.modules if m.startswith(('kvseal.server', 'torch', 'cuda'))]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


@pytest.mark.parametrize("dist", ["client", "server"])
def test_distributions_build_with_the_right_contents(tmp_path: Path, dist: str) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT / dist),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    meta = next(n for n in names if n.endswith("METADATA"))
    requires = [
        line.split(":", 1)[1].strip()
        for line in zipfile.ZipFile(wheel).read(meta).decode().splitlines()
        if line.startswith("Requires-Dist:")
    ]
    if dist == "client":
        assert "kvseal/v1/kvseal_pb2.py" in names and "kvseal/client/client.py" in names
        assert not any(n.startswith("kvseal/server/") for n in names)
        assert not any(n == "kvseal/__init__.py" for n in names)  # namespace package
        hard = [r for r in requires if "extra ==" not in r]
        assert sorted(r.split(">")[0].split("=")[0].split("<")[0] for r in hard) == [
            "grpcio",
            "protobuf",
        ]
    else:
        assert "kvseal/server/main.py" in names
        assert not any(n.startswith(("kvseal/client/", "kvseal/v1/")) for n in names)
        assert any(r.startswith("kvseal-client") for r in requires)
