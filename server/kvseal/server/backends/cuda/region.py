"""The CUDA backend's host region: page-locked host memory that holds only ciphertext.

How it is allocated depends on the platform (``probe.cc_mode()``):

- **CC on**: ``cuMemHostAlloc`` only. ``cuMemHostRegister`` is refused there
  (error 801 for every size and flag), so ``--host-region PATH`` is ignored, with a
  warning: never a crash loop.
- **CC off / unknown**, with ``--host-region PATH``: the file (mode 0600, truncated
  then sized, like the CPU backend's) is memory-mapped and registered with
  ``cuMemHostRegister``, so tests can play the hypervisor by rewriting the file.
  If the driver refuses, the region falls back to ``cuMemHostAlloc`` and says so
  in its ``description``.
- otherwise anonymous ``cuMemHostAlloc`` memory (mapped into the device address
  space when CC is off, which the ``mapped`` seal mode uses).

The GPU reads and writes the region by DMA (the backend); ``write``/``read_into``
are CPU-side copies for tests and tools, with the same contract as
:class:`~kvseal.server.hostregion.HostRegion`: bounds-checked, ciphertext only,
``read_into`` snapshots into caller-owned private memory. The region owns its
memory; ``close`` unregisters/frees it (idempotent).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import stat
import threading

from kvseal.server.backends.cuda.device import Device
from kvseal.server.hostregion import RegionError

log = logging.getLogger("kvseal.cuda")


class CudaHostRegion:
    """Pinned host memory of ``capacity`` bytes. ``host_ptr`` is its host address;
    ``device_ptr`` its device address when mapped (None otherwise). ``mode`` is
    "alloc" or "registered". Raises RegionError with a clear message when no
    pinned memory can be had."""

    def __init__(self, dev: Device, capacity: int, path: str | None, *, cc: str) -> None:
        if capacity <= 0:
            raise RegionError("host region capacity must be positive")
        self._dev = dev
        self.capacity = capacity
        self.path: str | None = None
        self.device_ptr: int | None = None
        self._map: mmap.mmap | None = None
        self._anchor: ctypes.Array[ctypes.c_char] | None = None
        self._closed = threading.Event()
        cc_on = cc == "on"
        cc_label = f"CC {cc}" if cc in ("on", "off") else "CC unknown"
        note = ""
        if path is not None and cc_on:
            log.warning(
                "--host-region %s ignored: in CC mode cuMemHostRegister is refused (error 801); "
                "using cuMemHostAlloc memory instead",
                path,
            )
            note = f"; --host-region {path} ignored in CC mode"
        elif path is not None:
            try:
                self._register_file(path)
                self.description = f"{path} registered with cuMemHostRegister ({cc_label})"
                return
            except _Refused as e:
                log.warning(
                    "cuMemHostRegister refused --host-region %s (%s); using cuMemHostAlloc "
                    "memory instead (the file is not used)",
                    path,
                    e,
                )
                note = f"; cuMemHostRegister of {path} refused: {e}"
        mapped = not cc_on
        try:
            try:
                self.host_ptr = dev.host_alloc(capacity, mapped=mapped)
            except Exception as e:
                if not mapped:
                    raise
                # Mapping is an optimisation only (and CC mode may refuse DEVICEMAP
                # when NVML could not tell that CC is on): plain pinned memory then.
                log.warning("mapped cuMemHostAlloc refused (%s); retrying unmapped", e)
                mapped = False
                self.host_ptr = dev.host_alloc(capacity, mapped=False)
        except Exception as e:
            raise RegionError(
                f"cannot allocate {capacity} bytes of pinned host memory with cuMemHostAlloc "
                f"({e}): lower --host-bytes"
            ) from e
        self.mode = "alloc"
        if mapped:
            try:
                self.device_ptr = dev.host_device_pointer(self.host_ptr)
            except Exception:  # mapping is an optimisation only
                self.device_ptr = None
        self.description = f"pinned cuMemHostAlloc ({cc_label}){note}"

    def _register_file(self, path: str) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            raise RegionError(f"cannot open host region {path!r}: {e.strerror}") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RegionError(f"host region {path!r} is not a regular file")
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, 0)  # stale ciphertext from a previous key is useless
            os.ftruncate(fd, self.capacity)
            m = mmap.mmap(fd, self.capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise RegionError(f"cannot size host region {path!r}: {e.strerror}") from e
        finally:
            os.close(fd)
        anchor = (ctypes.c_char * self.capacity).from_buffer(m)
        ptr = ctypes.addressof(anchor)
        try:
            self._dev.host_register(ptr, self.capacity, mapped=True)
        except Exception as e:
            del anchor
            m.close()
            raise _Refused(str(e)) from e
        self._map, self._anchor, self.host_ptr = m, anchor, ptr
        self.path = path
        self.mode = "registered"
        try:
            self.device_ptr = self._dev.host_device_pointer(ptr)
        except Exception:
            self.device_ptr = None

    def write(self, offset: int, data: memoryview) -> None:
        """Copy ``data`` (ciphertext) to ``offset``; RegionError outside the region."""
        view = data.cast("B") if data.format != "B" else data
        n = len(view)
        if not 0 <= offset <= self.capacity - n:
            raise RegionError(f"write of {n} bytes at {offset} is outside the region")
        self._live()
        src = (ctypes.c_char * n).from_buffer_copy(view) if n else None
        if src is not None:
            ctypes.memmove(self.host_ptr + offset, src, n)

    def read_into(self, offset: int, out: memoryview) -> int:
        """Snapshot ``len(out)`` bytes at ``offset`` into writable private ``out``;
        returns the number of bytes copied (short at the end of the region)."""
        self._live()
        n = max(0, min(len(out), self.capacity - max(0, offset)))
        if offset < 0 or n == 0:
            return 0
        dst = (ctypes.c_char * n).from_buffer(out)
        ctypes.memmove(dst, self.host_ptr + offset, n)
        del dst
        return n

    def _live(self) -> None:
        if self._closed.is_set():
            raise RegionError("the host region is closed")

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._dev.make_current()  # close may run on any thread
            if self.mode == "registered":
                self._dev.host_unregister(self.host_ptr)
            else:
                self._dev.host_free(self.host_ptr)
        except Exception as e:
            log.warning("releasing the pinned host region failed: %s", e)
        self._anchor = None
        if self._map is not None:
            self._map.close()
            self._map = None


class _Refused(Exception):
    """cuMemHostRegister refused the file mapping."""
