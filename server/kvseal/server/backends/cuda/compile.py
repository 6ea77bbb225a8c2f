"""Compile the kvseal kernels with NVRTC (cuda-python), with an on-disk cache.

cuda-python is an optional dependency (the ``cuda`` extra): it is imported lazily, and
everything here raises :class:`NvrtcUnavailable` when the bindings or the NVRTC library
are missing, so importing this module never fails. Compilation needs no GPU.

The cache key is (hash of kernels.cu and its headers, target, output kind, options, NVRTC
version); images are written to a temporary file and renamed into place, so concurrent
processes never see a partial file.

Every image carries line information (``-lineinfo``: compute-sanitizer and cuda-gdb
name source lines; the generated code is the same). ``KVSEAL_KERNELS_SAFE`` (read at
each compile, so by the daemon at start) builds a diagnostic variant, for bisecting a
kernel that gives wrong bytes on a GPU: ``vector`` turns off the 16-byte load/store
fast path (byte accesses only, ``KVS_NO_VECTOR_IO``), ``atomics`` the device atomics
(one CTA per block runs its slices in turn, ``KVS_NO_ATOMICS``), ``1`` or ``all``
both; unset, empty or ``0``: the normal build. The bytes produced are the same.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "DEFAULT_ARCH",
    "KERNEL_NAMES",
    "CompiledKernels",
    "NvrtcError",
    "NvrtcUnavailable",
    "compile_kernels",
    "safe_options",
    "kernel_sources",
    "nvrtc_version",
]

CUDA_DIR = Path(__file__).resolve().parent
MAIN_SOURCE = "kernels.cu"
HEADERS = ("kernels.cuh", "aesgcm.cuh")
DEFAULT_ARCH = "sm_90"
# extern "C" entry points of kernels.cu (launch shapes documented there).
KERNEL_NAMES = ("kvseal_key_setup", "kvseal_seal", "kvseal_verify", "kvseal_open")
BASE_OPTIONS = ("-std=c++17", "-lineinfo")
SAFE_ENV = "KVSEAL_KERNELS_SAFE"
# KVSEAL_KERNELS_SAFE's words -> the macros kernels.cuh / kernels.cu test.
SAFE_DEFINES = {"vector": "-DKVS_NO_VECTOR_IO=1", "atomics": "-DKVS_NO_ATOMICS=1"}

Output = Literal["cubin", "ptx"]


class NvrtcUnavailable(RuntimeError):
    """cuda-python or the NVRTC shared library cannot be loaded."""


class NvrtcError(RuntimeError):
    """NVRTC rejected the kernel source; the message carries the compile log."""


@dataclass(frozen=True)
class CompiledKernels:
    """A compiled module image (CUBIN or PTX) ready for cuModuleLoadData."""

    arch: str
    output: Output
    image: bytes
    nvrtc_version: tuple[int, int]
    log: str
    cached: bool


def kernel_sources() -> tuple[bytes, dict[str, bytes]]:
    """The kernel translation unit and the headers it includes (name -> bytes)."""
    return (CUDA_DIR / MAIN_SOURCE).read_bytes(), {h: (CUDA_DIR / h).read_bytes() for h in HEADERS}


def _nvrtc() -> Any:
    """Import the NVRTC bindings lazily (cuda-python 12.6+ / cuda-bindings)."""
    for name in ("cuda.bindings.nvrtc", "cuda.nvrtc"):  # new layout, then cuda-python < 12.6
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise NvrtcUnavailable("cuda-python is not installed (pip install 'kvseal-server[cuda]')")


def _check(result: Any, what: str) -> Any:
    """Unpack a cuda-python return tuple ``(err, *values)``, raising on error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise NvrtcError(f"{what} failed: {err!r}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library cuda-python loads."""
    nvrtc = _nvrtc()
    try:
        major, minor = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    except NvrtcError:
        raise
    except Exception as exc:  # the bindings raise RuntimeError & co. when libnvrtc is absent
        raise NvrtcUnavailable(f"the NVRTC library cannot be loaded: {exc}") from exc
    return int(major), int(minor)


def _cache_dir() -> Path:
    env = os.environ.get("KVSEAL_CACHE_DIR")
    if env:
        return Path(env) / "nvrtc"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvseal" / "nvrtc"


def _program_log(nvrtc: Any, prog: Any) -> str:
    size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    buf = _out_buffer(size)
    _check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
    return str(bytes(buf).rstrip(b"\0").decode(errors="replace").strip())


def _out_buffer(size: int) -> bytearray:
    """A writable buffer for NVRTC to fill (its ``char*`` outputs accept bytearray).

    Never ``b" " * size``, the idiom of cuda-python's samples: for size 1 (an empty
    compile log is just its NUL) that is CPython's shared one-byte ``b" "`` object,
    and NVRTC writing the NUL into it turns every ``b" "`` of the process into
    ``b"\\0"`` (print() then writes NULs for spaces, and so does every encoder)."""
    return bytearray(max(1, size))


def safe_options(value: str | None = None) -> tuple[str, ...]:
    """The NVRTC defines that ``value`` (default: ``$KVSEAL_KERNELS_SAFE``) asks for:
    none for unset, empty or ``0``; both for ``1`` or ``all``; else a comma-separated
    list of ``vector`` and ``atomics``. Raises :class:`NvrtcError` for anything else
    (the daemon then refuses to start, naming the variable)."""
    raw = os.environ.get(SAFE_ENV, "") if value is None else value
    words = {w.strip().lower() for w in raw.split(",")} - {""}
    if not words or words == {"0"}:
        return ()
    if words & {"1", "all"}:
        words = (words - {"1", "all"}) | set(SAFE_DEFINES)
    bad = words - set(SAFE_DEFINES)
    if bad:
        raise NvrtcError(
            f"{SAFE_ENV}={raw!r}: unknown {', '.join(sorted(bad))}; use 1, all, or a "
            f"comma-separated list of {', '.join(SAFE_DEFINES)}"
        )
    return tuple(SAFE_DEFINES[w] for w in SAFE_DEFINES if w in words)


def compile_kernels(
    arch: str = DEFAULT_ARCH,
    *,
    output: Output = "cubin",
    options: tuple[str, ...] = (),
    cache_dir: Path | None = None,
    use_cache: bool = True,
) -> CompiledKernels:
    """Compile kernels.cu for ``arch`` (``sm_90``, ``sm_100``, ...) to CUBIN or PTX.

    CUBIN targets exactly ``arch``; PTX targets the matching virtual architecture
    (``compute_90``), which the driver JIT-compiles for newer GPUs. The options are
    :data:`BASE_OPTIONS`, the target, :func:`safe_options` and ``options``. Raises
    :class:`NvrtcUnavailable` without cuda-python/NVRTC and :class:`NvrtcError` (with
    the compile log) when compilation fails. Cache failures are ignored (the image
    is then simply recompiled next time).
    """
    if not arch.startswith("sm_") or not arch[3:].rstrip("af").isdigit():
        raise ValueError(f"arch must look like sm_90, got {arch!r}")
    if output not in ("cubin", "ptx"):
        raise ValueError("output must be 'cubin' or 'ptx'")
    target = arch if output == "cubin" else "compute_" + arch[3:]
    opts = (*BASE_OPTIONS, f"--gpu-architecture={target}", *safe_options(), *options)
    version = nvrtc_version()
    source, headers = kernel_sources()
    key = hashlib.sha256()
    for part in (source, *headers.values()):
        key.update(hashlib.sha256(part).digest())
    key.update(repr((target, output, opts, version)).encode())
    directory = cache_dir or _cache_dir()
    path = directory / f"kernels-{target}-{key.hexdigest()[:24]}.{output}"
    if use_cache and path.is_file():
        return CompiledKernels(arch, output, path.read_bytes(), version, "", cached=True)

    nvrtc = _nvrtc()
    prog = _check(
        nvrtc.nvrtcCreateProgram(
            source,
            MAIN_SOURCE.encode(),
            len(headers),
            list(headers.values()),
            [h.encode() for h in headers],
        ),
        "nvrtcCreateProgram",
    )
    try:
        encoded = [o.encode() for o in opts]
        err, *_ = nvrtc.nvrtcCompileProgram(prog, len(encoded), encoded)
        log = _program_log(nvrtc, prog)
        if int(err) != 0:
            raise NvrtcError(f"NVRTC compile of {MAIN_SOURCE} for {target} failed:\n{log}")
        if output == "cubin":
            size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
            out = _out_buffer(size)
            _check(nvrtc.nvrtcGetCUBIN(prog, out), "nvrtcGetCUBIN")
        else:
            size = _check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            out = _out_buffer(size)
            _check(nvrtc.nvrtcGetPTX(prog, out), "nvrtcGetPTX")
        # PTX comes NUL-terminated; keep the text clean (ptxas rejects the NUL in a
        # cached .ptx file), the loader adds the terminator back.
        image = bytes(out) if output == "cubin" else bytes(out).rstrip(b"\0")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)

    if use_cache:
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # code we will run
            fd, tmp = tempfile.mkstemp(prefix=".kernels-", dir=directory)
            with os.fdopen(fd, "wb") as f:
                f.write(image)
            os.replace(tmp, path)
        except OSError:
            pass
    return CompiledKernels(arch, output, image, version, log, cached=False)
