"""An engine's CPU KV cache in a named POSIX shared-memory object (vLLM's CPU
platform; SGLang's staging buffers use the same allocation).

On vLLM's CPU platform the whole KV cache is one ``torch.zeros(n, dtype=int8)``
buffer with per-layer views, private to the worker process. kvseal's CPU
backend moves bytes by opening the engine's pool by name under ``/dev/shm``
(``BufferHandle.shm_name``), so the connector allocates that buffer there
instead: :func:`shm_kv_allocation` is the context vLLM runs the allocation in
(``KVConnectorBase_V1.get_mem_pool_context``); inside it, the first large
int8 CPU ``torch.zeros`` is served from a fresh object ``/dev/shm/<name>``
(mode 0600, owned by the engine's uid, as the daemon requires) mapped
``MAP_SHARED``. Everything else allocates as usual.

Ownership of the name ``/dev/shm/kvseal-vllm-<pid>-<random>``: it is this
process's, *owner-locked* (:func:`kvseal.client.shm.create_owner_locked`: a
shared ``flock`` held on an fd for the life of the process, released by the
kernel however the process ends). It stays linked while the process lives,
because a restarted daemon opens the pool by name when the worker registers
it again; it is unlinked

- by the worker when it shuts its pool down (:meth:`kvseal.core.kv_pool.KVPool.close`,
  before it unregisters: vLLM 0.32 SIGKILLs its worker right after the
  shutdown when ``vllm serve`` gets SIGTERM, before any exit handler), and at
  interpreter exit;
- by the daemon, when it drops the registration of a pool whose owner lock is
  free: the worker was killed before its shutdown (SIGKILL of the engine), its
  ``HoldPool`` stream ended and the daemon unregistered the pool;
- otherwise (killed while no daemon held its pool: daemon down, not yet
  registered, or a daemon of another uid, which may not unlink it) by the next
  engine that allocates its KV cache here on the same ``/dev/shm``
  (:func:`kvseal.client.shm.sweep_orphans` of ``kvseal-vllm-*`` objects of its
  uid whose lock is free).

The memory itself is freed by the kernel once the last mapping and fd are gone
(the worker's tensor, the daemon's fds of a registered pool). The mapping
lives as long as the tensor.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import mmap
import os
import secrets
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvseal.client.shm import OwnedShm, create_owner_locked, sweep_orphans

# Only an allocation at least this large is the KV cache (vLLM's other CPU
# buffers inside the context, if any, are small).
MIN_KV_BYTES = 1 << 12


log = logging.getLogger("kvseal.core")


@dataclass
class ShmAllocation:
    """One KV-cache buffer in shared memory: ``base`` is its address in this
    process, ``size`` its bytes, ``shm_name`` the name the daemon opens;
    ``owned`` holds the object's owner lock (see the module doc)."""

    shm_name: str
    size: int
    base: int
    map: mmap.mmap
    owned: OwnedShm

    def contains(self, ptr: int, nbytes: int) -> bool:
        return self.base <= ptr and ptr + nbytes <= self.base + self.size

    def unlink(self) -> None:
        self.owned.unlink()


_lock = threading.Lock()
_allocations: list[ShmAllocation] = []


def allocations() -> list[ShmAllocation]:
    """The KV buffers this process placed in shared memory (oldest first)."""
    with _lock:
        return list(_allocations)


def find_allocation(ptr: int, nbytes: int) -> ShmAllocation | None:
    """The shared-memory buffer that holds ``[ptr, ptr + nbytes)``, if any."""
    with _lock:
        for a in _allocations:
            if a.contains(ptr, nbytes):
                return a
    return None


def _unlink_all() -> None:
    with _lock:
        for a in _allocations:
            a.unlink()


atexit.register(_unlink_all)


@functools.cache  # once per process and prefix
def _sweep(prefix: str) -> None:
    """Remove what engines killed before left behind (module doc)."""
    gone = sweep_orphans(prefix)
    if gone:
        log.info("kvseal: removed %d shared-memory KV object(s) of dead engines", len(gone))


def _new_shm_tensor(size: int, prefix: str) -> Any:
    import torch  # noqa: PLC0415 - only the worker process gets here

    _sweep(prefix)
    owned = create_owner_locked(f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}", size)
    t = torch.frombuffer(owned.map, dtype=torch.int8)  # keeps the map alive as long as ``t``
    alloc = ShmAllocation(owned.name, size, t.data_ptr(), owned.map, owned)
    with _lock:
        _allocations.append(alloc)
    return t


@contextlib.contextmanager
def shm_kv_allocation(prefix: str = "kvseal-vllm") -> Iterator[None]:
    """Serve the first large int8 CPU ``torch.zeros`` inside this context from
    shared memory (see module doc); all other calls pass through unchanged."""
    import torch  # noqa: PLC0415
    from torch.overrides import TorchFunctionMode  # noqa: PLC0415

    class _Mode(TorchFunctionMode):
        done = False

        def __torch_function__(
            self,
            func: Callable[..., Any],
            types: Any,
            args: tuple[Any, ...] = (),
            kwargs: dict[str, Any] | None = None,
        ) -> Any:
            kwargs = kwargs or {}
            if func is torch.zeros and not self.done and _is_kv_alloc(args, kwargs):
                self.done = True
                size = int(args[0] if not isinstance(args[0], (tuple, list)) else args[0][0])
                return _new_shm_tensor(size, prefix)
            return func(*args, **kwargs)

    def _is_kv_alloc(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if len(args) != 1 or kwargs.get("dtype") is not torch.int8:
            return False
        dims = args[0] if isinstance(args[0], (tuple, list)) else (args[0],)
        if len(dims) != 1 or int(dims[0]) < MIN_KV_BYTES:
            return False
        device = kwargs.get("device")
        return device is None or torch.device(device).type == "cpu"

    with _Mode():
        yield
