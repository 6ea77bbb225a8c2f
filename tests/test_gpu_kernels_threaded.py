"""The kernels' phases with real threads and concurrent CTAs (tests/kernels_threaded.cpp).

The sequential emulator runs one CTA after another, so it cannot show a race in the
cross-CTA reduction (atomic XORs, ticket, the last CTA's read-and-clear) or a missing
barrier inside a CTA. This harness runs every GPU thread as a host thread with
barriers at each ``__syncthreads()`` and several CTAs at once; the ThreadSanitizer
build reports any data race in the phase code. Each run checks ciphertext and tags
against a serial GCM, repeated launches on an unreset workspace, verify verdicts,
the all-or-nothing open after tampering, and that no key material is left in
shared memory.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CUDA_DIR = ROOT / "server" / "kvseal" / "server" / "backends" / "cuda"
SOURCE = ROOT / "tests" / "kernels_threaded.cpp"
GXX = shutil.which("g++")

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ is not installed")

# (seed, threads per CTA, AES blocks per thread per slice, launches, concurrent CTAs)
SHAPES = [
    (1, 32, 1, 3, 3),
    (2, 32, 4, 2, 4),
    (3, 64, 2, 2, 3),
    (4, 128, 1, 2, 2),
]
# Under TSan every memory access is instrumented: fewer, larger slices.
TSAN_SHAPES = [(5, 32, 4, 2, 4), (6, 64, 2, 1, 3)]


def _build(tmp: Path, *extra: str) -> Path | None:
    exe = tmp / ("kt" + "".join(e.strip("-=").replace("=", "") for e in extra))
    cmd = [str(GXX), "-std=c++17", "-O1", "-g", "-pthread", f"-I{CUDA_DIR}", *extra]
    r = subprocess.run(
        [*cmd, str(SOURCE), "-o", str(exe)], capture_output=True, text=True, timeout=180
    )
    if r.returncode != 0:
        if extra:
            return None  # the sanitizer runtime is not installed: caller skips
        raise AssertionError(r.stderr[-4000:])
    return exe


@pytest.fixture(scope="module")
def plain_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    exe = _build(tmp_path_factory.mktemp("kt"))
    assert exe is not None
    return exe


@pytest.fixture(scope="module")
def tsan_exe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    exe = _build(tmp_path_factory.mktemp("kt-tsan"), "-fsanitize=thread")
    if exe is None:
        pytest.skip("g++ cannot link -fsanitize=thread here (libtsan missing)")
    return exe


def _run(exe: Path, shape: tuple[int, ...]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(exe), *map(str, shape)],
        capture_output=True,
        text=True,
        timeout=300,
        env={"TSAN_OPTIONS": "halt_on_error=1 exitcode=66 report_signal_unsafe=0"},
    )


@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{s[1]}-J{s[2]}" for s in SHAPES])
def test_concurrent_ctas_match_serial_gcm(plain_exe: Path, shape: tuple[int, ...]) -> None:
    r = _run(plain_exe, shape)
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


@pytest.mark.parametrize("shape", TSAN_SHAPES, ids=[f"T{s[1]}-J{s[2]}" for s in TSAN_SHAPES])
def test_phase_code_has_no_data_race(tsan_exe: Path, shape: tuple[int, ...]) -> None:
    r = _run(tsan_exe, shape)
    assert "ThreadSanitizer" not in r.stderr, r.stderr[-6000:]
    assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


def test_no_atomics_build_matches_serial_gcm(tmp_path: Path) -> None:
    """The KVSEAL_KERNELS_SAFE=atomics build (``-DKVS_NO_ATOMICS``, plain workspace
    accesses, a block's slices in turn) gives the same bytes as a serial GCM."""
    exe = _build(tmp_path, "-DKVS_NO_ATOMICS=1")
    assert exe is not None
    for shape in SHAPES[:2]:
        r = _run(exe, shape)
        assert r.returncode == 0 and r.stdout.strip().endswith("OK"), r.stdout + r.stderr


def _build_variant(tmp: Path, name: str, edits: list[tuple[str, str]]) -> Path:
    """The harness with some lines replaced (each must be present), compiled."""
    text = SOURCE.read_text()
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    src = tmp / f"{name}.cpp"
    src.write_text(text)  # emulate.cpp comes from CUDA_DIR through -I
    exe = tmp / name
    subprocess.run(
        [str(GXX), "-std=c++17", "-O1", "-pthread", f"-I{CUDA_DIR}", str(src), "-o", str(exe)],
        check=True,
        capture_output=True,
        timeout=180,
    )
    return exe


def test_harness_catches_a_missing_barrier(tmp_path: Path) -> None:
    """The harness is able to fail: without the barrier between the hot loop and the
    reuse of the T0 area for the reduction tree, results go wrong (or TSan objects)."""
    main = "            kvs_phase_verify_main(p, *sh, st, g, tid, nthr);\n"
    finish = "        kvs_phase_finish(p, *sh, st, g, tid, k == K::verify);\n"
    exe = _build_variant(
        tmp_path,
        "kt-nobarrier",
        [
            (main + "        bar.wait();\n", main),
            # One barrier less per thread would deadlock the later barriers: give the
            # barrier count back at the very end instead, so only the ordering is lost.
            (finish, finish + "        bar.wait();\n"),
        ],
    )
    results = [_run(exe, (seed, 64, 1, 2, 3)) for seed in (11, 12, 13)]
    assert any(r.returncode != 0 for r in results), [r.stdout for r in results]


def test_harness_catches_key_material_left_in_shared_memory(tmp_path: Path) -> None:
    """The shared-memory wipe is checked (the same check fails the sequential
    emulator's launches): without open's final wipe, the run reports it."""
    exe = _build_variant(
        tmp_path, "kt-nowipe", [("            kvs_phase_open_wipe(*sh, tid, nthr);\n", "")]
    )
    r = _run(exe, (21, 32, 2, 1, 2))
    assert r.returncode == 1 and "open left key material" in r.stdout, r.stdout
