"""Daemons with a store tier refusing to start (exit 2, one line, never a
traceback): a shard directory replaced by a symlink (planted by the host),
and a CDH endpoint off the guest's loopback without the explicit
``--store-cdh-insecure-endpoint``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvseal.server.store.fsstore import FsStore, StoreConfig
from kvseal.server.store.keysource import FileKeySource

from .store_helpers import key_file, store_flags


def _start(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvseal.server", "--listen",
         f"unix://{tmp_path}/run/s.sock", "--backend", "cpu", "--host-bytes", "1MiB", *flags],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_cdh_endpoint_off_the_loopback_is_refused(tmp_path: Path) -> None:
    flags = store_flags(tmp_path / "store", "cdh:default/kvseal/store-key")
    r = _start(tmp_path, *flags, "--store-cdh-endpoint", "http://10.0.0.5:8006")
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "loopback" in r.stderr, r.stderr
    # With the opt-in the endpoint is accepted (and then unreachable: still exit 2,
    # but for the fetch, after --store-key-wait).
    r = _start(
        tmp_path, *flags, "--store-cdh-endpoint", "http://192.0.2.1:8006",
        "--store-cdh-insecure-endpoint", "--store-key-wait", "0",
    )  # fmt: skip
    assert r.returncode == 2 and "loopback" not in r.stderr, r.stderr


def test_planted_shard_symlink_at_start_exits_2_in_one_line(tmp_path: Path) -> None:
    store, key = tmp_path / "store", key_file(tmp_path / "key")
    FsStore(
        StoreConfig(str(store), capacity_bytes=64 << 20, max_object_bytes=1 << 20),
        FileKeySource(str(key)).load(),
    ).close()
    (tmp_path / "elsewhere").mkdir()
    shard = store / "00"
    if shard.exists():
        shard.rmdir()
    shard.symlink_to(tmp_path / "elsewhere")
    r = _start(tmp_path, *store_flags(store, f"file:{key}"))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "--store-dir" in r.stderr and "not a directory" in r.stderr, r.stderr
    assert list((tmp_path / "elsewhere").iterdir()) == []
