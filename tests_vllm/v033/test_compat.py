"""kvseal.vllm.compat against vLLM 0.33 and 0.34 (``make test-vllm-033`` /
``make test-vllm-034``): tests_vllm/test_compat.py's checks (the names
kvseal relies on, the pointer mapper) on this version, and the worker's side:
what this vLLM's connector hands the worker maps to the right pages, and
(vLLM 0.34) a job whose device pointers do not map fails whole, the daemon
neither reading nor writing a page of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvseal.vllm import compat
from kvseal.vllm.manager import KVSealLoadStoreSpec

from tests_vllm.daemon import Daemon
from tests_vllm.helpers import wait_for
from tests_vllm.test_compat import (  # noqa: F401 - collected here too, on this vLLM
    test_compat_names_exist_with_the_expected_signatures,
    test_mapper_maps_good_pointers_to_pages,
    test_mapper_refuses_a_layout_it_was_not_registered_with,
    test_mapper_refuses_what_is_not_one_whole_registered_page,
    test_version_flags_follow_the_version,
)
from tests_vllm.v033.engine import LAYERS, NUM_BLOCKS, PAGE, Engine, write_model_config


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[tuple[Engine, Daemon]]:
    d = Daemon(tmp_path / "d")
    d.start()
    e = Engine(write_model_config(tmp_path / "model"), d.target)
    try:
        assert wait_for(lambda: e.worker.kv is not None)
        assert e.worker.kv is not None and e.worker.kv.pool.wait_ready(20)
        yield e, d
    finally:
        e.shutdown()
        d.stop()


def _gpu_side(e: Engine, block_ids: list[int]) -> Any:
    """What this vLLM's connector hands the worker for these blocks: a
    GPULoadStoreSpec (0.33) or its DevicePointers (0.34, vLLM's own resolver)."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec

    spec = GPULoadStoreSpec(block_ids, group_sizes=[len(block_ids)], block_indices=[0])
    if not compat.DEVICE_POINTERS:
        return spec
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    cw = e.worker_connector.connector_worker
    assert cw is not None
    return resolve_device_pointers(spec, cw._kv_caches)


def test_job_pages_of_what_vllm_hands_the_worker(engine: tuple[Engine, Daemon]) -> None:
    e, _d = engine
    ids = [5, 0, NUM_BLOCKS - 1, 17]
    pages, sizes = compat.job_pages(_gpu_side(e, ids), e.worker.pools)
    assert pages == ids and sizes == [len(ids)]
    regions = e.worker.pools[0].page_regions()
    assert len(regions) == LAYERS
    assert all(r[2] == NUM_BLOCKS and r[3] == PAGE for r in regions)


def _finish(e: Engine, job_id: int) -> Any:
    e.worker.wait({job_id})
    done = [r for r in e.worker.get_finished() if r.job_id == job_id]
    assert len(done) == 1
    return done[0]


@pytest.mark.skipif(not compat.DEVICE_POINTERS, reason="vLLM < 0.34 hands the worker block ids")
def test_unmappable_pointers_fail_the_job_untouched(engine: tuple[Engine, Daemon]) -> None:
    e, d = engine
    good = _gpu_side(e, [3, 4])
    for block in (3, 4):  # known bytes in both pages
        for layer in range(LAYERS):
            off = layer * PAGE * NUM_BLOCKS + block * PAGE
            e.buf[off : off + PAGE] = block + 1
    tenant = b"\x01" * 32
    hashes = [bytes([7]) * 32, bytes([8]) * 32]
    # A store whose second block points one page past the pool: refused whole.
    bad = _gpu_side(e, [3, 4])
    bad.ptrs = bad.ptrs.copy()
    bad.ptrs[1] = e.worker.pools[0].page_regions()[0][0] + NUM_BLOCKS * PAGE
    assert e.worker.submit_store(101, bad, KVSealLoadStoreSpec(tenant, hashes))
    assert not _finish(e, 101).success
    assert d.stats()["offloaded_blocks"] == 0
    assert e.worker.stats["dropped_stores"] == 1
    # A good store, then a load whose pointer starts inside a page: refused, the
    # pages keep their bytes (the daemon wrote nothing), vLLM is told it failed.
    assert e.worker.submit_store(102, good, KVSealLoadStoreSpec(tenant, hashes))
    assert _finish(e, 102).success
    before = bytes(e.buf.numpy().tobytes())
    bad = _gpu_side(e, [3, 4])
    bad.ptrs = bad.ptrs.copy()
    bad.ptrs[0] += 64
    assert e.worker.submit_load(103, KVSealLoadStoreSpec(tenant, hashes), bad)
    assert not _finish(e, 103).success
    assert d.stats()["restored_blocks"] == 0
    assert bytes(e.buf.numpy().tobytes()) == before
    # The same load with vLLM's own pointers restores both blocks.
    assert e.worker.submit_load(104, KVSealLoadStoreSpec(tenant, hashes), good)
    assert _finish(e, 104).success
    assert d.stats()["restored_blocks"] == 2
