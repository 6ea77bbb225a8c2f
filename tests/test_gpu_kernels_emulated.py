"""The GPU seal/verify/open kernels, run on the CPU through the g++-built emulator.

The emulator executes the same header code as the CUDA kernels, CTA by CTA and phase by
phase, so these tests check the kernels' arithmetic, thread mapping, GHASH parallelisation
and gather/scatter addressing on machines without a GPU. Reference: pyca/cryptography's
AESGCM and the NIST CAVP GCM vectors shipped in cryptography-vectors.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvseal.server.backends.cuda import emulated as E


@pytest.fixture(scope="module")
def emu() -> E.Emulator:
    try:
        return E.load_emulator()
    except E.EmulatorUnavailable as exc:
        pytest.skip(f"CPU emulator unavailable: {exc}")


# --------------------------------------------------------------------------------------
# NIST CAVP known answers (96-bit IVs, all PT/AAD/tag lengths, FAIL cases)
# --------------------------------------------------------------------------------------


def _gcm_vectors(name: str) -> list[dict[str, str]]:
    # CI always has the vectors; the device check leaves the 56 MB wheel behind.
    pytest.importorskip("cryptography_vectors", reason="cryptography-vectors not installed")
    root = resources.files("cryptography_vectors") / "ciphers" / "AES" / "GCM" / name
    vectors: list[dict[str, str]] = []
    header: dict[str, str] = {}
    current: dict[str, str] | None = None
    for raw in Path(str(root)).read_text().splitlines():
        line = raw.strip()
        if line.startswith("["):
            k, _, v = line.strip("[]").partition("=")
            header[k.strip()] = v.strip()
        elif line.startswith("Count"):
            current = dict(header)
            vectors.append(current)
        elif current is not None and line == "FAIL":
            current["FAIL"] = "1"
        elif current is not None and "=" in line:
            k, _, v = line.partition("=")
            current[k.strip()] = v.strip()
    return [v for v in vectors if v.get("IVlen") == "96"]


def test_nist_gcm256_encrypt_vectors(emu: E.Emulator) -> None:
    vectors = _gcm_vectors("gcmEncryptExtIV256.rsp")
    assert len(vectors) >= 2000
    lengths = {(int(v["PTlen"]), int(v["AADlen"]), int(v["Taglen"])) for v in vectors}
    assert any(p % 128 for p, _, _ in lengths) and any(a % 128 for _, a, _ in lengths)
    for v in vectors:
        key, iv = bytes.fromhex(v["Key"]), bytes.fromhex(v["IV"])
        pt, aad = bytes.fromhex(v["PT"]), bytes.fromhex(v["AAD"])
        out = emu.gcm_seal(key, iv, aad, pt)
        tag = bytes.fromhex(v["Tag"])
        assert out[: len(pt)] == bytes.fromhex(v["CT"]), v["Count"]
        assert out[len(pt) : len(pt) + len(tag)] == tag, v["Count"]


def test_nist_gcm256_decrypt_vectors(emu: E.Emulator) -> None:
    vectors = _gcm_vectors("gcmDecrypt256.rsp")
    fails = 0
    for v in vectors:
        key, iv = bytes.fromhex(v["Key"]), bytes.fromhex(v["IV"])
        ct, aad, tag = bytes.fromhex(v["CT"]), bytes.fromhex(v["AAD"]), bytes.fromhex(v["Tag"])
        got = emu.gcm_open(key, iv, aad, ct, tag)
        if "FAIL" in v:
            fails += 1
            assert got is None, v["Count"]
        else:
            assert got == bytes.fromhex(v["PT"]), v["Count"]
    assert fails > 100 and len(vectors) > fails


# --------------------------------------------------------------------------------------
# Batch kernels vs AESGCM
# --------------------------------------------------------------------------------------


@dataclass
class Scenario:
    """A random pool, a batch of pages and the staging layout for them."""

    key: bytes
    pool: E.Pool
    pages: list[int]
    nonces: list[bytes]
    aads: list[bytes]
    offsets: list[int]
    staging_size: int

    @property
    def block_bytes(self) -> int:
        return sum(s.bytes for s in self.pool.segments)

    def plaintext(self, pool: E.Pool, page: int) -> bytes:
        return b"".join(
            bytes(pool.buffers[s.buffer][s.offset + page * s.page_stride :][: s.bytes])
            for s in pool.segments
        )

    def args(
        self,
        staging: bytearray | memoryview,
        *,
        pages: list[int] | None = None,
        aads: list[bytes] | None = None,
        offsets: list[int] | None = None,
    ) -> dict[str, Any]:
        """Keyword arguments describing this batch for Emulator.seal/verify/open."""
        return {
            "pages": self.pages if pages is None else pages,
            "nonces": self.nonces,
            "aads": self.aads if aads is None else aads,
            "staging": staging,
            "staging_offsets": self.offsets if offsets is None else offsets,
        }

    def poisoned_pool(self) -> E.Pool:
        return E.Pool([bytearray(b"\x5a" * len(b)) for b in self.pool.buffers], self.pool.segments)


def make_scenario(rng: random.Random, seg_sizes: list[int], num_blocks: int) -> Scenario:
    """Segments spread over 1..3 buffers, each in its own region with an odd offset and a
    page stride >= its size; distinct random page ids; staging with gaps and odd offsets."""
    num_buffers = rng.randint(1, min(3, len(seg_sizes)))
    num_pages = num_blocks + rng.randint(0, 8)
    sizes = [0] * num_buffers
    segments = []
    for n in seg_sizes:
        buf = rng.randrange(num_buffers)
        stride = n + rng.choice((0, 0, 1, 16, 33))
        start = sizes[buf] + rng.randint(0, 17)
        segments.append(E.Segment(buf, start, stride, n))
        sizes[buf] = start + stride * num_pages + 8
    buffers = [bytearray(rng.randbytes(size)) for size in sizes]
    pages = rng.sample(range(num_pages), num_blocks)
    block_bytes = sum(seg_sizes)
    offsets, cursor = [], rng.randint(0, 31)
    for _ in range(num_blocks):
        offsets.append(cursor)
        cursor += block_bytes + rng.choice((0, 0, 5, 16))
    return Scenario(
        key=rng.randbytes(32),
        pool=E.Pool(buffers, segments),
        pages=pages,
        nonces=[rng.randbytes(4) + i.to_bytes(8, "big") for i in range(num_blocks)],
        aads=[b"KVSEAL\x00\x01" + rng.randbytes(104) for _ in range(num_blocks)],
        offsets=offsets,
        staging_size=cursor + 3,
    )


def seal_and_check(
    emu: E.Emulator, sc: Scenario, cfg: E.LaunchConfig, seed: int
) -> tuple[E.KeyContext, bytearray, list[bytes]]:
    ctx = emu.key_setup(sc.key)
    staging = bytearray(b"\xee" * sc.staging_size)
    tags = emu.seal(ctx, sc.pool, **sc.args(staging), config=cfg, order_seed=seed)
    aead = AESGCM(sc.key)
    bb = sc.block_bytes
    for i, page in enumerate(sc.pages):
        ref = aead.encrypt(sc.nonces[i], sc.plaintext(sc.pool, page), sc.aads[i])
        assert bytes(staging[sc.offsets[i] : sc.offsets[i] + bb]) == ref[:-16], f"block {i}"
        assert tags[i] == ref[-16:], f"tag {i}"
    return ctx, staging, tags


def open_into_poison(
    emu: E.Emulator,
    sc: Scenario,
    ctx: E.KeyContext,
    staging: bytearray,
    *,
    ok: list[bool],
    cfg: E.LaunchConfig,
    all_or_nothing: bool = False,
) -> E.Pool:
    dest = sc.poisoned_pool()
    emu.open(ctx, dest, **sc.args(staging), ok=ok, all_or_nothing=all_or_nothing, config=cfg)
    return dest


def expected_dest(sc: Scenario, restored: set[int]) -> list[bytearray]:
    """Poison everywhere except the segments of the restored blocks' pages."""
    dest = sc.poisoned_pool()
    for i in restored:
        page = sc.pages[i]
        for s in sc.pool.segments:
            lo = s.offset + page * s.page_stride
            dest.buffers[s.buffer][lo : lo + s.bytes] = sc.pool.buffers[s.buffer][lo : lo + s.bytes]
    return [bytearray(b) for b in dest.buffers]


CONFIGS = [
    E.LaunchConfig(threads=32, slice_blocks=32),  # many CTAs per block, 1 block per thread
    E.LaunchConfig(threads=64, slice_blocks=192),  # 3 strided blocks per thread
    E.LaunchConfig(threads=128, slice_blocks=128),
    E.LaunchConfig(threads=32, slice_blocks=32 * 40),  # mostly one CTA per block
    E.LaunchConfig(),  # production default
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"t{c.threads}-s{c.slice_blocks}")
@pytest.mark.parametrize("seed", [1, 2])
def test_batch_seal_matches_aesgcm_and_roundtrips(
    emu: E.Emulator, cfg: E.LaunchConfig, seed: int
) -> None:
    rng = random.Random(seed * 1000 + cfg.threads + cfg.slice_blocks)
    seg_sizes = [rng.randint(1, 700) for _ in range(rng.randint(1, 9))]
    sc = make_scenario(rng, seg_sizes, num_blocks=rng.randint(1, 64))
    ctx, staging, tags = seal_and_check(emu, sc, cfg, seed=seed)
    ok = emu.verify(ctx, sc.pool, **sc.args(staging), tags=tags, config=cfg, order_seed=seed + 7)
    assert ok == [True] * len(sc.pages)
    dest = open_into_poison(emu, sc, ctx, staging, ok=ok, cfg=cfg)
    assert [bytearray(b) for b in dest.buffers] == expected_dest(sc, set(range(len(sc.pages))))
    ctx.wipe()


def test_segment_edge_sizes(emu: E.Emulator) -> None:
    """1-byte segments, 16-byte-straddling runs, exact multiples and a 1-byte block."""
    rng = random.Random(99)
    for seg_sizes in ([1], [15], [16], [17], [1] * 40, [3, 1, 29, 2, 16, 1], [16] * 5, [255, 1]):
        for cfg in (E.LaunchConfig(32, 32), E.LaunchConfig(64, 128)):
            sc = make_scenario(rng, seg_sizes, num_blocks=rng.randint(1, 5))
            ctx, staging, _ = seal_and_check(emu, sc, cfg, seed=3)
            ok = [True] * len(sc.pages)
            dest = open_into_poison(emu, sc, ctx, staging, ok=ok, cfg=cfg)
            assert [bytearray(b) for b in dest.buffers] == expected_dest(
                sc, set(range(len(sc.pages)))
            )


def test_real_geometry_4mib_block(emu: E.Emulator) -> None:
    """The production shape: 128 segments of 32 KiB (64 layers x K/V, one buffer per
    layer and K/V) -> 4 MiB blocks, default launch (16 CTAs per block)."""
    rng = random.Random(4)
    seg = 32 * 1024
    pages = 3
    buffers = [bytearray(rng.randbytes(seg * pages)) for _ in range(128)]
    sc = Scenario(
        key=rng.randbytes(32),
        pool=E.Pool(buffers, [E.Segment(i, 0, seg, seg) for i in range(128)]),
        pages=[2],
        nonces=[rng.randbytes(12)],
        aads=[rng.randbytes(112)],
        offsets=[0],
        staging_size=128 * seg,
    )
    assert E.LaunchConfig().ctas_per_block(sc.block_bytes) == 16
    seal_and_check(emu, sc, E.LaunchConfig(), seed=11)


def test_cta_order_does_not_matter(emu: E.Emulator) -> None:
    rng = random.Random(5)
    sc = make_scenario(rng, [333, 1, 1000], num_blocks=9)
    cfg = E.LaunchConfig(32, 32)
    _, first, tags = seal_and_check(emu, sc, cfg, seed=0)
    for seed in (1, 2, 3):
        _, again, tags2 = seal_and_check(emu, sc, cfg, seed=seed)
        assert again == first and tags2 == tags


@pytest.fixture(scope="module")
def emu_no_atomics(tmp_path_factory: pytest.TempPathFactory) -> E.Emulator:
    """The emulator built as KVSEAL_KERNELS_SAFE=atomics builds the kernels
    (``-DKVS_NO_ATOMICS``: plain workspace accesses); ``-DKVS_NO_VECTOR_IO`` changes
    no host code (host builds never take the 16-byte path)."""
    gxx = shutil.which(os.environ.get("CXX") or "g++")
    if gxx is None:
        pytest.skip("no C++ compiler")
    lib = tmp_path_factory.mktemp("emu") / "emulate-no-atomics.so"
    cmd = [gxx, *E.CXXFLAGS, "-DKVS_NO_ATOMICS=1", "-DKVS_NO_VECTOR_IO=1", "-o", str(lib)]
    r = subprocess.run([*cmd, str(E.CUDA_DIR / "emulate.cpp")], capture_output=True, text=True,
                       timeout=300, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    return E.Emulator(lib)


@pytest.mark.parametrize("cfg", CONFIGS[:2], ids=lambda c: f"t{c.threads}-s{c.slice_blocks}")
def test_no_atomics_build_matches_aesgcm_in_any_cta_order(
    emu_no_atomics: E.Emulator, cfg: E.LaunchConfig
) -> None:
    """Several CTAs per block, in shuffled order: the diagnostic build's sealed bytes
    and tags are AESGCM's, and verify and open agree."""
    rng = random.Random(77 + cfg.threads)
    sc = make_scenario(rng, [rng.randint(300, 900) for _ in range(9)], num_blocks=7)
    assert cfg.ctas_per_block(sc.block_bytes) > 1
    ctx, staging, tags = seal_and_check(emu_no_atomics, sc, cfg, seed=3)
    ok = emu_no_atomics.verify(ctx, sc.pool, **sc.args(staging), tags=tags, config=cfg,
                               order_seed=5)  # fmt: skip
    assert ok == [True] * len(sc.pages)
    dest = open_into_poison(emu_no_atomics, sc, ctx, staging, ok=ok, cfg=cfg)
    assert [bytearray(b) for b in dest.buffers] == expected_dest(sc, set(range(len(sc.pages))))
    ctx.wipe()


# --------------------------------------------------------------------------------------
# Tampering: verify flags it, open leaves those pages untouched
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", CONFIGS[:3], ids=lambda c: f"t{c.threads}-s{c.slice_blocks}")
def test_tampered_blocks_are_rejected_and_not_written(emu: E.Emulator, cfg: E.LaunchConfig) -> None:
    rng = random.Random(cfg.threads)
    sc = make_scenario(rng, [500, 77, 1, 1200], num_blocks=12)
    ctx, staging, tags = seal_and_check(emu, sc, cfg, seed=0)
    bb = sc.block_bytes
    staging = bytearray(staging)
    tags = list(tags)
    aads = list(sc.aads)
    offsets = list(sc.offsets)
    # 0: bit flip in the first byte, 1: in the last (partial) byte, 2: mid-block
    staging[offsets[0]] ^= 0x01
    staging[offsets[1] + bb - 1] ^= 0x80
    staging[offsets[2] + bb // 2] ^= 0x10
    # 3: wrong tag (last bit)
    tags[3] = tags[3][:15] + bytes([tags[3][15] ^ 1])
    # 4, 5: swapped ciphertexts (each carries the other's position)
    offsets[4], offsets[5] = offsets[5], offsets[4]
    # 6: wrong AAD (generation bumped)
    aads[6] = aads[6][:-1] + bytes([aads[6][-1] ^ 1])
    # 7: tag of another block
    tags[7] = tags[8]
    bad = {0, 1, 2, 3, 4, 5, 6, 7}
    tampered = sc.args(staging, aads=aads, offsets=offsets)
    ok = emu.verify(ctx, sc.pool, **tampered, tags=tags, config=cfg, order_seed=9)
    assert {i for i, good in enumerate(ok) if not good} == bad

    # Per-block mode: good blocks restored, bad pages keep the poison pattern.
    dest = sc.poisoned_pool()
    emu.open(ctx, dest, **tampered, ok=ok, config=cfg)
    good = set(range(len(sc.pages))) - bad
    assert [bytearray(b) for b in dest.buffers] == expected_dest(sc, good)

    # All-or-nothing mode: one failure and nothing at all is written.
    dest = sc.poisoned_pool()
    emu.open(ctx, dest, **tampered, ok=ok, all_or_nothing=True, config=cfg)
    assert [bytearray(b) for b in dest.buffers] == expected_dest(sc, set())

    # All-or-nothing with every block verified restores everything.
    dest = sc.poisoned_pool()
    emu.open(ctx, dest, **sc.args(staging), ok=[True] * 12, all_or_nothing=True, config=cfg)
    for i in good:  # (blocks 0-2 were corrupted in staging and flagged ok on purpose)
        assert sc.plaintext(dest, sc.pages[i]) == sc.plaintext(sc.pool, sc.pages[i])


def test_single_failure_blocks_all_or_nothing_open(emu: E.Emulator) -> None:
    rng = random.Random(77)
    sc = make_scenario(rng, [100, 30], num_blocks=40)
    cfg = E.LaunchConfig(32, 64)
    ctx, staging, tags = seal_and_check(emu, sc, cfg, seed=0)
    staging[sc.offsets[39] + 129] ^= 0x40
    ok = emu.verify(ctx, sc.pool, **sc.args(staging), tags=tags, config=cfg)
    assert ok == [True] * 39 + [False]
    dest = open_into_poison(emu, sc, ctx, staging, ok=ok, cfg=cfg, all_or_nothing=True)
    assert [bytearray(b) for b in dest.buffers] == expected_dest(sc, set())


# --------------------------------------------------------------------------------------
# Property test over sizes and launch shapes
# --------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seg_sizes=st.lists(st.integers(1, 300), min_size=1, max_size=6),
    num_blocks=st.integers(1, 6),
    threads=st.sampled_from([32, 64]),
    per_thread=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_seal_verify_open(
    emu: E.Emulator, seg_sizes: list[int], num_blocks: int, threads: int, per_thread: int, seed: int
) -> None:
    cfg = E.LaunchConfig(threads, threads * per_thread)
    sc = make_scenario(random.Random(seed), seg_sizes, num_blocks)
    ctx, staging, tags = seal_and_check(emu, sc, cfg, seed=seed)
    ok = emu.verify(ctx, sc.pool, **sc.args(staging), tags=tags, config=cfg)
    assert all(ok)
    dest = open_into_poison(emu, sc, ctx, staging, ok=ok, cfg=cfg)
    assert [bytearray(b) for b in dest.buffers] == expected_dest(sc, set(range(num_blocks)))


# --------------------------------------------------------------------------------------
# Argument validation (nothing is touched on error)
# --------------------------------------------------------------------------------------


def test_invalid_arguments_raise(emu: E.Emulator) -> None:
    for threads, slice_blocks in ((16, 16), (48, 48), (2048, 2048), (32, 48), (32, 0)):
        with pytest.raises(ValueError):
            E.LaunchConfig(threads, slice_blocks)
    rng = random.Random(1)
    sc = make_scenario(rng, [64], num_blocks=2)
    ctx = emu.key_setup(sc.key)
    staging = bytearray(sc.staging_size)
    with pytest.raises(ValueError, match="outside"):
        emu.seal(ctx, sc.pool, **sc.args(staging, pages=[0, 10_000]))
    with pytest.raises(ValueError, match="staging"):
        emu.seal(ctx, sc.pool, **sc.args(bytearray(10)))
    with pytest.raises(ValueError, match="aad"):
        emu.seal(ctx, sc.pool, **sc.args(staging, aads=[b"x", b"y"]))
    with pytest.raises(ValueError, match="writable"):
        emu.seal(ctx, sc.pool, **sc.args(memoryview(bytes(sc.staging_size))))
    with pytest.raises(ValueError, match="key"):
        emu.key_setup(b"short")
    assert staging == bytearray(sc.staging_size)
