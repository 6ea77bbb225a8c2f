"""KV pools in POSIX shared memory: the engine side of the CPU backend.

A :class:`SharedKVPool` owns one shared-memory object per pool buffer
(``/dev/shm/<name>``, mode 0600, unlinked on ``close``) and describes it to
the daemon as a ``PoolGeometry``. Its buffers can be used as raw memoryviews
(no torch needed, e.g. by ``kvseal selftest``) or as torch tensors in the
engine's own layout (``tensors()``, imports torch lazily).

Supported layouts (all give the same block byte order "layer, K/V, token,
head, dim", so pools of different engines with the same model share blocks):

- ``vllm_per_layer``: one tensor per layer, ``[2, pages, tokens, heads, dim]``
  (vLLM FlashAttention backends).
- ``vllm_cross_layer``: one tensor ``[pages, layers, 2, tokens, heads, dim]``
  (vLLM's contiguous cross-layer blocks).
- ``sglang_per_layer``: a K and a V tensor per layer,
  ``[pages * tokens, heads, dim]`` (SGLang MHA token pool).
"""

from __future__ import annotations

import mmap
import os
import secrets
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvseal.v1 import kvseal_pb2 as pb

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"  # noqa: S108 - POSIX shm objects live here on Linux
BLOCK_ORDER = "L,KV,T,H,D"  # the canonical byte order of a block
LAYOUTS = ("vllm_per_layer", "vllm_cross_layer", "sglang_per_layer")
DTYPE_BYTES = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}


@dataclass(frozen=True)
class KVShape:
    num_pages: int
    tokens_per_page: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    @property
    def elem_bytes(self) -> int:
        try:
            return DTYPE_BYTES[self.dtype]
        except KeyError:
            raise ValueError(f"unsupported dtype {self.dtype!r}") from None

    @property
    def token_bytes_per_layer(self) -> int:
        """Bytes of K (or V) for one token in one layer."""
        return self.num_kv_heads * self.head_dim * self.elem_bytes

    @property
    def page_bytes_per_layer_kv(self) -> int:
        return self.tokens_per_page * self.token_bytes_per_layer

    @property
    def block_bytes(self) -> int:
        return 2 * self.num_layers * self.page_bytes_per_layer_kv


class _ShmBuffer:
    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        self.view = memoryview(self.map)

    def close(self, unlink: bool = True) -> None:
        self.view.release()
        try:
            self.map.close()
        except BufferError:  # tensors still hold an export: the mapping goes with them
            pass
        if unlink:
            try:
                os.unlink(os.path.join(SHM_DIR, self.name))
            except FileNotFoundError:
                pass


class SharedKVPool:
    """An engine KV pool in shared memory. The pool owns its buffers; the
    daemon opens them too, and both see every write. ``close`` unlinks them
    (the daemon's fds stay valid until it unregisters the pool) and unmaps
    them, except that a mapping still viewed by tensors from ``tensors()`` is
    unmapped only when the last such tensor is freed (never under a live
    tensor). After ``close`` the raw accessors (``read_block`` ...) raise."""

    def __init__(self, shape: KVShape, layout: str, name_prefix: str = "kvseal") -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
        self.shape = shape
        self.layout = layout
        s = shape
        tag = f"{name_prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        kv = s.page_bytes_per_layer_kv
        self.buffers: list[_ShmBuffer] = []
        self.segments: list[pb.Segment] = []
        try:
            if layout == "vllm_per_layer":
                for layer in range(s.num_layers):
                    self.buffers.append(_ShmBuffer(f"{tag}-L{layer}", 2 * s.num_pages * kv))
                    for half in (0, 1):  # K then V: [2, pages, ...]
                        self.segments.append(
                            pb.Segment(
                                buffer=layer,
                                offset=half * s.num_pages * kv,
                                page_stride=kv,
                                bytes=kv,
                            )
                        )
            elif layout == "vllm_cross_layer":
                self.buffers.append(_ShmBuffer(f"{tag}-X", s.num_pages * s.block_bytes))
                self.segments.append(
                    pb.Segment(buffer=0, offset=0, page_stride=s.block_bytes, bytes=s.block_bytes)
                )
            else:  # sglang_per_layer: K_l, V_l buffers of [pages * tokens, heads, dim]
                for layer in range(s.num_layers):
                    for kind in ("K", "V"):
                        self.buffers.append(_ShmBuffer(f"{tag}-{kind}{layer}", s.num_pages * kv))
                        self.segments.append(
                            pb.Segment(
                                buffer=len(self.buffers) - 1, offset=0, page_stride=kv, bytes=kv
                            )
                        )
        except BaseException:
            self.close()
            raise
        # Unlink the objects even if the owner never calls close (exit, GC):
        # shared memory outlives processes and would otherwise leak.
        self._finalizer = weakref.finalize(self, SharedKVPool._unlink_all, list(self.buffers))

    @staticmethod
    def _unlink_all(buffers: list[_ShmBuffer]) -> None:
        for b in buffers:
            b.close()

    def geometry(self) -> pb.PoolGeometry:
        s = self.shape
        return pb.PoolGeometry(
            num_pages=s.num_pages,
            tokens_per_page=s.tokens_per_page,
            num_layers=s.num_layers,
            num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim,
            dtype=s.dtype,
            layout=BLOCK_ORDER,
            buffers=[pb.BufferHandle(shm_name=b.name, offset=0, size=b.size) for b in self.buffers],
            segments=self.segments,
        )

    def _spans(self, page: int) -> list[memoryview]:
        out = []
        for seg in self.segments:
            start = seg.offset + page * seg.page_stride
            out.append(self.buffers[seg.buffer].view[start : start + seg.bytes])
        return out

    def read_block(self, page: int) -> bytes:
        """The block's plaintext as the daemon sees it (a copy)."""
        return b"".join(bytes(v) for v in self._spans(page))

    def write_block(self, page: int, data: bytes | memoryview) -> None:
        if len(data) != self.shape.block_bytes:
            raise ValueError("data must be exactly one block")
        pos = 0
        for v in self._spans(page):
            v[:] = data[pos : pos + len(v)]
            pos += len(v)

    def fill_page(self, page: int, byte: int) -> None:
        """Overwrite a page with one byte value (tests' poison pattern)."""
        for v in self._spans(page):
            v[:] = bytes([byte]) * len(v)

    def tensors(self) -> list[torch.Tensor]:
        """The pool's buffers as torch tensors in the engine's layout
        (zero-copy views of the shared memory).

        Each tensor holds a buffer export of its mapping (``torch.frombuffer``
        itself keeps none), so while any of them, or a view of one, is alive
        ``close`` (or the finalizer) cannot unmap the memory under it: the
        names are unlinked then and the mapping goes with the last tensor."""
        import torch  # noqa: PLC0415 - torch is optional for the client

        dtype: Any = getattr(torch, self.shape.dtype)
        s = self.shape
        out = []
        for b in self.buffers:
            # The memoryview is the export: torch keeps a reference to the
            # object it is given, and mmap.close() refuses while it exists.
            flat = torch.frombuffer(memoryview(b.map), dtype=dtype)
            if self.layout == "vllm_per_layer":
                shape: tuple[int, ...] = (
                    2,
                    s.num_pages,
                    s.tokens_per_page,
                    s.num_kv_heads,
                    s.head_dim,
                )
            elif self.layout == "vllm_cross_layer":
                shape = (
                    s.num_pages,
                    s.num_layers,
                    2,
                    s.tokens_per_page,
                    s.num_kv_heads,
                    s.head_dim,
                )
            else:
                shape = (s.num_pages * s.tokens_per_page, s.num_kv_heads, s.head_dim)
            out.append(flat.view(shape))
        return out

    def close(self) -> None:
        for b in self.buffers:
            b.close()
        self.buffers.clear()
        if hasattr(self, "_finalizer"):
            self._finalizer.detach()

    def __enter__(self) -> SharedKVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
