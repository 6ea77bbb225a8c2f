"""vLLM's CPU KV cache in a named POSIX shared-memory object.

On vLLM's CPU platform the whole KV cache is one ``torch.zeros(n, dtype=int8)``
buffer with per-layer views, private to the worker process. kvseal's CPU
backend moves bytes by opening the engine's pool by name under ``/dev/shm``
(``BufferHandle.shm_name``), so the connector allocates that buffer there
instead: :func:`shm_kv_allocation` is the context vLLM runs the allocation in
(``KVConnectorBase_V1.get_mem_pool_context``); inside it, the first large
int8 CPU ``torch.zeros`` is served from a fresh object ``/dev/shm/<name>``
(mode 0600, owned by the engine's uid, as the daemon requires) mapped
``MAP_SHARED``. Everything else allocates as usual.

Ownership: the object belongs to this process. Its name stays linked while
the process lives (a restarted daemon must be able to open it again when the
pool is registered anew) and is unlinked at interpreter exit; a process
killed with SIGKILL leaves it behind (``/dev/shm/kvseal-vllm-<pid>-*``), as
any shared-memory segment would. The mapping lives as long as the tensor.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import secrets
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvseal.client.shm import SHM_DIR

# Only an allocation at least this large is the KV cache (vLLM's other CPU
# buffers inside the context, if any, are small).
MIN_KV_BYTES = 1 << 12


@dataclass
class ShmAllocation:
    """One KV-cache buffer in shared memory: ``base`` is its address in this
    process, ``size`` its bytes, ``shm_name`` the name the daemon opens."""

    shm_name: str
    size: int
    base: int
    map: mmap.mmap

    def contains(self, ptr: int, nbytes: int) -> bool:
        return self.base <= ptr and ptr + nbytes <= self.base + self.size

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.shm_name))


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


def _new_shm_tensor(size: int, prefix: str) -> Any:
    import torch  # noqa: PLC0415 - only the worker process gets here

    name = f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)  # reads back as zeros: torch.zeros' contract holds
        m = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    t = torch.frombuffer(m, dtype=torch.int8)  # keeps ``m`` alive as long as ``t``
    alloc = ShmAllocation(name, size, t.data_ptr(), m)
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
