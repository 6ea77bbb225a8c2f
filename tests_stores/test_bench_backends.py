"""``make bench``'s store backend rows (bench/store_backends.py), run small:
the table has the directory's rows and, per backend, a spill and a restore
row with kvseal's figure, the raw client's and their ratio, or one row
saying why that backend was skipped. Mooncake has two: its memory on a
separate node process (production's topology), and in the bench's process. A backend whose server this suite can
start (weed installed; mooncake_master inside netns.sh's namespace) must not
be skipped. Shape only: no figure is compared with a goal (the machine is
shared)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests_stores.conftest import MC_MASTER_IP, mooncake_binary, weed_binary

ROOT = Path(__file__).resolve().parents[1]
NUM = r"\d+\.\d{3}"
BACKEND = r"dir|s3|mooncake|mooncake \(memory in this process\)"
ROW = re.compile(rf"^\| ({BACKEND}) \| (.+?) \| ({NUM}) \| ({NUM}) \| (\d+\.\d\d) \((\d+\.\d\d)-(\d+\.\d\d)\) \|$")  # fmt: skip
SKIPPED = re.compile(rf"^\| ({BACKEND}) \| skipped: (.+?) \| \| \| \|$")


def test_store_backend_rows_have_their_shape() -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_cpu.py"), "--store-only", "--quick",
         "--reps", "1", "--store-blocks", "2", "--store-backend-blocks", "2"],
        cwd=ROOT, env=os.environ.copy(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    lines = r.stdout.splitlines()
    title = next(i for i, line in enumerate(lines) if line.startswith("Store backends: "))
    assert "goal >= 0.8" in lines[title]
    assert lines[title + 2] == "| backend | operation | kvseal GB/s | raw GB/s | ratio |"
    rows: dict[str, list[tuple[str, float, float, float]]] = {}
    skipped: dict[str, str] = {}
    for line in lines[title + 4 :]:
        if not line.startswith("|"):
            break
        m = ROW.match(line)
        if m:
            kvseal, raw, ratio = float(m[3]), float(m[4]), float(m[5])
            assert kvseal > 0 and raw > 0, line
            # One repetition: the ratio is kvseal / raw of that repetition
            # (within the rounding of the three printed figures).
            slack = 0.006 + ratio * (0.0006 / kvseal + 0.0006 / raw)
            assert abs(ratio - kvseal / raw) <= slack, line
            assert m[5] == m[6] == m[7], "min, median and max of one repetition"
            rows.setdefault(m[1], []).append((m[2], kvseal, raw, ratio))
            continue
        s = SKIPPED.match(line)
        assert s, f"neither a figure row nor a skip: {line}"
        skipped[s[1]] = s[2]
    assert len(rows["dir"]) == 2
    both_mooncakes = ("mooncake", "mooncake (memory in this process)")
    for backend in ("s3", *both_mooncakes):
        if backend in skipped:
            assert backend not in rows and skipped[backend].strip()
            continue
        ops = [op for op, *_ in rows[backend]]
        assert ops == ["spill (put) vs raw put", "restore (get) vs raw get"], ops
    # What this suite can start must have run.
    if weed_binary() is not None:
        assert "s3" in rows, skipped.get("s3")
    for backend in both_mooncakes:  # memory on a separate node process; in this one
        if MC_MASTER_IP and mooncake_binary() is not None:
            assert backend in rows, skipped.get(backend)
        else:
            assert backend in skipped, "no namespace here: skipped, with its reason"
