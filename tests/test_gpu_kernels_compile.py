"""The kernels compile for the GPU: with NVRTC (cuda-python) and with nvcc, no GPU needed.

Each test skips with its reason when its tool is absent (CI machines may lack both).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from kvseal.server.backends.cuda import compile as kc

CUDA_DIR = Path(kc.__file__).resolve().parent


def _nvrtc_or_skip() -> tuple[int, int]:
    try:
        return kc.nvrtc_version()
    except kc.NvrtcUnavailable as exc:
        pytest.skip(f"NVRTC unavailable: {exc}")


def test_nvrtc_compiles_cubin_for_sm90_and_caches(tmp_path: Path) -> None:
    version = _nvrtc_or_skip()
    first = kc.compile_kernels("sm_90", cache_dir=tmp_path)
    assert not first.cached and first.nvrtc_version == version
    assert first.image.startswith(b"\x7fELF")
    for name in kc.KERNEL_NAMES:
        assert name.encode() in first.image
    again = kc.compile_kernels("sm_90", cache_dir=tmp_path)
    assert again.cached and again.image == first.image
    assert len(list(tmp_path.iterdir())) == 1


ATOMIC = re.compile(rb"\batom\.")
VECTOR_IO = re.compile(rb"\b(?:ld|st)\.global[.\w]*\.v4\b")
LINE_INFO = re.compile(rb"^\s*\.loc\s", re.M)


def test_nvrtc_ptx_has_all_entry_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _nvrtc_or_skip()
    monkeypatch.delenv(kc.SAFE_ENV, raising=False)
    ptx = kc.compile_kernels("sm_90", output="ptx", cache_dir=tmp_path).image
    entries = set(re.findall(rb"\.entry\s+(\w+)", ptx))
    assert entries == {n.encode() for n in kc.KERNEL_NAMES}
    assert b".target sm_90" in ptx
    # The normal build: device atomics, 16-byte loads and stores, and line info.
    assert ATOMIC.search(ptx) and VECTOR_IO.search(ptx)
    assert LINE_INFO.search(ptx), "no -lineinfo"


def test_safe_switch_builds_without_vector_io_or_atomics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVSEAL_KERNELS_SAFE=1: the PTX has no atomic and no 16-byte global access,
    keeps every entry point and the line info, is cached apart from the normal
    build, and ptxas turns it into a CUBIN."""
    _nvrtc_or_skip()
    monkeypatch.setenv(kc.SAFE_ENV, "1")
    ptx = kc.compile_kernels("sm_90", output="ptx", cache_dir=tmp_path).image
    assert not ATOMIC.search(ptx) and not VECTOR_IO.search(ptx)
    assert set(re.findall(rb"\.entry\s+(\w+)", ptx)) == {n.encode() for n in kc.KERNEL_NAMES}
    assert LINE_INFO.search(ptx)
    monkeypatch.setenv(kc.SAFE_ENV, "vector")
    vec = kc.compile_kernels("sm_90", output="ptx", cache_dir=tmp_path).image
    assert ATOMIC.search(vec) and not VECTOR_IO.search(vec)
    monkeypatch.setenv(kc.SAFE_ENV, "all")
    cubin = kc.compile_kernels("sm_90", cache_dir=tmp_path)
    assert cubin.image.startswith(b"\x7fELF") and not cubin.cached
    assert len(list(tmp_path.iterdir())) == 3


def test_safe_switch_values() -> None:
    both = ("-DKVS_NO_VECTOR_IO=1", "-DKVS_NO_ATOMICS=1")
    assert kc.safe_options("") == kc.safe_options("0") == kc.safe_options(" , ") == ()
    assert kc.safe_options("1") == kc.safe_options("ALL") == kc.safe_options("atomics,vector")
    assert kc.safe_options("1") == both
    assert kc.safe_options("vector") == both[:1] and kc.safe_options("atomics") == both[1:]
    with pytest.raises(kc.NvrtcError, match="KVSEAL_KERNELS_SAFE='fast': unknown fast"):
        kc.safe_options("fast")


def test_nvrtc_reports_compile_errors(tmp_path: Path) -> None:
    _nvrtc_or_skip()
    with pytest.raises(kc.NvrtcError, match="failed"):
        kc.compile_kernels(
            "sm_90", options=("--pre-include=kvseal_no_such_header.h",), cache_dir=tmp_path
        )


def test_compile_rejects_bad_arch() -> None:
    with pytest.raises(ValueError):
        kc.compile_kernels("compute_90")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_nvcc_compiles_sm90_without_spills(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            "nvcc",
            "-arch=sm_90",
            "-c",
            "-Xptxas",
            "-v",
            str(CUDA_DIR / "kernels.cu"),
            "-o",
            str(tmp_path / "kernels.o"),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    # Spilling the hot loop to local memory would quietly cost a lot of bandwidth.
    spills = re.findall(r"(\d+) bytes spill stores", proc.stderr)
    assert spills and all(s == "0" for s in spills), proc.stderr


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
def test_emulator_builds_warning_free(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            "g++",
            "-O2",
            "-std=c++17",
            "-fPIC",
            "-shared",
            "-Wall",
            "-Wextra",
            "-Werror",
            str(CUDA_DIR / "emulate.cpp"),
            "-o",
            str(tmp_path / "emu.so"),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
