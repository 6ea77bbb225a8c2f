"""Hardening regressions: each test reproduced a defect found in a security
and concurrency review (and failed on the code of that time). Real daemons
via ``conftest`` where the defect is visible at the API; unit level
(``SealedCache`` with a real ``CpuBackend`` and ``HostRegion``) where a
specific thread interleaving must be forced.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from kvseal.client import KVSealRpcError, chain_block_hashes, tenant_digest
from kvseal.client.shm import KVShape, SharedKVPool
from kvseal.server import convert
from kvseal.server.backends.cpu.backend import CpuBackend
from kvseal.server.cache import SealedCache
from kvseal.server.config import IntegrityPolicy, ServerConfig
from kvseal.server.errors import IntegrityFailure, KVSealError
from kvseal.server.events import EventKind
from kvseal.server.hostregion import HostRegion
from kvseal.server.index import State
from kvseal.server.sealing import BlockSealer
from kvseal.v1 import kvseal_pb2 as pb

from .conftest import SMALL, DaemonProc, fill_random, start_daemon, wait_serving

FP = b"model:review"
IS_ROOT = os.geteuid() == 0
FOREIGN_UID = 4242


def _chain(n: int, salt: str = "t", tpp: int = 4) -> list[bytes]:
    return chain_block_hashes(list(os.urandom(n * tpp)), tpp, cache_salt=salt)


# --------------------------------------------------------------- unit rig


class Rig:
    """A SealedCache over a real CpuBackend, a file-backed HostRegion (the
    test plays the host) and a real shared-memory pool."""

    def __init__(self, tmp: Path, policy: IntegrityPolicy, *, rekey_after: int = 2**32) -> None:
        self.cfg = ServerConfig(
            listen="unix://" + str(tmp / "unused.sock"),
            backend="cpu",
            host_bytes=1 << 20,
            integrity_policy=policy,
            workers=1,
        )
        self.sealer = BlockSealer(rekey_after)
        self.backend = CpuBackend(self.sealer, 1)
        self.region_path = tmp / "region.bin"
        self.region = HostRegion(1 << 20, str(self.region_path))
        self.aborted = threading.Event()
        self.cache = SealedCache(
            self.cfg, self.backend, self.region, self.sealer, on_integrity_abort=self.aborted.set
        )
        self.pool = SharedKVPool(KVShape(8, **SMALL), "vllm_per_layer", name_prefix="kvseal-rev")
        self.data = fill_random(self.pool)
        req = pb.RegisterPoolRequest(
            name="engine", model_fingerprint=FP, geometry=self.pool.geometry()
        )
        self.pool_id = self.cache.register_pool(convert.pool_spec(req, "cpu")).pool_id
        self.tenant = tenant_digest("t")

    def close(self) -> None:
        self.cache.close()
        self.pool.close()


@pytest.fixture
def rig_factory(tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    rigs: list[Rig] = []

    def make(policy: IntegrityPolicy = IntegrityPolicy.DROP, **kw: Any) -> Rig:
        d = tmp_path / f"r{len(rigs)}"
        d.mkdir()
        r = Rig(d, policy, **kw)
        rigs.append(r)
        return r

    yield make
    for r in rigs:
        r.close()


# ============================================================ 1. security


@pytest.mark.skipif(not IS_ROOT, reason="needs root to create a directory owned by another uid")
def test_socket_dir_owned_by_another_uid_is_refused(tmp_path: Path) -> None:
    """A pre-existing socket directory owned by someone else (e.g. another
    local user pre-creating the predictable /tmp/kvseal-<uid>) with mode
    01777 is accepted: its owner can then replace kvseal.sock or the private
    `.kvseal-<pid>/grpc.sock` the relay connects to by path (control-plane
    hijack). The README promises "a 0700 directory the daemon creates"."""
    work = tmp_path / "d"
    run = work / "run"
    run.mkdir(parents=True)
    os.chown(run, FOREIGN_UID, FOREIGN_UID)
    os.chmod(run, 0o1777)
    d = start_daemon(work, wait=False)
    try:
        try:
            wait_serving(d.target, d.proc, d.log_path, timeout=10)
            served = True
        except RuntimeError:
            served = False
        assert not served, "daemon serves from a socket directory owned by another uid"
        assert d.proc.returncode == 2
    finally:
        d.stop()


@pytest.mark.skipif(not IS_ROOT, reason="needs root to create a shm object owned by another uid")
def test_register_pool_refuses_shm_object_of_a_foreign_uid(
    daemon_factory: Callable[..., DaemonProc],
) -> None:
    """The daemon opens whatever /dev/shm name a peer gives, with the
    daemon's own privileges: with two allowed uids, engine A can name engine
    B's 0600 pool (names are listable in /dev/shm), then offload B's KV and
    restore it into its own pool, or restore into B's pages (confused
    deputy). The object's owner must be checked against the peer/allow list."""
    d = daemon_factory()
    pool = SharedKVPool(KVShape(4, **SMALL), "vllm_cross_layer", name_prefix="kvseal-rev-foreign")
    try:
        for b in pool.buffers:
            path = os.path.join("/dev/shm", b.name)
            os.chown(path, FOREIGN_UID, FOREIGN_UID)
            os.chmod(path, 0o600)
        with d.client() as c, pytest.raises(KVSealRpcError) as e:
            c.register_pool("thief", FP, pool.geometry())
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        pool.close()


def test_sigterm_while_offload_in_flight_does_not_crash(
    daemon_factory: Callable[..., DaemonProc], pool_factory: Callable[..., SharedKVPool]
) -> None:
    """Shutdown closes the host region (munmap) while RPC threads still copy
    into it: server.stop(grace) returns at the end of the grace period but
    does not stop handler threads, and the region has no lease. With one
    sealing thread the copy runs on the RPC thread, so the next
    ``region.write`` memmoves to address 0 + offset: SIGSEGV instead of exit
    0 (and after an integrity abort, a signal death instead of status 3,
    which systemd's Restart=on-failure then restarts)."""
    d = daemon_factory("--workers", "1", "--grace", "0.01", host_bytes="600MiB")
    geo = {"tokens_per_page": 16, "num_layers": 16, "num_kv_heads": 8, "head_dim": 128}
    n = 512  # 1 MiB blocks: ~0.5 GiB to seal on one thread
    pool = pool_factory(num_pages=n, layout="vllm_cross_layer", geometry=geo)
    c = d.client(transfer_timeout_s=60.0)
    h = c.register_pool("big", FP, pool.geometry())
    # On a loaded machine the poll below can miss a whole offload: then try
    # again with a fresh chain (into the now-freed pages' blocks' place).
    for _attempt in range(5):
        chain = _chain(n, tpp=16)
        stub_call = threading.Thread(
            target=lambda ch=chain: _swallow(  # type: ignore[misc]
                lambda: c.offload(h.pool_id, tenant_digest("t"), ch, range(n))
            )
        )
        stub_call.start()
        deadline = time.monotonic() + 30
        sealing = False
        while stub_call.is_alive() and time.monotonic() < deadline:
            if c.stats().blocks_pending > 0:  # the offload is sealing
                sealing = True
                break
            time.sleep(0.005)
        if sealing:
            break
        stub_call.join(60)
        c.drop(h.pool_id, tenant_digest("t"), all_of_tenant=True)
    assert sealing, "never caught the offload while it was sealing"
    d.proc.send_signal(signal.SIGTERM)
    rc = d.wait_exit(30)
    stub_call.join(30)
    assert rc == 0, f"daemon died with {rc} (negative: killed by signal {-rc})"


def _swallow(fn: Callable[[], object]) -> None:
    try:
        fn()
    except KVSealRpcError:
        pass


def test_truncated_pool_object_does_not_kill_daemon(
    daemon_factory: Callable[..., DaemonProc], pool_factory: Callable[..., SharedKVPool]
) -> None:
    """Any process with write access to a pool's /dev/shm object (an engine
    bug, a restart that reuses the name) can shrink it. Were pools memory
    maps, the next gather/scatter would take SIGBUS and every tenant's cache
    would die with the daemon; the daemon reads them with preadv instead, so
    the request fails and the daemon serves on (tests/test_pool_shrink.py
    shrinks the object *during* copies)."""
    d = daemon_factory()
    pool = pool_factory(num_pages=4, layout="vllm_cross_layer")
    with d.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        os.truncate(os.path.join("/dev/shm", pool.buffers[0].name), 0)
        with pytest.raises(KVSealRpcError):
            c.offload(h.pool_id, tenant_digest("t"), _chain(1), [3])
        time.sleep(0.2)
        assert d.proc.poll() is None, f"daemon died with {d.proc.returncode}"
        assert c.health() == "SERVING"


# ================================================ 2. concurrency / events


def test_failed_store_cascade_announces_removed_descendants(
    rig_factory: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Request A stores h1 (PENDING, sealing). Request B offloads [h1, h2]:
    h1 is IN_PROGRESS, h2 is stored and linked under A's pending h1, then
    announced BLOCK_STORED. A's seal fails: ``complete_store`` cascades the
    removal to B's READY h2 but returns nothing, so no BLOCK_REMOVED is ever
    published and watchers (llm-d's KV-event indexer) keep a phantom block."""
    r = rig_factory()
    h1, h2 = _chain(2)
    r.cache.note_tenant(r.pool_id, r.tenant)  # as the service does for each block request
    _, sub = r.cache.subscribe_events(r.pool_id, b"")
    gate, entered = threading.Event(), threading.Event()
    real_seal = r.backend.seal_blocks
    calls = {"n": 0}

    def seal(pool: Any, blocks: Any, region: Any, wait_event: Any = None, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:  # request A: fails after B has committed
            entered.set()
            gate.wait(10)
            raise RuntimeError("injected seal failure (e.g. ENOSPC on the region file)")
        return real_seal(pool, blocks, region, wait_event, **kw)

    monkeypatch.setattr(r.backend, "seal_blocks", seal)
    errs: list[BaseException] = []

    def a() -> None:
        try:
            r.cache.offload(r.pool_id, r.tenant, None, [h1], [0])
        except BaseException as e:
            errs.append(e)

    t = threading.Thread(target=a)
    t.start()
    assert entered.wait(10)
    r.cache.offload(r.pool_id, r.tenant, None, [h1, h2], [0, 1])
    gate.set()
    t.join(10)
    assert errs, "request A should have failed"
    _, states = r.cache.index.lookup(r.cache.pools.all()[0].namespace, r.tenant, [h2])
    events = []
    while not sub.queue.empty():
        events.append(sub.queue.get_nowait())
    stored = [e for e in events if e.kind is EventKind.STORED and h2 in e.block_hashes]
    removed = [e for e in events if e.kind is EventKind.REMOVED and h2 in e.block_hashes]
    assert stored, "h2 was announced as stored"
    if states[0] is State.ABSENT:
        assert removed, "h2 silently left the index: no BLOCK_REMOVED was published"


def test_stored_event_never_follows_removal_of_the_same_block(
    rig_factory: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``offload`` decides which blocks to announce (``not e.removed``) and
    publishes BLOCK_STORED later, outside any lock. A Drop that runs in that
    window publishes BLOCK_REMOVED first; the STORED that follows leaves every
    watcher believing a dropped block is cached. Simulated by running the
    concurrent Drop at the exact interleaving point (inside publish)."""
    r = rig_factory()
    (h,) = _chain(1)
    r.cache.note_tenant(r.pool_id, r.tenant)  # as the service does for each block request
    _, sub = r.cache.subscribe_events(r.pool_id, b"")
    real_publish = r.cache.events.publish
    fired = {"done": False}

    threads: list[threading.Thread] = []

    def publish(
        kind: EventKind, reason: str, ns: bytes, tenant: bytes, hashes: list[bytes]
    ) -> None:
        if kind is EventKind.STORED and not fired["done"]:
            fired["done"] = True
            # The other thread's Drop, started at the worst moment.
            t = threading.Thread(
                target=r.cache.drop,
                args=(r.pool_id, r.tenant, [h]),
                kwargs={"all_of_tenant": False},
            )
            t.start()
            threads.append(t)
            t.join(0.2)  # give it every chance to overtake
        real_publish(kind, reason, ns, tenant, hashes)

    monkeypatch.setattr(r.cache.events, "publish", publish)
    r.cache.offload(r.pool_id, r.tenant, None, [h], [0])
    for t in threads:
        t.join(10)
    events = []
    while not sub.queue.empty():
        events.append(sub.queue.get_nowait())
    last = [e for e in events if h in e.block_hashes][-1]
    hit, _ = r.cache.lookup(r.pool_id, r.tenant, [h])
    assert hit == 0
    assert last.kind is EventKind.REMOVED, "last event says STORED for a block that is gone"


def test_abort_stops_restores_already_in_flight(
    rig_factory: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Policy abort: once one request has seen an integrity failure the
    daemon must not serve again. A restore that passed ``_check_serving``
    before the failure still scatters into the pool and returns OK afterwards
    (only the entry check looks at ``_serving``)."""
    r = rig_factory(IntegrityPolicy.ABORT)
    good, bad = _chain(1, salt="a")[0], _chain(1, salt="b")[0]
    r.cache.offload(r.pool_id, r.tenant, None, [good], [0])
    r.cache.offload(r.pool_id, r.tenant, None, [bad], [1])
    # Play the host: flip the second slot (the region is a file).
    size = r.pool.shape.block_bytes
    with open(r.region_path, "r+b") as f:
        blob = bytearray(f.read())
        nz = [i for i in range(0, len(blob), 256) if any(blob[i : i + 256])]
        off = nz[-1]
        blob[off] ^= 1
        f.seek(0)
        f.write(blob)
    assert len(nz) * 256 >= 2 * size
    gate, entered = threading.Event(), threading.Event()
    real_open = r.backend.open_blocks

    def open_blocks(
        pool: Any, blocks: Any, records: Any, region: Any, we: Any = None, **kw: Any
    ) -> Any:
        if blocks[0].ad.block_hash == good:
            entered.set()
            gate.wait(10)
        return real_open(pool, blocks, records, region, we, **kw)

    monkeypatch.setattr(r.backend, "open_blocks", open_blocks)
    r.pool.fill_page(5, 0xA5)
    out: list[object] = []

    def in_flight() -> None:
        try:
            out.append(r.cache.restore(r.pool_id, r.tenant, [good], [5], release=False))
        except KVSealError as e:
            out.append(e)

    t = threading.Thread(target=in_flight)
    t.start()
    assert entered.wait(10)
    with pytest.raises(IntegrityFailure):
        r.cache.restore(r.pool_id, r.tenant, [bad], [6], release=False)
    assert r.aborted.is_set() and not r.cache.serving
    gate.set()
    t.join(10)
    assert isinstance(out[0], KVSealError), f"served after the integrity abort: {out[0]!r}"
    assert r.pool.read_block(5) == bytes([0xA5]) * size


# ======================================================= 3. error contract


def test_offload_with_cuda_event_on_cpu_backend_changes_nothing(
    daemon_factory: Callable[..., DaemonProc], pool_factory: Callable[..., SharedKVPool]
) -> None:
    """The CPU backend rejects ``cuda_event_ipc_handle`` with BAD_REQUEST,
    but only inside ``seal_blocks``, after ``begin_store`` has already
    evicted blocks to make room. "A failed request changes nothing" is
    broken: cached blocks are gone and BLOCK_REMOVED(EVICTED) was published."""
    d = daemon_factory(host_bytes="1MiB")
    geo = {"tokens_per_page": 16, "num_layers": 4, "num_kv_heads": 8, "head_dim": 128}
    pool = pool_factory(num_pages=6, geometry=geo)  # 256 KiB blocks: 4 fill the tier
    fill_random(pool)
    tenant = tenant_digest("t")
    chain = _chain(5, tpp=16)
    with d.client() as c:
        h = c.register_pool("engine", FP, pool.geometry())
        c.offload(h.pool_id, tenant, chain[:4], [0, 1, 2, 3])
        assert c.lookup(h.pool_id, tenant, chain[:4]).hit_blocks == 4
        with pytest.raises(KVSealRpcError) as e:
            c.offload(h.pool_id, tenant, [chain[4]], [4], cuda_event_ipc_handle=b"\x01" * 64)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        hit = c.lookup(h.pool_id, tenant, chain[:4]).hit_blocks
        assert hit == 4, f"a rejected request evicted {4 - hit} cached block(s)"


def test_overlapping_pages_across_segments_are_rejected(
    daemon_factory: Callable[..., DaemonProc], tmp_path: Path
) -> None:
    """README: geometry with "overlapping pages" is BAD_REQUEST. Only each
    segment's own stride is checked: segment 1's page 0 can be segment 0's
    page 1, so a Restore into page 0 also rewrites page 1, which the request
    never named."""
    d = daemon_factory()
    block = 1024
    name = f"kvseal-rev-ovl-{os.getpid()}"
    path = os.path.join("/dev/shm", name)
    with open(path, "wb") as f:
        f.truncate(3 * block)
    try:
        geo = pb.PoolGeometry(
            num_pages=2,
            tokens_per_page=4,
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            dtype="uint8",
            layout="L,KV,T,H,D",
            buffers=[pb.BufferHandle(shm_name=name, offset=0, size=3 * block)],
            segments=[
                pb.Segment(buffer=0, offset=0, page_stride=block, bytes=block),
                pb.Segment(buffer=0, offset=block, page_stride=block, bytes=block),
            ],
        )
        with d.client() as c, pytest.raises(KVSealRpcError) as e:
            c.register_pool("overlap", FP, geo)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        os.unlink(path)


# ============================================================ keys


def test_failed_seal_does_not_pin_key_epochs_forever(tmp_path: Path) -> None:
    """If publishing a sealed block fails (``pwrite`` ENOSPC/EIO on a
    ``--host-region`` file in a full tmpfs), ``seal_blocks`` raises and the
    records of blocks it had already sealed are discarded without
    ``forget``: their epochs' live counts never reach zero, so those keys are
    never destroyed ("their key is destroyed with its last block")."""
    sealer = BlockSealer(rekey_after=1)  # one epoch per seal: easy to observe
    backend = CpuBackend(sealer, 1)
    region = HostRegion(1 << 20, str(tmp_path / "region.bin"))

    class FlakyRegion:
        capacity = region.capacity
        description = "flaky"
        writes = 0

        def write(self, offset: int, data: memoryview) -> None:
            FlakyRegion.writes += 1
            if FlakyRegion.writes == 2:
                raise OSError(28, "No space left on device")
            region.write(offset, data)

        def read_into(self, offset: int, out: memoryview) -> int:
            return region.read_into(offset, out)

        def close(self) -> None:
            region.close()

    cfg = ServerConfig(listen="unix:///unused.sock", backend="cpu", host_bytes=1 << 20)
    cache = SealedCache(cfg, backend, FlakyRegion(), sealer)
    pool = SharedKVPool(KVShape(4, **SMALL), "vllm_per_layer", name_prefix="kvseal-rev")
    try:
        req = pb.RegisterPoolRequest(name="e", model_fingerprint=FP, geometry=pool.geometry())
        pid = cache.register_pool(convert.pool_spec(req, "cpu")).pool_id
        t = tenant_digest("t")
        with pytest.raises(OSError):
            cache.offload(pid, t, None, _chain(2), [0, 1])
        cache.offload(pid, t, None, _chain(1, salt="x"), [2])  # rotates past both epochs
        # Only the stored block's epoch is left (the failed offload's are gone).
        assert sealer.live_epoch_ids() == {sealer.current_epoch}, (
            f"keys of epochs with no block left still exist: {sorted(sealer.live_epoch_ids())}"
        )
        cache.drop(pid, t, [], all_of_tenant=True)
        assert sealer.live_epoch_ids() == frozenset()  # the tenant's key scope is erased
    finally:
        cache.close()
        pool.close()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-q", __file__]))
