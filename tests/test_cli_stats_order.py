"""``kvseal stats`` prints its fields in one order, whatever their values.

The text output lists StatsReply's fields in their order in kvseal.proto.
(``MessageToDict`` puts the fields that are set first and the zero ones after,
so the order used to change as counters left zero.) A real daemon, read
before and after it stored blocks: the same keys, in the proto's order.
"""

from __future__ import annotations

import subprocess
import sys

from kvseal.client import tenant_digest
from kvseal.client.shm import KVShape, SharedKVPool
from kvseal.v1 import kvseal_pb2 as pb

from .conftest import DaemonProc


def _keys(daemon: DaemonProc) -> list[str]:
    r = subprocess.run(
        [sys.executable, "-m", "kvseal.client.cli", "--socket", daemon.socket, "stats"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return [line.split()[0] for line in r.stdout.splitlines()]


def test_stats_fields_in_proto_order(daemon: DaemonProc) -> None:
    proto_order = [f.name for f in pb.StatsReply.DESCRIPTOR.fields]
    idle = _keys(daemon)  # most counters zero
    with SharedKVPool(KVShape(4, 4, 2, 2, 16), "vllm_per_layer") as pool, daemon.client() as c:
        h = c.register_pool("stats-order", b"model:stats", pool.geometry())
        c.offload(h.pool_id, tenant_digest(None), [bytes([i]) * 32 for i in (1, 2)], [0, 1])
        c.lookup(h.pool_id, tenant_digest(None), [bytes([1]) * 32])
        busy = _keys(daemon)  # pools, lookups, blocks and bytes no longer zero
    assert idle == busy == proto_order
