"""What the host (and an admitted peer) can learn from kvseal: sizes, timing,
prefix hits and metrics, measured against real daemons.

Run: ``make leak-surface`` (or ``.venv/bin/python bench/leak_surface.py [--quick]``).
docs/threat-model.md ("Leak surface") quotes its output. The measurements of
sections 2 to 4 live in ``leak_measure.py``; this script runs the daemons and
prints the report.

Nothing here is hidden by kvseal; the script puts numbers on what is not. It
changes nothing in the daemon and asserts no speed. Four measurements:

1. **Sizes, as the host sees them.** A daemon with a ``--host-region`` file
   (the test's stand-in for hypervisor-visible memory). The "host" paints the
   region with a sentinel byte, then after each request diffs it: bytes that
   changed, per 256-byte-aligned slot. An odd block size (120 B) shows that the
   ciphertext in the region is exactly the plaintext length, with no header,
   nonce or tag next to it (those live in the daemon's private index): the
   slot padding stays painted. Also: re-offloading a cached prefix writes
   nothing (the host sees a repeat); another tenant's copy of the same bytes is
   different ciphertext (the host cannot link tenants by content); restore and
   drop write nothing (ciphertext stays until its slot is reused).
2. **Timing of offload/restore vs blocks per request** (Qwen3-32B geometry,
   4 MiB blocks, anonymous memfd region): median latency per batch size, a
   least-squares fit ``t = fixed + per_block * n``, and how well ``n`` can be
   recovered from one latency sample alone. Then what padding every transfer
   to the next power of two would cost (from the same measurements) and how
   much it would hide (entropy of the batch size for a uniform 1..max load).
3. **Prefix-hit probe, as a client sees it.** A victim tenant caches a
   prompt. Probes, interleaved in random order: the victim asks for it (hit:
   lookup + restore) and for a prompt never cached (miss); an attacker tenant
   (another cache salt) asks for the same prompt, for a never-cached one, and
   with the victim's exact block hashes under its own tenant digest. Reported:
   the hit counts (the answer itself is the oracle) and the latency
   distributions; for the attacker, the difference of medians with a
   bootstrap 95 % interval (no signal: every probe is a miss).
4. **What Stats and /metrics expose:** every metric family and label, a check
   that no label value looks like a hash or digest, and the cross-tenant view:
   an attacker peer reads ``Stats`` before and after the victim's hit.

Prints markdown tables last. No GPU is used.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import socket
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench_cpu import QWEN3_32B, cpu_label, percentile, run_daemon
from kvseal.client import (
    ClientConfig,
    KVSealClient,
    KVSealRpcError,
    chain_block_hashes,
    tenant_digest,
)
from kvseal.client.shm import KVShape, SharedKVPool
from kvseal.core.mirror import observer_geometry  # vLLM-free: only kvseal.client
from kvseal.v1 import kvseal_pb2 as pb
from leak_measure import (
    BIG_TIMEOUT,
    DIGEST_RE,
    bootstrap_median_diff,
    classify,
    entropy_bits,
    fit_line,
    interpolate,
    measure_probes,
    measure_timing,
    pow2_ceil,
    scrape,
    stats_delta,
)

MiB = 1024 * 1024
SLOT_ALIGN = 256  # kvseal.server.hostregion.SLOT_ALIGN (the script does not import server code)
SENTINEL = 0xA5
TABLE_TITLE = "## kvseal leak surface"
FP = b"kvseal-leak-surface/model"
FP_QWEN = b"kvseal-leak-surface/qwen3-32b"


def fill_random(pool: SharedKVPool) -> None:
    for buf in pool.buffers:
        for off in range(0, buf.size, 8 * MiB):
            n = min(8 * MiB, buf.size - off)
            buf.view[off : off + n] = os.urandom(n)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


# ---------------------------------------------------------------- 1. sizes


class HostView:
    """The hypervisor's view of the region file: paint it, then diff it.

    The region is painted once, while empty; each diff compares with the
    previous read. A slot's span is [first changed byte, last changed byte]
    inside it. A ciphertext byte equal to the byte it replaced (the sentinel,
    or old ciphertext in a reused slot) at either end shortens a span by one
    (probability 1/256 per end); the report says how many spans were exact.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = path.stat().st_size
        with open(path, "r+b") as f:
            f.write(bytes([SENTINEL]) * self.size)
        self.snapshot = path.read_bytes()

    def diff(self) -> tuple[dict[int, tuple[int, int]], int]:
        """Changed slots since the last call: {slot offset: (first, last)} and
        the number of changed bytes."""
        now = self.path.read_bytes()
        spans: dict[int, tuple[int, int]] = {}
        changed = 0
        for i, (a, b) in enumerate(zip(now, self.snapshot, strict=True)):
            if a != b:
                changed += 1
                slot = i - i % SLOT_ALIGN
                lo, hi = spans.get(slot, (i, i))
                spans[slot] = (min(lo, i), max(hi, i))
        # Never re-paint: the ciphertext must stay intact (a painted slot would
        # fail authentication on restore, which is the point of sealing).
        self.snapshot = now
        return spans, changed

    def slot_bytes(self, slot: int, n: int) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(slot)
            return f.read(n)


@dataclass
class SizeRow:
    action: str
    blocks_in_request: int
    slots_written: int
    span_bytes: list[int]
    changed_bytes: int
    note: str


def measure_sizes(workdir: Path) -> tuple[int, list[SizeRow]]:
    region = workdir / "region.bin"
    # 120-byte blocks: 2 layers x K,V x 3 tokens x 1 head x 5 dims x 2 bytes.
    shape = KVShape(
        num_pages=8, tokens_per_page=3, num_layers=2, num_kv_heads=1, head_dim=5, dtype="float16"
    )
    bb = shape.block_bytes
    rows: list[SizeRow] = []
    with (
        run_daemon(workdir, 1 * MiB, ["--host-region", str(region)]) as d,
        SharedKVPool(shape, "vllm_per_layer", name_prefix="kvseal-leak") as pool,
        KVSealClient(ClientConfig(target=d.target, timeout_s=30.0)) as c,
    ):
        fill_random(pool)
        h = c.register_pool(f"leak-sizes-{os.getpid()}", FP, pool.geometry())
        host = HostView(region)
        ta, tb = tenant_digest("victim-salt"), tenant_digest("attacker-salt")
        tokens = [random.randrange(50_000) for _ in range(7 * shape.tokens_per_page)]
        chain_a = chain_block_hashes(tokens, shape.tokens_per_page, cache_salt="victim-salt")
        chain_b = chain_block_hashes(tokens, shape.tokens_per_page, cache_salt="attacker-salt")

        def row(action: str, n: int, note: str) -> dict[int, tuple[int, int]]:
            spans, changed = host.diff()
            lengths = sorted(hi - lo + 1 for lo, hi in spans.values())
            rows.append(SizeRow(action, n, len(spans), lengths, changed, note))
            return spans

        c.offload(h.pool_id, ta, chain_a[:1], [0])
        row("offload", 1, "victim, 1 block")
        c.offload(h.pool_id, ta, chain_a[1:4], [1, 2, 3], parent_hash=chain_a[0])
        row("offload", 3, "victim, next 3 blocks of the chain")
        c.offload(h.pool_id, ta, chain_a[:7], list(range(7)))
        row(
            "offload", 7, "victim re-offloads its 7-block prompt (4 cached: touched, not rewritten)"
        )
        c.offload(h.pool_id, ta, chain_a[:7], list(range(7)))
        row("offload", 7, "victim again: all cached, nothing written")
        c.offload(h.pool_id, tb, chain_b, list(range(7)))
        spans_b = row("offload", 7, "attacker tenant, same pages (same plaintext), own salt")
        c.restore(h.pool_id, ta, chain_a, list(range(7)))
        row("restore", 7, "victim restores its prompt (reads are not visible in a diff)")
        c.drop(h.pool_id, ta, chain_a[:1])
        row("drop", 7, "victim drops its chain: ciphertext stays until the slot is reused")
        # Do the two tenants' ciphertexts of the same plaintext share any 16-byte run?
        region_now = region.read_bytes()
        shared = 0
        if spans_b:
            b_bytes = [host.slot_bytes(s, bb) for s in spans_b]
            others = [
                region_now[s : s + bb]
                for s in range(0, len(region_now), SLOT_ALIGN)
                if s not in spans_b
            ]
            for blk in b_bytes:
                for k in range(0, bb - 15, 8):
                    if any(blk[k : k + 16] in o for o in others):
                        shared += 1
                        break
        rows.append(
            SizeRow(
                "compare",
                7,
                0,
                [],
                shared,
                "attacker blocks sharing a 16-byte run with any "
                "other slot (the victim's copies included)",
            )
        )
        c.unregister_pool(h.pool_id)
    return bb, rows


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="smoke run: few sizes and repetitions")
    p.add_argument(
        "--blocks",
        default=None,
        help="batch sizes for the timing table (default 1,2,3,4,8,12,16,32,48,64)",
    )
    p.add_argument("--reps", type=int, default=None, help="repetitions per size (default 7)")
    p.add_argument("--rounds", type=int, default=None, help="probes per kind (default 200)")
    p.add_argument("--prompt-blocks", type=int, default=16, help="blocks in the probed prompt")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Measure what a peer that is no operator sees (the daemons inherit this
    # environment; the test suite sets it for its own daemons).
    os.environ.pop("KVSEAL_OPERATOR_UIDS", None)
    default_blocks = "1,2,4" if args.quick else "1,2,3,4,8,12,16,32,48,64"
    batches = sorted({int(x) for x in (args.blocks or default_blocks).split(",")})
    if not batches or batches[0] < 1:
        raise SystemExit("--blocks must be positive integers")
    reps = args.reps or (2 if args.quick else 7)
    rounds = args.rounds or (20 if args.quick else 200)
    pb_blocks = max(1, min(args.prompt_blocks, 4 if args.quick else args.prompt_blocks))
    random.seed(int.from_bytes(os.urandom(8), "big"))
    print(cpu_label(), flush=True)

    with tempfile.TemporaryDirectory(prefix="kvseal-leak-") as tmp:
        w1 = Path(tmp) / "sizes"
        w1.mkdir()
        print("1. sizes: daemon with a --host-region file, 120-byte blocks", flush=True)
        size_bb, size_rows = measure_sizes(w1)

        shape = KVShape(num_pages=max(*batches, 2 * pb_blocks), dtype="bfloat16", **QWEN3_32B)
        bb = shape.block_bytes
        host_bytes = (2 * max(batches) + 2 * pb_blocks) * bb + 64 * MiB
        port = free_port()
        w2 = Path(tmp) / "timing"
        w2.mkdir()
        print(
            f"2-4. timing, probes, metrics: Qwen3-32B {bb // MiB} MiB blocks, memfd region, "
            f"/metrics on 127.0.0.1:{port}",
            flush=True,
        )
        with (
            run_daemon(w2, host_bytes, ["--metrics-address", f"127.0.0.1:{port}"]) as d,
            SharedKVPool(shape, "vllm_per_layer", name_prefix="kvseal-leak") as pool,
            KVSealClient(ClientConfig(target=d.target, timeout_s=60.0, lookup_timeout_s=10.0)) as c,
            KVSealClient(ClientConfig(target=d.target, timeout_s=10.0)) as peer,
        ):
            fill_random(pool)
            h = c.register_pool(f"leak-{os.getpid()}", FP_QWEN, pool.geometry())
            detail = c.stats().backend_detail
            timing = measure_timing(c, h.pool_id, batches, reps)
            print("   timing done", flush=True)
            probes = measure_probes(c, h.pool_id, shape.tokens_per_page, pb_blocks, rounds)
            print("   probes done", flush=True)
            # 4. the attacker peer's view of the victim's activity through Stats.
            fields = (
                "lookups",
                "lookup_hit_blocks",
                "restored_blocks",
                "restored_bytes",
                "offloaded_blocks",
                "offloaded_bytes",
            )
            tv = tenant_digest("victim-salt-stats")
            chain = chain_block_hashes(
                [random.randrange(50_000) for _ in range(pb_blocks * shape.tokens_per_page)],
                shape.tokens_per_page,
                cache_salt="victim-salt-stats",
            )
            # The peer holds a pool of its own in the victim's namespace (an
            # observer pool: same model and block geometry, no memory), and asks
            # both with it and without a pool id (it is no --operator-uid).
            obs = observer_geometry(pool.geometry())
            own = peer.register_pool(f"attacker-{os.getpid()}", FP_QWEN, obs, observer=True).pool_id
            views = {"no pool id": "", "its own pool": own}
            s0 = {k: peer.stats(v) for k, v in views.items()}
            c.offload(h.pool_id, tv, chain, list(range(pb_blocks)), timeout=BIG_TIMEOUT)
            s1 = {k: peer.stats(v) for k, v in views.items()}
            hit = c.lookup(h.pool_id, tv, chain).hit_blocks
            c.restore(h.pool_id, tv, chain[:hit], list(range(hit)), timeout=BIG_TIMEOUT)
            s2 = {k: peer.stats(v) for k, v in views.items()}
            scopes = {k: pb.StatsScope.Name(s.scope) for k, s in s2.items()}
            d_off = {k: stats_delta(s0[k], s1[k], fields) for k in views}
            d_hit = {k: stats_delta(s1[k], s2[k], fields) for k in views}
            fams = scrape(port)
            stats_fields = [f.name for f in pb.StatsReply.DESCRIPTOR.fields]
            c.drop(h.pool_id, tv, chain)
            c.unregister_pool(h.pool_id)
            try:
                peer.stats()
            except KVSealRpcError:
                pass

    # ------------------------------------------------------------ report
    print()
    print(TABLE_TITLE)
    print()
    print(f"{cpu_label()}; daemon: {detail}; python {sys.version.split()[0]}")
    print()
    print(f"### 1. Sizes in the host region ({size_bb}-byte blocks, {SLOT_ALIGN}-byte slots)")
    print()
    print(
        "| request | blocks asked | slots written | ciphertext span per slot (B) "
        "| bytes changed | what the host learns |"
    )
    print("|---|---:|---:|---|---:|---|")
    for r in size_rows:
        if r.action == "compare":
            print(f"| compare | {r.blocks_in_request} | — | — | {r.changed_bytes} | {r.note} |")
            continue
        spans = ", ".join(str(x) for x in r.span_bytes) or "—"
        print(
            f"| {r.action} | {r.blocks_in_request} | {r.slots_written} | {spans} "
            f"| {r.changed_bytes} | {r.note} |"
        )
    exact = sum(x == size_bb for r in size_rows for x in r.span_bytes)
    total = sum(len(r.span_bytes) for r in size_rows)
    print()
    print(
        f"Spans equal to the plaintext block size ({size_bb} B): {exact} of {total} "
        f"(a span is one byte short when a ciphertext end byte equals the sentinel, p=1/256 "
        f"per end). Nothing outside the spans changed: no header, nonce or tag in the region."
    )
    print()
    print(
        f"### 2. Offload / restore latency vs blocks per request ({bb // MiB} MiB blocks, "
        f"median of {reps}, ms)"
    )
    print()
    print("| blocks | offload p50 | offload p10-p90 | restore p50 | restore p10-p90 |")
    print("|---:|---:|---|---:|---|")
    for t in timing:
        so, sr = sorted(t.offload), sorted(t.restore)
        print(
            f"| {t.blocks} | {fmt_ms(statistics.median(so))} | "
            f"{fmt_ms(percentile(so, 0.1))}-{fmt_ms(percentile(so, 0.9))} | "
            f"{fmt_ms(statistics.median(sr))} | "
            f"{fmt_ms(percentile(sr, 0.1))}-{fmt_ms(percentile(sr, 0.9))} |"
        )
    small = [t for t in timing if t.blocks <= 16] or timing
    print()
    print(
        "| direction | fit on <= 16 blocks: fixed ms | per block ms | R² "
        "| n guessed exactly from one sample | within 2x | median relative error |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for which in ("offload", "restore"):
        a, b, r2 = fit_line(
            [float(t.blocks) for t in small],
            [statistics.median(getattr(t, which)) for t in small],
        )
        guessed, within2, rel = classify(timing, which)
        print(
            f"| {which} | {fmt_ms(a)} | {fmt_ms(b)} | {r2:.3f} | {guessed * 100:.0f} % "
            f"| {within2 * 100:.0f} % | {rel * 100:.0f} % |"
        )
    nmax = max(batches)
    load = list(range(1, nmax + 1))
    pad_blocks = sum(pow2_ceil(n) for n in load) / sum(load) - 1
    fixed_blocks = nmax * len(load) / sum(load) - 1
    buckets: dict[int, int] = {}
    for n in load:
        buckets[pow2_ceil(n)] = buckets.get(pow2_ceil(n), 0) + 1
    t_plain = sum(interpolate(timing, "offload", n) for n in load)
    t_pow2 = sum(interpolate(timing, "offload", pow2_ceil(n)) for n in load)
    t_fixed = sum(interpolate(timing, "offload", nmax) for n in load)
    print()
    print(
        f"Padding, for batch sizes uniform in 1..{nmax} (time: the offload medians above, "
        "linear between measured sizes):"
    )
    print()
    print(
        "| policy | extra bytes sealed, moved and stored | extra offload time | "
        "distinct sizes the host sees | batch-size entropy left |"
    )
    print("|---|---:|---:|---:|---:|")
    print(f"| none | 0 % | 0 % | {nmax} | {math.log2(nmax):.2f} bits |")
    print(
        f"| next power of two | {pad_blocks * 100:.0f} % | {(t_pow2 / t_plain - 1) * 100:.0f} % "
        f"| {len(buckets)} | {entropy_bits(list(buckets.values())):.2f} bits |"
    )
    print(
        f"| always {nmax} | {fixed_blocks * 100:.0f} % | {(t_fixed / t_plain - 1) * 100:.0f} % "
        f"| 1 | 0.00 bits |"
    )
    print()
    print(
        f"### 3. Prefix-hit probe ({pb_blocks}-block prompt, {rounds} probes per kind, "
        f"random order; ms)"
    )
    print()
    print("| who | probes | hit blocks | lookup p50 | lookup p10-p90 | lookup + restore p50 |")
    print("|---|---|---|---:|---|---:|")
    for p in probes:
        hits = sorted(set(p.hits))
        sl = sorted(p.lookup_s)
        print(
            f"| {p.who} | {p.name} | {','.join(map(str, hits))} | {fmt_ms(statistics.median(sl))}"
            f" | {fmt_ms(percentile(sl, 0.1))}-{fmt_ms(percentile(sl, 0.9))} | "
            f"{fmt_ms(statistics.median(p.total_s))} |"
        )
    cross = bootstrap_median_diff(probes[2].lookup_s, probes[3].lookup_s)
    cross_x = bootstrap_median_diff(probes[4].lookup_s, probes[3].lookup_s)
    within = bootstrap_median_diff(probes[0].total_s, probes[1].total_s)
    within_l = bootstrap_median_diff(probes[0].lookup_s, probes[1].lookup_s)
    print()
    print("| comparison | median difference µs | bootstrap 95 % interval µs |")
    print("|---|---:|---|")
    for label, (pt, lo, hi) in (
        ("attacker: victim's prompt vs never cached (lookup)", cross),
        ("attacker: victim's exact hashes vs never cached (lookup)", cross_x),
        ("victim: cached vs never cached (lookup only)", within_l),
        ("victim: cached vs never cached (lookup + restore)", within),
    ):
        print(f"| {label} | {pt * 1e6:+.0f} | {lo * 1e6:+.0f} to {hi * 1e6:+.0f} |")
    print()
    print("### 4. What Stats and /metrics expose")
    print()
    print("| /metrics family | labels (values seen) |")
    print("|---|---|")
    suspicious = []
    for name in sorted(fams):
        if not name.startswith("kvseal_"):
            continue
        labels = sorted(fams[name])
        for k, v in labels:
            if k != "le" and DIGEST_RE.match(v):
                suspicious.append(f"{name}{{{k}={v}}}")
        by_key: dict[str, list[str]] = {}
        for k, v in labels:
            if k != "le":
                by_key.setdefault(k, []).append(v)
        text = "; ".join(f"{k}: {', '.join(sorted(vs))}" for k, vs in sorted(by_key.items()))
        print(f"| `{name}` | {text or '—'} |")
    print()
    print(f"Label values that look like a hash or digest: {len(suspicious)} {suspicious or ''}")
    print(f"StatsReply fields: {', '.join(stats_fields)}")
    print()
    print("| attacker peer's Stats delta | scope | " + " | ".join(fields) + " |")
    print("|---|---|" + "---:|" * len(fields))
    for view, offloaded in d_off.items():
        for what, delta in (
            (f"victim offloads a {pb_blocks}-block prompt", offloaded),
            ("victim looks it up and restores it", d_hit[view]),
        ):
            print(
                f"| {what} (peer asks with {view}) | {scopes[view]} | "
                + " | ".join(str(delta[f]) for f in fields)
                + " |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
