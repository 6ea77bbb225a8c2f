"""Daemons with a store tier meeting a store they cannot use at start-up: a
shard directory replaced by a symlink (planted by the host) stops the start
with the one-line exit 2 of every unusable ``--store-dir``, never a
traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvseal.server.store.fsstore import FsStore, StoreConfig
from kvseal.server.store.keysource import FileKeySource

from .store_helpers import key_file, store_flags


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
    r = subprocess.run(
        [sys.executable, "-m", "kvseal.server", "--listen",
         f"unix://{tmp_path}/run/s.sock", "--backend", "cpu", "--host-bytes", "1MiB",
         *store_flags(store, f"file:{key}")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert "--store-dir" in r.stderr and "not a directory" in r.stderr, r.stderr
    assert list((tmp_path / "elsewhere").iterdir()) == []
