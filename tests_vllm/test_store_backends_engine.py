"""Real vLLM engines through the shared stores that fleets run (issue 38):
test_store_engine.py's driver and tests, with the store a real S3 server
(SeaweedFS's ``weed mini``) or a real Mooncake Store (``mooncake_master`` and a
node that mounts the cluster's memory) instead of a directory
(tests_vllm/store_backends.py starts them; ``make test-stores`` runs this).

Per backend, one driver runs in turn (each part a new daemon and a new engine
on the same server; the daemons run from the main venv, where the backend's
client library is): ``first`` stores two tenants' prompts; ``second``, a
restarted daemon with an empty host tier, serves a stranger (no hits) and
then the two tenants, every block from the shared store; ``tampered``: the
host rewrites every block object through the server's own API (boto3's put;
Mooncake's own client's put), and a new engine recomputes with the
baseline's tokens while the daemon counts the integrity failures. The
baseline (no connector) and the two backends' drivers run at once.

On one backend: one store server (Mooncake: the master and its memory node),
three daemons and three engines, one daemon and one engine at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests_vllm.store_backends import KINDS, StoreServer, unavailable
from tests_vllm.test_store_engine import (  # the same assertions, on this module's store_run
    PREFIX_TOKENS,
    PROMPTS,
    SUFFIX_TOKENS,
    TENANTS,
    _delta,
    _outs,
    run_drivers,
    test_a_tenant_that_never_stored_gets_nothing,
    test_engine_restored_from_the_store_after_a_daemon_restart,
    test_vllms_kv_events_name_the_store_tier,
)

__all__ = [
    "test_a_tenant_that_never_stored_gets_nothing",
    "test_engine_restored_from_the_store_after_a_daemon_restart",
    "test_vllms_kv_events_name_the_store_tier",
]


@pytest.fixture(scope="module")
def backend_runs(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, dict[str, Any]]:
    """The baseline and a driver per backend this session asks for (and can
    run here), at once; each backend's server lives as long as its driver."""
    wanted = {
        item.callspec.params["kind"]
        for item in request.session.items
        if hasattr(item, "callspec") and "kind" in item.callspec.params
    }
    kinds = [k for k in KINDS if k in wanted and unavailable(k) is None]
    if not kinds:
        pytest.skip("; ".join(f"{k}: {unavailable(k)}" for k in KINDS))
    work = tmp_path_factory.mktemp("store-backends-engine")
    servers: list[StoreServer] = []
    try:
        runs: dict[str, list[str]] = {"baseline": ["--parts", "baseline"]}
        for k in kinds:
            servers.append(StoreServer(k, work / f"server-{k}").start())
            runs[k] = ["--parts", "store", "--backend-dir", str(servers[-1].workdir)]
        out = run_drivers(tiny_model, work, runs)
    finally:
        for s in servers:
            s.stop()
    return out


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_run(kind: str, backend_runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One backend's parts and the baseline, as test_store_engine's tests read them."""
    why = unavailable(kind)
    if why is not None:
        pytest.skip(why)
    return {**backend_runs["baseline"], **backend_runs[kind]}


def test_a_tampered_store_is_recomputed_with_the_same_tokens(store_run: dict[str, Any]) -> None:
    """Every block object the first engine stored, rewritten by the host
    through the server's own API: the new daemon finds them (a Lookup does
    not read a record), fails each restore's verification, counts it and
    writes nothing into the engine's pool; the engine recomputes, token for
    token the baseline's."""
    from tests_vllm.driver import BLOCK

    base, t = store_run["baseline"], store_run["tampered"]
    stored = len(TENANTS) * (PREFIX_TOKENS + PROMPTS * SUFFIX_TOKENS) // BLOCK
    assert t["tampered_objects"] >= stored
    assert t["figures"]["start"]["blocks_ready"] == 0
    f = _delta(t["figures"], "start", "end")
    assert f["restored_blocks"] == 0
    assert f["kvseal_store_hits_total"] == f["kvseal_store_promoted_blocks_total"] == 0
    assert f["kvseal_store_integrity_failures_total"] > 0
    assert f["integrity_failures"] > 0
    assert t["daemon_rc"] == 0  # drop: it kept serving
    # vLLM's cached-token counter is no evidence here: it counts the tokens it
    # scheduled to load even when the load then failed and was recomputed.
    for tenant in TENANTS:
        assert _outs(t, tenant) == _outs(base, tenant)
