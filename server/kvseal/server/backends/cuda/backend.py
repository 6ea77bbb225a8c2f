"""The CUDA backend: seal and verify KV blocks on the GPU (cuda-python driver API).

It keeps the :class:`~kvseal.server.backends.base.Backend` contract (see that module):
``seal_blocks`` returns one :class:`SealRecord` per block or raises (then every nonce
it drew is burnt and no extent holds a valid block); ``open_blocks`` authenticates
every block and writes nothing to the engine's pool unless all of them verified.

This module is the backend's front: the lock, the order of a request's steps, and
the failure handling. The parts, one room each:

- ``device``    :class:`~kvseal.server.backends.cuda.device.Device` (the driver
  calls; :class:`CudaDevice` is the real one, ``emulated_device.EmulatedDevice`` the
  CPU twin the test-suite uses), and the context's health (``ContextGuard``);
- ``ipc``       engine pools and events opened from CUDA IPC handles;
- ``keys``      device key contexts, derived from the sealer's keys;
- ``pipeline``  one request's copies and kernel launches (the data path of a
  seal and of a restore, stage by stage);
- ``launch``    the launch descriptors (pure arithmetic, tested on the CPU);
- ``region``    pinned host memory that holds only ciphertext.

Data path of one request: offload polls the engine's IPC event until it completes
(host side, before the backend lock; at most ``engine_event_timeout``), then runs
the seal pipeline; restore runs the snapshot-and-verify half of the open pipeline,
polls the engine's event (copies and verification overlap with the engine's
remaining work), then queues the open pass (``pipeline`` has the stages).

Concurrency: requests are serialised by one lock (the staging and descriptor
buffers are shared, and copies within one context serialise in CC mode anyway).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvseal.server.backends.base import BlockIO, Region, note_written
from kvseal.server.backends.cuda.device import ContextGuard, CudaDevice, CudaError, Device
from kvseal.server.backends.cuda.emulated import LaunchConfig
from kvseal.server.backends.cuda.ipc import (
    DEFAULT_ENGINE_EVENT_TIMEOUT,
    CudaMappedPool,
    IpcPools,
    await_engine_event,
    close_engine_event,
    open_engine_event,
)
from kvseal.server.backends.cuda.keys import DeviceKeys, DeviceKeySource
from kvseal.server.backends.cuda.launch import DEFAULT_MAX_CHUNKS, DEFAULT_MIN_CHUNK_BYTES
from kvseal.server.backends.cuda.pipeline import TransferPipeline, Tuning
from kvseal.server.backends.cuda.region import CudaHostRegion
from kvseal.server.deadline import NO_DEADLINE, Deadline
from kvseal.server.pools import MappedPool, PoolSpec
from kvseal.server.sealing import SealRecord

log = logging.getLogger("kvseal.cuda")


def _request_scope(blocks: Sequence[BlockIO]) -> tuple[bytes, bytes]:
    """The one key scope (namespace, tenant) of a seal batch; ValueError if the
    batch mixes scopes (the cache never does: one request is one pool and tenant)."""
    scope = blocks[0].ad.scope
    if any(b.ad.scope != scope for b in blocks):
        raise ValueError("a seal batch must be of one namespace and one tenant")
    return scope


class CudaBackend:
    """See the module docstring. ``device`` is the GPU ordinal; ``dev`` injects a
    :class:`Device` (tests use ``EmulatedDevice``). ``seal_mode="mapped"`` makes
    ``kvseal_seal`` write ciphertext straight into mapped pinned host memory (no
    staging, no D2H; off in CC mode, where the region is not mapped), a benchmark
    alternative to the default ``"dma"``. ``engine_event_timeout`` bounds how long a
    request polls the engine's IPC event on the host (``cuEventQuery``;
    EngineNotReady after it, nothing written). An offload polls before taking the
    backend lock; a restore polls after queuing its copies and verification, with
    the lock held, so a stuck engine stream can delay other requests by at most
    the timeout, and never blocks the GPU streams (no GPU-side wait on an engine
    event, ``cuStreamWaitEvent``, is ever queued).

    Failure contract: a request that raises after queuing GPU work first waits for
    all of it (both streams), so no stale copy or kernel can read descriptors or
    staging that the next request rewrites, and no page is touched after the call
    returned (the engine contract; ``deadline`` is checked before each queued chunk).
    A sticky CUDA error, or streams that cannot be drained, mark the backend
    unusable ("restart kvseal-server") and call the :meth:`set_on_broken` callback,
    on which the daemon stops serving and exits 4.

    Device memory it keeps: staging = the largest request's ciphertext (bounded by
    ``--max-batch-bytes``), descriptors, 2,800 B per live key epoch."""

    kind = "cuda"

    def __init__(
        self,
        sealer: DeviceKeySource,
        device: int = 0,
        *,
        dev: Device | None = None,
        config: LaunchConfig | None = None,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        min_chunk_bytes: int = DEFAULT_MIN_CHUNK_BYTES,
        seal_mode: str = "dma",
        cc: str | None = None,
        engine_event_timeout: float = DEFAULT_ENGINE_EVENT_TIMEOUT,
    ) -> None:
        if seal_mode not in ("dma", "mapped"):
            raise ValueError("seal_mode must be 'dma' or 'mapped'")
        from kvseal.server.backends.cuda import probe  # noqa: PLC0415

        self._sealer = sealer
        self.stopping = threading.Event()  # set by the cache when it stops serving
        self._dev: Device = dev if dev is not None else CudaDevice(device)
        self.cc = cc if cc is not None else probe.cc_mode()
        self.config = config or LaunchConfig()
        self.max_chunks = max(1, max_chunks)
        self.min_chunk_bytes = min_chunk_bytes
        self.seal_mode = seal_mode
        self.engine_event_timeout = engine_event_timeout
        self.device = device
        self._lock = threading.Lock()
        self._closed = False  # set by close(): the periodic check stops touching the device
        d = self._dev
        self._guard = ContextGuard(d)
        self._pools = IpcPools(d, self._guard, self._lock, device)
        self._keys = DeviceKeys(d, sealer)  # epoch -> device KvsKeyCtx
        self._pipeline = TransferPipeline(d)
        try:
            d.make_current()
            self._keys.allocate()
        except BaseException:
            self.close()
            raise
        image = getattr(self._dev, "image_kind", "")
        self.detail = (
            f"cuda: {d.name} (device {device}, {d.arch}), AES-256-GCM kernels"
            + (f" ({image})" if image else "")
            + f", CC mode {self.cc}, seal {seal_mode}"
        )

    # -- state --------------------------------------------------------------------------

    @property
    def broken(self) -> str | None:
        """Why the backend can no longer serve (a sticky CUDA error, or streams that
        could not be drained), or None. Once set it stays set: only a new process
        gets a new context."""
        return self._guard.broken

    def set_on_broken(self, callback: Callable[[str], None]) -> None:
        """Have ``callback(reason)`` run once, when the backend becomes unusable (at
        once if it already is). The daemon stops serving then and exits non-zero so
        that its supervisor starts a fresh process. It runs on the thread that hit
        the error, with the backend lock held: it must only signal, never block."""
        self._guard.set_on_broken(callback)

    @property
    def launches(self) -> int:
        """Kernel launches issued, for the benchmark's per-request count."""
        return self._pipeline.launches

    def _tuning(self) -> Tuning:
        return Tuning(
            self.config, self.max_chunks, self.min_chunk_bytes, self.seal_mode == "mapped"
        )

    def retire_keys(self) -> None:
        """Wipe and free, now, the device key contexts of epochs the sealer no
        longer lists (a ``Drop(all_of_tenant)`` destroyed their scope). Takes the
        backend lock, so it waits for a request in flight (bounded by that request's
        own deadline); a request that used such a context fails before its open
        pass (``require_live``). Never raises: on a broken backend the contexts go
        with the process (logged)."""
        with self._lock:
            if self._guard.broken is not None or not self._keys:
                return
            try:
                self._guard.enter()
                self._keys.prune()
            except CudaError as e:
                self._guard.note(e)
                log.warning("wiping the device key contexts of a dropped tenant failed: %s", e)

    def check_device(self) -> None:
        """The daemon's periodic check (``--device-check-interval``): make the context
        current and synchronise it (``Device.check_context``). A context lost while
        the daemon is idle (an Xid, a GPU reset) is then found without waiting for a
        request to touch the GPU: the backend is marked broken and the
        :meth:`set_on_broken` callback runs (the daemon turns health NOT_SERVING and
        exits 4). Any failure of the check counts: with no request in flight both
        streams are idle, so a healthy context cannot fail it.

        Cheap and never blocking on a request: if one holds the backend lock the
        check is skipped (that request meets a lost context itself), as it is once
        the backend is closed or already broken. Never raises a CudaError (any
        other exception is a defect of the bindings or of this code: it
        propagates, and the daemon turns the check off)."""
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._closed or self._guard.broken is not None:
                return
            try:
                self._dev.make_current()
                self._dev.check_context()
            except CudaError as e:
                self._guard.mark_broken(
                    f"CUDA context lost or unusable, found by the periodic device check: {e}"
                )
        finally:
            self._lock.release()

    # -- engine events (see ipc) --------------------------------------------------------

    def _open_event(self, handle: bytes | None) -> Any:
        return open_engine_event(self._dev, self._guard, handle, self.device)

    def _await_event(self, event: Any, deadline: Deadline = NO_DEADLINE) -> None:
        await_engine_event(self._dev, event, self.engine_event_timeout, self.stopping, deadline)

    def _close_event(self, event: Any) -> None:
        close_engine_event(self._dev, event)

    # -- Backend ------------------------------------------------------------------------

    def make_region(self, capacity: int, path: str | None) -> CudaHostRegion:
        with self._lock:
            self._guard.enter()
            try:
                return CudaHostRegion(self._dev, capacity, path, cc=self.cc)
            except CudaError as e:
                self._guard.note(e)
                raise

    def map_pool(self, spec: PoolSpec) -> CudaMappedPool:
        """Open every buffer's IPC handle (once per distinct handle), check that the
        buffer fits its allocation, and upload the pool's tables. HandleUnusable,
        with what to change, when a handle cannot be used; nothing stays open then."""
        with self._lock:
            self._guard.enter()
            return self._pools.map(spec)

    def map_local_pool(self, spec: PoolSpec, bases: Sequence[int]) -> CudaMappedPool:
        """A pool whose buffers this process owns (benchmarks, tests): ``bases`` are
        device addresses of ``spec``'s buffers; the caller keeps them alive."""
        with self._lock:
            self._guard.enter()
            return CudaMappedPool(spec, self._dev, bases)

    def seal_blocks(
        self,
        pool: MappedPool,
        blocks: Sequence[BlockIO],
        region: Region,
        wait_event: bytes | None = None,
        deadline: Deadline = NO_DEADLINE,
    ) -> list[SealRecord]:
        """Seal ``blocks`` (see the module docstring). ``deadline`` is checked before
        each chunk's kernels are queued (the kernels are what read the pages) and once
        more after everything completed: a seal that finished past the cutoff, or
        after the call was cancelled, is discarded (its nonces burnt, no record
        returned), since its pages may have been read after the engine gave up. On
        any failure both streams are drained before this raises, and the exception
        carries (:func:`~kvseal.server.backends.base.note_written`) exactly the blocks
        whose extents queued work may have written: none for a failure before the
        first region write is queued (a bad or pending engine event, the cutoff while
        waiting for it, context entry, key derivation, the descriptor upload, the
        first launch), else the chunks whose copies (or, with ``seal_mode="mapped"``,
        kernels) were queued. The cache reinstates every other block's victims."""
        assert isinstance(pool, CudaMappedPool) and isinstance(region, CudaHostRegion)
        if not blocks:
            return []
        try:
            return self._seal(pool, blocks, region, wait_event, deadline)
        except BaseException as e:
            # The cache reinstates the eviction victims of every block not noted as
            # written. Only the pipeline queues work that writes the region, and it
            # notes what it queued on every failure (note_written takes the union);
            # any failure before it (the engine's event, context entry, key pruning,
            # nonces) wrote nothing.
            note_written(e, set())
            raise

    def _seal(
        self,
        pool: CudaMappedPool,
        blocks: Sequence[BlockIO],
        region: CudaHostRegion,
        wait_event: bytes | None,
        deadline: Deadline,
    ) -> list[SealRecord]:
        TransferPipeline.check_blocks(pool, blocks, region)
        engine = self._open_event(wait_event)
        try:
            # Offload reads the pages, so nothing can start before the engine's event:
            # wait for it before taking the lock (a slow engine stream then holds up
            # only its own request, not the backend).
            self._await_event(engine, deadline)
            with self._lock:
                self._guard.enter()
                try:
                    self._keys.prune()
                except BaseException as e:
                    self._guard.failed(e)
                    raise
                deadline.check("the first page")  # the lock may have taken a while
                epoch, nonces = self._sealer.allocate_for_device(
                    len(blocks), _request_scope(blocks)
                )
                try:
                    return self._pipeline.seal(
                        self._tuning(), self._keys, pool, blocks, region, epoch, nonces, deadline
                    )
                except BaseException as e:
                    for _ in blocks:  # burn every nonce drawn: none is ever reused
                        self._sealer.forget(epoch)
                    self._guard.failed(e)
                    raise
        finally:
            self._close_event(engine)

    def open_blocks(
        self,
        pool: MappedPool,
        blocks: Sequence[BlockIO],
        records: Sequence[SealRecord],
        region: Region,
        wait_event: bytes | None = None,
        deadline: Deadline = NO_DEADLINE,
    ) -> list[int]:
        """Verify and open ``blocks`` into the pool (see the module docstring).
        ``deadline`` is checked before each chunk's snapshot and verification are
        queued, while the engine's event is awaited, and last right before the open
        pass (the only work that writes pages: one launch per key epoch, queued back
        to back, so it is one bounded unit of kernel time). After a failed check no
        page was written; both streams are drained before this raises.

        A CUDA error raised while or after the open pass was queued (a device fault,
        a failed launch of a later epoch's open) may leave any of the request's
        destination pages partly or wholly overwritten with the plaintext of this
        request's blocks, all of which verified first (``open`` decrypts only the
        verified snapshot in device memory, gated on every block's verdict); no
        unverified byte and no page outside the request is ever written. The
        request fails (INTERNAL) and the engine must treat all its destination
        pages as unwritten garbage, as after any failed restore."""
        assert isinstance(pool, CudaMappedPool) and isinstance(region, CudaHostRegion)
        if len(records) != len(blocks):
            raise ValueError("one record per block is required")
        if not blocks:
            return []
        TransferPipeline.check_blocks(pool, blocks, region)
        engine = self._open_event(wait_event)
        try:
            with self._lock:
                self._guard.enter()
                try:
                    self._keys.prune()
                    return self._pipeline.open(
                        self._tuning(),
                        self._keys,
                        pool,
                        blocks,
                        records,
                        region,
                        lambda: self._await_event(engine, deadline),
                        self.stopping,
                        deadline,
                    )
                except BaseException as e:
                    self._guard.failed(e)
                    raise
        finally:
            self._close_event(engine)

    def close(self) -> None:
        """Wipe and free key contexts, free buffers, close IPC mappings, release the
        device. Best effort: each step runs even if an earlier one failed (logged).
        Idempotent."""
        with self._lock:
            self._closed = True
            d = self._dev

            def step(what: str, fn: Callable[[], object]) -> None:
                try:
                    fn()
                except CudaError as e:
                    log.warning("releasing CUDA resources (%s) failed: %s", what, e)

            step("make the context current", d.make_current)
            self._keys.close(step)
            self._pipeline.close(step)
            step("close IPC mappings", self._pools.close_all)
            try:
                d.close()
            except CudaError as e:
                log.warning("releasing the CUDA device failed: %s", e)
