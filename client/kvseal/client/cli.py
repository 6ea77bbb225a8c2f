"""``kvseal``: the operator's command line (health, stats, selftest).

``kvseal selftest`` is what to run on a fresh node: it registers a synthetic
pool with real model geometry (Qwen3-32B by default: 64 layers, 8 KV heads,
head dim 128, bf16, 16-token pages = 4 MiB blocks) in shared memory, offloads
random blocks, poisons the pages, restores them, checks every byte, and
prints throughput. Exit status: 0 pass, 1 mismatch or failed call, 2 daemon
unreachable.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from collections.abc import Callable, Sequence

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.json_format import MessageToDict
from kvseal.client.client import KVSealClient
from kvseal.client.config import ClientConfig, default_target, socket_target
from kvseal.client.errors import KVSealRpcError
from kvseal.client.hashing import chain_block_hashes, tenant_digest
from kvseal.client.shm import LAYOUTS, KVShape, SharedKVPool
from kvseal.v1 import kvseal_pb2 as pb

EXIT_OK, EXIT_FAIL, EXIT_UNREACHABLE = 0, 1, 2
_INTEGER_TYPES = frozenset(
    (
        FieldDescriptor.CPPTYPE_INT32,
        FieldDescriptor.CPPTYPE_INT64,
        FieldDescriptor.CPPTYPE_UINT32,
        FieldDescriptor.CPPTYPE_UINT64,
    )
)


# What a field's count does not say, printed on its line of ``kvseal stats``
# (text only: --json stays the bare StatsReply). Engines' prefix hits do not
# reach ``lookups``: the vLLM and SGLang adapters answer a lookup from their
# mirror of the tier, with no Lookup call, so a user watching an engine being
# served from the tier saw 0 lookups beside a growing restored_blocks.
FIELD_NOTES = {
    "lookups": "(Lookup calls only: engines answer their lookups from their mirror"
    " of the tier without one; their hits show in restored_blocks)",
    "lookup_hit_blocks": "(blocks found by those Lookup calls, not the engines' hits)",
}


def stats_document(s: pb.StatsReply) -> dict[str, object]:
    """``s`` as a JSON-ready dict: every field (zeros too), proto field names,
    enums by name, and every integer a number. (Protobuf's JSON mapping writes
    64-bit integers as strings, so a script subtracting two snapshots would
    have got strings for the counters and numbers for ``pools``.)"""
    doc = MessageToDict(
        s, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    for f in s.DESCRIPTOR.fields:
        if f.cpp_type in _INTEGER_TYPES and f.name in doc:
            doc[f.name] = int(getattr(s, f.name))
    return doc


def _client(args: argparse.Namespace) -> KVSealClient:
    target = args.target or (socket_target(args.socket) if args.socket else default_target())
    return KVSealClient(ClientConfig(target=target, timeout_s=args.timeout))


def cmd_health(args: argparse.Namespace) -> int:
    with _client(args) as c:
        try:
            status = c.health(args.service)
        except KVSealRpcError as e:
            print(f"UNREACHABLE: {e}", file=sys.stderr)
            return EXIT_UNREACHABLE
    print(status)
    return EXIT_OK if status == "SERVING" else EXIT_FAIL


def cmd_stats(args: argparse.Namespace) -> int:
    with _client(args) as c:
        try:
            s = c.stats(args.pool)
        except KVSealRpcError as e:
            print(f"UNREACHABLE: {e}", file=sys.stderr)
            return EXIT_UNREACHABLE
    doc = stats_document(s)
    if args.json:
        print(json.dumps(doc, indent=2, sort_keys=True))
    else:
        # StatsReply's field order (kvseal.proto), whatever the values: MessageToDict
        # lists the fields that are set first and the zero ones after, so the
        # order followed the counters from call to call.
        names = [f.name for f in s.DESCRIPTOR.fields if f.name in doc]
        width = max(len(k) for k in names)
        for k in names:
            note = f"  {FIELD_NOTES[k]}" if k in FIELD_NOTES else ""
            print(f"{k:<{width}}  {doc[k]}{note}")
        if s.scope == pb.STATS_SCOPE_FACTS:
            # The quick start's first surprise: all zeros with an engine attached.
            print(
                "kvseal: the counts are 0 in this scope: the daemon shows its own counts "
                "only to an --operator-uid (start it with --operator-uid "
                f"{os.geteuid()} to see them here), a pool's with --pool",
                file=sys.stderr,
            )
    return EXIT_OK


def cmd_selftest(args: argparse.Namespace) -> int:
    shape = KVShape(
        num_pages=args.blocks,
        tokens_per_page=args.tokens_per_page,
        num_layers=args.layers,
        num_kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
    )
    with _client(args) as c:
        try:
            backend = c.stats().backend
        except KVSealRpcError as e:
            print(f"UNREACHABLE: {e}", file=sys.stderr)
            return EXIT_UNREACHABLE
        if backend == pb.BACKEND_CUDA:
            return _selftest_cuda(c, args, shape)
        with SharedKVPool(shape, args.layout, name_prefix="kvseal-selftest") as pool:
            originals = [os.urandom(shape.block_bytes) for _ in range(shape.num_pages)]
            for page, data in enumerate(originals):
                pool.write_block(page, data)

            def poison() -> None:
                for p in range(shape.num_pages):
                    pool.fill_page(p, 0xA5)

            def mismatched() -> list[int]:
                return [p for p in range(shape.num_pages) if pool.read_block(p) != originals[p]]

            return _round_trip(c, args, shape, pool.geometry(), poison, mismatched)


def _selftest_cuda(c: KVSealClient, args: argparse.Namespace, shape: KVShape) -> int:
    """The same round trip against a CUDA daemon, with a pool of torch CUDA
    tensors exported over CUDA IPC (needs torch with CUDA on this node)."""
    try:
        import torch  # noqa: PLC0415 - optional for the client
        from kvseal.client.torch_pool import geometry_from_tensors  # noqa: PLC0415
    except ImportError:
        print("FAIL: the daemon runs the CUDA backend: selftest needs torch", file=sys.stderr)
        return EXIT_FAIL
    if not torch.cuda.is_available():
        print("FAIL: the daemon runs the CUDA backend but torch sees no GPU", file=sys.stderr)
        return EXIT_FAIL
    if args.layout != "vllm_per_layer":
        print("FAIL: on the CUDA backend selftest uses the vllm_per_layer layout", file=sys.stderr)
        return EXIT_FAIL
    dtype = getattr(torch, shape.dtype)
    dims = (2, shape.num_pages, shape.tokens_per_page, shape.num_kv_heads, shape.head_dim)
    layers = [torch.empty(dims, dtype=dtype, device="cuda") for _ in range(shape.num_layers)]
    for t in layers:
        t.view(torch.uint8).random_(0, 256)
    originals = [t.clone() for t in layers]
    torch.cuda.synchronize()
    geometry = geometry_from_tensors(
        layers,
        1,
        layout_name="L,KV,T,H,D",
        tokens_per_page=shape.tokens_per_page,
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
    )

    def poison() -> None:
        for t in layers:
            t.view(torch.uint8).fill_(0xA5)
        torch.cuda.synchronize()

    def mismatched() -> list[int]:
        torch.cuda.synchronize()
        return [
            p
            for p in range(shape.num_pages)
            if not all(
                torch.equal(t[:, p], o[:, p]) for t, o in zip(layers, originals, strict=True)
            )
        ]

    return _round_trip(c, args, shape, geometry, poison, mismatched)


def _round_trip(
    c: KVSealClient,
    args: argparse.Namespace,
    shape: KVShape,
    geometry: pb.PoolGeometry,
    poison: Callable[[], None],
    mismatched: Callable[[], list[int]],
) -> int:
    """Offload every page, poison the pool, restore, compare; print a table."""
    n = shape.num_pages
    tokens = [secrets.randbelow(150_000) for _ in range(n * shape.tokens_per_page)]
    salt = secrets.token_bytes(16)  # a private tenant: touches no one else's blocks
    tenant = tenant_digest(salt)
    hashes = chain_block_hashes(tokens, shape.tokens_per_page, cache_salt=salt)
    pages = list(range(n))
    handle = None
    try:
        handle = c.register_pool(f"selftest-{os.getpid()}", b"kvseal-selftest", geometry)
        t0 = time.perf_counter()
        off = c.offload(handle.pool_id, tenant, hashes, pages)
        t_off = time.perf_counter() - t0
        hit = c.lookup(handle.pool_id, tenant, hashes).hit_blocks
        poison()
        t0 = time.perf_counter()
        res = c.restore(handle.pool_id, tenant, hashes, pages)
        t_res = time.perf_counter() - t0
        bad = mismatched()
        c.drop(handle.pool_id, tenant, all_of_tenant=True)
    except KVSealRpcError as e:
        print(f"FAIL: {e}", file=sys.stderr)
        return EXIT_FAIL
    finally:
        if handle is not None:
            try:
                c.unregister_pool(handle.pool_id)
            except KVSealRpcError:
                pass
    total = n * shape.block_bytes
    rows = [
        ("layout", args.layout),
        (
            "block bytes",
            f"{shape.block_bytes} ({args.layers} layers x K,V x {args.tokens_per_page} "
            f"tokens x {args.kv_heads} heads x {args.head_dim} x {args.dtype})",
        ),
        ("blocks", f"{n} ({total / 2**20:.1f} MiB)"),
        (
            "offload",
            f"{off.stored_blocks} stored in {t_off * 1e3:.1f} ms = {total / t_off / 1e9:.2f} GB/s",
        ),
        ("lookup", f"{hit}/{n} blocks hit"),
        (
            "restore",
            f"{res.restored_blocks} restored in {t_res * 1e3:.1f} ms "
            f"= {total / t_res / 1e9:.2f} GB/s",
        ),
        ("verify", "every byte identical" if not bad else f"{len(bad)} block(s) differ: {bad[:8]}"),
    ]
    for k, v in rows:
        print(f"{k:<12} {v}")
    ok = not bad and hit == n and off.stored_blocks == n and res.restored_blocks == n
    print("PASS" if ok else "FAIL")
    return EXIT_OK if ok else EXIT_FAIL


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvseal", description="Operate a kvseal sidecar daemon.")
    p.add_argument(
        "--socket", help="daemon Unix socket path (default: $KVSEAL_SOCKET or the daemon's default)"
    )
    p.add_argument(
        "--target", help="gRPC target instead of --socket, e.g. unix:///run/kvseal/kvseal.sock"
    )
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
    sub = p.add_subparsers(dest="command", required=True)
    h = sub.add_parser("health", help="print the grpc.health.v1 status; exit 0 when SERVING")
    h.add_argument("--service", default="", help="service name to check ('' = the whole daemon)")
    h.set_defaults(fn=cmd_health)
    s = sub.add_parser(
        "stats",
        help="print the daemon's counters and configuration, one field a line in "
        "StatsReply's field order, a note after lookups and lookup_hit_blocks (engines "
        "answer their lookups from their own mirror, so these count Lookup calls only; "
        "--json: keys sorted, every integer a JSON number, no notes). "
        "Scoped to the caller: the whole daemon for an --operator-uid of the daemon, "
        "one pool's with --pool, else the configuration only, every count 0 (the "
        "'scope' field says which)",
    )
    s.add_argument("--json", action="store_true")
    s.add_argument(
        "--pool", default="", help="a pool id this engine registered: that pool's counts"
    )
    s.set_defaults(fn=cmd_stats)
    t = sub.add_parser(
        "selftest", help="round-trip synthetic blocks of real geometry and check every byte"
    )
    t.add_argument("--layout", choices=LAYOUTS, default="vllm_per_layer")
    t.add_argument("--layers", type=int, default=64)
    t.add_argument("--kv-heads", type=int, default=8)
    t.add_argument("--head-dim", type=int, default=128)
    t.add_argument("--tokens-per-page", type=int, default=16)
    t.add_argument("--dtype", default="bfloat16")
    t.add_argument(
        "--blocks", type=int, default=16, help="blocks to round-trip (4 MiB each by default)"
    )
    t.set_defaults(fn=cmd_selftest)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rc: int = args.fn(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
