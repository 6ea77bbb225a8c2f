"""The linker's staging blocks: memory the daemon seals from and opens into.

One tensor ``(blocks, block_bytes)`` of uint8, registered with the daemon as
this rank's pool (:class:`kvseal.core.kv_pool.KVPool`):

- **CPU**: in a named, owner-locked POSIX shared-memory object
  (``/dev/shm/kvseal-sglang-<pid>-<random>``, mode 0600), which the daemon's
  CPU backend opens by name; unlinked by the linker's close, at interpreter
  exit, or by the next engine's sweep if this one was killed
  (:mod:`kvseal.core.shm_kv` owns the mechanism);
- **CUDA**: device memory on the KV pool's device, exported to the daemon by
  legacy CUDA IPC.

:class:`Slots` hands out block indices to the transfers in flight (loads and
offloads share the blocks); a transfer larger than the free blocks is done in
chunks by its caller.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from kvseal.core import shm_kv

SHM_PREFIX = "kvseal-sglang"


def new_staging(blocks: int, block_bytes: int, device: Any) -> Any:
    """A zeroed uint8 tensor ``(blocks, block_bytes)`` on ``device`` (shared
    memory when it is the CPU: module doc)."""
    import torch  # noqa: PLC0415

    if torch.device(device).type == "cpu":
        # shm_kv serves only allocations of at least MIN_KV_BYTES from shared
        # memory: a smaller staging (one small block) is over-allocated.
        n = blocks * block_bytes
        with shm_kv.shm_kv_allocation(SHM_PREFIX):
            flat = torch.zeros(max(n, shm_kv.MIN_KV_BYTES), dtype=torch.int8)
        return flat[:n].view(torch.uint8).view(blocks, block_bytes)
    return torch.zeros((blocks, block_bytes), dtype=torch.uint8, device=device)


@dataclass
class _Ref:
    """What :class:`kvseal.core.kv_pool.KVPool` reads of a tensor and a layer."""

    tensor: Any
    tensor_idx: int = 0
    page_size_bytes: int = 0


def pool_inputs(staging: Any) -> tuple[list[_Ref], list[_Ref]]:
    """``(tensors, refs)`` describing the staging tensor as one "layer" whose
    page is a whole block, as KVPool takes them."""
    return [_Ref(staging.view(staging.shape[0], -1).view(_int8()))], [
        _Ref(None, 0, int(staging.shape[1]))
    ]


def _int8() -> Any:
    import torch  # noqa: PLC0415

    return torch.int8


class Slots:
    """A free list of staging block indices. ``take(n, timeout)`` waits until
    at least one block is free and returns up to ``n`` of them; it returns an
    empty list when ``closed`` or when ``timeout`` seconds passed first (None:
    no bound, for the offload thread; a verified load on SGLang's scheduler
    thread passes what is left of its deadline, since an offload may hold the
    blocks for a whole offload RPC). ``give`` returns them. Thread-safe."""

    def __init__(self, blocks: int) -> None:
        self._free = list(range(blocks - 1, -1, -1))
        self._cv = threading.Condition()
        self.closed = False

    def take(self, n: int, timeout: float | None = None) -> list[int]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while not self._free and not self.closed:
                if deadline is None:
                    self._cv.wait()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cv.wait(left)
            if self.closed:
                return []
            k = min(n, len(self._free))
            out = self._free[-k:]
            del self._free[-k:]
            return out

    def give(self, slots: list[int]) -> None:
        with self._cv:
            self._free.extend(slots)
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify_all()
