"""Helpers for the tests of daemons with a store tier (``--store-dir``)."""

from __future__ import annotations

import os
import re
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvseal.client import chain_block_hashes

from .conftest import until

FP = b"model:store-test@rev1"
OBJECT = re.compile(r"[0-9a-f]{64}")
# SMALL geometry blocks are 1 KiB; a 64 MiB store with 1 MiB objects at most
# is 4 shards of 16 MiB (the store's own sizing: 8 whole records per shard).
STORE_BYTES = "64MiB"
MAX_BLOCK = "1MiB"


def key_file(path: Path, key: bytes | None = None) -> Path:
    """A deployment key file (64 hex digits, mode 0600) the daemon accepts."""
    path.write_text((key or os.urandom(32)).hex() + "\n")
    path.chmod(0o600)
    return path


def store_flags(store: Path, key: str, *extra: str) -> tuple[str, ...]:
    return (
        "--store-dir",
        str(store),
        "--store-bytes",
        STORE_BYTES,
        "--store-max-block-bytes",
        MAX_BLOCK,
        "--store-key",
        key,
        *extra,
    )


def objects(store: Path) -> list[Path]:
    """Every block object in the store (not markers, layout or temp files)."""
    if not store.exists():
        return []
    return sorted(
        p for shard in store.iterdir() if shard.is_dir() for p in shard.iterdir()
        if OBJECT.fullmatch(p.name)
    )  # fmt: skip


def scope_records(store: Path) -> tuple[list[Path], list[Path]]:
    """The store's scope markers and floor records (``.scope`` files, told
    apart by their size)."""
    from kvseal.server.store.scopes import FLOOR_BYTES, MARKER_BYTES

    files = sorted(store.glob("*/*.scope"))
    markers = [p for p in files if p.stat().st_size == MARKER_BYTES]
    floors = [p for p in files if p.stat().st_size == FLOOR_BYTES]
    assert len(markers) + len(floors) == len(files), files
    return markers, floors


def wait_objects(store: Path, n: int) -> list[Path]:
    """Wait until the spill thread has published at least ``n`` objects."""
    until(lambda: len(objects(store)) >= n, f"{n} objects in {store}")
    return objects(store)


def chain(n: int, tokens_per_page: int, salt: bytes | None = None) -> list[bytes]:
    return chain_block_hashes(
        list(os.urandom(n * tokens_per_page)), tokens_per_page, cache_salt=salt
    )


def scrape(port: int) -> dict[str, float]:
    """The daemon's /metrics as name -> value (unlabelled samples only)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            out[name] = float(value)
    return out


def store_and_stop(
    daemon_factory: Callable[..., Any],
    flags: Sequence[str],
    geometry: Any,
    tenant: bytes,
    hashes: list[bytes],
    store: Path,
) -> list[Path]:
    """Offload ``hashes`` from pages 0, 1, ... through a daemon started with
    ``flags`` (pool "engine" of ``geometry``), wait until every one is in
    ``store``, stop the daemon cleanly (exit 0); the objects written."""
    d = daemon_factory(*flags)
    with d.client() as c:
        h = c.register_pool("engine", FP, geometry)
        c.offload(h.pool_id, tenant, hashes, list(range(len(hashes))))
    found = wait_objects(store, len(hashes))
    assert d.stop() == 0
    return found
