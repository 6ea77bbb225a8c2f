"""CPU emulation of the kvseal GPU kernels, for tests and for machines without a GPU.

``emulate.cpp`` includes the same ``aesgcm.cuh``/``kernels.cuh`` as the CUDA kernels and
runs the whole grid on one host thread, phase by phase (see docs/gpu-kernels.md). This
module builds it with g++ on first use into a per-user cache directory keyed by the hash
of the sources (never into the source tree), loads it with :mod:`ctypes`, and exposes
typed wrappers.

The ctypes mirrors of the launch descriptors (:class:`KvsBatch`, :class:`KvsSegment`,
:class:`KvsBlockWs`, :class:`KvsKeyCtx`) and :func:`make_batch` take plain integer
addresses, so a GPU launcher fills the very same structures with device pointers.

Buffer ownership: every function borrows the buffers it is given for the duration of the
call only; nothing is retained. Output buffers must be writable (``bytearray`` or a
writable contiguous ``memoryview``). Failure behaviour: malformed arguments raise
:class:`ValueError` before any memory is touched; a missing compiler raises
:class:`EmulatorUnavailable`; an authentication failure is a result (``False`` / ``None``),
never an exception.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "AAD_BYTES",
    "KEY_BYTES",
    "MAX_BLOCK_BYTES",
    "NONCE_BYTES",
    "TAG_BYTES",
    "Emulator",
    "EmulatorUnavailable",
    "KeyContext",
    "KvsBatch",
    "KvsBlockWs",
    "KvsKeyCtx",
    "KvsSegment",
    "LaunchConfig",
    "Pool",
    "Segment",
    "build_library",
    "load_emulator",
    "make_batch",
    "segment_table",
]

CUDA_DIR = Path(__file__).resolve().parent
SOURCES = ("aesgcm.cuh", "kernels.cuh", "emulate.cpp")
CXXFLAGS = ("-O2", "-std=c++17", "-fPIC", "-shared")
ABI_VERSION = 1

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
AAD_BYTES = 112
MAX_BLOCK_BYTES = (1 << 27) - 1  # KVS_MAX_BLOCK_BYTES - 1: keeps H exponents < 2^24

Buffer = bytearray | memoryview


class EmulatorUnavailable(RuntimeError):
    """The emulation library cannot be built or loaded (no C++ compiler, ABI mismatch)."""


# --------------------------------------------------------------------------------------
# ctypes mirrors of kernels.cuh (checked against the C sizeof at load time)
# --------------------------------------------------------------------------------------


class KvsKeyCtx(ctypes.Structure):
    """``struct KvsKeyCtx``: round keys, T0 and powers of H. Secret; wipe after use."""

    _fields_ = (
        ("rk", ctypes.c_uint32 * 60),
        ("t0", ctypes.c_uint32 * 256),
        ("hpow", ctypes.c_uint64 * (6 * 16 * 2)),
    )


class KvsSegment(ctypes.Structure):
    """``struct KvsSegment``: one contiguous run of a page inside one pool buffer."""

    _fields_ = (
        ("buffer", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("offset", ctypes.c_uint64),
        ("page_stride", ctypes.c_uint64),
        ("bytes", ctypes.c_uint64),
        ("block_offset", ctypes.c_uint64),
    )


class KvsBlockWs(ctypes.Structure):
    """``struct KvsBlockWs``: per-block tag-reduction scratch; zero before a launch."""

    _fields_ = (
        ("acc", ctypes.c_uint64 * 2),
        ("count", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    )


class KvsBatch(ctypes.Structure):
    """``struct KvsBatch``: the single by-value parameter of seal/verify/open.

    Pointer fields are plain ``uint64`` addresses: host addresses for the emulator,
    device addresses for the GPU kernels.
    """

    _fields_ = (
        ("key", ctypes.c_uint64),
        ("buffers", ctypes.c_uint64),
        ("segments", ctypes.c_uint64),
        ("pages", ctypes.c_uint64),
        ("nonces", ctypes.c_uint64),
        ("aads", ctypes.c_uint64),
        ("staging", ctypes.c_uint64),
        ("staging_offsets", ctypes.c_uint64),
        ("tags", ctypes.c_uint64),
        ("ok", ctypes.c_uint64),
        ("ws", ctypes.c_uint64),
        ("block_bytes", ctypes.c_uint64),
        ("num_segments", ctypes.c_uint32),
        ("num_blocks", ctypes.c_uint32),
        ("threads_per_cta", ctypes.c_uint32),
        ("slice_blocks", ctypes.c_uint32),
        ("ctas_per_block", ctypes.c_uint32),
        ("all_or_nothing", ctypes.c_uint32),
    )


_STRUCTS: tuple[type[ctypes.Structure], ...] = (KvsKeyCtx, KvsSegment, KvsBlockWs, KvsBatch)

_ERRORS = {
    -1: "null pointer in descriptor",
    -2: "threads_per_cta must be a power of two in [32, 1024]",
    -3: "slice_blocks must be a positive multiple of threads_per_cta",
    -4: "ctas_per_block does not match block_bytes and slice_blocks",
    -5: "block too large",
    -6: "no segments",
    -7: "a CTA left key material in shared memory (emulator check)",
}


# --------------------------------------------------------------------------------------
# Descriptors
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """One segment of the pool geometry (bytes at ``offset + page * page_stride``)."""

    buffer: int
    offset: int
    page_stride: int
    bytes: int


@dataclass(frozen=True)
class LaunchConfig:
    """Launch shape: ``threads`` per CTA and ``slice_blocks`` AES blocks per CTA.

    Defaults (256 threads, 64 blocks per thread = 256 KiB per CTA, 16 CTAs for a 4 MiB
    block) amortise the per-CTA setup; they are a starting point, not a measurement.
    """

    threads: int = 256
    slice_blocks: int = 256 * 64

    def __post_init__(self) -> None:
        t = self.threads
        if t < 32 or t > 1024 or t & (t - 1):
            raise ValueError(f"threads must be a power of two in [32, 1024], got {t}")
        if self.slice_blocks <= 0 or self.slice_blocks % t or self.slice_blocks >= 1 << 31:
            raise ValueError("slice_blocks must be a positive multiple of threads")

    def ctas_per_block(self, block_bytes: int) -> int:
        """CTAs per sealed block: one per slice, at least one."""
        m = (block_bytes + 15) // 16
        return max(1, -(-m // self.slice_blocks))


def segment_table(segments: Sequence[Segment]) -> tuple[ctypes.Array[KvsSegment], int]:
    """Pack segments into a C array (with prefix-sum ``block_offset``); return it and the
    block size. Raises ValueError for an empty table, empty segments or too large blocks."""
    if not segments:
        raise ValueError("at least one segment is required")
    table = (KvsSegment * len(segments))()
    total = 0
    for i, s in enumerate(segments):
        if s.bytes <= 0 or s.offset < 0 or s.page_stride < 0 or not 0 <= s.buffer < 2**32:
            raise ValueError(f"invalid segment {i}: {s}")
        table[i] = KvsSegment(s.buffer, 0, s.offset, s.page_stride, s.bytes, total)
        total += s.bytes
    if total > MAX_BLOCK_BYTES:
        raise ValueError(f"block of {total} bytes exceeds {MAX_BLOCK_BYTES}")
    return table, total


def make_batch(
    *,
    key: int,
    buffers: int,
    segments: int,
    pages: int,
    nonces: int,
    aads: int,
    staging: int,
    staging_offsets: int,
    tags: int,
    ok: int,
    ws: int,
    block_bytes: int,
    num_segments: int,
    num_blocks: int,
    config: LaunchConfig,
    all_or_nothing: bool = False,
) -> KvsBatch:
    """Fill a :class:`KvsBatch` from addresses (host or device) and a launch shape."""
    return KvsBatch(
        key,
        buffers,
        segments,
        pages,
        nonces,
        aads,
        staging,
        staging_offsets,
        tags,
        ok,
        ws,
        block_bytes,
        num_segments,
        num_blocks,
        config.threads,
        config.slice_blocks,
        config.ctas_per_block(block_bytes),
        1 if all_or_nothing else 0,
    )


@dataclass(frozen=True)
class Pool:
    """Host stand-in for the engine's KV pool: buffers plus the segment geometry."""

    buffers: Sequence[Buffer]
    segments: Sequence[Segment]


class KeyContext:
    """A derived key context (``KvsKeyCtx``) in host memory. Call :meth:`wipe` when done."""

    def __init__(self, raw: KvsKeyCtx) -> None:
        self.raw = raw

    def wipe(self) -> None:
        """Overwrite the round keys and powers of H with zeros."""
        ctypes.memset(ctypes.addressof(self.raw), 0, ctypes.sizeof(self.raw))


# --------------------------------------------------------------------------------------
# Building and loading
# --------------------------------------------------------------------------------------


def _cache_dir() -> Path:
    env = os.environ.get("KVSEAL_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "kvseal"


def build_library(cache_dir: Path | None = None, cxx: str | None = None) -> Path:
    """Compile emulate.cpp into ``<cache>/emulate-<hash>.so`` unless already there.

    The file name hashes the sources, compiler and flags, so an edited header never
    loads a stale library. The build goes to a temporary file that is renamed into
    place, so concurrent builders (pytest-xdist) are safe. Raises EmulatorUnavailable
    when no compiler is found or the build fails.
    """
    compiler = cxx or os.environ.get("CXX") or "g++"
    exe = shutil.which(compiler)
    if exe is None:
        raise EmulatorUnavailable(f"C++ compiler {compiler!r} not found")
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update(name.encode() + b"\0" + (CUDA_DIR / name).read_bytes() + b"\0")
    digest.update(" ".join((compiler, *CXXFLAGS)).encode())
    target_dir = cache_dir or _cache_dir()
    try:
        target_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        target_dir = Path(tempfile.gettempdir()) / f"kvseal-{os.getuid()}"
        target_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    target = target_dir / f"emulate-{digest.hexdigest()[:24]}.so"
    if target.exists():
        return target
    fd, tmp = tempfile.mkstemp(prefix=".emulate-", suffix=".so", dir=target_dir)
    os.close(fd)
    cmd = [exe, *CXXFLAGS, "-o", tmp, str(CUDA_DIR / "emulate.cpp")]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=300)
        if proc.returncode != 0:
            raise EmulatorUnavailable(f"building the emulator failed:\n{proc.stderr}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


_P = ctypes.c_void_p
_U64 = ctypes.c_ulonglong


class Emulator:
    """The loaded emulation library. Prefer :func:`load_emulator` (cached)."""

    def __init__(self, path: Path | None = None) -> None:
        lib = ctypes.CDLL(str(path or build_library()))
        lib.kvseal_emu_abi_version.restype = ctypes.c_uint
        lib.kvseal_emu_sizeof.restype = ctypes.c_ulonglong
        lib.kvseal_emu_sizeof.argtypes = (ctypes.c_int,)
        for name in ("kvseal_emu_seal", "kvseal_emu_verify", "kvseal_emu_open"):
            getattr(lib, name).argtypes = (ctypes.POINTER(KvsBatch), _U64)
            getattr(lib, name).restype = ctypes.c_int
        lib.kvseal_emu_check.argtypes = (ctypes.POINTER(KvsBatch),)
        lib.kvseal_emu_key_setup.argtypes = (_P, ctypes.POINTER(KvsKeyCtx))
        lib.kvseal_emu_gcm_seal.argtypes = (_P, _P, _P, _U64, _P, _U64, _P, _P)
        lib.kvseal_emu_gcm_open.argtypes = (_P, _P, _P, _U64, _P, _U64, _P, ctypes.c_uint, _P)
        if lib.kvseal_emu_abi_version() != ABI_VERSION:
            raise EmulatorUnavailable("emulator ABI version mismatch")
        for i, struct in enumerate(_STRUCTS):
            if lib.kvseal_emu_sizeof(i) != ctypes.sizeof(struct):
                raise EmulatorUnavailable(f"ctypes layout of {struct.__name__} != C layout")
        self._lib = lib

    # -- single message (known-answer tests) ------------------------------------------

    def gcm_seal(self, key: bytes, nonce: bytes, aad: bytes, plaintext: bytes) -> bytes:
        """AES-256-GCM encrypt one message; returns ciphertext || 16-byte tag (like
        ``AESGCM.encrypt``). Serial; for known-answer tests."""
        _check_len("key", key, KEY_BYTES)
        _check_len("nonce", nonce, NONCE_BYTES)
        out = ctypes.create_string_buffer(len(plaintext) + TAG_BYTES)
        rc = self._lib.kvseal_emu_gcm_seal(
            key,
            nonce,
            aad,
            len(aad),
            plaintext,
            len(plaintext),
            out,
            ctypes.addressof(out) + len(plaintext),
        )
        _raise_for(rc)
        return out.raw

    def gcm_open(
        self, key: bytes, nonce: bytes, aad: bytes, ciphertext: bytes, tag: bytes
    ) -> bytes | None:
        """Verify (constant time, tags of 1..16 bytes compare as a prefix) and decrypt one
        message. Returns the plaintext, or None when the tag does not match."""
        _check_len("key", key, KEY_BYTES)
        _check_len("nonce", nonce, NONCE_BYTES)
        if not 1 <= len(tag) <= TAG_BYTES:
            raise ValueError("tag must be 1..16 bytes")
        out = ctypes.create_string_buffer(max(1, len(ciphertext)))
        rc = self._lib.kvseal_emu_gcm_open(
            key, nonce, aad, len(aad), ciphertext, len(ciphertext), tag, len(tag), out
        )
        _raise_for(rc)
        return out.raw[: len(ciphertext)] if rc == 1 else None

    # -- batch kernels ----------------------------------------------------------------

    def key_setup(self, key: bytes) -> KeyContext:
        """Derive the key context the kernels take (what ``kvseal_key_setup`` computes
        on the GPU)."""
        _check_len("key", key, KEY_BYTES)
        raw = KvsKeyCtx()
        _raise_for(self._lib.kvseal_emu_key_setup(key, ctypes.byref(raw)))
        return KeyContext(raw)

    def seal(
        self,
        key: KeyContext,
        pool: Pool,
        *,
        pages: Sequence[int],
        nonces: Sequence[bytes],
        aads: Sequence[bytes],
        staging: Buffer,
        staging_offsets: Sequence[int],
        config: LaunchConfig = LaunchConfig(),
        order_seed: int = 0,
    ) -> list[bytes]:
        """Emulate ``kvseal_seal``: gather block i from ``pages[i]`` of the pool, encrypt
        it into ``staging[staging_offsets[i]:][:block_bytes]`` and return the 16-byte
        tags. ``order_seed`` != 0 runs the CTAs in a shuffled order."""
        call = _Call(key, pool, pages, nonces, aads, staging, staging_offsets, config, None, None)
        call.run(self._lib.kvseal_emu_seal, order_seed)
        return [call.tags.raw[16 * i : 16 * i + 16] for i in range(call.num_blocks)]

    def verify(
        self,
        key: KeyContext,
        pool: Pool,
        *,
        pages: Sequence[int],
        nonces: Sequence[bytes],
        aads: Sequence[bytes],
        staging: Buffer,
        staging_offsets: Sequence[int],
        tags: Sequence[bytes],
        config: LaunchConfig = LaunchConfig(),
        order_seed: int = 0,
    ) -> list[bool]:
        """Emulate ``kvseal_verify``: recompute each block's tag over its staged
        ciphertext and compare it (constant time) with ``tags[i]``. Reads only."""
        call = _Call(key, pool, pages, nonces, aads, staging, staging_offsets, config, tags, None)
        call.run(self._lib.kvseal_emu_verify, order_seed)
        return [bool(call.ok[i]) for i in range(call.num_blocks)]

    def open(
        self,
        key: KeyContext,
        pool: Pool,
        *,
        pages: Sequence[int],
        nonces: Sequence[bytes],
        aads: Sequence[bytes],
        staging: Buffer,
        staging_offsets: Sequence[int],
        ok: Sequence[bool],
        all_or_nothing: bool = False,
        config: LaunchConfig = LaunchConfig(),
        order_seed: int = 0,
    ) -> None:
        """Emulate ``kvseal_open``: decrypt block i into ``pages[i]`` iff ``ok[i]`` (and,
        with ``all_or_nothing``, only if every ``ok`` is true). Pages of blocks that are
        not written keep their previous contents byte for byte."""
        call = _Call(key, pool, pages, nonces, aads, staging, staging_offsets, config, None, ok)
        call.batch.all_or_nothing = 1 if all_or_nothing else 0
        call.run(self._lib.kvseal_emu_open, order_seed)


@functools.lru_cache(maxsize=1)
def load_emulator() -> Emulator:
    """Build (if needed) and load the emulator once per process."""
    return Emulator()


# --------------------------------------------------------------------------------------
# Internals
# --------------------------------------------------------------------------------------


def _check_len(name: str, value: bytes, n: int) -> None:
    if len(value) != n:
        raise ValueError(f"{name} must be {n} bytes, got {len(value)}")


def _raise_for(rc: int) -> None:
    if rc < 0:
        raise ValueError(_ERRORS.get(rc, f"emulator error {rc}"))


def _address(buf: Buffer, keep: list[object]) -> int:
    """Address of a writable contiguous buffer (kept alive through ``keep``)."""
    view = memoryview(buf)
    if view.readonly or not view.contiguous:
        raise ValueError("buffers must be writable and contiguous")
    arr = (ctypes.c_char * max(1, view.nbytes)).from_buffer(view if view.nbytes else bytearray(1))
    keep.append(arr)
    return ctypes.addressof(arr)


class _Call:
    """Host arrays for one emulated launch, validated so the C side stays in bounds."""

    def __init__(
        self,
        key: KeyContext,
        pool: Pool,
        pages: Sequence[int],
        nonces: Sequence[bytes],
        aads: Sequence[bytes],
        staging: Buffer,
        staging_offsets: Sequence[int],
        config: LaunchConfig,
        tags: Sequence[bytes] | None,
        ok: Sequence[bool] | None,
    ) -> None:
        n = len(pages)
        if not 0 < n < 2**31:
            raise ValueError("need at least one block")
        if not len(nonces) == len(aads) == len(staging_offsets) == n:
            raise ValueError("pages, nonces, aads and staging_offsets differ in length")
        seg_table, block_bytes = segment_table(pool.segments)
        keep: list[object] = []
        # Bounds: every byte the kernels touch must lie inside the caller's buffers.
        if min(pages) < 0:
            raise ValueError("page ids must be >= 0")
        top = max(pages)
        sizes = [memoryview(b).nbytes for b in pool.buffers]
        for s in pool.segments:
            if s.buffer >= len(sizes) or s.offset + top * s.page_stride + s.bytes > sizes[s.buffer]:
                raise ValueError(f"segment {s} of page {top} lies outside its buffer")
        staging_size = memoryview(staging).nbytes
        for off in staging_offsets:
            if off < 0 or off + block_bytes > staging_size:
                raise ValueError("staging offset out of range")
        for nonce, aad in zip(nonces, aads, strict=True):
            _check_len("nonce", nonce, NONCE_BYTES)
            _check_len("aad", aad, AAD_BYTES)
        self.num_blocks = n
        buffers = (ctypes.c_uint64 * len(pool.buffers))(*(_address(b, keep) for b in pool.buffers))
        page_arr = (ctypes.c_int64 * n)(*pages)
        nonce_arr = ctypes.create_string_buffer(b"".join(nonces), NONCE_BYTES * n)
        aad_arr = ctypes.create_string_buffer(b"".join(aads), AAD_BYTES * n)
        offsets = (ctypes.c_uint64 * n)(*staging_offsets)
        if tags is not None:
            if len(tags) != n or any(len(t) != TAG_BYTES for t in tags):
                raise ValueError("need one 16-byte tag per block")
            self.tags = ctypes.create_string_buffer(b"".join(tags), TAG_BYTES * n)
        else:
            self.tags = ctypes.create_string_buffer(TAG_BYTES * n)
        if ok is not None and len(ok) != n:
            raise ValueError("need one ok flag per block")
        self.ok = (ctypes.c_uint8 * n)(*(1 if f else 0 for f in (ok or [False] * n)))
        self.ws = (KvsBlockWs * n)()
        keep += [key, seg_table, buffers, page_arr, nonce_arr, aad_arr, offsets]
        self._keep = keep
        self.batch = make_batch(
            key=ctypes.addressof(key.raw),
            buffers=ctypes.addressof(buffers),
            segments=ctypes.addressof(seg_table),
            pages=ctypes.addressof(page_arr),
            nonces=ctypes.addressof(nonce_arr),
            aads=ctypes.addressof(aad_arr),
            staging=_address(staging, keep),
            staging_offsets=ctypes.addressof(offsets),
            tags=ctypes.addressof(self.tags),
            ok=ctypes.addressof(self.ok),
            ws=ctypes.addressof(self.ws),
            block_bytes=block_bytes,
            num_segments=len(seg_table),
            num_blocks=n,
            config=config,
        )

    def run(self, fn: Callable[[object, int], int], order_seed: int) -> None:
        _raise_for(fn(ctypes.byref(self.batch), order_seed & (2**64 - 1)))
        # The kernels promise to leave the reduction workspace zeroed.
        if any(w.acc[0] or w.acc[1] or w.count for w in self.ws):
            raise RuntimeError("kernel left the reduction workspace dirty")
