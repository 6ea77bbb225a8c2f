"""``kvseal-server --store s3://...`` end to end: real daemon processes, a real
engine-side pool, a real S3 server (SeaweedFS on the loopback). A restarted
daemon restores what the first one stored; tampered objects are never written
into the pool; a server that goes down costs misses, and the daemon finds it
again by itself; the credentials never reach the log.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path

import pytest
from kvseal.client import KVSealRpcError, tenant_digest
from kvseal.client.shm import SharedKVPool

from tests.conftest import (  # noqa: F401 - fixtures
    DaemonProc,
    daemon_factory,
    fill_random,
    is_poisoned,
    poison,
    pool_factory,
    until,
)
from tests.store_helpers import FP, MAX_BLOCK, STORE_BYTES, chain, key_file

from .conftest import BUCKET, SECRET_KEY, new_weed, s3_client

Factory = Callable[..., DaemonProc]


def _objects(client: object, prefix: str) -> list[str]:
    page = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix)  # type: ignore[attr-defined]
    return [
        o["Key"] for o in page.get("Contents", ())
        if len(o["Key"].rpartition("/")[2]) == 64
    ]  # fmt: skip


def test_a_daemon_on_s3_restores_after_restart_and_survives_the_server(
    tmp_path: Path,
    daemon_factory: Factory,  # noqa: F811
    pool_factory: Callable[..., SharedKVPool],  # noqa: F811
    credentials_file: Path,
) -> None:
    weed = new_weed(tmp_path / "weed")
    weed.start()
    try:
        prefix = f"d-{secrets.token_hex(6)}/"
        url = (
            f"s3://{BUCKET}/{prefix}?endpoint={weed.endpoint}"
            f"&credentials=file:{credentials_file}&timeout=1&retries=0"
        )
        flags = (
            "--store", url, "--store-bytes", STORE_BYTES, "--store-max-block-bytes", MAX_BLOCK,
            "--store-key", f"file:{key_file(tmp_path / 'key')}",
        )  # fmt: skip
        host = s3_client(weed.endpoint)
        pool = pool_factory(num_pages=8)
        data = fill_random(pool)
        tenant = tenant_digest("user-a")
        hashes = chain(4, pool.shape.tokens_per_page, b"user-a")
        a = daemon_factory(*flags)
        with a.client() as c:
            h = c.register_pool("engine", FP, pool.geometry())
            c.offload(h.pool_id, tenant, hashes, [0, 1, 2, 3])
            until(lambda: len(_objects(host, prefix)) >= 4, "4 objects in the bucket", 60)
        assert a.stop() == 0
        assert SECRET_KEY not in a.log_path.read_text()
        assert "s3://" in a.log_path.read_text(), "the store tier's line names the bucket"

        # An empty host tier, the same bucket; a failed record is dropped, not fatal.
        b = daemon_factory(*flags, "--on-integrity-failure", "drop")
        with b.client() as c:
            h = c.register_pool("engine", FP, pool.geometry())
            assert c.lookup(h.pool_id, tenant, hashes).hit_blocks == 4
            poison(pool, [0, 1])
            c.restore(h.pool_id, tenant, hashes[:2], [0, 1])
            assert [pool.read_block(p) for p in (0, 1)] == [data[0], data[1]]

            weed.stop()  # the server goes away: misses, not a hang or a crash
            assert c.lookup(h.pool_id, tenant, hashes[2:]).hit_blocks == 0
            weed.start()
            until(
                lambda: c.lookup(h.pool_id, tenant, hashes[2:]).hit_blocks == 2,
                "the daemon finds the server again",
                60,
            )
            # The host rewrites every object: none is ever written into the pool.
            for key in _objects(host, prefix):
                body = host.get_object(Bucket=BUCKET, Key=key)["Body"].read()
                flipped = body[:100] + bytes([body[100] ^ 1]) + body[101:]
                host.put_object(Bucket=BUCKET, Key=key, Body=flipped)
            poison(pool, [2, 3])
            with pytest.raises(KVSealRpcError):
                c.restore(h.pool_id, tenant, hashes[2:], [2, 3])
            assert is_poisoned(pool, 2) and is_poisoned(pool, 3)
            assert c.lookup(h.pool_id, tenant, hashes[:2]).hit_blocks == 2, "still serving"
        assert b.stop() == 0
    finally:
        weed.stop()
