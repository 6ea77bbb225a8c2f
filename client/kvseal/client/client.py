"""The typed gRPC client of the kvseal daemon: :class:`KVSealClient`.

Every call has a deadline; calls that are safe to repeat (lookup, touch,
stats, health) are retried by gRPC's own retry policy on UNAVAILABLE, bounded
by attempts and by the deadline (:mod:`kvseal.client.channel`). Offload and
restore are not retried (they move data; the engine decides) and run under the
engine contract (:mod:`kvseal.client.transfer`). Failures raise
:class:`~kvseal.client.errors.KVSealRpcError` with the status code and the
daemon's machine-readable reason.

The engine's hot path uses :class:`kvseal.client.engine_pool.EnginePool`
over this client instead: it never raises and never waits past its deadline.

The configuration, error and result types this module used to define live in
their own modules now; they are re-exported here (``__all__``) so that
``from kvseal.client.client import ClientConfig`` keeps working.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import grpc
from kvseal.client.channel import open_channel, trace_metadata
from kvseal.client.config import ClientConfig, default_target
from kvseal.client.errors import ERROR_METADATA_KEY, KVSealRpcError
from kvseal.client.hashing import tenant_digest
from kvseal.client.health import (
    HEALTH_METHOD,
    HEALTH_STATUS,
    decode_health_status,
    encode_health_request,
)
from kvseal.client.hold import PoolHold
from kvseal.client.results import LookupResult, OffloadResult, PoolHandle, RestoreResult
from kvseal.client.transfer import run_transfer
from kvseal.v1 import kvseal_pb2 as pb
from kvseal.v1 import kvseal_pb2_grpc as pb_grpc

__all__ = [
    "ERROR_METADATA_KEY",
    "HOLD_WITHIN_METADATA_KEY",
    "ClientConfig",
    "KVSealClient",
    "KVSealRpcError",
    "LookupResult",
    "OffloadResult",
    "PoolHandle",
    "PoolHold",
    "RestoreResult",
    "default_target",
]

# RegisterPool: "a HoldPool follows within this many ms" (the daemon drops a
# registration that is never held: its engine died before it could hold it).
HOLD_WITHIN_METADATA_KEY = "kvseal-hold-within-ms"


class KVSealClient:
    """One channel to one daemon. Thread-safe (gRPC channels are).

    Connecting: a call waits, up to its own deadline, for a connection that is
    being established (a slow accept or handshake ends in success or in
    DEADLINE_EXCEEDED at the deadline, never in an early UNAVAILABLE). A
    connection that is refused (no daemon on the socket) fails the call with
    UNAVAILABLE at once, so an engine degrades without waiting.
    """

    def __init__(self, config: ClientConfig | None = None) -> None:
        self.config = config or ClientConfig()
        self._channel = open_channel(self.config)
        self._stub = pb_grpc.KVSealStub(self._channel)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> KVSealClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _transfer(
        self, method: str, request: pb.OffloadRequest | pb.RestoreRequest, timeout: float
    ) -> Any:
        """Run an Offload/Restore under the engine contract
        (:func:`kvseal.client.transfer.run_transfer`): the daemon's cutoff is
        ``timeout`` from now, the gRPC deadline ``transfer_grace_s`` later, and a
        failure without the daemon's reason is returned only once the daemon can
        no longer touch the request's pages."""
        cfg = self.config
        return run_transfer(
            lambda deadline: self._call(method, request, deadline),
            request,
            timeout,
            cfg.transfer_grace_s,
            cfg.target,
        )

    def _call(
        self,
        method: str,
        request: Any,
        timeout: float | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Any:
        fn = getattr(self._stub, method)
        md = (trace_metadata() or ()) + metadata
        try:
            return fn(request, timeout=timeout or self.config.timeout_s, metadata=md or None)
        except grpc.RpcError as e:
            raise KVSealRpcError.from_rpc(e) from None
        except ValueError as e:  # grpc: "Cannot invoke RPC on closed channel!"
            err = KVSealRpcError(grpc.StatusCode.CANCELLED, "", f"client closed: {e}")
            err.sent = False
            raise err from None

    # ------------------------------------------------------------ API

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """The daemon's grpc.health.v1 status name, e.g. "SERVING"."""
        check = self._channel.unary_unary(
            HEALTH_METHOD,
            request_serializer=encode_health_request,
            response_deserializer=decode_health_status,
        )
        try:
            status: int = check(service, timeout=timeout or self.config.timeout_s)
        except grpc.RpcError as e:
            raise KVSealRpcError.from_rpc(e) from None
        return HEALTH_STATUS.get(status, f"STATUS_{status}")

    def register_pool(
        self,
        name: str,
        model_fingerprint: bytes,
        geometry: pb.PoolGeometry,
        backend: pb.Backend = pb.BACKEND_UNSPECIFIED,
        *,
        owner_token: bytes = b"",
        timeout: float | None = None,
        hold_within_s: float | None = None,
        observer: bool = False,
        identity: pb.DeploymentIdentity | None = None,
    ) -> PoolHandle:
        """Register (or replace) the pool named ``name``. ``owner_token``: the
        ``owner_token`` of an earlier handle for this name, which lets this engine
        replace its own registration while it is held; without it a held name is
        refused with ALREADY_EXISTS (POOL_NAME_TAKEN). A refused registration left
        nothing mapped on the daemon. ``hold_within_s``: this client will open a
        HoldPool on the new pool within that many seconds; if none is ever opened
        (the engine died right after registering), the daemon unregisters the pool
        then (the ``kvseal-hold-within-ms`` request metadata). ``observer``: register
        an observer pool (no memory; ``geometry`` has no pages, buffers or segments
        and states ``block_bytes``): lookups, events and holds only, in the namespace
        of the pools with that block geometry (see ``RegisterPoolRequest.observer``).
        ``identity``: what replicas sharing a store must agree on; the daemon's
        warnings come back in ``PoolHandle.warnings`` (the caller logs them)."""
        md: tuple[tuple[str, str], ...] = ()
        if hold_within_s is not None:
            md = ((HOLD_WITHIN_METADATA_KEY, str(max(1, round(hold_within_s * 1000)))),)
        r = self._call(
            "RegisterPool",
            pb.RegisterPoolRequest(
                name=name,
                model_fingerprint=model_fingerprint,
                geometry=geometry,
                backend=backend,
                owner_token=owner_token,
                observer=observer,
                identity=identity,
            ),
            timeout,
            md,
        )
        return PoolHandle(
            r.pool_id,
            r.namespace,
            r.block_bytes,
            r.server_instance,
            bytes(r.owner_token),
            tuple(r.warnings),
        )

    def unregister_pool(self, pool_id: str) -> None:
        self._call("UnregisterPool", pb.UnregisterPoolRequest(pool_id=pool_id))

    def hold_pool(self, pool_id: str, timeout: float | None = None) -> PoolHold:
        """Tie the pool's registration to this process (see :class:`PoolHold`).
        Returns once the daemon confirmed the hold; raises KVSealRpcError if it
        refused (NOT_FOUND, RESOURCE_EXHAUSTED, ...) or did not answer in time."""
        hold = PoolHold(self._stub, pool_id)  # one attempt: the caller decides
        if hold.wait_established(timeout or self.config.timeout_s):
            return hold
        hold.close()
        raise hold.error or KVSealRpcError(
            grpc.StatusCode.DEADLINE_EXCEEDED, "", "HoldPool was not confirmed in time"
        )

    def lookup(self, pool_id: str, tenant: bytes, block_hashes: Sequence[bytes]) -> LookupResult:
        r = self._call(
            "Lookup",
            pb.LookupRequest(pool_id=pool_id, tenant=tenant, block_hashes=block_hashes),
            self.config.lookup_timeout_s,
        )
        return LookupResult(r.hit_blocks, list(r.states))

    def touch(self, pool_id: str, tenant: bytes, block_hashes: Sequence[bytes]) -> int:
        r = self._call(
            "Touch", pb.TouchRequest(pool_id=pool_id, tenant=tenant, block_hashes=block_hashes)
        )
        return int(r.touched)

    def offload(
        self,
        pool_id: str,
        tenant: bytes,
        block_hashes: Sequence[bytes],
        page_ids: Sequence[int],
        parent_hash: bytes | None = None,
        timeout: float | None = None,
        cuda_event_ipc_handle: bytes = b"",
    ) -> OffloadResult:
        """Seal and store pages. ``cuda_event_ipc_handle`` (CUDA backend): an
        interprocess event recorded after the engine wrote the pages; without
        it the engine must have synchronised its stream first.

        The pages belong to kvseal until this returns. On success every block
        was read. On any KVSealRpcError the daemon reads none of the pages any
        more and publishes nothing it read after the failure: the engine may
        overwrite the pages at once. (A failed offload may still have stored
        blocks whose bytes it read before, while they still held this
        request's KV: a later hit on them is correct.)"""
        r = self._transfer(
            "Offload",
            pb.OffloadRequest(
                pool_id=pool_id,
                tenant=tenant,
                parent_hash=parent_hash or b"",
                block_hashes=block_hashes,
                page_ids=page_ids,
                cuda_event_ipc_handle=cuda_event_ipc_handle,
            ),
            timeout or self.config.transfer_timeout_s,
        )
        return OffloadResult(list(r.outcomes), r.stored_blocks, r.stored_bytes, r.evicted_blocks)

    def restore(
        self,
        pool_id: str,
        tenant: bytes,
        block_hashes: Sequence[bytes],
        page_ids: Sequence[int],
        release: bool = False,
        timeout: float | None = None,
        cuda_event_ipc_handle: bytes = b"",
    ) -> RestoreResult:
        """Verify and write blocks into pages; returns once the bytes are in
        place. ``cuda_event_ipc_handle``: an interprocess event recorded after
        the engine's last use of the destination pages.

        The pages belong to kvseal until this returns. On success every page
        holds its verified block. On any KVSealRpcError the daemon writes none
        of the pages any more, so the engine may reuse them at once. What they
        hold then depends on when the request failed:

        - untouched, when it failed before its first page write: a refused
          request (bad input, an unknown pool, an absent block, an unusable
          pool or event handle), an integrity failure (DATA_LOSS: nothing is
          written unless every block of the request verified), keys destroyed
          by a drop, the engine's CUDA event not completing, or a deadline,
          cancellation or shutdown met before the writes began;
        - any of the request's own pages partly or wholly overwritten with
          its *verified* block, when it failed once the writes had begun: on
          CUDA a device error during or after the open pass (INTERNAL); on CPU
          a restore stopped in the middle of its writes (a daemon starved for
          half the grace) or by a write to the pool that failed (an object the
          engine shrank that cannot grow back).

        Never unverified bytes, never a page outside the request. The status
        code alone does not tell the two cases apart (nor does a local timeout
        or a lost connection): treat every page of a failed restore as
        garbage."""
        r = self._transfer(
            "Restore",
            pb.RestoreRequest(
                pool_id=pool_id,
                tenant=tenant,
                block_hashes=block_hashes,
                page_ids=page_ids,
                release=release,
                cuda_event_ipc_handle=cuda_event_ipc_handle,
            ),
            timeout or self.config.transfer_timeout_s,
        )
        return RestoreResult(r.restored_blocks, r.restored_bytes)

    def drop(
        self,
        pool_id: str,
        tenant: bytes,
        block_hashes: Sequence[bytes] = (),
        all_of_tenant: bool = False,
    ) -> int:
        r = self._call(
            "Drop",
            pb.DropRequest(
                pool_id=pool_id,
                tenant=tenant,
                block_hashes=block_hashes,
                all_of_tenant=all_of_tenant,
            ),
        )
        return int(r.dropped_blocks)

    def release(
        self,
        pool_id: str,
        tenant: bytes,
        block_hashes: Sequence[bytes],
        timeout: float | None = None,
    ) -> int:
        """Write-back: release the host copies of blocks restored with
        ``release=False`` once the whole load they belong to verified (the
        proto's ReleaseRequest). Returns how many left the tier; absent
        blocks are skipped."""
        r = self._call(
            "Release",
            pb.ReleaseRequest(pool_id=pool_id, tenant=tenant, block_hashes=block_hashes),
            timeout,
        )
        return int(r.released_blocks)

    def stats(self, pool_id: str = "") -> pb.StatsReply:
        """The daemon's Stats, scoped to the caller (``reply.scope``): with
        ``pool_id`` (a pool this client registered), that pool's requests and its
        tenants' blocks; without, the whole daemon for an operator
        (``--operator-uid``) and the daemon's configuration only for anyone
        else. KVSealRpcError NOT_FOUND (UNKNOWN_POOL) for an unknown pool."""
        reply: pb.StatsReply = self._call("Stats", pb.StatsRequest(pool_id=pool_id))
        return reply

    def tenant_digest(self, cache_salt: str | bytes | None) -> bytes:
        """The tenant digest of ``cache_salt`` under this client's ``tenant_key``."""
        return tenant_digest(cache_salt, key=self.config.tenant_key)

    def watch_events(
        self, pool_id: str, tenant: bytes = b"", timeout: float | None = None
    ) -> Iterator[pb.BlockEvent]:
        """Stream of the block events of ``pool_id``'s namespace, for the tenants
        requests on that pool have named (only ``tenant``'s when given); ends with
        KVSealRpcError: RESOURCE_EXHAUSTED if this watcher fell behind (resubscribe
        and resync), NOT_FOUND / UNKNOWN_POOL once the pool is gone.

        Returns once the daemon has subscribed the stream (its "kvseal-watch"
        header), so no event published after the return is missed: subscribe,
        then resync or act. A refused watch raises on the first ``next``. The
        call is cancelled when the iterator ends or is closed."""
        call = self._stub.WatchEvents(
            pb.WatchEventsRequest(pool_id=pool_id, tenant=tenant), timeout=timeout
        )
        try:
            call.initial_metadata()  # blocks until subscribed (or refused: then empty)
        except BaseException:
            call.cancel()
            raise
        return self._events(call)

    @staticmethod
    def _events(call: Any) -> Iterator[pb.BlockEvent]:
        try:
            yield from call
        except grpc.RpcError as e:
            raise KVSealRpcError.from_rpc(e) from None
        finally:
            call.cancel()
