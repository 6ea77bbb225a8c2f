"""Device key contexts of the CUDA backend.

:class:`~kvseal.server.sealing.BlockSealer` owns the keys (:class:`DeviceKeySource`
is what this backend needs of it). :class:`DeviceKeys` asks for the 32-byte key of
an epoch once, into its own pinned buffer, wiped right after a synchronous upload;
``kvseal_key_setup`` expands it into a ``KvsKeyCtx`` that lives in device memory
only, and the raw key's device copy is zeroed on the same stream. Contexts of
retired epochs are zeroed and freed: at the start of every request, and at once
(``CudaBackend.retire_keys``) when a drop destroyed a tenant's key scope.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol, runtime_checkable

from kvseal.server.backends.cuda.device import Device
from kvseal.server.backends.cuda.emulated import KvsKeyCtx
from kvseal.server.sealing import KEY_BYTES

KEYCTX_BYTES = ctypes.sizeof(KvsKeyCtx)


@runtime_checkable
class DeviceKeySource(Protocol):
    """What the CUDA backend needs from :class:`~kvseal.server.sealing.BlockSealer`.

    - ``allocate_for_device(n, scope)``: draw ``n`` fresh nonces, all under ONE epoch
      of the key scope ``(namespace, tenant)`` (its current one, after rotating if
      fewer than ``n`` seals are left before ``rekey_after``); counts them as ``n``
      live blocks of that epoch. A seal batch is single-scope (one request = one
      pool namespace and one tenant). Thread-safe.
    - ``export_key_to(epoch, dst)``: write the epoch's 32-byte key into ``dst``
      (a caller-owned ``ctypes`` ``c_char * 32`` buffer, which the caller wipes).
      Raises ``SealingError`` (``KeyDestroyed``) if the epoch is gone. Never
      returns the key.
    - ``live_epoch_ids()``: ids of epochs whose key still exists (unique across
      scopes); a device key context of any other epoch is wiped and freed.
    - ``require_live(epochs)``: raise ``KeyDestroyed`` if any epoch is gone (a
      drop destroyed its scope); checked right before the open pass writes pages.
    - ``forget(epoch)``: one block of ``epoch`` is gone (also burns an unused nonce).
    """

    def allocate_for_device(
        self, n: int, scope: tuple[bytes, bytes]
    ) -> tuple[int, list[bytes]]: ...

    def export_key_to(self, epoch: int, dst: ctypes.Array[ctypes.c_char]) -> None: ...

    def live_epoch_ids(self) -> frozenset[int]: ...

    def require_live(self, epoch_ids: Iterable[int]) -> None: ...

    def forget(self, epoch_index: int) -> None: ...


class DeviceKeys(Mapping[int, int]):
    """The device key contexts, by epoch: epoch -> device address of its
    ``KvsKeyCtx``. Callers hold the backend lock with the context current.

    :meth:`allocate` takes the key upload buffers (device, and pinned host: a
    pageable source would pass through the driver's own staging buffer, which
    nobody wipes); :meth:`close` wipes and frees everything."""

    def __init__(self, dev: Device, sealer: DeviceKeySource) -> None:
        self._dev = dev
        self.sealer = sealer
        self._ctx: dict[int, int] = {}
        self._key_dev = 0
        self._key_host = 0

    def __getitem__(self, epoch: int) -> int:
        return self._ctx[epoch]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ctx)

    def __len__(self) -> int:
        return len(self._ctx)

    def allocate(self) -> None:
        self._key_dev = self._dev.alloc(KEY_BYTES)
        self._key_host = self._dev.host_alloc(KEY_BYTES, mapped=False)

    def prune(self) -> None:
        """Wipe and free the contexts of epochs the sealer no longer lists."""
        live = self.sealer.live_epoch_ids()
        dead = [e for e in self._ctx if e not in live]
        if not dead:
            return
        s = self._dev.compute_stream
        for e in dead:
            self._dev.memset_async(self._ctx[e], KEYCTX_BYTES, s)  # wipe before freeing
        self._dev.sync(s)
        for e in dead:
            self._dev.free(self._ctx.pop(e))

    def context(self, epoch: int) -> int:
        """Device address of the epoch's KvsKeyCtx, derived on first use.

        The raw key crosses to the device once: sealer -> ctypes buffer -> stream-
        ordered H2D -> ``kvseal_key_setup`` -> the device copy is zeroed on the same
        stream; after the stream synchronises the host buffer is wiped too."""
        ctx = self._ctx.get(epoch)
        if ctx is not None:
            return ctx
        d, s = self._dev, self._dev.compute_stream
        ctx = d.alloc(KEYCTX_BYTES)
        key = (ctypes.c_char * KEY_BYTES).from_address(self._key_host)
        try:
            try:
                self.sealer.export_key_to(epoch, key)
                d.h2d_async(self._key_dev, ctypes.addressof(key), KEY_BYTES, s)
                d.launch(
                    "kvseal_key_setup",
                    1,
                    32,
                    [ctypes.c_uint64(self._key_dev), ctypes.c_uint64(ctx)],
                    s,
                )
            finally:
                try:
                    d.memset_async(self._key_dev, KEY_BYTES, s)  # ordered after the setup
                    d.sync(s)
                finally:
                    ctypes.memset(key, 0, KEY_BYTES)  # also when the wipe above failed
        except BaseException:
            d.free(ctx)
            raise
        self._ctx[epoch] = ctx
        return ctx

    def close(self, step: Callable[[str, Callable[[], object]], None]) -> None:
        """Wipe and free every context and the upload buffers. ``step(what, fn)``
        runs ``fn`` and logs a CudaError instead of raising (best effort: each
        release runs even if an earlier one failed)."""
        d = self._dev

        def wipe_keys() -> None:
            for ctx in self._ctx.values():
                d.memset_async(ctx, KEYCTX_BYTES, d.compute_stream)
            d.sync(d.compute_stream)

        if self._ctx:
            step("wipe key contexts", wipe_keys)
        for ctx in list(self._ctx.values()):
            step("free a key context", functools.partial(d.free, ctx))
        self._ctx.clear()
        if self._key_dev:
            step("free the key upload buffer", lambda: d.free(self._key_dev))
            self._key_dev = 0
        if self._key_host:
            ctypes.memset(self._key_host, 0, KEY_BYTES)
            step("free the pinned key buffer", lambda: d.host_free(self._key_host))
            self._key_host = 0
