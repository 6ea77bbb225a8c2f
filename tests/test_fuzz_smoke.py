"""Smoke run of the fuzz suite (``make fuzz`` runs 100,000 requests; this runs
5,000): a real daemon over its real Unix socket, valid, invalid and mutated
calls on several pools and tenants, then the end-of-run checks. Also checks
the fuzzer's own parts: the wire helpers and that its verdicts can fail."""

from __future__ import annotations

import random
import re
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError
from kvseal.v1 import kvseal_pb2 as pb

from .suites import protowire as pw
from .suites.fuzz import Fuzzer, Result, run_fuzz


def test_fuzz_smoke_5000_requests(tmp_path: Path) -> None:
    lines: list[str] = []
    passed, failed = run_fuzz(5_000, seed=7, threads=4, workdir=tmp_path, log=lines.append)
    out = "\n".join(lines)
    assert failed == 0, out
    assert re.search(rf"^{passed} passed, 0 failed$", out, re.M), out
    sent = re.search(r"^kvseal fuzz: ([\d,]+) requests in", out, re.M)
    assert sent is not None and int(sent.group(1).replace(",", "")) >= 5_000, out
    # Every class of request was sent and every end-of-run check ran.
    for row in ("valid", "invalid", "mutated", "final"):
        assert re.search(rf"^{row}\s+[\d,]+\s+0$", out, re.M), out
    for check in (
        "every READY reference block restores byte-exact",
        "Stats.offloaded_blocks == sum over replies",
        "SIGTERM: daemon exits 0",
        "no page written except by its own successful restore",
    ):
        assert re.search(rf"^{re.escape(check)}\s+PASS", out, re.M), out


def test_wire_split_join_round_trips_real_messages() -> None:
    rnd = random.Random(3)
    msg = pb.OffloadRequest(
        pool_id="p#1",
        tenant=rnd.randbytes(32),
        block_hashes=[rnd.randbytes(32)] * 3,
        page_ids=[1, 2, 2**32 - 1],
        grace_ms=1000,
        budget_us=2**40,
    )
    data = msg.SerializeToString()
    fields = pw.split(data)
    assert fields is not None and pw.join(fields) == data
    assert {f.number for f in fields} == {1, 2, 4, 5, 7, 8}


def test_mutators_never_raise_and_the_parser_is_the_oracle() -> None:
    rnd = random.Random(5)
    base = pb.LookupRequest(pool_id="p#1", tenant=bytes(32), block_hashes=[bytes(32)])
    data = base.SerializeToString()
    undecodable = 0
    for _ in range(3_000):
        out, names = pw.mutate(rnd, data)
        assert isinstance(out, bytes) and names
        try:
            pb.LookupRequest.FromString(out)
        except DecodeError:
            undecodable += 1
    assert 0 < undecodable < 3_000
    # A cut inside a length-delimited payload never parses; non-UTF-8 in a string neither.
    for raw in (data[:-1], pw.field(1, pw.LEN, b"\xff") + data):
        try:
            pb.LookupRequest.FromString(raw)
            raise AssertionError("parsed")
        except DecodeError:
            pass


def test_verdicts_can_fail(tmp_path: Path) -> None:
    fz = Fuzzer(tmp_path, 1, 1, 1, log=lambda _: None)
    ok = frozenset({(grpc.StatusCode.OK, "")})
    fz._record("Lookup", "valid", Result(grpc.StatusCode.OK, "", b""), ok, "fine")
    fz._record("Lookup", "valid", Result(grpc.StatusCode.INTERNAL, "INTERNAL_ERROR", None), ok, "x")
    fz._record("Stats", "mutated", Result(grpc.StatusCode.UNKNOWN, "", None), None, "y")
    failed = {c.name for c in fz.checks.values() if c.failed}
    assert failed == {
        "no INTERNAL status",
        "no UNKNOWN status (unhandled exception)",
        "valid calls get their documented status",
    }
    _, nfailed = fz.report(1.0)
    assert nfailed == 3
