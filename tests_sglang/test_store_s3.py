"""A real SGLang server warm from a shared S3 store after its daemon and the
server restarted (issue 38): SeaweedFS's ``weed mini`` as the S3 server
(tests_vllm/store_backends.py starts it; ``make test-stores`` runs this), real
daemons with ``--store s3://...`` (from the main venv, where boto3 is), two
real ``sglang.launch_server`` processes one after the other, and a baseline
server without kvseal beside the first.

- ``first``: a daemon and a kvseal server (write-through, the default) serve
  one tenant's two prompts (a shared 128-token prefix); every page is sealed
  and written through to the bucket; server and daemon stop.
- ``second``: a new daemon (an empty host tier, the same bucket and key) and
  a new server with offload at eviction (``offload_policy: "evict"``: the
  workload never fills SGLang's pool, so this server seals nothing, and every
  page it restores can only have come from the store). A stranger asks the
  tenant's prompt and gets nothing; then the tenant's prompts, in rounds on a
  flushed SGLang cache: each lookup's background discovery finds one more
  page in the store (the first one the mirror has no word of), until the
  prompts come back whole from kvseal; every round's tokens are the
  baseline's.

On the backend: one S3 server, two daemons and two kvseal servers, one at a
time (and the baseline server, which has no daemon).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.store_helpers import key_file, scrape
from tests_sglang.server import Server, free_port, prompt
from tests_vllm.daemon import Daemon
from tests_vllm.store_backends import StoreServer, unavailable
from tests_vllm.tiny_model import make_tiny_llama

PAGE = 16
KV_TOKENS = 512
PREFIX = prompt(31, 128)  # 8 pages, shared
PROMPTS = [PREFIX + prompt(40 + i, 42) for i in range(2)]  # 170 tokens: 10 whole pages each
MAX_NEW = 6
TENANT, STRANGER = "alice", "carol"
CACHEABLE = (len(PROMPTS[0]) - 1) // PAGE * PAGE  # 160: whole pages before the last token
# Distinct pages SGLang restores for the tenant: prompt 0's ten, then prompt
# 1's two beyond the shared prefix (SGLang's cache holds the prefix by then).
RESTORED = CACHEABLE // PAGE + (CACHEABLE - len(PREFIX)) // PAGE


def _until(cond: Any, what: Any, timeout: float = 90.0) -> None:
    """Wait for ``cond``; ``what`` (a string, or a callable giving one) says
    what did not happen."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(0.3)


def _figures(d: Daemon, port: int) -> dict[str, float]:
    m = scrape(port)
    return {**d.stats(), **{k: v for k, v in m.items() if k.startswith("kvseal_store_")}}


def _delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a.get(k, 0) for k in b}


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreServer]:
    why = unavailable("s3")
    if why is not None:
        pytest.skip(why)
    srv = StoreServer("s3", tmp_path_factory.mktemp("s3")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def run(s3: StoreServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("sglang-store")
    model = make_tiny_llama(work / "tiny-llama")
    key = key_file(work / "store-key")
    res: dict[str, Any] = {}

    def daemon(name: str, port: int) -> Daemon:
        flags = (*s3.flags(key), "--metrics-address", f"127.0.0.1:{port}")
        return Daemon(work / f"daemon-{name}", extra=flags, **s3.daemon_kwargs()).start()

    def server(name: str, d: Daemon | None, **linker: Any) -> Server:
        sock = d.socket if d is not None else None
        linker = {"staging_bytes": 4 << 20, "transfer_timeout_s": 5, **linker}
        return Server(model, work / name, kv_tokens=KV_TOKENS, page_size=PAGE,
                      kvseal_socket=sock, linker=linker if d else None)  # fmt: skip

    # The baseline starts and serves beside the first kvseal server.
    base = server("baseline", None)
    started: list[BaseException] = []

    def start_base() -> None:
        try:
            base.start()
        except BaseException as e:  # reported below, with its log
            started.append(e)

    t = threading.Thread(target=start_base)
    t.start()
    port1 = free_port()
    d1 = daemon("first", port1)
    srv = server("first", d1)
    try:
        srv.start()
        res["first"] = [srv.generate(p, salt=TENANT, max_new=MAX_NEW) for p in PROMPTS]

        def spilled() -> bool:
            res["first_figures"] = f = _figures(d1, port1)
            done = sum(
                f[f"kvseal_store_spills_{k}total"] for k in ("", "present_", "skipped_")
            )  # every offload's spill ended, one way or another
            return (
                f["offloaded_blocks"] >= RESTORED
                and f["kvseal_store_spill_queue"] == 0
                and done >= f["offloaded_blocks"]
            )

        _until(spilled, lambda: f"not every sealed page in the bucket: {res}")
        t.join()
        assert not started, started
        res["baseline"] = [base.generate(p, salt=TENANT, max_new=MAX_NEW) for p in PROMPTS]
        res["baseline_stranger"] = base.generate(PROMPTS[0], salt=STRANGER, max_new=MAX_NEW)
    finally:
        t.join()
        base.stop()
        srv.stop()
        res["first_rc"] = d1.stop()

    port2 = free_port()
    d2 = daemon("second", port2)
    srv = server("second", d2, offload_policy="evict")
    try:
        srv.start()
        f0 = _figures(d2, port2)
        res["second_start"] = f0
        # The stranger: its discovery Lookup answered (a Lookup RPC more), then
        # asked again on an empty SGLang cache.
        res["stranger"] = [srv.generate(PROMPTS[0], salt=STRANGER, max_new=MAX_NEW)]
        _until(lambda: _figures(d2, port2)["lookups"] > f0["lookups"], "the stranger's discovery")
        srv.flush()
        res["stranger"].append(srv.generate(PROMPTS[0], salt=STRANGER, max_new=MAX_NEW))
        res["stranger_figures"] = _figures(d2, port2)
        # The tenant: each lookup's background discovery asks the daemon about
        # the first page the mirror has no word of, so every round (SGLang's
        # cache flushed first) restores at least one page more, until the
        # prompts come back whole.
        res["tenant_first"] = [srv.generate(p, salt=TENANT, max_new=MAX_NEW) for p in PROMPTS]
        rounds: list[list[dict[str, Any]]] = []

        def warm() -> bool:
            srv.flush()
            rounds.append([srv.generate(p, salt=TENANT, max_new=MAX_NEW) for p in PROMPTS])
            return all(r["cached"] == CACHEABLE for r in rounds[-1])

        _until(warm, lambda: f"the tenant's prompts not whole from the store: {rounds[-3:]}", 300)
        res["rounds"] = rounds
        res["tenant"] = rounds[-1]
        res["tenant_figures"] = _figures(d2, port2)
    finally:
        srv.stop()
        res["second_rc"] = d2.stop()
    (work / "run.json").write_text(json.dumps(res))  # what the tests read, for a failure's look
    return res


def _ids(rs: list[dict[str, Any]]) -> list[list[int]]:
    assert all(r["status"] == 200 for r in rs), rs
    return [r["ids"] for r in rs]


def test_first_server_writes_every_page_through_to_the_bucket(run: dict[str, Any]) -> None:
    f = run["first_figures"]
    assert f["offloaded_blocks"] >= RESTORED
    assert f["kvseal_store_spills_total"] >= RESTORED  # each distinct page, in the bucket
    assert run["first_rc"] == 0
    assert _ids(run["first"]) == _ids(run["baseline"])


def test_restarted_server_is_warm_from_the_store_with_the_same_tokens(
    run: dict[str, Any],
) -> None:
    """Every whole page of both prompts restored from kvseal on an empty
    SGLang cache, found in the store by discovery, read, verified and
    promoted by the new daemon (which sealed nothing itself)."""
    assert [r["cached"] for r in run["tenant"]] == [CACHEABLE, CACHEABLE]
    assert _ids(run["tenant_first"]) == _ids(run["baseline"])
    for r in run["rounds"]:  # partly restored, partly computed: the same tokens
        assert _ids(r) == _ids(run["baseline"])
    f = _delta(run["stranger_figures"], run["tenant_figures"])
    assert run["tenant_figures"]["offloaded_blocks"] == 0  # offload at eviction: none
    assert f["restored_blocks"] >= RESTORED
    assert f["kvseal_store_lookup_hit_blocks_total"] >= RESTORED
    assert f["kvseal_store_hits_total"] >= RESTORED
    assert f["kvseal_store_promoted_blocks_total"] == f["kvseal_store_hits_total"]
    assert f["kvseal_store_integrity_failures_total"] == f["integrity_failures"] == 0
    assert run["second_rc"] == 0


def test_a_stranger_gets_nothing_from_the_store(run: dict[str, Any]) -> None:
    """Another salt asks the tenant's very prompt on the restarted server,
    before and after its discovery Lookup: no store hit, nothing restored,
    nothing cached; the tokens are the baseline's for that salt."""
    f = _delta(run["second_start"], run["stranger_figures"])
    assert f["kvseal_store_lookup_hit_blocks_total"] == 0
    assert f["kvseal_store_hits_total"] == 0
    assert f["restored_blocks"] == 0
    assert [r["cached"] for r in run["stranger"]] == [0, 0]
    assert _ids(run["stranger"]) == [run["baseline_stranger"]["ids"]] * 2
