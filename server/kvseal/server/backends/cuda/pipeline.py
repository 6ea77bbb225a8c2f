"""The transfer pipeline of the CUDA backend: one request's copies and launches.

Every stage is a constant number of launches/copies, whatever the block count:

offload (seal)
    ONE H2D of the descriptors (pages, staging offsets, nonces, AADs) -> per chunk:
    ``kvseal_seal`` into device staging -> per chunk, on the copy stream: DMA
    staging -> host extents (runs of adjacent extents are merged into one copy) ->
    ONE D2H of the tags -> synchronise. Kernels for all chunks are queued before the
    first D2H is issued, because in CC mode a D2H blocks the issuing thread: chunk
    i+1 is sealed while chunk i crosses PCIe.
restore (verify + open)
    ONE H2D of descriptors (also the expected tags) -> per chunk: DMA host extents
    -> device staging (the snapshot: host memory is read exactly once),
    ``kvseal_verify`` on that chunk -> wait for the engine's event (host side;
    copies and verification overlap with the engine's remaining work) ->
    ``kvseal_open`` with ``all_or_nothing=1`` over the whole request -> ONE D2H of
    the verdicts -> synchronise (the RPC replies only once the plaintext is in the
    pages).

The staging, descriptor and pinned host buffers are shared by all requests: the
caller (``CudaBackend``) holds the backend lock, and drains both streams after any
failure before the next request may reuse them.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvseal.server.backends.base import BlockIO, note_written
from kvseal.server.backends.cuda.device import Device
from kvseal.server.backends.cuda.emulated import TAG_BYTES, KvsBatch, LaunchConfig
from kvseal.server.backends.cuda.ipc import CudaMappedPool
from kvseal.server.backends.cuda.keys import DeviceKeys
from kvseal.server.backends.cuda.launch import (
    WS_BYTES,
    RequestLayout,
    check_batch,
    chunk_batch,
    fill_descriptors,
    plan_runs,
    request_layout,
    split_chunks,
    staging_layout,
)
from kvseal.server.backends.cuda.region import CudaHostRegion
from kvseal.server.deadline import Deadline
from kvseal.server.errors import DeadlinePassed, ShuttingDown
from kvseal.server.sealing import SealRecord


@dataclass(frozen=True, slots=True)
class Tuning:
    """How one request is cut and launched, read from the backend's settings when
    the request starts: launch shape, chunking, and whether ``kvseal_seal`` writes
    ciphertext straight into mapped pinned host memory (``seal_mode="mapped"``)."""

    config: LaunchConfig
    max_chunks: int
    min_chunk_bytes: int
    mapped_seal: bool


class _Growable:
    """A device or pinned-host allocation that only grows (freed on close). Callers
    hold the backend lock and have synchronised the streams before it grows."""

    def __init__(self, alloc: Any, free: Any) -> None:
        self._alloc, self._free = alloc, free
        self.ptr = 0
        self.size = 0

    def get(self, nbytes: int) -> int:
        if nbytes > self.size:
            self.release()
            self.ptr = self._alloc(nbytes)
            self.size = nbytes
        return self.ptr

    def release(self) -> None:
        if self.ptr:
            ptr, self.ptr, self.size = self.ptr, 0, 0
            self._free(ptr)


class TransferPipeline:
    """Queues a request's copies and kernels on the device's two streams. Owns the
    reusable staging/descriptor buffers and the per-chunk events; ``launches``
    counts kernel launches issued (the benchmark's per-request count)."""

    def __init__(self, dev: Device) -> None:
        self._dev = dev
        self._staging = _Growable(dev.alloc, dev.free)
        self._desc = _Growable(dev.alloc, dev.free)
        self._host = _Growable(lambda n: dev.host_alloc(n, mapped=False), dev.host_free)
        self._events: list[Any] = []
        self.launches = 0

    @staticmethod
    def check_blocks(
        pool: CudaMappedPool, blocks: Sequence[BlockIO], region: CudaHostRegion
    ) -> None:
        """ValueError unless every block is one pool block that fits the region."""
        bb = pool.block_bytes
        for i, b in enumerate(blocks):
            if b.size != bb or not 0 <= b.extent.offset <= region.capacity - bb:
                raise ValueError(f"block {i} does not fit the pool or the host region")

    def _event(self, i: int) -> Any:
        while len(self._events) <= i:
            self._events.append(self._dev.new_event())
        return self._events[i]

    def _batch(
        self,
        tuning: Tuning,
        key: int,
        pool: CudaMappedPool,
        desc: int,
        lay: RequestLayout,
        staging: int,
        start: int,
        stop: int,
        *,
        all_or_nothing: bool = False,
    ) -> KvsBatch:
        """The descriptor of one launch over blocks [start, stop) of the request."""
        return chunk_batch(
            key=key,
            pool=pool.desc,
            desc=desc,
            lay=lay,
            staging=staging,
            start=start,
            stop=stop,
            config=tuning.config,
            all_or_nothing=all_or_nothing,
        )

    def _launch(self, kernel: str, batch: KvsBatch, stream: Any) -> None:
        check_batch(batch)
        self._dev.launch(
            kernel, batch.num_blocks * batch.ctas_per_block, batch.threads_per_cta, [batch], stream
        )
        self.launches += 1

    def seal(
        self,
        tuning: Tuning,
        contexts: DeviceKeys,
        pool: CudaMappedPool,
        blocks: Sequence[BlockIO],
        region: CudaHostRegion,
        epoch: int,
        nonces: list[bytes],
        deadline: Deadline,
    ) -> list[SealRecord]:
        """Seal ``blocks`` under ``epoch`` with ``nonces`` (one each) and publish the
        ciphertext to their extents; returns their records. ``deadline`` is checked
        before each chunk's kernels are queued and once more after everything
        completed (a seal that finished past the cutoff is discarded). On failure
        the caller drains both streams; the exception notes (``note_written``) the
        blocks whose region writes were queued (or being queued) before it, which
        are all that may have been written, also once the drain has run them: the
        chunks whose kernels were launched when they write the region directly
        (mapped), else the chunks whose D2H copies were being issued."""
        written: set[int] = set()
        try:
            return self._seal(
                tuning, contexts, pool, blocks, region, epoch, nonces, deadline, written
            )
        except BaseException as e:
            note_written(e, written)
            raise

    def _seal(
        self,
        tuning: Tuning,
        contexts: DeviceKeys,
        pool: CudaMappedPool,
        blocks: Sequence[BlockIO],
        region: CudaHostRegion,
        epoch: int,
        nonces: list[bytes],
        deadline: Deadline,
        written: set[int],
    ) -> list[SealRecord]:
        """:meth:`seal`; adds to ``written`` each block whose extent queued work
        may write (see there)."""
        d, n, bb = self._dev, len(blocks), pool.block_bytes
        if len(nonces) != n:
            raise RuntimeError("the sealer returned the wrong number of nonces")
        host_offsets = [b.extent.offset for b in blocks]
        mapped = tuning.mapped_seal and region.device_ptr is not None
        if mapped:
            # The kernel computes the tag from ciphertext in registers, never by
            # re-reading it, so writing straight into hostile memory is safe for seal.
            assert region.device_ptr is not None
            staging, staging_offsets = region.device_ptr, host_offsets
        else:
            staging_offsets, total = staging_layout(n, bb)
            staging = self._staging.get(total)
        lay = request_layout(n)
        host = self._host.get(lay.total)
        desc = self._desc.get(lay.total)
        fill_descriptors(
            host,
            self._host.size,
            lay,
            pages=[b.page for b in blocks],
            staging_offsets=staging_offsets,
            nonces=nonces,
            aads=[b.ad.encode() for b in blocks],
        )
        key = contexts.context(epoch)
        sk, sc = d.compute_stream, d.copy_stream
        d.h2d_async(desc, host, lay.upload_seal, sk)
        d.memset_async(desc + lay.ws, WS_BYTES * n, sk)
        chunks = split_chunks(n, bb, tuning.max_chunks, tuning.min_chunk_bytes)
        for ci, (a, b) in enumerate(chunks):
            # Each chunk is a bounded unit of page reads; a failed check stops here
            # and the caller drains what is queued (the chunks before this one).
            # No D2H copy is queued yet: the region holds nothing of this request,
            # unless the kernels write it directly (mapped).
            deadline.check(f"blocks [{a}, {b})")
            self._launch(
                "kvseal_seal", self._batch(tuning, key, pool, desc, lay, staging, a, b), sk
            )
            if mapped:  # queued (a launch that raised queued nothing): it writes the region
                written.update(range(a, b))
            d.record(self._event(ci), sk)
        # Only now the D2H copies: under CC each one blocks this thread at issue,
        # and every kernel is already queued behind it.
        for ci, (a, b) in enumerate(chunks):
            d.wait(sc, self._event(ci))
            if not mapped:
                # Before the first copy: one that fails may still have moved bytes
                # (under CC a D2H runs through the bounce buffers at issue).
                written.update(range(a, b))
                for h, s, nbytes in plan_runs(host_offsets, staging_offsets, bb, a, b):
                    d.d2h_async(region.host_ptr + h, staging + s, nbytes, sc)
        d.d2h_async(host + lay.tags, desc + lay.tags, TAG_BYTES * n, sc)
        d.sync(sc)
        d.sync(sk)
        if deadline.expired():
            # The last chunk may have read its pages after the cutoff, i.e. after the
            # engine gave up and reused them: never let those bytes be published.
            raise DeadlinePassed(
                "the request's deadline passed while its blocks were sealed; "
                "the ciphertext was discarded and nothing is published"
            )
        deadline.check("the sealed blocks")  # cancelled or stopping meanwhile: discard
        tags = ctypes.string_at(host + lay.tags, TAG_BYTES * n)
        return [
            SealRecord(epoch, nonces[i], tags[TAG_BYTES * i : TAG_BYTES * (i + 1)])
            for i in range(n)
        ]

    def open(
        self,
        tuning: Tuning,
        contexts: DeviceKeys,
        pool: CudaMappedPool,
        blocks: Sequence[BlockIO],
        records: Sequence[SealRecord],
        region: CudaHostRegion,
        await_engine: Callable[[], None],
        stopping: threading.Event,
        deadline: Deadline,
    ) -> list[int]:
        """Snapshot, verify and (only if every block verified) open ``blocks`` into
        the pool; returns the indices that failed. ``await_engine`` waits for the
        engine's event before the open pass, the only work that writes pages. On
        failure the caller drains both streams."""
        d, n, bb = self._dev, len(blocks), pool.block_bytes
        # One key per launch: order the blocks by epoch so each epoch is a contiguous
        # range of the descriptor arrays (almost always a single range).
        perm = sorted(range(n), key=lambda i: records[i].epoch)
        groups: list[tuple[int, int, int]] = []  # (epoch, start, stop) in perm order
        for j, i in enumerate(perm):
            e = records[i].epoch
            if groups and groups[-1][0] == e:
                groups[-1] = (e, groups[-1][1], j + 1)
            else:
                groups.append((e, j, j + 1))
        host_offsets = [blocks[i].extent.offset for i in perm]
        staging_offsets, total = staging_layout(n, bb)
        staging = self._staging.get(total)
        lay = request_layout(n)
        host = self._host.get(lay.total)
        desc = self._desc.get(lay.total)
        fill_descriptors(
            host,
            self._host.size,
            lay,
            pages=[blocks[i].page for i in perm],
            staging_offsets=staging_offsets,
            nonces=[records[i].nonce for i in perm],
            aads=[blocks[i].ad.encode() for i in perm],
            tags=[records[i].tag for i in perm],
        )
        keys = {e: contexts.context(e) for e, _, _ in groups}
        sk, sc = d.compute_stream, d.copy_stream
        d.h2d_async(desc, host, lay.upload_open, sk)
        # Verdicts and workspace together: open trusts ok[], which must never carry a
        # previous request's 1 (ok directly precedes ws in the layout).
        d.memset_async(desc + lay.ok, lay.total - lay.ok, sk)
        ci = 0
        for e, g0, g1 in groups:
            for ra, rb in split_chunks(g1 - g0, bb, tuning.max_chunks, tuning.min_chunk_bytes):
                a, b = ra + g0, rb + g0
                # Nothing here touches the pages (host region -> staging, verify on
                # staging), but a request already failed need not spend the GPU.
                deadline.check(f"blocks [{a}, {b})")
                # Snapshot this chunk's ciphertext into private device memory: the
                # only read of host memory; verify and open use the snapshot.
                for h, s, nbytes in plan_runs(host_offsets, staging_offsets, bb, a, b):
                    d.h2d_async(staging + s, region.host_ptr + h, nbytes, sc)
                d.record(self._event(ci), sc)
                d.wait(sk, self._event(ci))
                batch = self._batch(tuning, keys[e], pool, desc, lay, staging, a, b)
                self._launch("kvseal_verify", batch, sk)
                ci += 1
        # Only open writes the pages: copies and verification above overlap with the
        # engine's remaining work; its event is awaited here, on the host (the
        # backend lock is held, so a stuck engine stream delays other requests by at
        # most the timeout; no GPU-side wait is ever queued on it).
        await_engine()
        if len(groups) > 1:
            # Each launch's all-or-nothing gate sees only its own epoch's flags,
            # so the whole-request decision is made here first (rare: rekeys).
            d.d2h_async(host + lay.ok, desc + lay.ok, n, sk)
            d.sync(sk)
            flags = ctypes.string_at(host + lay.ok, n)
            if any(f != 1 for f in flags):
                return sorted(perm[j] for j in range(n) if flags[j] != 1)
        if stopping.is_set():  # an integrity abort elsewhere: write no page
            raise ShuttingDown("kvseal stopped serving; nothing was restored")
        # The last check: once the open pass is queued it runs to its end (all
        # epochs' launches back to back), and the reply waits for it.
        deadline.check("the destination pages")
        # Right before the open pass: a drop that destroyed these keys since the
        # request began makes it write no page (KeyDestroyed). Once the pass is
        # queued the restore is committed and counts as done before such a drop.
        contexts.sealer.require_live(keys)
        for e, g0, g1 in groups:
            batch = self._batch(
                tuning, keys[e], pool, desc, lay, staging, g0, g1, all_or_nothing=True
            )
            self._launch("kvseal_open", batch, sk)
        d.d2h_async(host + lay.ok, desc + lay.ok, n, sk)
        d.sync(sk)
        d.sync(sc)
        flags = ctypes.string_at(host + lay.ok, n)
        return sorted(perm[j] for j in range(n) if flags[j] != 1)

    def close(self, step: Callable[[str, Callable[[], object]], None]) -> None:
        """Free the buffers and destroy the events; ``step(what, fn)`` logs failures."""
        for buf in (self._staging, self._desc, self._host):
            step("free a staging/descriptor buffer", buf.release)
        for ev in self._events:
            step("destroy an event", functools.partial(self._dev.destroy_event, ev))
        self._events = []
