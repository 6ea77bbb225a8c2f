"""The sealed host tier's request semantics: lookup, offload, restore, drop.

- ``cache``   :class:`~kvseal.server.cache.cache.SealedCache`: validates a whole
  request, runs the index's atomic reserve/pin step, moves bytes through the
  backend without the index lock, completes (or releases what it reserved);
  pools, holds and event subscriptions;
- ``tenants`` the tenants each pool's requests named (a part of ``SealedCache``);
- ``checks``  request validation (nothing changes before every check passed);
- ``results`` results, counters and the observer hooks;
- ``storetier``, ``spillworker``, ``storestate``, ``storeevents`` the sealed
  store tier under the host tier (``--store-dir``; docs/store.md).

The names below are the package's interface; its modules import each other
directly, never through this file.
"""

from kvseal.server.cache.cache import SealedCache
from kvseal.server.cache.results import (
    Counters,
    Observer,
    OffloadResult,
    Registered,
    RestoreResult,
)

__all__ = ["Counters", "Observer", "OffloadResult", "Registered", "RestoreResult", "SealedCache"]
