"""The tenants each pool's requests named (for its event watchers), as the
cache keeps them: :class:`TenantBook`, a part of
:class:`~kvseal.server.cache.cache.SealedCache` (split out of it for size;
it uses the cache's pools, index and tenants lock)."""

from __future__ import annotations

import threading
import time

from kvseal.server.errors import UnknownPool
from kvseal.server.index import Index
from kvseal.server.pools import Pool, PoolRegistry
from kvseal.server.sealing import TENANT_BYTES

# Tenants remembered per pool for its event watchers (32 B each, plus dict overhead).
MAX_POOL_TENANTS = 65536
# A tenant a pool named is forgotten once no request on the pool has named it
# for this long and it holds no block in the pool's namespace (sweep_tenants):
# with a salt per user or conversation, tenants come and go all the time.
TENANT_IDLE_S = 600.0


class TenantBook:
    """Each pool's named tenants (``Pool.tenants``: tenant -> last use)."""

    pools: PoolRegistry
    index: Index
    _tenants_lock: threading.Lock

    def note_tenant(self, pool_id: str, tenant: bytes) -> None:
        """Record that a request on ``pool_id`` names ``tenant``, so that the pool's
        event watchers receive that tenant's events. Called before the request
        runs (a watcher sees the events the request itself causes); a malformed
        tenant or an unknown pool is ignored (the request reports it). Beyond
        ``MAX_POOL_TENANTS`` tenants the first-named is forgotten until its next
        request (a known tenant is never removed and re-added: the publisher reads
        the set without this lock, and must not see it missing meanwhile), and an
        idle one with no block left goes at the next :meth:`sweep_tenants`."""
        if len(tenant) != TENANT_BYTES:
            return
        try:
            with self.pools.use(pool_id) as pool:
                self._note_tenant(pool, tenant)
        except UnknownPool:
            return

    def _note_tenant(self, pool: Pool, tenant: bytes) -> None:
        """:meth:`note_tenant` on a pool the caller holds a lease on."""
        used = pool.tenants
        now = time.monotonic()
        if tenant in used:  # the common case: no lock (a known key keeps its place)
            used[tenant] = now
            return
        with self._tenants_lock:
            used[tenant] = now
            while len(used) > MAX_POOL_TENANTS:
                del used[next(iter(used))]

    def sweep_tenants(self, now: float | None = None, idle_s: float = TENANT_IDLE_S) -> int:
        """Forget, in every pool, the tenants no request on it named for
        ``idle_s`` seconds that hold no block in its namespace, so that the
        daemon's per-tenant state follows the active tenants, not every tenant
        ever seen. Returns how many were forgotten. Runs off the request path
        (the servicer's timer thread); takes no index lock. A request that names
        a tenant while it is being forgotten may see its events skip this pool's
        watchers until its next request: the engine's scheduler counts its own
        stores anyway (kvseal.vllm), and a stale view costs a recompute."""
        now = time.monotonic() if now is None else now
        gone = 0
        for pool in self.pools.all():
            used = pool.tenants
            with self._tenants_lock:
                for tenant, last in list(used.items()):
                    if now - last >= idle_s and not self.index.has_blocks(pool.namespace, tenant):
                        del used[tenant]
                        gone += 1
        return gone
