"""Describe an engine's KV pool tensors to the daemon (engine side).

The daemon needs, per pool, the buffers that hold the KV cache and the *segments*
that make up one block (see ``Segment`` in the proto). This module derives both
from the engine's own tensors:

- :func:`geometry_from_tensors`: torch **CUDA** tensors (CUDA backend). Each
  distinct caching-allocator segment (``cudaMalloc`` allocation) becomes one
  ``BufferHandle`` carrying its legacy CUDA IPC handle, so the daemon opens each
  allocation once. Uses ``untyped_storage()._share_cuda_()``, which returns
  the IPC handle of the allocation that contains the storage and the storage's
  byte offset in it.
- :func:`geometry_from_shm_tensors`: tensors made by
  :meth:`kvseal.client.shm.SharedKVPool.tensors` (CPU backend); buffers are the
  pool's shared-memory objects.
- :func:`ipc_event_handle`: the 64-byte handle of a
  ``torch.cuda.Event(interprocess=True)`` for ``Offload``/``Restore``'s
  ``cuda_event_ipc_handle``.

Segment rule: the dimension ``page_dim`` indexes pages; every dimension after it
must be contiguous (one page of one tensor is one run of bytes); the dimensions
before it enumerate segments in row-major order. For tensors in token-major
layouts (SGLang's ``[pages * tokens, heads, dim]``) pass a view with a page
dimension: ``t.unflatten(0, (-1, tokens_per_page))``.

The block byte order the geometry implies is the tensors' order, then leading
dimensions, then the inner bytes; ``layout_name`` goes into the cache namespace,
so pools whose blocks have the same byte order should use the same name
(:data:`kvseal.client.shm.BLOCK_ORDER` for "layer, K/V, token, head, dim").

torch is imported lazily and only its tensors' methods are used; cuda-python is
never needed on the engine side. Errors are ValueError with what to change.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvseal.v1 import kvseal_pb2 as pb

if TYPE_CHECKING:
    import torch
    from kvseal.client.shm import SharedKVPool

__all__ = [
    "geometry_from_shm_tensors",
    "geometry_from_tensors",
    "ipc_event_handle",
    "page_segments",
]

IPC_HANDLE_BYTES = 64
_EXPANDABLE_HINT = (
    "the KV pool lives in PyTorch expandable segments (cuMemCreate memory), which legacy "
    "CUDA IPC cannot export: start the engine with "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False"
)


def page_segments(
    shape: Sequence[int],
    strides: Sequence[int],
    itemsize: int,
    page_dim: int,
    start: int,
) -> tuple[int, list[tuple[int, int, int]]]:
    """(pages, [(offset, page_stride, bytes), ...]) of one tensor, in bytes.

    ``shape``/``strides`` are in elements (as torch reports them); ``start`` is the
    byte offset of the tensor's first element in its buffer. Raises ValueError when
    the dimensions after ``page_dim`` are not contiguous or pages would overlap."""
    nd = len(shape)
    if not 0 <= page_dim < nd:
        raise ValueError(f"page_dim {page_dim} is out of range for a {nd}-d tensor")
    if any(s <= 0 for s in shape):
        raise ValueError(f"empty tensor (shape {tuple(shape)})")
    inner = 1
    for d in range(nd - 1, page_dim, -1):
        if shape[d] != 1 and strides[d] != inner:
            raise ValueError(
                f"dimensions after page_dim {page_dim} must be contiguous (shape {tuple(shape)}, "
                f"strides {tuple(strides)}): one page must be one run of bytes"
            )
        inner *= shape[d]
    nbytes = inner * itemsize
    pages = shape[page_dim]
    page_stride = strides[page_dim] * itemsize
    if pages > 1 and page_stride < nbytes:
        raise ValueError(
            f"page stride {page_stride} bytes < {nbytes} bytes per page: pages would overlap"
        )
    segs = []
    for idx in itertools.product(*(range(s) for s in shape[:page_dim])):
        off = start + sum(i * st for i, st in zip(idx, strides[:page_dim], strict=True)) * itemsize
        segs.append((off, page_stride, nbytes))
    return pages, segs


@dataclass
class _Buffer:
    """A group of tensors in one allocation / shm object (byte span in it)."""

    key: Any
    handle: pb.BufferHandle
    lo: int
    hi: int


def _geometry(
    tensors: Sequence[torch.Tensor],
    page_dim: int,
    locate: Callable[[torch.Tensor], tuple[Any, int, pb.BufferHandle]],
    whole_buffers: bool,
    *,
    layout_name: str,
    tokens_per_page: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str | None,
) -> pb.PoolGeometry:
    if not tensors:
        raise ValueError("need at least one tensor")
    buffers: list[_Buffer] = []
    index: dict[Any, int] = {}
    raw: list[tuple[int, int, int, int]] = []  # (buffer, absolute offset, stride, bytes)
    num_pages: int | None = None
    for t in tensors:
        key, start, handle = locate(t)
        pages, segs = page_segments(
            tuple(t.shape), tuple(t.stride()), t.element_size(), page_dim, start
        )
        if num_pages is None:
            num_pages = pages
        elif pages != num_pages:
            raise ValueError(f"tensors disagree on the number of pages ({num_pages} vs {pages})")
        if key not in index:
            index[key] = len(buffers)
            buffers.append(_Buffer(key, handle, 2**63, 0))
        b = index[key]
        for off, stride, n in segs:
            buffers[b].lo = min(buffers[b].lo, off)
            buffers[b].hi = max(buffers[b].hi, off + (pages - 1) * stride + n)
            raw.append((b, off, stride, n))
    assert num_pages is not None
    handles = []
    for buf in buffers:
        if whole_buffers:  # the handle already says offset 0 and the object's size
            buf.lo = 0
        else:
            buf.handle.offset = buf.lo
            buf.handle.size = buf.hi - buf.lo
        handles.append(buf.handle)
    segments = [
        pb.Segment(buffer=b, offset=off - buffers[b].lo, page_stride=stride, bytes=n)
        for b, off, stride, n in raw
    ]
    if dtype is None:
        dtype = str(tensors[0].dtype).removeprefix("torch.")
    return pb.PoolGeometry(
        num_pages=num_pages,
        tokens_per_page=tokens_per_page,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        layout=layout_name,
        buffers=handles,
        segments=segments,
    )


def _legacy_handle(raw: bytes) -> bytes:
    """The 64-byte cudaIpcMemHandle_t inside torch's shareable handle: torch >= 2.2
    writes a version byte and a type byte ('c' cudaMalloc, 'e' expandable segment)
    before it; older torch gives the bare handle."""
    if len(raw) == IPC_HANDLE_BYTES:
        return raw
    if len(raw) >= 2 and raw[1] == ord("e"):
        raise ValueError(_EXPANDABLE_HINT)
    if len(raw) == IPC_HANDLE_BYTES + 2 and raw[1] == ord("c"):
        return raw[2:]
    raise ValueError(f"unrecognised CUDA IPC handle from torch ({len(raw)} bytes)")


def _locate_cuda(t: torch.Tensor) -> tuple[Any, int, pb.BufferHandle]:
    if not t.is_cuda:
        raise ValueError(f"expected a CUDA tensor, got one on {t.device}")
    try:
        storage: Any = t.untyped_storage()  # _share_cuda_ is untyped in torch's stubs
        device, raw, _size, storage_offset, *_ = storage._share_cuda_()
    except RuntimeError as e:
        if "expandable" in str(e):
            raise ValueError(_EXPANDABLE_HINT) from e
        raise
    handle = _legacy_handle(bytes(raw))
    start = int(storage_offset) + int(t.storage_offset()) * t.element_size()
    return (
        (int(device), handle),
        start,
        pb.BufferHandle(cuda_ipc_handle=handle, device=int(device)),
    )


def geometry_from_tensors(
    tensors: Sequence[torch.Tensor],
    page_dim: int,
    *,
    layout_name: str,
    tokens_per_page: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str | None = None,
) -> pb.PoolGeometry:
    """``PoolGeometry`` of a pool of torch CUDA tensors, for the CUDA backend.

    One ``BufferHandle`` per distinct allocation: its offset/size span exactly the
    bytes the segments touch in that allocation. The engine must keep the tensors
    alive while the pool is registered (the daemon maps their memory).
    ``dtype`` defaults to the first tensor's (e.g. "bfloat16").

    Lifetime: torch's ``_share_cuda_()`` marks each exported allocation as shared
    with another process and, since kvseal does not take part in torch's
    reference-counting protocol, torch keeps that memory out of its caching
    allocator until the engine exits, even after the tensors are freed. That is what
    makes the export safe (a block the daemon still maps is never handed to another
    tensor), and it costs nothing for a KV pool allocated once per process; an engine
    that reallocates its KV cache should unregister the pool first and expect the old
    allocation to stay reserved."""
    return _geometry(
        tensors,
        page_dim,
        _locate_cuda,
        False,
        layout_name=layout_name,
        tokens_per_page=tokens_per_page,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
    )


def geometry_from_shm_tensors(
    pool: SharedKVPool,
    tensors: Sequence[torch.Tensor],
    page_dim: int,
    *,
    layout_name: str,
    tokens_per_page: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: str | None = None,
) -> pb.PoolGeometry:
    """``PoolGeometry`` of CPU tensors that live in ``pool``'s shared memory (views
    from :meth:`SharedKVPool.tensors` or views of them), for the CPU backend. Each
    buffer is a whole shm object (offset 0, its size), like ``pool.geometry()``."""
    spans = []
    for b in pool.buffers:
        anchor = ctypes.c_char.from_buffer(b.map)
        spans.append((ctypes.addressof(anchor), b))
        del anchor  # only the address is needed; keep the mmap closable

    def locate(t: torch.Tensor) -> tuple[Any, int, pb.BufferHandle]:
        ptr = t.data_ptr()
        for base, b in spans:
            if base <= ptr < base + b.size:
                return b.name, ptr - base, pb.BufferHandle(shm_name=b.name, offset=0, size=b.size)
        raise ValueError("tensor does not live in this SharedKVPool's shared memory")

    return _geometry(
        tensors,
        page_dim,
        locate,
        True,
        layout_name=layout_name,
        tokens_per_page=tokens_per_page,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
    )


def ipc_event_handle(event: torch.cuda.Event) -> bytes:
    """The 64-byte ``cudaIpcEventHandle_t`` of ``torch.cuda.Event(interprocess=True)``.

    Record the event on the stream that wrote (offload) or last read (restore) the
    pages, then pass the handle with the request. The daemon polls it on the host
    (``cuEventQuery``; at most ``--engine-event-timeout``, then DEADLINE_EXCEEDED
    with nothing touched) and reads (offload) or writes (restore) the pages only
    once it has completed; no GPU stream of the daemon ever waits on it.
    """
    ev: Any = event  # ipc_handle is untyped in torch's stubs
    raw = bytes(ev.ipc_handle())
    if len(raw) != IPC_HANDLE_BYTES:
        raise ValueError(f"unexpected event IPC handle of {len(raw)} bytes")
    return raw
