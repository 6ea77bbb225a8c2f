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

**Owner-locked objects** (:func:`create_owner_locked`, used for vLLM's KV
cache by :mod:`kvseal.core.shm_kv`). The creator of such an object holds a
shared ``flock`` on an fd of it for as long as it lives; the kernel releases
that lock however the process ends, SIGKILL included, so the lock tells a
live engine's pool from a leftover without pids (which other pid namespaces
do not share). The name belongs to the creator, who unlinks it on a normal
exit; when the creator died without doing so, whoever finds the lock free
unlinks it: the daemon, when it drops the registration of an owner-locked
object (the CPU backend's ``CpuMappedPool.close``), and any engine starting on
the same ``/dev/shm`` (:func:`sweep_orphans`). The name stays linked while its
creator lives (a restarted daemon opens the pool by name again). Limits: a
child forked (not exec'd) after the lock was taken shares it and keeps the
name alive until it exits; a daemon of another uid may not unlink names in
the sticky ``/dev/shm`` (the next sweep by the engines' uid does); an object
of a kvseal older than the lock looks orphaned to a sweep.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import secrets
import stat
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


def owner_alive(fd: int) -> bool:
    """Whether a process still holds the owner lock of the object open as
    ``fd`` (an fd of one's own, not the owner's: ``flock`` locks belong to open
    file descriptions, so the test works in the owner's process too). Takes
    and drops an exclusive lock without waiting; an object nobody locked reads
    as not alive."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


@dataclass
class OwnedShm:
    """A shared-memory object this process created and owner-locks (see the
    module doc). ``fd`` carries the lock: keep it open while the object may be
    registered (closing it, or exiting, releases the lock)."""

    name: str
    size: int
    fd: int
    map: mmap.mmap

    @property
    def path(self) -> str:
        return os.path.join(SHM_DIR, self.name)

    def unlink(self) -> None:
        """Remove the name (idempotent). The memory stays mapped and the lock
        held; a daemon that opened the object keeps its fd."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def create_owner_locked(name: str, size: int) -> OwnedShm:
    """Create ``/dev/shm/<name>`` (mode 0600, ``size`` zero bytes, mapped
    ``MAP_SHARED``) and take its owner lock. FileExistsError if the name
    exists; an OSError leaves no name behind.

    A sweep may find the object between its creation and its lock, see the
    lock free and unlink it (holding an exclusive lock meanwhile, which the
    shared one here waits for); so the name is checked once the lock is held
    and, if it no longer names this object, the object is dropped and made
    again under the same name."""
    path = os.path.join(SHM_DIR, name)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits out a sweep holding it
            st = os.fstat(fd)
            try:
                now = os.stat(path, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is None or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                os.close(fd)  # swept before it was locked: make another
                continue
            os.ftruncate(fd, size)  # reads back as zeros
            m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        return OwnedShm(name, size, fd, m)


def sweep_orphans(prefix: str) -> list[str]:
    """Unlink the ``/dev/shm/<prefix>-*`` objects of this process's uid whose
    owner lock is free (their creator died without unlinking them, e.g.
    SIGKILLed while no daemon held its pool). Returns the names removed. Never
    raises for one object (it may vanish or be locked meanwhile); objects of
    other uids are left alone."""
    pattern = re.compile(re.escape(prefix) + r"-[A-Za-z0-9._-]+")
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    uid = os.geteuid()
    for name in names:
        if not pattern.fullmatch(name):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == uid and unlink_if_orphaned(fd, path):
                removed.append(name)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


def unlink_if_orphaned(fd: int, path: str) -> bool:
    """Unlink ``path`` if it still names the object open as ``fd`` and nobody
    holds that object's owner lock. The exclusive lock taken for the test is
    held until the name is gone, so a creator locking the object meanwhile
    waits and then sees its name gone (see :func:`create_owner_locked`).
    True if the name was removed; OSError from the unlink is the caller's."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    try:
        st = os.fstat(fd)
        try:
            now = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False
        os.unlink(path)
        return True
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


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
