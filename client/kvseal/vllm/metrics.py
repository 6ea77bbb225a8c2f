"""The metrics and the config-info series kvseal adds to vLLM's own (the
spec declares them, :class:`~kvseal.vllm.manager.KVSealOffloadingManager`
fills them). Imports only vLLM's metric metadata classes."""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata

# The metric kvseal adds to vLLM's own /metrics (through the spec's
# build_metric_definitions and the manager's get_stats; exposed with "_total").
LOAD_FAILED_BLOCKS = "vllm:kvseal_load_failed_blocks"
# Blocks the tier holds for this engine on every rank (what the scheduler's
# lookups can hit), as the mirrors last heard: a gauge.
TIER_BLOCKS = "vllm:kvseal_tier_blocks"

# The labels of vLLM 0.33's ``vllm:kv_offload_config_info`` series for kvseal
# (the spec declares them, the manager fills them once; vLLM 0.32 has no such
# series and never asks). What an operator wants on a dashboard next to the
# hit rates: which tier, which daemon, how big, which write mode.
CONFIG_INFO_KEYS: tuple[str, ...] = (
    "kvseal_backend",  # the daemon's backend: cpu or cuda ("unknown": not reached yet)
    "kvseal_daemon_instance",  # rank 0's daemon start (a restart is a new key and cache)
    "kvseal_socket",  # rank 0's daemon socket (one daemon per rank)
    "kvseal_ranks",  # daemons (tensor-parallel ranks) a hit needs
    "kvseal_host_bytes",  # rank 0's tier capacity (--host-bytes; 0: unknown)
    "kvseal_block_bytes",  # plaintext bytes of one block on one rank
    "kvseal_write_mode",  # write-through (default) or write-back
    "kvseal_integrity_policy",  # the daemon's: abort or drop ("" unknown)
    "kvseal_lookup_discovery",  # blocks stored before this engine found by Lookup
    "kvseal_transfer_timeout_s",  # the deadline of one Offload/Restore
)


def metric_definitions() -> dict[str, Any]:
    """The kvseal metrics vLLM registers for the spec (name -> vLLM metadata).
    The gauge keeps vLLM 0.33's default ``multiprocess_mode`` (``mostrecent``:
    with several API servers the freshest value, never a sum); vLLM 0.32's
    metadata has no such field (its multiprocess gauges are per process)."""
    return {
        LOAD_FAILED_BLOCKS: OffloadingCounterMetadata(
            documentation="KV blocks kvseal could not restore (evicted since the "
            "lookup, failed verification, daemon unreachable or slow); vLLM "
            "recomputed them",
        ),
        TIER_BLOCKS: OffloadingGaugeMetadata(
            documentation="KV blocks the kvseal tier holds for this engine on every "
            "rank (what a lookup can hit), as the scheduler last heard from the daemons",
        ),
    }


def config_info_keys() -> tuple[str, ...]:
    """Label names of kvseal's ``vllm:kv_offload_config_info`` series (vLLM >= 0.33)."""
    return CONFIG_INFO_KEYS
