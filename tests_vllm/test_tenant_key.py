"""The vLLM adapter's tenants follow the deployment's tenant key
(``KVSEAL_TENANT_KEY_FILE``, docs/security-model.md "Tenants"), as the engine
contract says: with the key set, a salt's tenant is the keyed digest (which a
peer without the key cannot compute), and a key file others can read fails
the adapter's import, i.e. the engine's start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CHECK = """
from kvseal.client import tenant_digest, load_tenant_key
from kvseal.vllm import manager
key = load_tenant_key()
assert manager.TENANT_KEY == key
assert manager.SHARED_TENANT == tenant_digest(None, key=key)
manager._salts["r1"] = "alice"
m = object.__new__(manager.KVSealOffloadingManager)
m.mirrors = []
t = m._tenant_of("r1")
assert t == tenant_digest("alice", key=key), "salted tenant"
print("keyed" if key else "unkeyed", t != tenant_digest("alice"))
"""


def _run(env_key: str | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("KVSEAL_TENANT_KEY_FILE", None)
    if env_key is not None:
        env["KVSEAL_TENANT_KEY_FILE"] = env_key
    return subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120
    )


def test_tenants_are_keyed_by_the_tenant_key_file(tmp_path: Path) -> None:
    key = tmp_path / "tenant.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    r = _run(str(key))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["keyed", "True"]
    r = _run(None)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["unkeyed", "False"]


def test_a_key_file_others_can_read_fails_the_start(tmp_path: Path) -> None:
    key = tmp_path / "tenant.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o644)
    r = _run(str(key))
    assert r.returncode != 0
    assert "ValueError" in r.stderr
    assert key.read_bytes().hex() not in r.stderr  # the key never reaches the error
