"""A running daemon: what ``kvseal-server`` builds, binds, serves and stops.

Lifecycle (``Daemon.create`` -> ``start`` -> ``wait``): both locks (socket,
region) -> cipher self-test -> pick the backend (``make_backend``) -> create the
host region -> bind (gRPC on a private socket behind the SO_PEERCRED relay, or
tcp:// with mutual TLS) -> health SERVING -> systemd READY=1 -> a periodic device
check (``--device-check-interval``) -> ... shutdown -> health NOT_SERVING -> drain
-> release everything -> exit status (4, EXIT_BACKEND, once the backend can no
longer serve: a lost CUDA context, found by a request or by the check).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from kvseal.server import locks, sealing, telemetry
from kvseal.server.backends.base import Backend
from kvseal.server.backends.cpu.backend import CpuBackend
from kvseal.server.cache import Observer, SealedCache
from kvseal.server.config import EXIT_INTEGRITY, ServerConfig
from kvseal.server.daemon.process import sd_notify
from kvseal.server.daemon.socket_access import (
    SocketAccess,
    grant_search,
    make_private_dir,
    prepare_unix_dir,
    socket_access,
)
from kvseal.server.hostregion import RegionError
from kvseal.server.peercred import PeerCredGate, listen_owner_only, relayed_uid
from kvseal.server.service import KVSealServicer, add_to_server
from kvseal.server.store.backend import BackendOpener
from kvseal.server.store.errors import KeySourceError, StoreError
from kvseal.server.store.fsstore import FsStore, StoreConfig
from kvseal.server.store.keysource import parse_key_source
from kvseal.server.store.mooncake import open_mooncake
from kvseal.server.store.s3 import open_s3
from kvseal.server.threads import FixedPool, name_os_thread
from kvseal.v1 import kvseal_pb2 as pb

log = logging.getLogger("kvseal")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVSeal"].full_name
EXIT_BACKEND = 4  # the backend cannot serve any more (CUDA context lost): restart


def make_backend(cfg: ServerConfig, sealer: sealing.BlockSealer) -> Backend:
    """``cuda``: the GPU backend or exit with one clear line (no traceback);
    ``auto``: the GPU backend when usable, else CPU with a log line saying why."""
    if cfg.backend in ("cuda", "auto"):
        # Imported here so that CPU-only installs never load cuda-python.
        from kvseal.server.backends.cuda import probe  # noqa: PLC0415

        ok, reason = probe.cuda_available(cfg.device)
        if ok:
            from kvseal.server.backends.cuda.backend import CudaBackend  # noqa: PLC0415
            from kvseal.server.backends.cuda.device import (  # noqa: PLC0415
                BackendUnavailable,
                CudaError,
            )

            try:
                return CudaBackend(
                    sealer, cfg.device, engine_event_timeout=cfg.engine_event_timeout
                )
            except (BackendUnavailable, CudaError) as e:
                reason = str(e)
        if cfg.backend == "cuda":
            raise SystemExit(f"kvseal-server: --backend cuda: {reason}")
        log.info("backend auto: using cpu (%s)", reason)
    return CpuBackend(sealer, cfg.effective_workers, cfg.effective_allow_uids)


def operator_check(
    cfg: ServerConfig, access: SocketAccess | None, relay_tag: str
) -> Callable[[grpc.ServicerContext], bool]:
    """Whether a call comes from an operator (``--operator-uid``): the Stats view
    of the whole daemon. Behind the relay the peer's uid is known
    (``peercred.relayed_uid``). On an owner-only socket every peer has the
    daemon's uid (or is root), so they all are operators exactly when that uid
    is listed. Over tcp:// (mutual TLS) nobody is: operators use the socket or
    the Prometheus endpoint."""
    operators = frozenset(cfg.operator_uids)
    if not operators or access is None:
        return lambda context: False
    if not access.relay:
        everyone = os.geteuid() in operators
        return lambda context: everyone

    def check(context: grpc.ServicerContext) -> bool:
        uid = relayed_uid(context.peer(), relay_tag)
        return uid is not None and uid in operators

    return check


def open_store(cfg: ServerConfig) -> FsStore | None:
    """The store tier under its deployment key (``--store-*``): a directory
    (``--store-dir``, ``--store dir:///PATH``), an S3 bucket (``--store
    s3://...``, :mod:`kvseal.server.store.s3`) or a Mooncake Store cluster
    (``--store mooncake://...``, :mod:`kvseal.server.store.mooncake`); None
    without either. A key
    that cannot be had (an unsafe or malformed file, the CDH refusing or
    unreachable for ``--store-key-wait`` seconds), a directory or bucket that
    cannot be used as configured (another fanout, too small, a shard that is
    not a directory, an S3 server unreachable or refusing the credentials),
    or a malformed URL stops the start with one line (exit 2); no message
    carries key bytes (``store.keysource``) or S3 credentials."""
    if cfg.store_dir is None and cfg.store_url is None:
        return None
    opener: BackendOpener | None = None
    flag = f"--store-dir {cfg.store_dir}"
    if cfg.store_url is not None:
        flag = "--store"
        try:
            # parsed before the key is fetched
            if cfg.store_url.startswith("mooncake://"):
                opener = open_mooncake(cfg.store_url)
            else:
                opener = open_s3(cfg.store_url)
        except StoreError as e:
            raise SystemExit(f"kvseal-server: --store: {e}") from None
    try:
        source = parse_key_source(
            cfg.store_key,
            cdh_endpoint=cfg.store_cdh_endpoint,
            cdh_retry_for_s=cfg.store_key_wait,
            cdh_allow_remote=cfg.store_cdh_insecure_endpoint,
        )
        key = source.load()
    except KeySourceError as e:
        raise SystemExit(f"kvseal-server: --store-key: {e}") from None
    try:
        store = FsStore(
            StoreConfig(
                cfg.store_dir or "",
                capacity_bytes=cfg.store_bytes,
                max_object_bytes=cfg.store_max_block_bytes,
                durable=cfg.store_fsync,
            ),
            key,  # the store owns it from here (closes it on failure too)
            opener,
        )
    except (StoreError, OSError) as e:  # also a planted shard symlink met by the sweep
        key.close()
        raise SystemExit(f"kvseal-server: {flag}: {e}") from None
    log.info(
        "store tier: %s (%d bytes, fanout %d, key %s, policy %s, fsync %s)",
        store.location,
        cfg.store_bytes,
        store.fanout,
        source.describe(),
        cfg.store_policy.value,
        "on" if cfg.store_fsync else "off",
    )
    return store


@dataclass
class Daemon:
    """A running daemon; ``create`` builds and binds it, ``wait`` blocks."""

    cfg: ServerConfig
    cache: SealedCache
    server: grpc.Server
    health: health.HealthServicer
    gate: PeerCredGate | None
    instance: str
    private_dir: str | None
    stop_event: threading.Event
    metrics: telemetry.Metrics | None = None
    exit_code: int = 0
    _stop_metrics: Callable[[], None] | None = None
    # The socket and region locks (kvseal.server.locks): open for the daemon's
    # whole life; the kernel drops them when the process exits, however it exits.
    lock_fds: tuple[int, ...] = ()

    @classmethod
    def create(cls, cfg: ServerConfig) -> Daemon:
        # One daemon per socket and per region: both locks come first, before
        # anything is unlinked, truncated or bound (see kvseal.server.locks).
        held: list[int] = []
        access: SocketAccess | None = None
        private = False
        try:
            if cfg.unix_path is not None:
                access = socket_access(cfg)
                private = prepare_unix_dir(cfg.unix_path, access)
                held.append(locks.lock_socket(cfg.unix_path))
                grant_search(cfg.unix_path, access)
            if cfg.host_region is not None:
                held.append(locks.lock_region(cfg.host_region))
        except locks.LockError as e:
            for fd in held:
                os.close(fd)
            raise SystemExit(f"kvseal-server: {e}") from e
        sealing.self_test()
        store = open_store(cfg)  # before the backend: a bad key or directory fails fast
        sealer = sealing.BlockSealer(cfg.rekey_after)
        try:
            backend = make_backend(cfg, sealer)
        except BaseException:
            if store is not None:
                store.close()
            raise
        try:
            region = backend.make_region(cfg.host_bytes, cfg.host_region)
        except RegionError as e:
            backend.close()
            if store is not None:
                store.close()
            raise SystemExit(f"kvseal-server: {e}") from e
        if cfg.host_region is not None and not locks.same_file(held[-1], cfg.host_region):
            raise SystemExit(
                f"kvseal-server: host region {cfg.host_region} was replaced while starting"
            )
        stop_event = threading.Event()
        instance = secrets.token_hex(8)
        holder: list[Daemon] = []

        def on_abort() -> None:
            if holder:
                holder[0].begin_shutdown(EXIT_INTEGRITY)

        broken: list[str] = []

        def on_broken(why: str) -> None:
            # Runs on the request thread that hit the error: only signal. Health goes
            # NOT_SERVING and the process exits EXIT_BACKEND after the drain.
            broken.append(why)
            if holder:
                holder[0].begin_shutdown(EXIT_BACKEND)

        watch_broken = getattr(backend, "set_on_broken", None)
        if watch_broken is not None:
            watch_broken(on_broken)
        telemetry.setup_tracing()
        cache = SealedCache(cfg, backend, region, sealer, on_integrity_abort=on_abort, store=store)
        metrics = telemetry.Metrics(cache) if cfg.metrics_address else None
        if metrics is not None:
            cache.observer = Observer(on_transfer=metrics.on_transfer)
        server = grpc.server(
            # Streams (event watchers, pool holds) each keep a thread for their whole
            # life, so the pool is sized for them on top of --grpc-threads. The
            # executor is shared (first come, first served): under a burst of long
            # transfers a new hold may wait, and clients retry it. All its threads
            # start now (kvseal.server.threads): the count is the configuration's,
            # not the highest concurrency seen so far.
            FixedPool(cfg.grpc_threads + cfg.max_watchers + cfg.max_holds, "kvseal-rpc"),
            options=[
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.so_reuseport", 0),
                # Find dead peers on half-open connections (tcp://): a hold ends, and
                # its pool is released, within about 40 s of the engine's host going.
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.keepalive_timeout_ms", 10_000),
            ],
            maximum_concurrent_rpcs=cfg.grpc_threads * 4 + cfg.max_watchers + cfg.max_holds,
        )
        relay_tag = secrets.token_hex(8)
        add_to_server(
            KVSealServicer(
                cache,
                instance,
                on_done=metrics.on_request if metrics else None,
                is_operator=operator_check(cfg, access, relay_tag),
            ),
            server,
        )
        health_servicer = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        gate = None
        private_dir = None
        if cfg.unix_path is not None:
            assert access is not None
            if not access.relay:
                # Owner-only: no hop; the kernel checks every connect (see peercred).
                listen_owner_only(server, cfg.unix_path)
            else:
                # gRPC's own socket lives in a fresh 0700 directory: only this uid
                # can bypass the gate, and the gate admits only allowed uids.
                private_dir = make_private_dir(os.path.dirname(cfg.unix_path) or ".", private)
                internal = os.path.join(private_dir, "grpc.sock")
                log.info(
                    "internal gRPC socket: %s (reachable by uid %d only)", internal, os.geteuid()
                )
                server.add_insecure_port("unix://" + internal)
                gate = PeerCredGate(
                    cfg.unix_path,
                    internal,
                    cfg.effective_allow_uids,
                    mode=access.mode,
                    gid=access.gid,
                    tag=relay_tag,
                )
            log.info(
                "socket %s: %s; allowed uids %s; lock file %s",
                cfg.unix_path,
                access.summary,
                sorted(cfg.effective_allow_uids),
                locks.socket_lock_path(cfg.unix_path),
            )
        else:
            assert cfg.tls_cert and cfg.tls_key and cfg.tls_client_ca  # checked by ServerConfig
            with (
                open(cfg.tls_key, "rb") as k,
                open(cfg.tls_cert, "rb") as c,
                open(cfg.tls_client_ca, "rb") as ca,
            ):
                creds = grpc.ssl_server_credentials(
                    [(k.read(), c.read())], root_certificates=ca.read(), require_client_auth=True
                )
            address = cfg.listen[len("tcp://") :]
            if server.add_secure_port(address, creds) == 0:
                raise SystemExit(f"kvseal-server: cannot listen on {address}")
        daemon = cls(
            cfg,
            cache,
            server,
            health_servicer,
            gate,
            instance,
            private_dir,
            stop_event,
            metrics,
            lock_fds=tuple(held),
        )
        holder.append(daemon)
        if broken:  # broke while the daemon was being built
            daemon.begin_shutdown(EXIT_BACKEND)
        return daemon

    def start(self) -> None:
        self.server.start()
        if self.metrics is not None and self.cfg.metrics_address:
            self._stop_metrics = self.metrics.serve(self.cfg.metrics_address)
            log.info("metrics on http://%s/metrics", self.cfg.metrics_address)
        if self.gate is not None:
            self.gate.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "kvseal serving on %s (instance %s, %s, host tier %d bytes in %s, integrity policy %s)",
            self.cfg.listen,
            self.instance,
            self.cache.backend.detail,
            self.cfg.host_bytes,
            self.cache.region.description,
            self.cfg.integrity_policy.value,
        )
        sd_notify("READY=1\nSTATUS=serving")
        if self.cfg.device_check_interval > 0:
            threading.Thread(
                target=self._check_device, name="kvseal-device-check", daemon=True
            ).start()

    def _check_device(self) -> None:
        """Every ``device_check_interval`` seconds until shutdown begins, the
        backend's cheap device check: a CUDA context lost while no request runs is
        reported through the backend's broken callback (``on_broken`` in
        :meth:`create`: health NOT_SERVING, exit EXIT_BACKEND) as a failure inside
        a request would be. The check skips while a request holds the backend; the
        backend ignores it once closed. A check that cannot run at all (an
        exception other than the device's own errors, which the backend handles:
        a defect, not a lost device) is logged once and checking stops; requests
        still find a lost context themselves."""
        name_os_thread("kvseal-devcheck")  # its kernel name: 15 bytes at most
        while not self.stop_event.wait(self.cfg.device_check_interval):
            try:
                self.cache.backend.check_device()
            except Exception:
                log.exception("the periodic device check cannot run; it is turned off")
                return

    def begin_shutdown(self, exit_code: int = 0) -> None:
        """Idempotent; callable from any thread (signal handler, RPC thread)."""
        if exit_code and not self.exit_code:
            self.exit_code = exit_code
        self.health.enter_graceful_shutdown()
        self.stop_event.set()

    def wait(self) -> int:
        self.stop_event.wait()
        sd_notify("STOPPING=1")
        log.info("shutting down: draining for up to %.1fs", self.cfg.grace_seconds)
        self.cache.begin_drain()  # streams end now; unary requests get the grace period
        if self.gate is not None:
            # gRPC stops listening below: a connection the relay accepted now could
            # only be dropped. Refuse new ones at the socket; relayed ones drain.
            self.gate.stop_accepting()
        self.server.stop(self.cfg.grace_seconds).wait()  # refuse new RPCs, drain the rest
        if self.gate is not None:
            self.gate.stop()
        elif self.cfg.unix_path is not None:  # gRPC's own socket (owner-only)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.cfg.unix_path)
        # grpc's stop() does not wait for handler threads: the cache does,
        # before it unmaps anything a handler may still copy into.
        if not self.cache.close(timeout=max(5.0, self.cfg.grace_seconds)):
            log.critical("requests did not finish; exiting without releasing memory")
            logging.shutdown()
            os._exit(self.exit_code)
        if self._stop_metrics is not None:
            self._stop_metrics()
        telemetry.shutdown_tracing()
        if self.private_dir is not None:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.private_dir, "grpc.sock"))
            with contextlib.suppress(OSError):
                os.rmdir(self.private_dir)
        # Last: the socket file is gone and nothing serves any more, so the next
        # daemon may take over the socket path and the region.
        for fd in self.lock_fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        log.info("stopped (exit status %d)", self.exit_code)
        return self.exit_code
