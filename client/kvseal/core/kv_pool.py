"""This rank's vLLM KV cache as a kvseal pool (worker side); imports no vLLM.

vLLM hands the offloading worker its KV cache canonicalised
(``CanonicalKVCaches``): a list of tensors whose first dimension is the block
(page) index, each typically int8 ``(num_blocks, page_bytes)`` with
``stride(0)`` the block stride in bytes (equal to the page, or larger for
padded and packed layouts), and per KV-cache group one reference per layer:
``(tensor_idx, page_size_bytes)``, the layer's un-padded bytes per page. A
block's plaintext is, in layer order, each layer's first ``page_size_bytes``
bytes of that page: :func:`layer_page_views` turns that description into one
``(num_blocks, page_size_bytes)`` int8 view per layer, the pure part (shapes
and strides only, the same for CPU and CUDA tensors), and :func:`pool_geometry`
turns the views into the daemon's ``PoolGeometry``:

- **CPU** tensors must live in the shared-memory object the connector made vLLM
  allocate (:mod:`kvseal.core.shm_kv`); the pool is for the daemon's CPU backend.
- **CUDA** tensors are exported with legacy CUDA IPC through
  :func:`kvseal.client.torch_pool.geometry_from_tensors` (one buffer per
  ``cudaMalloc`` allocation); the pool is for the CUDA backend, and every
  transfer carries an interprocess CUDA event (:meth:`KVPool.engine_event`)
  recorded on the engine's current stream when vLLM submits the job: the
  daemon polls it on the host (``cuEventQuery``) until it has completed, so it
  reads pages only after the engine's writes to them (offload) and writes pages
  only after the engine's last use of them (restore). A restore's reply comes
  after its bytes are in the pages.

:class:`KVPool` is what :class:`kvseal.vllm.spec.KVSealOffloadingWorker` holds
(its registration and transfers); it is usable without vLLM (tests/gpu).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvseal.client import EnginePool, KVSealClient, torch_pool
from kvseal.core import shm_kv
from kvseal.v1 import kvseal_pb2 as pb


class TensorRef(Protocol):
    """vLLM's ``CanonicalKVCacheRef`` as this module reads it."""

    tensor_idx: int
    page_size_bytes: int


class KVTensor(Protocol):
    """vLLM's ``CanonicalKVCacheTensor`` as this module reads it."""

    tensor: Any  # torch.Tensor, first dimension the block index


def layer_page_views(tensors: Sequence[KVTensor], refs: Sequence[TensorRef]) -> list[Any]:
    """One int8 view ``(num_blocks, page_size_bytes)`` per ref, in ref (layer)
    order: view ``i`` row ``p`` is layer ``i``'s bytes of page ``p``. Views
    share memory with vLLM's tensors (nothing is copied, nothing allocated on the
    device). ValueError, saying what is wrong, when there is no layer, a tensor's
    bytes within a page are not one contiguous run, a layer's page bytes exceed
    its tensor's page, or the layers disagree on the number of blocks."""
    import torch  # noqa: PLC0415 - only the worker process gets here

    if not refs:
        raise ValueError("the offloaded KV-cache group has no layer")
    views: list[Any] = []
    num_blocks: int | None = None
    for i, ref in enumerate(refs):
        t = tensors[ref.tensor_idx].tensor
        if t.dim() < 1 or t.shape[0] < 1:
            raise ValueError(f"layer {i}: KV tensor of shape {tuple(t.shape)} has no blocks")
        try:
            # Bytes of one page as one row; view() (never reshape) so a layout
            # whose page is not one run of bytes fails instead of being copied.
            rows = t.view(t.shape[0], -1)
            if rows.element_size() != 1:
                rows = rows.view(torch.int8)
        except RuntimeError as e:
            raise ValueError(
                f"layer {i}: the bytes of one page of its KV tensor (shape {tuple(t.shape)}, "
                f"strides {tuple(t.stride())}) are not one contiguous run: {e}"
            ) from e
        if not 0 < ref.page_size_bytes <= rows.shape[1]:
            raise ValueError(
                f"layer {i}: {ref.page_size_bytes} page bytes, but its tensor has "
                f"{rows.shape[1]} bytes per page"
            )
        if num_blocks is None:
            num_blocks = rows.shape[0]
        elif rows.shape[0] != num_blocks:
            raise ValueError(
                f"layer {i} has {rows.shape[0]} blocks, layer 0 has {num_blocks}: "
                "one pool needs one block count"
            )
        views.append(rows[:, : ref.page_size_bytes])
    return views


def pool_geometry(
    views: Sequence[Any], template: pb.PoolGeometry
) -> tuple[pb.PoolGeometry, pb.Backend]:
    """``(geometry, backend)`` of the pool made of ``views`` (from
    :func:`layer_page_views`): one segment per view, in order, so the block bytes
    are the views' row bytes; the template's block fields (tokens_per_page,
    layers, heads, head_dim, dtype, layout: what the namespace depends on, shared
    with the scheduler's observer pool) are kept. ValueError when the tensors are
    neither all in the connector's shared memory (CPU) nor all on CUDA."""
    if all(v.device.type == "cuda" for v in views):
        g = torch_pool.geometry_from_tensors(
            views,
            0,
            layout_name=template.layout,
            tokens_per_page=template.tokens_per_page,
            num_layers=template.num_layers,
            num_kv_heads=template.num_kv_heads,
            head_dim=template.head_dim,
            dtype=template.dtype,
        )
        return g, pb.BACKEND_CUDA
    if any(v.device.type != "cpu" for v in views):
        devices = sorted({str(v.device) for v in views})
        raise ValueError(f"the KV cache is on {', '.join(devices)}: need all CPU or all CUDA")
    segs: list[pb.Segment] = []
    alloc = None
    num_pages = 0
    for v in views:
        nbytes = (v.shape[0] - 1) * v.stride(0) + v.shape[1]
        a = shm_kv.find_allocation(v.data_ptr(), nbytes)
        if a is None or (alloc is not None and a is not alloc):
            raise ValueError(
                "the KV cache is not in shared memory (use kv_connector=KVSealOffloadingConnector)"
            )
        alloc = a
        num_pages = v.shape[0]
        segs.append(
            pb.Segment(
                buffer=0,
                offset=v.data_ptr() - a.base,
                page_stride=v.stride(0),
                bytes=v.shape[1],
            )
        )
    assert alloc is not None
    g = pb.PoolGeometry()
    g.CopyFrom(template)
    g.num_pages = num_pages
    g.block_bytes = 0
    del g.buffers[:]
    g.buffers.append(pb.BufferHandle(shm_name=alloc.shm_name, offset=0, size=alloc.size))
    del g.segments[:]
    g.segments.extend(segs)
    return g, pb.BACKEND_CPU


@dataclass
class EngineEvent:
    """An interprocess CUDA event recorded on the engine's stream, and its IPC
    handle for the request. Keep it (this object) until the transfer returned:
    the daemon opens the event by its handle while the request runs."""

    event: Any  # torch.cuda.Event(interprocess=True)
    handle: bytes


class KVPool:
    """This rank's KV pool on its daemon: geometry, registration, transfers.

    Construction builds the geometry (ValueError if the KV cache cannot be
    exported, see :func:`pool_geometry`) and starts the registration in the
    background (:class:`~kvseal.client.EnginePool`: retried, held, re-registered
    after a daemon restart). ``offload``/``restore`` never raise and return
    EnginePool's verdicts (False: the pages are the engine's again, nothing was
    or will be written to them by the daemon). Thread-safe.
    """

    def __init__(
        self,
        client: KVSealClient,
        name: str,
        fingerprint: bytes,
        template: pb.PoolGeometry,
        tensors: Sequence[KVTensor],
        refs: Sequence[TensorRef],
    ) -> None:
        views = layer_page_views(tensors, refs)
        self.geometry, self.backend = pool_geometry(views, template)
        self.block_bytes = sum(s.bytes for s in self.geometry.segments)
        self.device: Any = views[0].device if self.backend == pb.BACKEND_CUDA else None
        self._views = views  # the daemon maps this memory: keep the tensors alive
        # CPU: the shared-memory object the daemon opens by name (its owner: shm_kv).
        self._shm: shm_kv.ShmAllocation | None = None
        if self.backend == pb.BACKEND_CPU:
            shm_name = self.geometry.buffers[0].shm_name
            self._shm = next((a for a in shm_kv.allocations() if a.shm_name == shm_name), None)
        self.pool = EnginePool(client, name, fingerprint, self.geometry, backend=self.backend)

    @property
    def cuda(self) -> bool:
        return self.backend == pb.BACKEND_CUDA

    def page_regions(self) -> list[tuple[int, int, int, int]]:
        """Per layer (segment order): ``(base address, page stride, pages, page
        bytes)`` of the memory registered with the daemon (a CPU address in the
        shared-memory object, or a CUDA device address). What an engine that
        names pages by address (vLLM >= 0.34) is checked against: only these
        pages are ever read or written."""
        return [
            (int(v.data_ptr()), int(v.stride(0)), int(v.shape[0]), int(v.shape[1]))
            for v in self._views
        ]

    def engine_event(self) -> EngineEvent | None:
        """CUDA: an interprocess event recorded now on the current stream of the
        KV cache's device, i.e. after every kernel the engine has issued so far
        (call it on the engine's thread, when it hands over a job). None on the CPU."""
        if not self.cuda:
            return None
        import torch  # noqa: PLC0415

        cuda: Any = torch.cuda  # Event is untyped in torch's stubs
        ev = cuda.Event(interprocess=True)
        ev.record(cuda.current_stream(self.device))
        return EngineEvent(ev, torch_pool.ipc_event_handle(ev))

    def offload(
        self,
        tenant: bytes,
        hashes: Sequence[bytes],
        pages: Sequence[int],
        parent_hash: bytes | None = None,
        event: EngineEvent | None = None,
    ) -> bool:
        return self.pool.offload(
            tenant, hashes, pages, parent_hash, cuda_event_ipc_handle=_handle(event)
        )

    def restore(
        self,
        tenant: bytes,
        hashes: Sequence[bytes],
        pages: Sequence[int],
        release: bool = False,
        event: EngineEvent | None = None,
        timeout: float | None = None,
    ) -> bool:
        return self.pool.restore(
            tenant, hashes, pages, release, cuda_event_ipc_handle=_handle(event), timeout=timeout
        )

    def release(self, tenant: bytes, hashes: Sequence[bytes], timeout: float | None = None) -> bool:
        """Write-back: release blocks restored with ``release=False`` once
        the whole load verified (:meth:`EnginePool.release`; never raises)."""
        return self.pool.release(tenant, hashes, timeout=timeout)

    def close(self) -> None:
        """Release the pool for good (the worker's shutdown). CPU: the KV
        object's name is unlinked first, then the pool unregistered: nothing
        registers it again, and vLLM may kill the worker right after this (on
        SIGTERM it does), before any exit handler; unlinking before the daemon
        lets go leaves no moment in which a kill strands the name (the daemon
        keeps its fd until it unregisters, and the memory lives as long as
        vLLM's tensor)."""
        if self._shm is not None:
            self._shm.unlink()
        self.pool.close()


def _handle(event: EngineEvent | None) -> bytes:
    return event.handle if event is not None else b""
