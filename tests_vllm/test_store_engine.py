"""A real vLLM engine restored from the store after its daemon restarted
(issue 22, end to end): the engine of test_vllm_e2e.py (driver.Engine: CPU
platform, tiny local Llama, greedy) with kvseal's connector configured as
docs/store.md documents it (the one line, no ``kvseal_lookup_discovery``:
discovery follows from the daemon having a store, issue 28), against real
daemons with a store tier (``--store-dir``, ``--store-key file:``) on one
directory.

Two driver processes (this file run as a script; vLLM spawns processes), at
once, run four engines on the same prompts (two tenants, each with three
prompts sharing a 256-token prefix): one the baseline, the other the three
kvseal parts in turn (each needs the store the one before it left):

- ``baseline``: no connector;
- ``first``: kvseal against daemon 1, which writes every offloaded block
  through to the store; the engine and the daemon then stop (SIGTERM);
- ``second``: a new engine against daemon 2 (a new process: an empty host
  tier, new host keys; the same directory and key file). A third tenant that
  never stored asks the same prompts first, then the two tenants;
- ``other_key``: a new engine against daemon 3, the same directory under
  another key file: every block is a miss and the engine recomputes.

The driver takes the store as a flag: a directory (``--store-dir``, above)
or, with ``--backend-dir``, a shared S3 or Mooncake Store server started by
tests_vllm/store_backends.py (``--store s3://...``, ``--store mooncake://...``);
test_store_backends_engine.py runs it so, where ``tampered`` replaces
``other_key``: the host rewrites every block object, and a new engine against
a new daemon (same key, ``--on-integrity-failure drop``) recomputes.

The daemons' ``Stats`` and ``/metrics`` (``kvseal_store_*``, read with
tests/store_helpers.py's ``scrape``) are read around each part; the tests
assert on the JSON the drivers write. About 2.5 minutes on 2 cores.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests_vllm.conftest import HERE, free_port

PREFIX_TOKENS = 256  # shared by every prompt of a tenant (8 blocks)
SUFFIX_TOKENS = 64
PROMPTS = 3
TENANTS = ("alice", "bob")  # they store, then come back after the restart
STRANGER = "carol"  # never stored; asks alice's prompts after the restart
STORE_METRICS = (
    "kvseal_store_lookup_hit_blocks_total", "kvseal_store_hits_total",
    "kvseal_store_promoted_blocks_total", "kvseal_store_spills_total",
    "kvseal_store_integrity_failures_total", "kvseal_store_spill_queue",
)  # fmt: skip


# -- the driver (runs in its own process) ---------------------------------


def _prompts() -> list[list[int]]:
    rng = random.Random(22)
    prefix = [rng.randrange(3, 1000) for _ in range(PREFIX_TOKENS)]
    return [prefix + [rng.randrange(3, 1000) for _ in range(SUFFIX_TOKENS)] for _ in range(PROMPTS)]


class _Part:
    """One engine's run: its requests by tenant, and the daemon's figures."""

    def __init__(self, model: str, daemon: Any, metrics_port: int) -> None:
        from tests_vllm.driver import BLOCK, KV_BLOCKS, Engine, Subscriber

        self.daemon, self.port = daemon, metrics_port
        kv_bytes = KV_BLOCKS * BLOCK * 2 * 2 * 2 * 32 * 2  # as driver.py sizes it
        sock = daemon.socket if daemon else None
        extra: dict[str, Any] = {}  # the documented line: discovery follows from the store
        zmq_port = free_port()
        # vLLM's KV events (ZMQ), as llm-d's indexer receives them.
        self.sub = Subscriber(zmq_port) if daemon is not None else None
        self.eng = Engine(model, kv_bytes, sock, zmq_port, extra)
        self.res: dict[str, Any] = {"runs": {}, "figures": {}}

    def figures(self, name: str) -> None:
        if self.daemon is not None:
            from tests.store_helpers import scrape

            m = scrape(self.port)
            self.res["figures"][name] = {
                **self.daemon.stats(), **{k: m.get(k, -1) for k in STORE_METRICS},
            }  # fmt: skip

    def tenant(self, salt: str) -> None:
        """The prompts in turn, under ``salt``."""
        self.res["runs"][salt] = [self.eng.run(p, salt) for p in _prompts()]

    def spilled(self, expect: int) -> None:
        """Wait until ``expect`` offloads reached the daemon and the store."""
        from tests.store_helpers import scrape
        from tests_vllm.helpers import wait_for

        def done() -> bool:
            m = scrape(self.port)
            return (
                self.daemon.stats()["offloaded_blocks"] >= expect
                and m["kvseal_store_spill_queue"] == 0
                and m["kvseal_store_spills_total"] >= expect
            )

        self.res["spilled"] = wait_for(done, 30)

    def close(self) -> dict[str, Any]:
        if self.sub is not None:
            self.res["events"] = self.sub.close()["counts"]
        self.eng.llm.llm_engine.engine_core.shutdown()
        if self.daemon is not None:
            self.res["daemon_rc"] = self.daemon.stop()
        return self.res


def main() -> None:
    import argparse
    import atexit

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="baseline,store", help="baseline, store (the other three)")
    ap.add_argument("--backend-dir", default="", help="a store_backends.StoreServer's workdir")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    from tests.store_helpers import key_file
    from tests_vllm.daemon import Daemon
    from tests_vllm.driver import BLOCK
    from tests_vllm.test_store import _store_flags

    work = Path(args.workdir)
    store = work / "store"
    keys = [key_file(work / "key-1"), key_file(work / "key-2")]
    res: dict[str, Any] = {}
    remote = None
    if args.backend_dir:
        from tests_vllm.store_backends import StoreServer

        remote = StoreServer.attach(Path(args.backend_dir))

    def part(name: str, key: Path | None, *more: str) -> _Part:
        port = free_port()
        d = None
        if key is not None:
            store_flags = _store_flags(store, key) if remote is None else remote.flags(key)
            flags = (*store_flags, "--metrics-address", f"127.0.0.1:{port}", *more)
            kw = {} if remote is None else remote.daemon_kwargs()
            d = Daemon(work / f"daemon-{name}", extra=flags, **kw).start()
            atexit.register(d.stop)  # also when this driver fails
        return _Part(args.model, d, port)

    # Every full block of a tenant's prompts, once (the outputs never fill one).
    per_tenant = (PREFIX_TOKENS + PROMPTS * SUFFIX_TOKENS) // BLOCK

    if "baseline" in parts:
        p = part("baseline", None)
        for t in TENANTS:
            p.tenant(t)
        p.tenant(STRANGER)
        res["baseline"] = p.close()
    if "store" in parts:
        store_parts(part, keys, per_tenant, res, remote)
    Path(args.out).write_text(json.dumps(res))
    os._exit(0)  # as driver.py: vLLM's atexit hooks can linger on 2 busy cores


def store_parts(
    part: Any, keys: list[Path], per_tenant: int, res: dict[str, Any], remote: Any = None
) -> None:
    """``first``, ``second`` and ``other_key`` (a directory) or ``tampered``
    (a ``remote`` store server) in turn (module doc) into ``res``."""
    p = part("first", keys[0])
    p.figures("start")
    for t in TENANTS:
        p.tenant(t)
    p.spilled(len(TENANTS) * per_tenant)
    p.figures("end")
    res["first"] = p.close()

    p = part("second", keys[0])
    p.figures("start")
    p.tenant(STRANGER)
    p.figures("stranger")
    for t in TENANTS:
        p.tenant(t)
    p.figures("end")
    res["second"] = p.close()

    if remote is not None:
        tampered = remote.tamper()  # the host, through the server's own API
        p = part("tampered", keys[0], "--on-integrity-failure", "drop")
        p.res["tampered_objects"] = tampered
        p.figures("start")
        for t in TENANTS:
            p.tenant(t)
        p.figures("end")
        res["tampered"] = p.close()
        return

    p = part("other_key", keys[1])
    p.figures("start")
    for t in TENANTS:
        p.tenant(t)
    p.figures("end")
    res["other_key"] = p.close()


# -- the test ----------------------------------------------------------------


def _delta(fig: dict[str, dict[str, float]], a: str, b: str) -> dict[str, float]:
    return {k: fig[b][k] - fig[a][k] for k in fig[b]}


def _outs(part: dict[str, Any], tenant: str) -> list[list[int]]:
    return [r["out"] for r in part["runs"][tenant]]


def _cached(part: dict[str, Any], tenant: str) -> list[int]:
    return [r["cached"] for r in part["runs"][tenant]]


# Each driver's bound, both at once on a loaded 2-core machine (pytest-timeout,
# mk/vllm.mk, is longer: a slow run ends here, with its log).
DRIVER_TIMEOUT_S = 900


def run_drivers(model: Path, work: Path, runs: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """This file's driver once per ``runs`` entry (name: its own arguments),
    started at once: each run shares nothing with the others, and an engine's
    start-up leaves much of a 2-core machine idle. Each a session of its own,
    killed with its engine when it fails or outlives its bound. Returns each
    run's JSON by name."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        "VLLM_LOGGING_LEVEL": "WARNING",
        "OMP_WAIT_POLICY": "PASSIVE",  # spinning OMP threads would starve the daemons
    }
    procs: dict[str, subprocess.Popen[bytes]] = {}
    r: dict[str, dict[str, Any]] = {}
    t0 = time.monotonic()
    try:
        for name, more in runs.items():
            wd = work / name
            wd.mkdir()
            with open(wd / "driver.log", "wb") as f:
                procs[name] = subprocess.Popen(
                    [sys.executable, str(HERE / "test_store_engine.py"), "--model",
                     str(model), "--workdir", str(wd), "--out", str(wd / "result.json"), *more],
                    stdout=f, stderr=subprocess.STDOUT, cwd=wd, env=env, start_new_session=True,
                )  # fmt: skip
        for name, p in procs.items():
            try:
                rc: int | None = p.wait(max(1.0, t0 + DRIVER_TIMEOUT_S - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = None
            out, log = work / name / "result.json", work / name / "driver.log"
            assert rc == 0 and out.exists(), (name, rc, log.read_text(errors="replace")[-6000:])
            r[name] = json.loads(out.read_text())
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return r


@pytest.fixture(scope="module")
def store_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The two drivers (the baseline; the three kvseal parts on a directory),
    started at once (run_drivers)."""
    work = tmp_path_factory.mktemp("store-engine")
    runs = run_drivers(tiny_model, work, {p: ["--parts", p] for p in ("baseline", "store")})
    return {**runs["baseline"], **runs["store"]}


def test_engine_restored_from_the_store_after_a_daemon_restart(store_run: dict[str, Any]) -> None:
    """(1) identical greedy tokens and (2) the restarted engine's prompts came
    back whole from the store through the new daemon."""
    from tests_vllm.driver import BLOCK

    base, first, second = store_run["baseline"], store_run["first"], store_run["second"]
    # The first engine stored every full block of both tenants, and the daemon
    # wrote each through to the store before its clean stop.
    assert first["spilled"], first["figures"]
    f1 = _delta(first["figures"], "start", "end")
    stored = len(TENANTS) * (PREFIX_TOKENS + PROMPTS * SUFFIX_TOKENS) // BLOCK
    assert f1["offloaded_blocks"] == f1["kvseal_store_spills_total"] == stored
    assert first["daemon_rc"] == 0
    # The second daemon is a new process: its host tier starts empty.
    assert second["figures"]["start"]["blocks_ready"] == 0
    for t in TENANTS:
        assert _outs(second, t) == _outs(first, t) == _outs(base, t)
        # The first engine computed each tenant's first prompt; the restarted
        # one got every prompt whole (every full block) from kvseal, its first
        # prompt's too (the engine's own cache had only the stranger's blocks).
        assert _cached(first, t)[0] == 0
        want = [r["prompt_len"] // BLOCK * BLOCK for r in second["runs"][t]]
        assert _cached(second, t) == want
    # Every block the first engine stored was found by the mirror's discovery
    # Lookups as a store block, read and verified from the store by the new
    # daemon, promoted and restored into the engine, once.
    f2 = _delta(second["figures"], "stranger", "end")
    assert f2["lookups"] > 0
    assert f2["kvseal_store_lookup_hit_blocks_total"] >= stored  # (a Lookup may ask again)
    assert f2["kvseal_store_hits_total"] == f2["kvseal_store_promoted_blocks_total"] == stored
    assert f2["restored_blocks"] == stored
    assert f2["kvseal_store_integrity_failures_total"] == f2["integrity_failures"] == 0


def test_a_tenant_that_never_stored_gets_nothing(store_run: dict[str, Any]) -> None:
    """(3) The stranger asks alice's very prompts first on the new engine: no
    restore, no store hit, the first prompt computed; its tokens are the
    baseline's."""
    base, second = store_run["baseline"], store_run["second"]
    f = _delta(second["figures"], "start", "stranger")
    assert f["restored_blocks"] == 0
    assert f["kvseal_store_lookup_hit_blocks_total"] == 0
    assert f["kvseal_store_hits_total"] == 0
    assert _cached(second, STRANGER)[0] == 0
    assert _outs(second, STRANGER) == _outs(base, STRANGER) == _outs(base, TENANTS[0])


def test_a_daemon_with_another_key_misses_and_the_engine_recomputes(
    store_run: dict[str, Any],
) -> None:
    """(4) The same directory under another deployment key: nothing is found
    or restored, the engine recomputes, and the tokens stay the baseline's."""
    base, other = store_run["baseline"], store_run["other_key"]
    f = _delta(other["figures"], "start", "end")
    assert f["restored_blocks"] == 0
    assert f["kvseal_store_lookup_hit_blocks_total"] == 0
    assert f["kvseal_store_hits_total"] == 0
    assert f["kvseal_store_integrity_failures_total"] == 0
    assert f["offloaded_blocks"] > 0  # it served (stored) all the same
    for t in TENANTS:
        assert _cached(other, t)[0] == 0
        assert _outs(other, t) == _outs(base, t)


if __name__ == "__main__":
    main()


def test_vllms_kv_events_name_the_store_tier(store_run: dict[str, Any]) -> None:
    """llm-d's view (vLLM's ZMQ KV events): the first engine's blocks are
    published stored in the CPU tier and in the STORAGE tier (the daemon has a
    store), and the restarted engine's, found in the store by discovery and
    promoted, in the STORAGE tier and then the CPU tier again."""
    first, second = store_run["first"]["events"], store_run["second"]["events"]
    assert first.get("BlockStored:CPU", 0) > 0, first
    assert first.get("BlockStored:STORAGE", 0) > 0, first
    assert second.get("BlockStored:STORAGE", 0) > 0, second
    assert second.get("BlockStored:CPU", 0) > 0, second
