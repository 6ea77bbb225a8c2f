"""Closing a SharedKVPool never unmaps memory under live torch tensors.

``torch.frombuffer`` keeps no buffer export of its own, so without one held
for the tensors ``close()`` (or the pool's finalizer, when the engine keeps
only ``.tensors()``) would unmap the pool and the next tensor access would
segfault: the engine runs in a subprocess so that crash shows as a signal.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

ENGINE = """
import gc, os, sys
import torch  # imported up front: the pool then is collectable as soon as it is dropped
from kvseal.client.shm import KVShape, SharedKVPool
shape = KVShape(num_pages=4, tokens_per_page=4, num_layers=2, num_kv_heads=2, head_dim=16)
pool = SharedKVPool(shape, sys.argv[2], name_prefix="kvseal-test")
names = [b.name for b in pool.buffers]
tensors = pool.tensors()
views = [t[1:] for t in tensors]  # a view of a view keeps the memory too
if sys.argv[1] == "close":
    pool.close()
else:  # drop the pool, keep the tensors: the finalizer runs
    del pool
    gc.collect()
print("unlinked", not any(os.path.exists("/dev/shm/" + n) for n in names))
del tensors
gc.collect()
for v in views:
    v.fill_(3)  # segfaulted here before the fix
print("written", all(bool((v == 3).all()) for v in views))
mapped = lambda: any(n in open("/proc/self/maps").read() for n in names)
print("mapped", mapped())
del v, views
gc.collect()
print("mapped", mapped())
"""


@pytest.mark.parametrize(
    ("how", "layout"),
    [
        ("close", "vllm_per_layer"),
        ("close", "vllm_cross_layer"),
        ("close", "sglang_per_layer"),
        ("drop", "vllm_per_layer"),
    ],
)
def test_close_with_live_tensors_defers_the_unmap(how: str, layout: str) -> None:
    pytest.importorskip("torch")
    r = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", ENGINE, how, layout],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, f"engine exited with {r.returncode}:\n{r.stderr}"
    lines = r.stdout.split("\n")
    assert lines[0] == "unlinked True"  # the names go at once
    assert lines[1] == "written True"  # the tensors still work on the real memory
    assert lines[2] == "mapped True"  # still mapped under the live views
    assert lines[3] == "mapped False"  # and unmapped with the last of them
