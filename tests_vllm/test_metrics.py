"""kvseal's metric in vLLM's own /metrics: ``vllm:kvseal_load_failed_blocks``,
the blocks vLLM recomputed because kvseal could not restore them (the figure an
operator watches next to vLLM's prefix-cache hit counters).

The path is vLLM's: the spec declares the metric (``build_metric_definitions``),
the manager reports counts (``get_stats``, each scheduler step), and the API
server's process registers and fills the Prometheus family through the
connector class's ``build_prom_metrics``, in a process where no connector was
ever built. That last step is what this test drives with vLLM's own
``OffloadPromMetrics`` and a real ``prometheus_client`` registry."""

from __future__ import annotations

import functools
import types
from pathlib import Path

from kvseal.vllm.connector import KVSealOffloadingConnector
from kvseal.vllm.spec import LOAD_FAILED_BLOCKS, KVSealOffloadingManager, KVSealOffloadingSpec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from vllm.config import KVTransferConfig

from tests_vllm.helpers import offloading_config


def test_load_failures_reach_vllms_prometheus_family(tmp_path: Path) -> None:
    # A daemon is not needed: the manager only counts (its mirror retries
    # connecting in the background meanwhile).
    mgr = KVSealOffloadingSpec(offloading_config([f"unix://{tmp_path}/none.sock"], 0)).get_manager()
    assert isinstance(mgr, KVSealOffloadingManager)
    try:
        assert mgr.get_stats() is None  # nothing failed: nothing reported
        mgr.note_load_errors(3)
        mgr.note_load_errors(2)
        stats = mgr.get_stats()
        assert stats is not None and stats.reduce() == {LOAD_FAILED_BLOCKS: 5}
        assert mgr.get_stats() is None  # reported once, then reset
    finally:
        mgr.shutdown()

    # The API server's side, as vLLM's KVConnectorProm builds it: the config as
    # the user wrote it (no spec_name: the connector names its spec itself).
    reg = CollectorRegistry()
    metric_types = {
        cls: functools.partial(cls, registry=reg) for cls in (Gauge, Counter, Histogram)
    }
    ktc = KVTransferConfig(
        kv_connector="KVSealOffloadingConnector",
        kv_connector_module_path="kvseal.vllm.connector",
        kv_role="kv_both",
        kv_connector_extra_config={"kvseal_socket": "/run/kvseal/kvseal.sock"},
    )
    prom = KVSealOffloadingConnector.build_prom_metrics(
        types.SimpleNamespace(kv_transfer_config=ktc),
        metric_types,
        ["model_name", "engine"],
        {0: ["tiny", "0"]},
    )
    prom.observe(stats.data, 0)
    prom.observe(stats.data, 0)
    text = generate_latest(reg).decode()
    assert 'vllm:kvseal_load_failed_blocks_total{engine="0",model_name="tiny"} 10.0' in text
