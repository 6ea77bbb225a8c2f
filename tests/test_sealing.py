"""kvseal.server.sealing: the cipher, the v1 block format, nonces and key epochs.

Everything runs the real ``cryptography`` AES-GCM (nothing is mocked):

- NIST CAVP AES-GCM-256 vectors (``cryptography-vectors``), 96-bit IVs and
  128-bit tags, through the module's KAT entry point. The decrypt file's
  FAIL cases are checked to be unforgeable with the module's own cipher (CTR
  is its own inverse, so "encrypting" the ciphertext yields the candidate
  plaintext; re-sealing that must give a different tag) and rejected by
  ``AESGCM.decrypt``.
- ``BlockSealer``: round trips, in-place == out-of-place == an independent
  ``AESGCM.encrypt`` over a hand-built 112-byte AAD, every binding of the AAD,
  nonce construction and uniqueness (also across threads), key epochs, misuse.
"""

from __future__ import annotations

import ctypes
import os
import re
import resource
import struct
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import cryptography_vectors
import pytest
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from kvseal.server import sealing
from kvseal.server.sealing import (
    AAD_BYTES,
    TAG_BYTES,
    AuthenticationFailed,
    BlockAD,
    BlockSealer,
    KeyDestroyed,
    KeysExhausted,
    SealingError,
    SealRecord,
    aes256gcm_encrypt_for_kat,
    self_test,
)

# ---------------------------------------------------------------- CAVP vectors

GCM_DIR = Path(cryptography_vectors.__file__).parent / "ciphers" / "AES" / "GCM"


@dataclass(frozen=True)
class GcmVector:
    name: str
    key: bytes
    iv: bytes
    pt: bytes | None  # None: a decrypt FAIL case (no plaintext exists)
    aad: bytes
    ct: bytes
    tag: bytes


def parse_rsp(path: Path) -> Iterator[GcmVector]:
    """Parse a CAVP .rsp file: ``[Name = value]`` section headers, then
    records of ``Name = value`` lines separated by blank lines; a bare
    ``FAIL`` line marks a decrypt case that must not authenticate."""
    section: dict[str, str] = {}
    rec: dict[str, str] = {}

    def flush() -> Iterator[GcmVector]:
        if "Key" not in rec:
            return
        fail = rec.get("FAIL") == "1"
        yield GcmVector(
            name=f"{path.stem}[Keylen={section.get('Keylen')},IVlen={section.get('IVlen')},"
            f"PTlen={section.get('PTlen')},AADlen={section.get('AADlen')},"
            f"Taglen={section.get('Taglen')},Count={rec.get('Count')}]",
            key=bytes.fromhex(rec["Key"]),
            iv=bytes.fromhex(rec["IV"]),
            pt=None if fail else bytes.fromhex(rec.get("PT", "")),
            aad=bytes.fromhex(rec.get("AAD", "")),
            ct=bytes.fromhex(rec.get("CT", "")),
            tag=bytes.fromhex(rec["Tag"]),
        )

    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            if not line:
                yield from flush()
                rec = {}
            continue
        if line.startswith("[") and line.endswith("]"):
            yield from flush()
            rec = {}
            k, _, v = line[1:-1].partition("=")
            section[k.strip()] = v.strip()
        elif line == "FAIL":
            rec["FAIL"] = "1"
        else:
            k, _, v = line.partition("=")
            if k.strip() == "Count":
                yield from flush()
                rec = {}
            rec[k.strip()] = v.strip()
    yield from flush()


def _usable(v: GcmVector) -> bool:
    # kvseal uses 96-bit nonces and full 128-bit tags only.
    return len(v.key) == 32 and len(v.iv) == 12 and len(v.tag) == 16


ENCRYPT_VECTORS = [v for v in parse_rsp(GCM_DIR / "gcmEncryptExtIV256.rsp") if _usable(v)]
DECRYPT_VECTORS = [v for v in parse_rsp(GCM_DIR / "gcmDecrypt256.rsp") if _usable(v)]


def test_vector_files_parsed() -> None:
    # The CAVP files have 15 sections of 15 cases each with 96-bit IVs, 128-bit tags.
    assert len(ENCRYPT_VECTORS) >= 100
    assert len(DECRYPT_VECTORS) >= 100
    assert any(v.pt is None for v in DECRYPT_VECTORS)
    assert any(v.pt is not None for v in DECRYPT_VECTORS)
    assert all(v.pt is not None for v in ENCRYPT_VECTORS)
    assert any(v.pt and v.aad for v in ENCRYPT_VECTORS)  # both PT and AAD non-empty


def test_cavp_encrypt_256() -> None:
    failures = []
    for v in ENCRYPT_VECTORS:
        assert v.pt is not None
        if aes256gcm_encrypt_for_kat(v.key, v.iv, v.pt, v.aad) != v.ct + v.tag:
            failures.append(v.name)
    assert not failures, failures[:5]


def test_cavp_decrypt_256() -> None:
    passed = failed = 0
    for v in DECRYPT_VECTORS:
        # GCM's CTR part is an involution: "encrypting" CT gives the candidate PT.
        candidate = aes256gcm_encrypt_for_kat(v.key, v.iv, v.ct, v.aad)[: len(v.ct)]
        resealed = aes256gcm_encrypt_for_kat(v.key, v.iv, candidate, v.aad)
        assert resealed[: len(v.ct)] == v.ct, v.name
        if v.pt is None:
            # FAIL case: no plaintext seals to this (ciphertext, tag).
            assert resealed[len(v.ct) :] != v.tag, v.name
            with pytest.raises(InvalidTag):
                AESGCM(v.key).decrypt(v.iv, v.ct + v.tag, v.aad)
            failed += 1
        else:
            assert candidate == v.pt, v.name
            assert resealed[len(v.ct) :] == v.tag, v.name
            assert AESGCM(v.key).decrypt(v.iv, v.ct + v.tag, v.aad) == v.pt
            passed += 1
    assert passed and failed


def test_self_test_passes() -> None:
    self_test()


# ---------------------------------------------------------------- helpers

NS = bytes(range(32))
TENANT = bytes(range(32, 64))
HASH = bytes(range(64, 96))


def ad(
    ns: bytes = NS, tenant: bytes = TENANT, block_hash: bytes = HASH, generation: int = 7
) -> BlockAD:
    return BlockAD(ns, tenant, block_hash, generation)


def seal(sealer: BlockSealer, plaintext: bytes, block_ad: BlockAD) -> tuple[SealRecord, bytearray]:
    out = bytearray(len(plaintext) + TAG_BYTES)
    rec = sealer.seal_into(memoryview(plaintext), block_ad, memoryview(out))
    return rec, out


def open_(sealer: BlockSealer, rec: SealRecord, block_ad: BlockAD, sealed: bytes) -> bytes:
    out = bytearray(len(sealed) - TAG_BYTES)
    sealer.open_into(rec, block_ad, memoryview(bytearray(sealed)), memoryview(out))
    return bytes(out)


def flip(data: bytes | bytearray, bit: int) -> bytes:
    b = bytearray(data)
    b[bit // 8] ^= 1 << (bit % 8)
    return bytes(b)


# ---------------------------------------------------------------- format


def test_aad_layout_is_the_documented_112_bytes() -> None:
    a = ad(generation=0x0102030405060708)
    enc = a.encode()
    assert len(enc) == AAD_BYTES == 112
    expected = b"KVSEAL" + struct.pack(">H", 1) + NS + TENANT + HASH + bytes(range(1, 9))
    assert enc == expected
    assert enc[:6] == b"KVSEAL"
    assert enc[6:8] == b"\x00\x01"
    assert enc[8:40] == NS and enc[40:72] == TENANT and enc[72:104] == HASH
    assert int.from_bytes(enc[104:], "big") == 0x0102030405060708


@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 4096, 1 << 20])
def test_round_trip(size: int) -> None:
    sealer = BlockSealer()
    pt = os.urandom(size)
    rec, sealed = seal(sealer, pt, ad())
    assert len(sealed) == size + TAG_BYTES
    assert rec.tag == bytes(sealed[size:])
    assert rec.epoch == 0 and len(rec.nonce) == 12 and len(rec.tag) == 16
    if size >= 16:  # (a 1-byte ciphertext equals its plaintext 1 time in 256)
        assert bytes(sealed[:size]) != pt
    assert open_(sealer, rec, ad(), bytes(sealed)) == pt


KNOWN_KEY = bytes.fromhex("000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f")


@pytest.fixture
def known_key(monkeypatch: pytest.MonkeyPatch) -> bytes:
    """Make new epochs draw KNOWN_KEY instead of getrandom() bytes. The key
    still travels through the ctypes buffer and ``AESGCM`` exactly as in
    production; only the CSPRNG is replaced, the cipher is real."""

    def fake_fill(buf: ctypes.Array[ctypes.c_char]) -> None:
        ctypes.memmove(buf, KNOWN_KEY, len(KNOWN_KEY))

    monkeypatch.setattr(sealing, "_fill_random", fake_fill)
    return KNOWN_KEY


def test_in_place_equals_out_of_place_equals_independent_aesgcm(known_key: bytes) -> None:
    n = 64 * 1024 + 5
    pt = os.urandom(n)
    block_ad = ad(generation=123456789)
    # Two sealers with the same key and nonce prefix hand out the same first nonce.
    s_out, s_in = BlockSealer(), BlockSealer()
    for s in (s_out, s_in):  # open the scope (nonce 0 burnt in both)
        s.allocate_for_device(1, block_ad.scope)
    s_in._scopes[block_ad.scope].current.prefix = s_out._scopes[block_ad.scope].current.prefix  # type: ignore[union-attr]

    rec_out, c_out = seal(s_out, pt, block_ad)  # out of place
    buf = bytearray(n + TAG_BYTES)
    buf[:n] = pt
    mv = memoryview(buf)
    rec_in = s_in.seal_into(mv[:n], block_ad, mv)  # in place: plaintext = out[:n]

    assert rec_in.nonce == rec_out.nonce
    assert bytes(buf) == bytes(c_out)
    assert rec_in == rec_out
    assert rec_in.tag == bytes(buf[n:])
    # Independent check of format v1 (AAD spelled out by hand).
    aad = b"KVSEAL" + b"\x00\x01" + NS + TENANT + HASH + struct.pack(">Q", 123456789)
    assert len(aad) == 112
    assert bytes(c_out) == AESGCM(known_key).encrypt(rec_out.nonce, pt, aad)
    assert AESGCM(known_key).decrypt(rec_in.nonce, bytes(buf), aad) == pt


def test_real_key_is_not_the_wiped_buffer() -> None:
    """The key buffer is zeroed after ``AESGCM`` copies it; if the cipher
    kept a view instead of a copy, every key would be all zeros."""
    sealer = BlockSealer()
    pt = os.urandom(64)
    rec, sealed = seal(sealer, pt, ad())
    with pytest.raises(InvalidTag):
        AESGCM(bytes(32)).decrypt(rec.nonce, bytes(sealed), ad().encode())
    assert open_(sealer, rec, ad(), bytes(sealed)) == pt


def test_epochs_have_distinct_keys() -> None:
    sealer = BlockSealer(rekey_after=1)
    pt = os.urandom(64)
    r0, c0 = seal(sealer, pt, ad())
    r1, _ = seal(sealer, pt, ad())
    assert (r0.epoch, r1.epoch) == (0, 1)
    # Epoch 0's block presented as if sealed under epoch 1 (same nonce and
    # tag) does not open: the epochs have different keys.
    forged = SealRecord(1, r0.nonce, r0.tag)
    with pytest.raises(AuthenticationFailed):
        open_(sealer, forged, ad(), bytes(c0))


def test_in_place_open() -> None:
    sealer = BlockSealer()
    pt = os.urandom(10_000)
    rec, sealed = seal(sealer, pt, ad())
    mv = memoryview(sealed)
    sealer.open_into(rec, ad(), mv, mv[: len(pt)])
    assert bytes(sealed[: len(pt)]) == pt


# ---------------------------------------------------------------- authentication


@pytest.fixture
def sealed_block() -> tuple[BlockSealer, bytes, SealRecord, bytes]:
    sealer = BlockSealer()
    pt = os.urandom(4096)
    rec, sealed = seal(sealer, pt, ad())
    return sealer, pt, rec, bytes(sealed)


@pytest.mark.parametrize(
    "changed",
    [
        ad(ns=bytes(31) + b"\x01"),
        ad(tenant=TENANT[:-1] + bytes([TENANT[-1] ^ 0x80])),
        ad(block_hash=HASH[::-1]),
        ad(generation=8),
        ad(generation=6),
        ad(generation=7 + 2**32),
        ad(ns=TENANT, tenant=NS),  # fields swapped
    ],
    ids=["namespace", "tenant", "hash", "generation+1", "generation-1", "generation+2^32", "swap"],
)
def test_every_ad_field_is_bound(
    sealed_block: tuple[BlockSealer, bytes, SealRecord, bytes], changed: BlockAD
) -> None:
    sealer, pt, rec, sealed = sealed_block
    with pytest.raises(AuthenticationFailed):
        open_(sealer, rec, changed, sealed)
    assert open_(sealer, rec, ad(), sealed) == pt  # the original still opens


@pytest.mark.parametrize("bit", [0, 7, 8 * 2048 + 3, 8 * 4096 - 1])
def test_flipped_ciphertext_bit(
    sealed_block: tuple[BlockSealer, bytes, SealRecord, bytes], bit: int
) -> None:
    sealer, _, rec, sealed = sealed_block
    with pytest.raises(AuthenticationFailed):
        open_(sealer, rec, ad(), flip(sealed, bit))


@pytest.mark.parametrize("bit", [0, 64, 127])
def test_wrong_tag(sealed_block: tuple[BlockSealer, bytes, SealRecord, bytes], bit: int) -> None:
    sealer, _, rec, sealed = sealed_block
    n = len(sealed) - TAG_BYTES
    bad_tag = flip(rec.tag, bit)
    with pytest.raises(AuthenticationFailed):
        open_(sealer, rec, ad(), sealed[:n] + bad_tag)
    with pytest.raises(AuthenticationFailed):
        open_(sealer, replace(rec, tag=bad_tag), ad(), sealed[:n] + bad_tag)
    with pytest.raises(AuthenticationFailed):
        open_(sealer, rec, ad(), sealed[:n] + bytes(16))


def test_wrong_nonce(sealed_block: tuple[BlockSealer, bytes, SealRecord, bytes]) -> None:
    sealer, _, rec, sealed = sealed_block
    for bad in (flip(rec.nonce, 0), flip(rec.nonce, 95), rec.nonce[:4] + struct.pack(">Q", 1)):
        with pytest.raises(AuthenticationFailed):
            open_(sealer, replace(rec, nonce=bad), ad(), sealed)


def test_truncated_or_extended_ciphertext_is_misuse_not_success(
    sealed_block: tuple[BlockSealer, bytes, SealRecord, bytes],
) -> None:
    sealer, _, rec, sealed = sealed_block
    n = len(sealed) - TAG_BYTES
    # Shifted by one byte (same total size): auth fails.
    with pytest.raises(AuthenticationFailed):
        open_(sealer, rec, ad(), sealed[1:n] + bytes([sealed[0] ^ 0xFF]) + sealed[n:])
    # Last ciphertext byte replaced by something else (never the same value).
    with pytest.raises(AuthenticationFailed):
        open_(sealer, rec, ad(), sealed[: n - 1] + bytes([sealed[n - 1] ^ 0x5A]) + sealed[n:])
    out = bytearray(n)
    with pytest.raises(SealingError):
        sealer.open_into(rec, ad(), memoryview(bytearray(sealed[:-1])), memoryview(out))


def test_swapped_ciphertexts_between_blocks() -> None:
    sealer = BlockSealer()
    pa, pb = os.urandom(4096), os.urandom(4096)
    ad_a, ad_b = ad(block_hash=b"A" * 32), ad(block_hash=b"B" * 32)
    ra, ca = seal(sealer, pa, ad_a)
    rb, cb = seal(sealer, pb, ad_b)
    for rec, block_ad, sealed in ((ra, ad_a, cb), (rb, ad_b, ca)):
        with pytest.raises(AuthenticationFailed):
            open_(sealer, rec, block_ad, bytes(sealed))
    # Even with the records swapped along (the host cannot do that: records
    # live in the trusted index), the AD still binds each block hash.
    with pytest.raises(AuthenticationFailed):
        open_(sealer, rb, ad_a, bytes(cb))
    assert open_(sealer, ra, ad_a, bytes(ca)) == pa
    assert open_(sealer, rb, ad_b, bytes(cb)) == pb


def test_same_plaintext_and_ad_give_different_ciphertexts() -> None:
    sealer = BlockSealer()
    pt = bytes(1024)
    r1, c1 = seal(sealer, pt, ad())
    r2, c2 = seal(sealer, pt, ad())
    assert r1.nonce != r2.nonce
    assert c1 != c2 and r1.tag != r2.tag


def test_other_sealer_cannot_open() -> None:
    a, b = BlockSealer(), BlockSealer()
    pt = os.urandom(256)
    rec, sealed = seal(a, pt, ad())
    seal(b, pt, ad())  # b has an epoch 0 of the same scope too
    with pytest.raises(AuthenticationFailed):  # independent key, same epoch index 0
        open_(b, rec, ad(), bytes(sealed))


# ---------------------------------------------------------------- nonces


def _counter(nonce: bytes) -> int:
    return int(struct.unpack(">Q", nonce[4:])[0])


def test_nonce_is_prefix_plus_big_endian_counter() -> None:
    sealer = BlockSealer()
    records = [seal(sealer, b"x", ad())[0] for _ in range(300)]
    prefixes = {r.nonce[:4] for r in records}
    assert len(prefixes) == 1
    assert [_counter(r.nonce) for r in records] == list(range(300))
    assert sealer.seals_under_current_key == 300
    # big endian: counter 256 is ...\x01\x00
    assert records[256].nonce[4:] == b"\x00\x00\x00\x00\x00\x00\x01\x00"


def test_nonce_unique_across_threads() -> None:
    sealer = BlockSealer()
    threads, per_thread = 8, 500
    results: list[list[SealRecord]] = [[] for _ in range(threads)]
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            pt = os.urandom(64)
            out = bytearray(64 + TAG_BYTES)
            barrier.wait()
            for _ in range(per_thread):
                results[i].append(sealer.seal_into(memoryview(pt), ad(), memoryview(out)))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    nonces = [r.nonce for rs in results for r in rs]
    assert len(nonces) == threads * per_thread
    assert len(set(nonces)) == len(nonces)
    assert {n[:4] for n in nonces} == {nonces[0][:4]}
    assert sorted(_counter(n) for n in nonces) == list(range(threads * per_thread))
    assert sealer.seals_under_current_key == threads * per_thread


def test_failed_seal_burns_its_nonce() -> None:
    sealer = BlockSealer()
    r0, _ = seal(sealer, b"abc", ad())
    read_only_out = memoryview(bytes(3 + TAG_BYTES))  # right size, not writable
    with pytest.raises((TypeError, BufferError, ValueError)):
        sealer.seal_into(memoryview(b"abc"), ad(), read_only_out)
    r2, c2 = seal(sealer, b"abc", ad())
    assert _counter(r0.nonce) == 0
    assert _counter(r2.nonce) == 2  # counter 1 was burnt, never reused
    assert open_(sealer, r2, ad(), bytes(c2)) == b"abc"


def test_failed_seal_releases_its_epoch_reference() -> None:
    sealer = BlockSealer(rekey_after=2)
    r0, _ = seal(sealer, b"a", ad())
    with pytest.raises((TypeError, BufferError, ValueError)):
        sealer.seal_into(memoryview(b"a"), ad(), memoryview(bytes(1 + TAG_BYTES)))
    r2, _ = seal(sealer, b"a", ad())  # epoch 1
    assert (r0.epoch, r2.epoch) == (0, 1)
    assert sealer.live_epochs == 2
    sealer.forget(0)  # the only live block of epoch 0: the failed one did not count
    assert sealer.live_epochs == 1


# ---------------------------------------------------------------- key epochs


def test_rekey_after_three_seals() -> None:
    sealer = BlockSealer(rekey_after=3)
    blocks = []
    for i in range(4):
        pt = os.urandom(100)
        block_ad = ad(block_hash=bytes([i]) * 32, generation=i)
        rec, out = seal(sealer, pt, block_ad)
        blocks.append((pt, block_ad, rec, bytes(out)))
    assert [b[2].epoch for b in blocks] == [0, 0, 0, 1]
    assert sealer.current_epoch == 1
    assert sealer.seals_under_current_key == 1
    assert sealer.live_epochs == 2
    assert _counter(blocks[3][2].nonce) == 0  # a new key restarts the counter
    for pt, block_ad, rec, sealed in blocks:  # old-epoch blocks still open
        assert open_(sealer, rec, block_ad, sealed) == pt

    # Forget two of the three epoch-0 blocks: the epoch stays.
    sealer.forget(0)
    sealer.forget(0)
    assert sealer.live_epochs == 2
    pt, block_ad, rec, sealed = blocks[0]
    assert open_(sealer, rec, block_ad, sealed) == pt
    sealer.forget(0)
    assert sealer.live_epochs == 1
    with pytest.raises(SealingError):
        open_(sealer, rec, block_ad, sealed)
    pt1, ad1, rec1, sealed1 = blocks[3]
    assert open_(sealer, rec1, ad1, sealed1) == pt1
    # The scope's last block is gone: the current epoch goes too (a key lives
    # only while a block needs it); the next seal starts a fresh key.
    sealer.forget(1)
    assert sealer.live_epochs == 0 and sealer.live_scopes == 0
    with pytest.raises(SealingError):
        open_(sealer, rec1, ad1, sealed1)
    rec2, _ = seal(sealer, b"again", ad())
    assert rec2.epoch == 2 and _counter(rec2.nonce) == 0


def test_rekey_drops_an_old_epoch_with_no_live_blocks_at_rollover() -> None:
    sealer = BlockSealer(rekey_after=1)
    r0, _ = seal(sealer, b"a", ad())
    r1, _ = seal(sealer, b"b", ad())  # rollover to epoch 1; epoch 0 still has a block
    assert sealer.live_epochs == 2
    sealer.forget(0)  # not current, no block left: destroyed
    assert sealer.live_epochs == 1
    r2, _ = seal(sealer, b"c", ad())  # rollover to epoch 2: epoch 1 keeps its block
    assert (r0.epoch, r1.epoch, r2.epoch) == (0, 1, 2)
    assert sealer.live_epoch_ids() == {1, 2}


def test_unknown_epoch_is_sealing_error() -> None:
    sealer = BlockSealer()
    rec, sealed = seal(sealer, b"abc", ad())
    with pytest.raises(SealingError):
        open_(sealer, replace(rec, epoch=5), ad(), bytes(sealed))


def test_forget_unknown_epoch_is_harmless() -> None:
    sealer = BlockSealer()
    seal(sealer, b"x", ad())
    sealer.forget(42)
    assert sealer.live_epochs == 1


def test_rekey_after_bounds() -> None:
    for bad in (0, -1, 2**64 + 1):
        with pytest.raises(SealingError):
            BlockSealer(rekey_after=bad)
    BlockSealer(rekey_after=2**64)
    assert sealing.DEFAULT_REKEY_AFTER == 2**32
    assert BlockSealer().rekey_after == 2**32


# ---------------------------------------------------------------- misuse


@pytest.mark.parametrize("delta", [-16, -1, 1, 15, 17])
def test_seal_wrong_out_length(delta: int) -> None:
    sealer = BlockSealer()
    pt = bytes(100)
    out = bytearray(100 + TAG_BYTES + delta)
    with pytest.raises(SealingError):
        sealer.seal_into(memoryview(pt), ad(), memoryview(out))
    assert sealer.seals_under_current_key == 0  # misuse burns no nonce


@pytest.mark.parametrize("delta", [-1, 1, 16])
def test_open_wrong_out_length(delta: int) -> None:
    sealer = BlockSealer()
    rec, sealed = seal(sealer, bytes(100), ad())
    with pytest.raises(SealingError):
        sealer.open_into(rec, ad(), memoryview(sealed), memoryview(bytearray(100 + delta)))


@pytest.mark.parametrize(
    "bad",
    [
        ad(ns=bytes(31)),
        ad(ns=bytes(33)),
        ad(tenant=b""),
        ad(tenant=bytes(64)),
        ad(block_hash=bytes(16)),
        ad(block_hash=bytes(33)),
        ad(generation=-1),
        ad(generation=2**64),
    ],
    ids=["ns31", "ns33", "tenant0", "tenant64", "hash16", "hash33", "gen-1", "gen2^64"],
)
def test_bad_ad_is_sealing_error(bad: BlockAD) -> None:
    sealer = BlockSealer()
    with pytest.raises(SealingError):
        bad.encode()
    with pytest.raises(SealingError):
        seal(sealer, b"abc", bad)
    assert sealer.seals_under_current_key == 0
    rec, sealed = seal(sealer, b"abc", ad())
    with pytest.raises(SealingError):
        open_(sealer, rec, bad, bytes(sealed))


def test_generation_limits_accepted() -> None:
    sealer = BlockSealer()
    for g in (0, 2**64 - 1):
        rec, sealed = seal(sealer, b"z", ad(generation=g))
        assert open_(sealer, rec, ad(generation=g), bytes(sealed)) == b"z"


# ---------------------------------------------------------------- no key material in reprs

_LONG_HEX = re.compile(r"[0-9a-fA-F]{16,}")


def _reprs(sealer: BlockSealer) -> list[str]:
    out = [repr(sealer), str(sealer)]
    for epoch in sealer._epochs.values():
        out += [repr(epoch), str(epoch), repr(epoch.aead)]
    return out


def test_reprs_contain_no_key_material() -> None:
    sealer = BlockSealer(rekey_after=2)
    for _ in range(3):
        seal(sealer, b"payload", ad())
    assert sealer.live_epochs == 2
    for text in _reprs(sealer):
        assert not _LONG_HEX.search(text), text
        assert "key material" not in text.lower()
        assert "\\x" not in text  # no raw bytes either
        assert "b'" not in text and 'b"' not in text
    assert "epoch" in repr(sealer)


def test_epoch_keeps_key_only_in_a_wipeable_buffer() -> None:
    sealer = BlockSealer()
    seal(sealer, b"x", ad())
    epoch = sealer._epochs[0]
    assert set(type(epoch).__slots__) == {
        "_arena",
        "_slot",
        "aead",
        "counter",
        "destroyed",
        "index",
        "live",
        "prefix",
        "scope",
    }
    assert isinstance(epoch._slot, ctypes.Array)  # never an immutable bytes
    assert not hasattr(sealer, "key") and not hasattr(sealer, "_key")
    assert not hasattr(epoch, "__dict__")
    addr = epoch.slot_address
    assert ctypes.string_at(addr, 32) != bytes(32)
    epoch.destroy()
    assert ctypes.string_at(addr, 32) == bytes(32) and epoch.slot_address == 0


def test_retired_epoch_drops_its_cipher_and_the_key_schedules_with_it() -> None:
    """AESGCM holds the expanded key (OpenSSL contexts, cleansed when freed):
    a retired epoch must not keep it alive until the epoch object is collected,
    and must refuse to seal or open with a wiped key."""
    sealer = BlockSealer(rekey_after=1)
    seal(sealer, b"old", ad())
    old = sealer._epochs[0]
    aead, addr = old.aead, old.slot_address
    assert aead is not None
    held = sys.getrefcount(aead)
    seal(sealer, b"new", ad())  # epoch 1 starts; epoch 0 still has a live block
    assert old.aead is aead
    sealer.forget(0)  # its last block is gone: destroyed
    assert 0 not in sealer._epochs
    assert old.aead is None and sys.getrefcount(aead) == held - 1  # only ours is left
    assert ctypes.string_at(addr, 32) == bytes(32)
    with pytest.raises(SealingError):
        old.cipher()


def test_close_wipes_every_key_and_refuses_to_seal_afterwards() -> None:
    sealer = BlockSealer(rekey_after=1)
    rec, sealed = seal(sealer, b"a", ad())
    seal(sealer, b"b", ad())
    epochs = list(sealer._epochs.values())
    addrs = [e.slot_address for e in epochs]
    assert len(epochs) == 2
    sealer.close()
    assert sealer.live_epochs == 0
    assert all(e.aead is None and e.destroyed for e in epochs)
    assert all(ctypes.string_at(a, 32) == bytes(32) for a in addrs)
    with pytest.raises(SealingError):
        seal(sealer, b"c", ad())
    with pytest.raises(SealingError):
        open_(sealer, rec, ad(), bytes(sealed))


def test_device_key_api_matches_host_sealing() -> None:
    """What the CUDA backend gets (nonces, exported key) seals exactly like
    the host path, and retired epochs wipe their key."""
    sealer = BlockSealer(rekey_after=4)
    ad = BlockAD(bytes(32), bytes(32), bytes(32), 7)
    epoch, nonces = sealer.allocate_for_device(3, ad.scope)
    assert epoch == 0 and len(set(nonces)) == 3
    key = (ctypes.c_char * 32)()
    sealer.export_key_to(epoch, key)
    sealed = AESGCM(bytes(key)).encrypt(nonces[0], b"block bytes", ad.encode())
    ctypes.memset(key, 0, 32)
    out = bytearray(11)
    sealer.open_into(
        SealRecord(epoch, nonces[0], sealed[-16:]), ad, memoryview(sealed), memoryview(out)
    )
    assert bytes(out) == b"block bytes"
    # Two more would exceed rekey_after=4 under epoch 0: they come from epoch 1.
    epoch1, more = sealer.allocate_for_device(2, ad.scope)
    assert epoch1 == 1 and not set(more) & set(nonces)
    assert sealer.live_epoch_ids() == {0, 1}
    addr = sealer._epochs[0].slot_address
    for _ in range(3):
        sealer.forget(0)
    assert sealer.live_epoch_ids() == {1}
    assert ctypes.string_at(addr, 32) == bytes(32)
    with pytest.raises(KeyDestroyed):
        sealer.export_key_to(0, key)
    with pytest.raises(SealingError):
        sealer.allocate_for_device(5, ad.scope)
    with pytest.raises(SealingError):
        sealer.allocate_for_device(1, (bytes(31), bytes(32)))


# ---------------------------------------------------------------- key scopes, crypto-erase

NS2 = bytes(range(96, 128))
TENANT_B = bytes(range(128, 160))


def test_each_scope_has_its_own_key_nonces_and_epochs() -> None:
    """(namespace, tenant) scopes: independent random keys, each with its own
    nonce prefix and counter from 0; epoch ids are unique across scopes."""
    sealer = BlockSealer()
    pt = os.urandom(256)
    scopes = [ad(), ad(tenant=TENANT_B), ad(ns=NS2)]  # A; B same model; A other model
    recs = [seal(sealer, pt, a) for a in scopes]
    assert [r.epoch for r, _ in recs] == [0, 1, 2]
    assert sealer.live_scopes == 3
    assert all(_counter(r.nonce) == 0 for r, _ in recs)  # a counter per key
    addrs = [sealer._epochs[i].slot_address for i in range(3)]
    keys = {ctypes.string_at(a, 32) for a in addrs}
    assert len(keys) == 3 and bytes(32) not in keys
    # A's ciphertext and nonce presented under B's epoch (B's key) does not open
    # even with A's own AD: the keys differ, not just the AAD.
    (ra, ca), (rb, _) = recs[0], recs[1]
    with pytest.raises(AuthenticationFailed):
        open_(sealer, SealRecord(rb.epoch, ra.nonce, ra.tag), scopes[0], bytes(ca))
    assert open_(sealer, ra, scopes[0], bytes(ca)) == pt


def test_destroy_scope_erases_every_epoch_of_that_scope_only() -> None:
    sealer = BlockSealer(rekey_after=2)
    a, b, a_other_model = ad(), ad(tenant=TENANT_B), ad(ns=NS2)
    pt = os.urandom(512)
    mine = [seal(sealer, pt, replace(a, generation=g)) for g in range(5)]  # 3 epochs
    others = [seal(sealer, pt, x) for x in (b, a_other_model)]
    epochs_a = sealer.scope_epoch_ids(NS, TENANT)
    assert len(epochs_a) == 3
    addrs = [sealer._epochs[e].slot_address for e in epochs_a]
    aeads = [sealer._epochs[e].aead for e in epochs_a]
    held = [sys.getrefcount(x) for x in aeads]
    assert all(ctypes.string_at(x, 32) != bytes(32) for x in addrs)

    assert sealer.destroy_scope(NS, TENANT) == 3
    assert sealer.scope_epoch_ids(NS, TENANT) == frozenset()
    assert all(ctypes.string_at(x, 32) == bytes(32) for x in addrs), "key bytes not wiped"
    # The sealer kept no reference to the ciphers (OpenSSL contexts freed then).
    assert [sys.getrefcount(x) for x in aeads] == [h - 1 for h in held]
    for g, (rec, sealed) in enumerate(mine):
        with pytest.raises(KeyDestroyed):
            open_(sealer, rec, replace(a, generation=g), bytes(sealed))
    for (rec, sealed), x in zip(others, (b, a_other_model), strict=True):
        assert open_(sealer, rec, x, bytes(sealed)) == pt
    # forget() of a destroyed epoch is harmless; a new seal of A starts a fresh key
    # under a new epoch id, under which A's old ciphertext does not authenticate.
    for rec, _ in mine:
        sealer.forget(rec.epoch)
    new, _ = seal(sealer, pt, a)
    assert new.epoch not in epochs_a and _counter(new.nonce) == 0
    old_rec, old_ct = mine[-1]
    with pytest.raises(AuthenticationFailed):
        open_(sealer, SealRecord(new.epoch, old_rec.nonce, old_rec.tag), a, bytes(old_ct))
    assert sealer.destroy_scope(bytes(32), bytes(32)) == 0  # unknown scope: nothing


class _DestroyingCipher:
    """Stands in for a scope's AESGCM: runs the real one, then (or instead, with
    ``fail``) the scope is destroyed, as a concurrent Drop would do mid-call."""

    def __init__(self, sealer: BlockSealer, real: AESGCM, fail: bool = False) -> None:
        self.sealer, self.real, self.fail = sealer, real, fail

    def encrypt_into(self, *args: object) -> None:
        self.real.encrypt_into(*args)  # type: ignore[arg-type]
        self.sealer.destroy_scope(NS, TENANT)

    def decrypt_into(self, *args: object) -> None:
        if not self.fail:
            self.real.decrypt_into(*args)  # type: ignore[arg-type]
        self.sealer.destroy_scope(NS, TENANT)
        if self.fail:  # an older OpenSSL reading the wiped key computes garbage
            raise InvalidTag


@pytest.mark.parametrize("fail", [False, True], ids=["cipher-finished", "cipher-failed"])
def test_open_racing_destroy_is_key_destroyed_never_plaintext(fail: bool) -> None:
    sealer = BlockSealer()
    pt = os.urandom(128)
    rec, sealed = seal(sealer, pt, ad())
    epoch = sealer._epochs[rec.epoch]
    assert epoch.aead is not None
    epoch.aead = _DestroyingCipher(sealer, epoch.aead, fail)  # type: ignore[assignment]
    with pytest.raises(KeyDestroyed):  # not AuthenticationFailed: nobody tampered
        open_(sealer, rec, ad(), bytes(sealed))


def test_seal_racing_destroy_fails_and_burns_the_nonce() -> None:
    sealer = BlockSealer()
    seal(sealer, b"first", ad())
    epoch = sealer._epochs[0]
    assert epoch.aead is not None
    epoch.aead = _DestroyingCipher(sealer, epoch.aead)  # type: ignore[assignment]
    with pytest.raises(KeyDestroyed):
        seal(sealer, b"second", ad())
    assert sealer.live_epochs == 0 and sealer.live_scopes == 0


def test_many_scopes_share_locked_pages_and_reuse_wiped_slots() -> None:
    """Keys live in 4 KiB arena pages of 128 slots, not one locked page each."""
    sealer = BlockSealer()
    per_page = sealing._KeyArena(1).slots_per_page
    n = per_page + 5
    tenants = [os.urandom(32) for _ in range(n)]
    for t in tenants:
        seal(sealer, b"k", ad(tenant=t))
    pages, unlocked = sealer.key_pages
    assert pages == 2
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft >= 64 * 4096:
        assert unlocked == 0, "key pages are not mlocked"
    addrs = {e.slot_address for e in sealer._epochs.values()}
    assert len(addrs) == n  # one slot each
    freed = sealer._scopes[(NS, tenants[0])].current.slot_address  # type: ignore[union-attr]
    sealer.destroy_scope(NS, tenants[0])
    assert ctypes.string_at(freed, 32) == bytes(32)
    seal(sealer, b"k", ad(tenant=os.urandom(32)))  # takes the wiped slot again
    assert sealer.key_pages[0] == 2
    assert ctypes.string_at(freed, 32) != bytes(32)


def test_key_slots_are_bounded_and_a_refused_scope_leaves_nothing() -> None:
    sealer = BlockSealer(max_keys=1)  # rounds up to one page of slots
    per_page = sealing._KeyArena(1).slots_per_page
    for i in range(per_page):
        seal(sealer, b"k", ad(tenant=i.to_bytes(32, "big")))
    with pytest.raises(KeysExhausted) as e:
        seal(sealer, b"k", ad(tenant=b"\xff" * 32))
    assert e.value.code.name == "RESOURCE_EXHAUSTED"
    assert sealer.live_scopes == per_page and sealer.live_epochs == per_page
    sealer.destroy_scope(NS, (0).to_bytes(32, "big"))
    seal(sealer, b"k", ad(tenant=b"\xff" * 32))  # room again


# ---------------------------------------------------------------- streams


def _chunks(data: bytearray, sizes: list[int]) -> Iterator[memoryview]:
    """Consecutive views of ``data`` of the given sizes (the rest last)."""
    mv, at = memoryview(data), 0
    for n in [*sizes, len(data)]:
        if at < len(data):
            yield mv[at : min(len(data), at + n)]
            at += n


@pytest.mark.parametrize("sizes", [[], [1], [16, 16], [100, 7, 4096], [65536]])
def test_streamed_seal_and_open_are_the_one_shot_format(known_key: bytes, sizes: list[int]) -> None:
    """Chunked sealing gives the bytes and tag of ``seal_into`` (and of an
    independent AESGCM): the host-memory format does not depend on chunking."""
    pt = os.urandom(70001)
    block_ad = ad(generation=99)
    sealer = BlockSealer()
    stream = sealer.begin_seal(block_ad, len(pt))
    buf = bytearray(pt)
    for view in _chunks(buf, sizes):
        stream.update(view)
    rec = stream.finish()
    assert bytes(buf) + rec.tag == AESGCM(known_key).encrypt(rec.nonce, pt, block_ad.encode())
    rec2, _ = seal(sealer, pt, block_ad)
    assert rec2.nonce != rec.nonce  # a fresh nonce per block, streamed or not
    assert open_(sealer, rec, block_ad, bytes(buf) + rec.tag) == pt
    opened = sealer.begin_open(rec, block_ad, len(pt))
    for view in _chunks(buf, sizes[::-1]):
        opened.update(view)
    opened.finish()
    assert bytes(buf) == pt


def test_streamed_open_rejects_tampering_and_wrong_lengths() -> None:
    sealer = BlockSealer()
    pt = os.urandom(1000)
    rec, sealed = seal(sealer, pt, ad())
    bad = bytearray(flip(sealed[:1000], 8 * 999 + 3))
    s = sealer.begin_open(rec, ad(), 1000)
    s.update(memoryview(bad))
    with pytest.raises(AuthenticationFailed):
        s.finish()
    s = sealer.begin_open(rec, ad(generation=8), 1000)  # AAD bound
    s.update(memoryview(bytearray(sealed[:1000])))
    with pytest.raises(AuthenticationFailed):
        s.finish()
    s = sealer.begin_open(rec, ad(), 1000)
    s.update(memoryview(bytearray(sealed[:999])))
    with pytest.raises(SealingError):  # a byte missing is misuse, never success
        s.finish()
    s = sealer.begin_open(rec, ad(), 1000)
    with pytest.raises(SealingError):
        s.update(memoryview(bytearray(1001)))
    with pytest.raises(SealingError):
        s.finish()  # aborted by the misuse


def test_aborted_or_short_seal_stream_burns_its_nonce_and_releases_the_epoch() -> None:
    sealer = BlockSealer()
    s = sealer.begin_seal(ad(), 64)
    s.update(memoryview(bytearray(32)))
    with pytest.raises(SealingError):
        s.finish()  # 32 bytes never sealed: no record
    assert sealer.live_scopes == 0 and sealer.live_epochs == 0  # its reference went
    kept, _ = seal(sealer, b"kept", ad())  # keeps the epoch (and its key) alive
    s = sealer.begin_seal(ad(), 8)
    s.abort()
    s.abort()  # idempotent
    assert sealer._epochs[kept.epoch].live == 1  # the aborted block's reference went
    rec, _ = seal(sealer, b"x", ad())
    counters = [struct.unpack(">Q", r.nonce[4:])[0] for r in (kept, rec)]
    assert rec.epoch == kept.epoch and counters == [0, 2]  # nonce 1 burnt, never reused
    with pytest.raises(SealingError):
        s.update(memoryview(bytearray(1)))


def test_scope_destroyed_during_a_stream_is_key_destroyed_even_if_its_slot_is_reused() -> None:
    """The context was built from the key under the lock; a drop in the middle
    wipes the slot (another scope may take it at once): finish refuses, so
    nothing sealed or opened under the old key is used."""
    sealer = BlockSealer()
    rec, sealed = seal(sealer, b"y" * 64, ad())
    opening = sealer.begin_open(rec, ad(), 64)
    sealing_ = sealer.begin_seal(ad(), 64)
    opening.update(memoryview(bytearray(sealed[:32])))
    sealing_.update(memoryview(bytearray(32)))
    assert sealer.destroy_scope(NS, TENANT) == 1
    seal(sealer, b"z", ad(tenant=b"o" * 32))  # reuses the wiped slot
    opening.update(memoryview(bytearray(sealed[32:64])))
    sealing_.update(memoryview(bytearray(32)))
    with pytest.raises(KeyDestroyed):
        opening.finish()
    with pytest.raises(KeyDestroyed):
        sealing_.finish()
    with pytest.raises(KeyDestroyed):
        sealer.begin_open(rec, ad(), 64)
    assert sealer.live_scopes == 1  # only the other tenant's
