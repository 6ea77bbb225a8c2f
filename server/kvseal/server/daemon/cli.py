"""The daemon's command line: every flag, and its ``KVSEAL_*`` variable."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from kvseal.server.config import (
    IntegrityPolicy,
    ServerConfig,
    StorePolicy,
    default_socket_path,
    parse_size,
)


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
        help="capacity of the sealed host tier, e.g. 512MiB, 64GiB; N blocks need N x block bytes (each rounded up to 256; nonce and tag are kept in private memory) [KVSEAL_HOST_BYTES]",  # noqa: E501
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
        "--operator-uid",
        type=int,
        action="append",
        default=None,
        help="uid whose Stats calls without a pool id get the daemon-wide counts (repeatable; "
        "admitted like --allow-uid). Others get their own pool's counts (Stats with its "
        "pool id) or the daemon's configuration only. The daemon's own uid makes every "
        "peer of an owner-only socket an operator [KVSEAL_OPERATOR_UIDS=uid,uid]",
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
        "--device-check-interval",
        type=float,
        default=float(_env("KVSEAL_DEVICE_CHECK_INTERVAL", "5") or 5),
        help="cuda: seconds between checks that the GPU context still works while idle; "
        "a lost context turns health NOT_SERVING and exits 4; 0: off "
        "[KVSEAL_DEVICE_CHECK_INTERVAL]",
    )
    _add_store_flags(p)
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


def _add_store_flags(p: argparse.ArgumentParser) -> None:
    """The sealed store tier's flags (docs/store.md); all unused without --store-dir."""
    p.add_argument(
        "--store-dir",
        default=_env("KVSEAL_STORE_DIR"),
        help="keep sealed blocks also in this directory (a local disk, or a volume every "
        "replica mounts), a tier under the host tier; off when unset [KVSEAL_STORE_DIR]",
    )
    p.add_argument(
        "--store",
        default=_env("KVSEAL_STORE"),
        help="the store as a URL instead of --store-dir: dir:///PATH (the same as "
        "--store-dir PATH) or s3://BUCKET/PREFIX?endpoint=URL&region=R&credentials=env|"
        "file:PATH&timeout=S&retries=N (needs kvseal-server[s3]; credentials never in the "
        'URL; docs/store.md, "S3") or mooncake://MASTER_HOST:PORT?local=HOST&metadata=..'
        '(needs kvseal-server[mooncake]; docs/store.md, "Mooncake Store") [KVSEAL_STORE]',
    )
    p.add_argument(
        "--store-bytes",
        default=_env("KVSEAL_STORE_BYTES", "16GiB"),
        help="capacity of the store directory; every replica sharing it must give the "
        "same [KVSEAL_STORE_BYTES]",
    )
    p.add_argument(
        "--store-key",
        default=_env("KVSEAL_STORE_KEY", "local"),
        help="where the store's deployment key comes from: local (random, this process "
        "only), file:PATH (32 bytes raw, hex or base64; a Kubernetes or CoCo sealed "
        "secret), cdh:REPO/TYPE/TAG (the confidential-data-hub) [KVSEAL_STORE_KEY]",
    )
    p.add_argument(
        "--store-cdh-endpoint",
        default=_env("KVSEAL_STORE_CDH_ENDPOINT", "http://127.0.0.1:8006"),
        help="the confidential-data-hub's API for --store-key cdh:..., http://ADDRESS:PORT; "
        "a literal loopback address (127.0.0.0/8 or [::1]; no name, not even localhost) "
        "[KVSEAL_STORE_CDH_ENDPOINT]",
    )
    p.add_argument(
        "--store-cdh-insecure-endpoint",
        action="store_true",
        default=_env("KVSEAL_STORE_CDH_INSECURE_ENDPOINT", "") in ("1", "true", "yes"),
        help="allow a --store-cdh-endpoint off the loopback: the deployment key then "
        "crosses the host's network in plaintext (tests, or a path protected otherwise) "
        "[KVSEAL_STORE_CDH_INSECURE_ENDPOINT]",
    )
    p.add_argument(
        "--store-key-wait",
        type=float,
        default=float(_env("KVSEAL_STORE_KEY_WAIT", "30") or 30),
        help="seconds --store-key cdh:... keeps retrying while the CDH is not up (refused, "
        "timeouts, 5xx); 401/403/404 fail at once [KVSEAL_STORE_KEY_WAIT]",
    )
    p.add_argument(
        "--store-policy",
        choices=[x.value for x in StorePolicy],
        default=_env("KVSEAL_STORE_POLICY", StorePolicy.WRITE_THROUGH.value),
        help="write-through: every block stored in the host tier is also spilled to the "
        "store (restarts and replicas find the hot set); spill: only blocks the host tier "
        "evicts [KVSEAL_STORE_POLICY]",
    )
    p.add_argument(
        "--store-locality",
        choices=("local", "remote"),
        default=_env("KVSEAL_STORE_LOCALITY"),
        help="where the store is, as its events tell vLLM and llm-d (medium STORAGE): local "
        "(a disk of this node) or remote (a network volume every replica mounts, or a "
        "shared backend); default: remote for s3:// and mooncake:// stores, local for a "
        "directory [KVSEAL_STORE_LOCALITY]",
    )
    p.add_argument(
        "--store-fsync",
        choices=("on", "off"),
        default=_env("KVSEAL_STORE_FSYNC", "on"),
        help="on: flush each record before it is published (a host crash never leaves a "
        "torn record behind a name); off: for a store that dies with the VM (tmpfs) "
        "[KVSEAL_STORE_FSYNC]",
    )
    p.add_argument(
        "--store-max-block-bytes",
        default=_env("KVSEAL_STORE_MAX_BLOCK_BYTES", "16MiB"),
        help="largest block the store takes (larger ones stay in the host tier only); "
        "replicas sharing a directory must agree [KVSEAL_STORE_MAX_BLOCK_BYTES]",
    )


def _store_location(store_dir: str | None, store: str | None) -> tuple[str | None, str | None]:
    """``--store-dir`` and ``--store`` as the config's (store_dir, store_url):
    ``dir:///PATH`` is ``--store-dir /PATH``; an s3:// URL is checked when the
    store opens (its errors never echo a userinfo part)."""
    if store is None:
        return store_dir, None
    if store_dir is not None:
        raise ValueError("give --store-dir or --store, not both")
    if store.startswith("dir://"):
        path = store[len("dir://") :]
        if not path.startswith("/"):
            raise ValueError("--store dir:///PATH takes an absolute path")
        return path, None
    if store.startswith(("s3://", "mooncake://")):
        return None, store
    raise ValueError(
        "--store must be dir:///PATH, s3://BUCKET/PREFIX?... or mooncake://MASTER:PORT?local=HOST..."
    )


def config_from_args(argv: Sequence[str] | None = None) -> ServerConfig:
    args = build_parser().parse_args(argv)
    store_dir, store_url = _store_location(args.store_dir or None, args.store or None)
    uids: tuple[int, ...] = tuple(args.allow_uid or ())
    if not uids and os.environ.get("KVSEAL_ALLOW_UIDS"):
        uids = tuple(int(u) for u in os.environ["KVSEAL_ALLOW_UIDS"].split(",") if u.strip())
    operators: tuple[int, ...] = tuple(args.operator_uid or ())
    if not operators and os.environ.get("KVSEAL_OPERATOR_UIDS"):
        operators = tuple(
            int(u) for u in os.environ["KVSEAL_OPERATOR_UIDS"].split(",") if u.strip()
        )
    if args.store_fsync not in ("on", "off"):  # KVSEAL_STORE_FSYNC skips argparse's choices
        raise ValueError("--store-fsync must be on or off")
    if not args.store_locality:  # a shared backend is every replica's: remote to each
        args.store_locality = "remote" if store_url is not None else "local"
    if args.store_locality not in ("local", "remote"):  # likewise KVSEAL_STORE_LOCALITY
        raise ValueError("--store-locality must be local or remote")
    return ServerConfig(
        listen=args.listen,
        backend=args.backend,
        device=args.device,
        host_bytes=parse_size(args.host_bytes),
        host_region=args.host_region,
        integrity_policy=IntegrityPolicy(args.on_integrity_failure),
        allow_uids=uids,
        operator_uids=operators,
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
        device_check_interval=args.device_check_interval,
        max_holds=args.max_holds,
        log_format=args.log_format,
        log_level=args.log_level.upper(),
        store_dir=store_dir,
        store_url=store_url,
        store_bytes=parse_size(args.store_bytes),
        store_key=args.store_key,
        store_cdh_endpoint=args.store_cdh_endpoint,
        store_cdh_insecure_endpoint=args.store_cdh_insecure_endpoint,
        store_key_wait=args.store_key_wait,
        store_policy=StorePolicy(args.store_policy),
        store_fsync=args.store_fsync == "on",
        store_locality=args.store_locality,
        store_max_block_bytes=parse_size(args.store_max_block_bytes),
    )
