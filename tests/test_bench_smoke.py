"""Smoke test of the CPU benchmark (``make bench``): it starts a real daemon,
moves real Qwen3-32B-sized blocks, and prints its table. Only that it runs
and reports is asserted, never a speed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "bench_cpu.py"


def test_bench_cpu_quick_runs_and_prints_the_table() -> None:
    with subprocess.Popen(
        [sys.executable, str(BENCH), "--quick"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as child:
        out, err = child.communicate(timeout=240)
    proc = subprocess.CompletedProcess(child.args, child.returncode, out, err)
    assert proc.returncode == 0, f"rc={proc.returncode}\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    lines = out.splitlines()
    assert "## kvseal CPU backend benchmark" in lines
    title = lines.index("## kvseal CPU backend benchmark")
    # The header says where it ran (CPU model and core count), no hostname.
    assert any(re.match(r"^CPU: .+, \d+ cores", line) for line in lines[title:])
    assert os.uname().nodename not in out
    # Both tables, with a row per batch and both sockets.
    assert any(line.startswith("| batch | bytes | sealed offload GB/s") for line in lines)
    assert sum(1 for line in lines if re.match(r"^\| \d+ blocks \| \d+ MiB \|", line)) == 2
    # The copies-alone bounds (cpu_floor.py): a ratio cell per design, per batch.
    floor = next(i for i, line in enumerate(lines) if line.startswith("| batch | offload copies"))
    floor_rows = lines[floor + 2 : floor + 4]
    cell = r"\d+\.\d\d \(\d+\.\d\d-\d+\.\d\d\)"
    assert all(re.fullmatch(rf"\| \d+ blocks( \| {cell}){{5}} \|", r) for r in floor_rows), (
        floor_rows
    )
    # The round-trip table: the bare echo is its reference row, then Lookup through
    # the public socket in both socket modes, with ratios, all from this run.
    header = lines.index("| round trip | p50 µs | p99 µs | p50 / echo p50 |")
    rows = lines[header + 2 :]
    assert rows[0].startswith("| bare grpcio unary echo") and rows[0].endswith(" 1.00 |")
    assert rows[1].startswith("| Lookup (1 hash), public socket, owner-only")
    assert rows[2].startswith("| Lookup (1 hash), public socket, --socket-group")
    assert all(re.search(r"\| \d+ \| \d+ \| \d+\.\d\d \|$", r) for r in rows[:4])
    # The table comes last.
    assert lines[-1].startswith("| relay cost ")
    # The daemon was stopped and the pool's shared memory was unlinked.
    assert not re.search(r"daemon exited with -?\d+", proc.stderr)
    # (Its pool's names carry its pid: another session's benchmark is not ours.)
    if os.path.isdir("/dev/shm"):
        mine = f"kvseal-bench-{child.pid}"
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(mine)]


def test_leak_surface_quick_runs() -> None:
    """``make leak-surface ARGS=--quick`` runs against a real daemon and
    prints its report (the figures themselves live in docs/threat-model.md)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, str(root / "bench" / "leak_surface.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "## kvseal leak surface" in out.stdout


def test_bench_gpu_runs_every_section_on_the_emulator() -> None:
    """``bench/bench_gpu.py --emulate`` drives the CUDA backend on the CPU
    emulator through every section and prints its table last: a smoke test of
    the script (its figures mean nothing here; the device check runs it on a GPU)."""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, str(root / "bench" / "bench_gpu.py"), "--emulate", "--quick"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stdout.splitlines()
    title = lines.index("## kvseal GPU benchmark: CPU emulator (numbers meaningless)")
    rows = [line for line in lines[title:] if line.startswith("| ") and "---" not in line]
    assert not [r for r in rows if "FAILED" in r or "SKIPPED" in r or "INVALID" in r], rows
    # What seal wrote verified, and every section reached the table.
    assert any(
        r.startswith("| kernel verify of what seal wrote: ok[] flags | 8/8 ok |") for r in rows
    )
    for name in ("sealed restore host to GPU", "fixed cost per restore request", "classic CC path"):
        assert any(r.startswith(f"| {name}") for r in rows), name
    assert lines[-1].startswith("| sealed offload, kernel writes mapped host memory |")
