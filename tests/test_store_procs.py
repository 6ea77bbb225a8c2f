"""FsStore shared by real processes: two writers both keep the capacity bound
(no central index), a writer killed with SIGKILL mid-put leaves a usable
store, and a block stored by one process (a replica, or the daemon before a
restart) is restored by another under the same deployment key (from a key
file), while a process with another key only misses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kvseal.server.store.fsstore import FsStore, StoreConfig
from kvseal.server.store.keysource import FileKeySource
from kvseal.server.store.record import record_bytes

BLOCK = 16 << 10
REC_ON_DISK = 20 << 10  # a 16,464-byte record takes five 4 KiB blocks

# A store process: argv[1] is a JSON job. Block i of writer w has a hash and
# bytes derived from (w, i), so any process can check what it reads.
WORKER = r"""
import hashlib, json, os, sys, time
from kvseal.server.store.fsstore import FsStore, StoreConfig
from kvseal.server.store.keysource import FileKeySource

job = json.loads(sys.argv[1])
def h(s): return hashlib.sha256(s.encode()).digest()
def kv(s): return (h(s) * (job["block"] // 32 + 1))[: job["block"]]
ns, tenant = h("model"), h(job.get("tenant", "tenant"))
store = FsStore(
    StoreConfig(job["path"], capacity_bytes=job["capacity"], max_object_bytes=job["block"],
                fanout=job["fanout"], durable=job.get("durable", True)),
    FileKeySource(job["key"]).load(),
)
out = {"read": {}}
if job["op"] == "put":
    while not os.path.exists(job["go"]):
        time.sleep(0.005)
    for i in range(job["count"]):
        store.put(ns, tenant, h(f"{job['writer']}/{i}"), kv(f"{job['writer']}/{i}"))
        print(i, flush=True)
elif job["op"] == "put-forever":
    i = 0
    while True:
        store.put(ns, tenant, h(f"{job['writer']}/{i}"), kv(f"{job['writer']}/{i}"))
        print(i, flush=True)
        i += 1
elif job["op"] == "get":
    for name in job["names"]:
        got = store.get(ns, tenant, h(name))
        out["read"][name] = None if got is None else (bytes(got) == kv(name))
elif job["op"] == "drop":
    store.delete_tenant(ns, tenant)
out["stats"] = store.stats().as_dict()
store.close()
print(json.dumps(out), flush=True)
"""


def key_file(path: Path, key: bytes) -> str:
    path.write_bytes(key.hex().encode() + b"\n")
    path.chmod(0o600)
    return str(path)


def job(tmp_path: Path, key: str, **kw: object) -> dict[str, object]:
    return {
        "path": str(tmp_path / "store"),
        "key": key,
        "block": BLOCK,
        "capacity": 1 << 20,
        "fanout": 2,
        **kw,
    }


def run(j: dict[str, object]) -> dict[str, object]:
    r = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps(j)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def open_store(tmp_path: Path, key: str, **kw: object) -> FsStore:
    return FsStore(
        StoreConfig(
            str(tmp_path / "store"),
            capacity_bytes=int(kw.pop("capacity", 1 << 20)),  # type: ignore[call-overload]
            max_object_bytes=BLOCK,
            fanout=2,
            **kw,  # type: ignore[arg-type]
        ),
        FileKeySource(key).load(),
    )


def test_two_writers_both_keep_the_bound(tmp_path: Path) -> None:
    """Two processes fill one directory at the same moment, each far past the
    capacity: afterwards it holds at most capacity + W (= 2) records."""
    key = key_file(tmp_path / "key", bytes(range(1, 33)))
    capacity = 2 * 12 * REC_ON_DISK  # 12 records per shard, 2 shards
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                WORKER,
                json.dumps(
                    job(tmp_path, key, op="put", writer=w, count=60, capacity=capacity, go=str(go))
                ),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for w in ("a", "b")
    ]
    go.touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    with open_store(tmp_path, key, capacity=capacity) as s:
        usage = s.usage()
    assert usage.temp_files == 0
    assert usage.total_bytes <= capacity + 2 * REC_ON_DISK
    assert usage.total_bytes > capacity // 2, "the store was filled, not emptied"
    assert all(r["stats"]["evictions"] > 0 for r in results), "both writers evicted"
    assert sum(r["stats"]["puts"] for r in results) == 120
    assert record_bytes(BLOCK) <= REC_ON_DISK


def test_a_writer_killed_mid_put_leaves_a_usable_store(tmp_path: Path) -> None:
    key = key_file(tmp_path / "key", bytes(range(2, 34)))
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            WORKER,
            json.dumps(job(tmp_path, key, op="put-forever", writer="w", capacity=8 << 20)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    published = -1
    deadline = time.monotonic() + 60  # only keeps a broken build from hanging
    while published < 40 and time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        published = int(line)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert published >= 40, p.stderr.read() if p.stderr else ""
    # Whatever it was doing, a temporary file it left is swept once stale.
    for tmp in (tmp_path / "store").rglob(".tmp-*"):
        os.utime(tmp, ns=(10**9, 10**9))
    names = [f"w/{i}" for i in range(published + 3)]
    out = run(job(tmp_path, key, op="get", names=names, capacity=8 << 20))
    read = out["read"]
    assert isinstance(read, dict)
    assert all(read[f"w/{i}"] is True for i in range(published + 1)), "every published block"
    assert all(v in (True, None) for v in read.values()), "never wrong bytes"
    assert out["stats"]["integrity_failures"] == 0  # type: ignore[index]
    with open_store(tmp_path, key, capacity=8 << 20) as s:
        assert s.usage().temp_files == 0


def test_replicas_and_restarts_share_blocks_under_one_key(tmp_path: Path) -> None:
    key = key_file(tmp_path / "key", bytes(range(3, 35)))
    other = key_file(tmp_path / "other", bytes(range(4, 36)))
    go = tmp_path / "go"
    go.touch()
    run(job(tmp_path, key, op="put", writer="r1", count=5, go=str(go)))
    names = [f"r1/{i}" for i in range(5)]
    # Another process (a second replica, or the first one restarted) restores them.
    assert run(job(tmp_path, key, op="get", names=names))["read"] == dict.fromkeys(names, True)
    # A process with another deployment key: misses, no error, never bytes.
    out = run(job(tmp_path, other, op="get", names=names))
    assert out["read"] == dict.fromkeys(names, None)
    assert out["stats"]["integrity_failures"] == 0  # type: ignore[index]
    # A drop in one process is seen by the next.
    run(job(tmp_path, key, op="drop"))
    assert run(job(tmp_path, key, op="get", names=names))["read"] == dict.fromkeys(names, None)


@pytest.mark.parametrize("mode", [0o644])
def test_a_key_file_others_can_read_stops_the_process(tmp_path: Path, mode: int) -> None:
    key = key_file(tmp_path / "key", bytes(range(5, 37)))
    os.chmod(key, mode)
    r = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps(job(tmp_path, key, op="drop"))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "mode 0644" in r.stderr
    assert bytes(range(5, 37)).hex() not in r.stderr
