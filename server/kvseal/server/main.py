"""``kvseal-server``: the daemon's command line, process hardening, serving
and shutdown.

Lifecycle: harden the process (no core dumps, not ptrace-able) -> cipher
self-test -> pick the backend -> create the host region -> bind -> health
SERVING -> systemd READY=1 -> ... SIGTERM -> health NOT_SERVING -> drain
in-flight RPCs for ``grace`` seconds -> exit 0. After an integrity failure
under ``--on-integrity-failure abort`` the same shutdown runs and the exit
status is 3 (EXIT_INTEGRITY). When the backend becomes unusable (the CUDA
context was lost: every later transfer would fail) the same shutdown runs and
the exit status is 4 (EXIT_BACKEND), so that the supervisor restarts it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import faulthandler
import grp
import json
import logging
import os
import pwd
import resource
import secrets
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from kvseal.server import locks, sealing, telemetry
from kvseal.server.backend import Backend, CpuBackend
from kvseal.server.cache import Observer, SealedCache
from kvseal.server.config import (
    EXIT_INTEGRITY,
    IntegrityPolicy,
    ServerConfig,
    default_socket_path,
    parse_size,
)
from kvseal.server.hostregion import RegionError
from kvseal.server.peercred import PeerCredGate, listen_owner_only
from kvseal.server.service import KVSealServicer, add_to_server
from kvseal.v1 import kvseal_pb2 as pb

log = logging.getLogger("kvseal")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVSeal"].full_name
EXIT_CONFIG = 2
EXIT_BACKEND = 4  # the backend cannot serve any more (CUDA context lost): restart
_PR_SET_DUMPABLE = 4


# ------------------------------------------------------------------ config


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvseal-server",
        description=(
            "kvseal: a sealed (AES-256-GCM) host-memory KV-cache tier for one GPU. "
            "Every flag can also be set with the KVSEAL_* variable shown."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--listen",
        default=_env("KVSEAL_LISTEN", "unix://" + default_socket_path()),
        help="unix:///path/to.sock, or tcp://host:port with mutual TLS [KVSEAL_LISTEN]",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "cpu", "cuda"),
        default=_env("KVSEAL_BACKEND", "auto"),
        help="where blocks are sealed; auto picks cuda when a GPU is usable [KVSEAL_BACKEND]",
    )
    p.add_argument(
        "--device",
        type=int,
        default=int(_env("KVSEAL_DEVICE", "0") or 0),
        help="GPU ordinal for the cuda backend [KVSEAL_DEVICE]",
    )
    p.add_argument(
        "--host-bytes",
        default=_env("KVSEAL_HOST_BYTES", "4GiB"),
        help="capacity of the sealed host tier, e.g. 512MiB, 64GiB [KVSEAL_HOST_BYTES]",
    )
    p.add_argument(
        "--host-region",
        default=_env("KVSEAL_HOST_REGION"),
        help="back the ciphertext region with this file (mode 0600, e.g. under /dev/shm) "
        "instead of anonymous memory [KVSEAL_HOST_REGION]",
    )
    p.add_argument(
        "--on-integrity-failure",
        choices=("abort", "drop"),
        default=_env("KVSEAL_ON_INTEGRITY_FAILURE", "abort"),
        help="abort: fail the request, stop serving, exit 3. drop: fail the request with "
        "DATA_LOSS, evict the blocks, keep serving [KVSEAL_ON_INTEGRITY_FAILURE]",
    )
    p.add_argument(
        "--allow-uid",
        type=int,
        action="append",
        default=None,
        help="peer uid allowed on the Unix socket (repeatable; default: the daemon's own "
        "uid). The daemon's own uid only: a 0600 socket, checked by the kernel (root can "
        "always connect). With other uids: checked with SO_PEERCRED on every connection, "
        "the socket 0666 unless --socket-group narrows it [KVSEAL_ALLOW_UIDS=uid,uid]",
    )
    p.add_argument(
        "--socket-group",
        default=_env("KVSEAL_SOCKET_GROUP"),
        help="group (name or gid) whose members may open the Unix socket: socket 0660 "
        "in that group; the allowed uids must be members [KVSEAL_SOCKET_GROUP]",
    )
    p.add_argument(
        "--tls-cert", default=_env("KVSEAL_TLS_CERT"), help="server certificate (PEM), tcp:// only"
    )
    p.add_argument(
        "--tls-key", default=_env("KVSEAL_TLS_KEY"), help="server key (PEM), tcp:// only"
    )
    p.add_argument(
        "--tls-client-ca",
        default=_env("KVSEAL_TLS_CLIENT_CA"),
        help="CA that signs client certificates (PEM); clients must present one",
    )
    p.add_argument(
        "--metrics-address",
        default=_env("KVSEAL_METRICS_ADDRESS"),
        help="serve Prometheus /metrics on HOST:PORT (off by default) [KVSEAL_METRICS_ADDRESS]",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=int(_env("KVSEAL_WORKERS", "0") or 0),
        help="CPU sealing threads (0: min(4, cores)) [KVSEAL_WORKERS]",
    )
    p.add_argument("--max-batch-blocks", type=int, default=4096, help="blocks per request limit")
    p.add_argument("--max-batch-bytes", default="2GiB", help="bytes per request limit")
    p.add_argument(
        "--rekey-after",
        type=int,
        default=2**32,
        help="seals under one key before a new key epoch starts (NIST SP 800-38D margin)",
    )
    p.add_argument("--grace", type=float, default=5.0, help="seconds to drain RPCs on SIGTERM")
    p.add_argument(
        "--max-holds",
        type=int,
        default=int(_env("KVSEAL_MAX_HOLDS", "8") or 8),
        help="open HoldPool streams at most (one per engine process is typical) [KVSEAL_MAX_HOLDS]",
    )
    p.add_argument(
        "--engine-event-timeout",
        type=float,
        default=float(_env("KVSEAL_ENGINE_EVENT_TIMEOUT", "30") or 30),
        help="cuda: seconds a request waits for the engine's CUDA event before failing "
        "with DEADLINE_EXCEEDED; nothing is read or written then [KVSEAL_ENGINE_EVENT_TIMEOUT]",
    )
    p.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=_env("KVSEAL_LOG_FORMAT", "text"),
        help="[KVSEAL_LOG_FORMAT]",
    )
    p.add_argument(
        "--log-level", default=_env("KVSEAL_LOG_LEVEL", "INFO"), help="[KVSEAL_LOG_LEVEL]"
    )
    return p


def config_from_args(argv: Sequence[str] | None = None) -> ServerConfig:
    args = build_parser().parse_args(argv)
    uids: tuple[int, ...] = tuple(args.allow_uid or ())
    if not uids and os.environ.get("KVSEAL_ALLOW_UIDS"):
        uids = tuple(int(u) for u in os.environ["KVSEAL_ALLOW_UIDS"].split(",") if u.strip())
    return ServerConfig(
        listen=args.listen,
        backend=args.backend,
        device=args.device,
        host_bytes=parse_size(args.host_bytes),
        host_region=args.host_region,
        integrity_policy=IntegrityPolicy(args.on_integrity_failure),
        allow_uids=uids,
        socket_group=args.socket_group,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        metrics_address=args.metrics_address,
        workers=args.workers,
        max_batch_blocks=args.max_batch_blocks,
        max_batch_bytes=parse_size(args.max_batch_bytes),
        rekey_after=args.rekey_after,
        grace_seconds=args.grace,
        engine_event_timeout=args.engine_event_timeout,
        max_holds=args.max_holds,
        log_format=args.log_format,
        log_level=args.log_level.upper(),
    )


# ------------------------------------------------------------------ process


class JsonFormatter(logging.Formatter):
    """One JSON object per line. Messages never contain key material or
    cache salts: the code that logs passes only ids, counts and digests."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, separators=(",", ":"))


def setup_logging(cfg: ServerConfig) -> None:
    h = logging.StreamHandler(sys.stderr)
    if cfg.log_format == "json":
        h.setFormatter(JsonFormatter())
    else:
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(cfg.log_level)


def harden_process() -> None:
    """Keep key material out of core dumps and away from same-uid debuggers."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_DUMPABLE, 0) failed: errno %d", ctypes.get_errno())


def sd_notify(state: str) -> None:
    """systemd readiness protocol (Type=notify); no-op without NOTIFY_SOCKET."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        try:
            s.sendto(state.encode(), addr)
        except OSError as e:
            log.warning("sd_notify(%s) failed: %s", state, e)


def make_backend(cfg: ServerConfig, sealer: sealing.BlockSealer) -> Backend:
    """``cuda``: the GPU backend or exit with one clear line (no traceback);
    ``auto``: the GPU backend when usable, else CPU with a log line saying why."""
    if cfg.backend in ("cuda", "auto"):
        # Imported here so that CPU-only installs never load cuda-python.
        from kvseal.server.cuda import probe  # noqa: PLC0415

        ok, reason = probe.cuda_available(cfg.device)
        if ok:
            from kvseal.server.cuda.backend import (  # noqa: PLC0415
                BackendUnavailable,
                CudaBackend,
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


@dataclass(frozen=True)
class SocketAccess:
    """Who may open the public socket file, and who then checks the peer.

    ``mode``: the socket's mode. ``gid``: its group (None: the daemon's).
    ``dir_search``: the search ("x") bit the socket directory needs so that the
    admitted uids can reach the socket and its lock file (0: none).
    ``relay``: the SO_PEERCRED relay checks each peer against the allow list
    (``kvseal.server.peercred.PeerCredGate``); False: gRPC listens on the socket
    itself and the kernel's permission check on the 0600 socket is the check
    (``kvseal.server.peercred.listen_owner_only``).
    """

    mode: int
    gid: int | None
    dir_search: int
    summary: str
    relay: bool = True


def socket_access(cfg: ServerConfig) -> SocketAccess:
    """Derive the socket's mode and group from ``--socket-group`` and the allow list.

    - ``--socket-group G``: 0660 in group G, the directory group-searchable;
    - otherwise, uids other than the daemon's (and root, which passes any mode)
      in the allow list: 0666, the directory searchable by all: every local uid
      can connect, and the gate refuses (and logs) every uid not in the list;
    - otherwise: 0600. When the daemon's own uid is in the list (with root at
      most), the kernel's check on a 0600 socket admits exactly that uid, and
      root: gRPC listens there itself, no relay. Otherwise (e.g. only root
      listed) the relay still refuses the daemon's own uid.

    Exits (status 2) when the group does not exist.
    """
    if cfg.socket_group is not None:
        name = cfg.socket_group.strip()
        try:
            gid = int(name) if name.isdigit() else grp.getgrnam(name).gr_gid
        except KeyError:
            raise SystemExit(f"kvseal-server: --socket-group {name}: no such group") from None
        for uid in sorted(cfg.effective_allow_uids - {0}):
            if not _in_group(uid, gid):
                log.warning(
                    "allowed uid %d is not a member of socket group %d: it cannot open the socket",
                    uid,
                    gid,
                )
        return SocketAccess(0o660, gid, 0o010, f"mode 0660, group {gid}")
    others = cfg.effective_allow_uids - {os.geteuid(), 0}
    if others:
        return SocketAccess(
            0o666,
            None,
            0o001,
            f"mode 0666 for allowed uids {sorted(others)} (SO_PEERCRED admits only the allow "
            "list; --socket-group narrows who can connect at all)",
        )
    uid = os.geteuid()
    if uid in cfg.effective_allow_uids:
        return SocketAccess(
            0o600,
            None,
            0,
            f"mode 0600, owner-only: the kernel admits uid {uid}{'' if uid == 0 else ' and root'}"
            "; no relay",
            relay=False,
        )
    return SocketAccess(0o600, None, 0, "mode 0600")


def _in_group(uid: int, gid: int) -> bool:
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return True  # unknown here (e.g. a uid of another container): cannot tell
    if pw.pw_gid == gid:
        return True
    try:
        return pw.pw_name in grp.getgrgid(gid).gr_mem
    except KeyError:
        return False


def _prepare_unix_dir(path: str, access: SocketAccess | None = None) -> bool:
    """Make sure nobody but this uid (or root) controls the socket directory.

    Creates it 0700 if missing (plus the search bit ``access`` needs, and its
    group). Refuses (exit 2) a directory that is a symlink, or owned by another
    uid: its owner could replace the socket and answer the engine in kvseal's
    name. Returns
    whether the directory is *private* (ours and not writable by group/others);
    a shared one (e.g. a Kubernetes emptyDir, root-owned 0777, reachable only
    from the pod) is accepted with a warning, and gRPC's own socket then goes
    elsewhere.
    """
    access = access or SocketAccess(0o600, None, 0, "mode 0600")
    d = os.path.dirname(path) or "."
    if not os.path.lexists(d):
        os.makedirs(d, mode=0o700, exist_ok=True)
        st = os.lstat(d)
        if st.st_uid == os.geteuid():
            if access.gid is not None:
                os.chown(d, -1, access.gid)
            os.chmod(d, 0o700 | access.dir_search)
    st = os.lstat(d)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise SystemExit(
            f"kvseal-server: socket directory {d} is not a directory (or is a symlink)"
        )
    if st.st_uid not in (os.geteuid(), 0):
        raise SystemExit(
            f"kvseal-server: socket directory {d} is owned by uid {st.st_uid}: refusing to use it "
            "(its owner could replace the socket)"
        )
    private = st.st_uid == os.geteuid() and not st.st_mode & 0o022
    if not private:
        log.warning(
            "socket directory %s is writable by others (mode %o): fine for a pod-private volume, "
            "not on a shared host",
            d,
            stat.S_IMODE(st.st_mode),
        )
    return private


def _grant_search(path: str, access: SocketAccess) -> None:
    """Give the admitted uids the search bit they need on the socket directory
    (of ours: never read or write, never on someone else's). Called once the
    socket lock is held, so a refused second daemon changes nothing."""
    d = os.path.dirname(path) or "."
    st = os.lstat(d)
    reachable = st.st_mode & 0o001 or (
        access.dir_search == 0o010 and st.st_gid == access.gid and st.st_mode & 0o010
    )
    if access.dir_search and not reachable:
        # A directory in another group than the socket's gets the "others" search
        # bit: the socket's own mode (0660) still keeps non-members from connecting.
        bit = access.dir_search if access.gid in (None, st.st_gid) else 0o001
        if st.st_uid == os.geteuid():
            os.chmod(d, stat.S_IMODE(st.st_mode) | bit)
            st = os.lstat(d)
            log.info(
                "socket directory %s: added search permission (mode %o)",
                d,
                stat.S_IMODE(st.st_mode),
            )
        else:
            log.warning(
                "socket directory %s (mode %o, owner uid %d) cannot be searched by the allowed "
                "uids: they cannot reach the socket",
                d,
                stat.S_IMODE(st.st_mode),
                st.st_uid,
            )


def _private_dir(socket_dir: str, socket_dir_private: bool) -> str:
    """A fresh 0700 directory (random name: nothing can be planted there in
    advance) for gRPC's own socket.

    Where: in the socket directory when that is private; else in the system
    temp directory if it is sticky or private (nobody else can rename our
    entry there); else, e.g. in a Kubernetes pod whose emptyDir volumes are
    all 0777, back in the socket directory, which is then no less exposed
    than the public socket itself (reachable only from the pod).
    """
    base = socket_dir
    if not socket_dir_private:
        tmp = tempfile.gettempdir()
        st = os.lstat(tmp)
        if st.st_mode & stat.S_ISVTX or (st.st_uid == os.geteuid() and not st.st_mode & 0o022):
            base = tmp
        else:
            log.warning("no private place for the internal socket; using %s", socket_dir)
    d = tempfile.mkdtemp(prefix=".kvseal-", dir=base)
    st = os.lstat(d)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:  # pragma: no cover
        raise SystemExit(f"kvseal-server: {d} is not a private directory")
    return d


# ------------------------------------------------------------------ server


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
                private = _prepare_unix_dir(cfg.unix_path, access)
                held.append(locks.lock_socket(cfg.unix_path))
                _grant_search(cfg.unix_path, access)
            if cfg.host_region is not None:
                held.append(locks.lock_region(cfg.host_region))
        except locks.LockError as e:
            for fd in held:
                os.close(fd)
            raise SystemExit(f"kvseal-server: {e}") from e
        sealing.self_test()
        sealer = sealing.BlockSealer(cfg.rekey_after)
        backend = make_backend(cfg, sealer)
        try:
            region = backend.make_region(cfg.host_bytes, cfg.host_region)
        except RegionError as e:
            backend.close()
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
        cache = SealedCache(cfg, backend, region, sealer, on_integrity_abort=on_abort)
        metrics = telemetry.Metrics(cache) if cfg.metrics_address else None
        if metrics is not None:
            cache.observer = Observer(on_transfer=metrics.on_transfer)
        server = grpc.server(
            # Streams (event watchers, pool holds) each keep a thread for their whole
            # life, so the pool is sized for them on top of --grpc-threads. The
            # executor is shared (first come, first served): under a burst of long
            # transfers a new hold may wait, and clients retry it.
            futures.ThreadPoolExecutor(
                cfg.grpc_threads + cfg.max_watchers + cfg.max_holds,
                thread_name_prefix="kvseal-rpc",
            ),
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
        add_to_server(
            KVSealServicer(cache, instance, on_done=metrics.on_request if metrics else None), server
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
                private_dir = _private_dir(os.path.dirname(cfg.unix_path) or ".", private)
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


EXIT_WATCHDOG_S = 3.0


def _exit_watchdog(code: int, after_s: float) -> None:
    """Everything is released once the daemon logged that it stopped; what is
    left is the interpreter's exit, which joins every non-daemon thread (gRPC's
    handler executor among them: concurrent.futures joins its workers at exit).
    A thread that lingers there must not keep a stopped daemon alive (its
    supervisor would SIGKILL it, and the exit status would be lost): if the
    process still runs ``after_s`` seconds later, log every thread's stack (to
    say which) and leave with ``code``."""

    def expire() -> None:
        time.sleep(after_s)
        log.error("still running %.1f s after it stopped; thread stacks follow", after_s)
        for h in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                h.flush()
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        logging.shutdown()
        os._exit(code)

    threading.Thread(target=expire, name="kvseal-exit-watchdog", daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        cfg = config_from_args(argv)
    except ValueError as e:
        print(f"kvseal-server: {e}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(cfg)
    harden_process()
    try:
        daemon = Daemon.create(cfg)
    except SystemExit as e:  # start-up refusals carry their one-line message
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return EXIT_CONFIG
        raise
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: daemon.begin_shutdown())
    # On demand, every thread's stack to the log (stderr): where a slow request
    # sits, without stopping the daemon (`kill -USR2 <pid>`; the soak sends it
    # when an engine's call has been in flight for long). Stacks carry no data.
    faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True)
    daemon.start()
    code = daemon.wait()
    _exit_watchdog(code, EXIT_WATCHDOG_S)  # the process's own entry point: exit it
    return code


if __name__ == "__main__":
    sys.exit(main())
