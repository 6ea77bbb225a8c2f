"""Store record format v1 and the keys behind it: strict parsing (every
truncation, wrong magic/version/kind/length/key), every bit authenticated,
every binding field bound, keyed names, derivation labels kept apart."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator

import pytest
from cryptography.hazmat.primitives import hashes, hmac
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from kvseal.server.keyarena import KeySlot
from kvseal.server.store.errors import (
    BadMagic,
    ForeignKey,
    LengthMismatch,
    RecordAuthenticationFailed,
    RecordTruncated,
    StoreIntegrityError,
    UnsupportedVersion,
    WrongKind,
)
from kvseal.server.store.keys import StoreKeys, slot_view
from kvseal.server.store.keysource import DeploymentKey
from kvseal.server.store.record import (
    HEADER_BYTES,
    KIND_BLOCK,
    KIND_FLOOR,
    KIND_SCOPE,
    MAGIC,
    OVERHEAD_BYTES,
    Binding,
    RecordHeader,
    next_generation,
    open_record,
    record_bytes,
    seal,
)

K = bytes(range(100, 132))
NS, TENANT, HASH = (hashlib.sha256(x).digest() for x in (b"ns", b"tenant", b"hash"))
EPOCH = b"\x01" * 8


def ident(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


@pytest.fixture
def keys() -> Iterator[StoreKeys]:
    k = StoreKeys(DeploymentKey(bytearray(K), "test"))
    yield k
    k.close()


@pytest.fixture
def slot(keys: StoreKeys) -> Iterator[KeySlot]:
    s = keys.take_scope_slot(NS, TENANT, EPOCH, bytearray(b"s" * 32))
    yield s
    keys.give_slot(s)


def make(
    keys: StoreKeys, slot: KeySlot, plaintext: bytes, binding: Binding | None = None
) -> tuple[bytearray, RecordHeader]:
    header = RecordHeader.fresh(KIND_BLOCK, keys.key_id, next_generation(), len(plaintext))
    data = seal(
        keys.record_key(slot, KIND_BLOCK, header.salt),
        header,
        binding or Binding(NS, TENANT, EPOCH, HASH),
        plaintext,
    )
    return data, header


def reopen(
    keys: StoreKeys, slot: KeySlot, data: bytearray, binding: Binding | None = None
) -> bytes:
    header = RecordHeader.parse(data, max_ct_len=1 << 20)
    header.expect(KIND_BLOCK, keys.key_id)
    key = keys.record_key(slot, KIND_BLOCK, header.salt)
    return bytes(open_record(key, data, header, binding or Binding(NS, TENANT, EPOCH, HASH)))


def test_round_trip_and_layout(keys: StoreKeys, slot: KeySlot) -> None:
    pt = bytes(range(256)) * 4
    data, header = make(keys, slot, pt)
    assert len(data) == record_bytes(len(pt)) == len(pt) + OVERHEAD_BYTES == len(pt) + 80
    assert data[:8] == MAGIC == b"KVSEALST"
    version, kind = struct.unpack_from(">HH", data, 8)
    assert (version, kind) == (1, KIND_BLOCK)
    assert data[12:20] == keys.key_id
    assert struct.unpack_from(">Q", data, 20)[0] == header.generation
    assert data[28:44] == header.salt and data[44:56] == header.nonce
    assert struct.unpack_from(">Q", data, 56)[0] == len(pt)
    assert pt not in bytes(data), "ciphertext only"
    # Nothing that identifies the block, tenant, namespace or epoch is stored.
    for secret in (NS, TENANT, HASH, EPOCH):
        assert secret not in bytes(data)
    assert reopen(keys, slot, data) == pt


def test_the_format_is_aes256gcm_over_header_and_binding(keys: StoreKeys, slot: KeySlot) -> None:
    """An independent reimplementation from the documented derivations opens it."""
    pt = b"kv" * 100
    data, header = make(keys, slot, pt)
    seed = b"s" * 32
    scope_key = HKDF(
        hashes.SHA256(), 32, None, b"kvseal/store/v1/block" + NS + TENANT + EPOCH
    ).derive(K + seed)
    assert bytes(slot_view(slot)) == scope_key
    record_key = HKDF(
        hashes.SHA256(), 32, None, b"kvseal/store/v1/record" + struct.pack(">H", 1) + header.salt
    ).derive(scope_key)
    aad = bytes(data[:HEADER_BYTES]) + NS + TENANT + EPOCH + HASH
    assert AESGCM(record_key).decrypt(header.nonce, bytes(data[HEADER_BYTES:]), aad) == pt


def test_keyed_names_and_key_id(keys: StoreKeys) -> None:
    name_key = HKDF(hashes.SHA256(), 32, None, b"kvseal/store/v1/name").derive(K)
    mac = hmac.HMAC(name_key, hashes.SHA256())
    mac.update(b"object\x00" + NS + TENANT + EPOCH + HASH)
    assert keys.object_name(NS, TENANT, EPOCH, HASH) == mac.finalize().hex()
    name = keys.object_name(NS, TENANT, EPOCH, HASH)
    assert len(name) == 64
    for secret in (NS, TENANT, HASH):
        assert secret.hex()[:16] not in name
    # Any input changes the name, and the domains differ.
    others = {
        keys.object_name(ident("x"), TENANT, EPOCH, HASH),
        keys.object_name(NS, ident("x"), EPOCH, HASH),
        keys.object_name(NS, TENANT, b"\x02" * 8, HASH),
        keys.object_name(NS, TENANT, EPOCH, ident("x")),
        keys.scope_name(NS, TENANT),
    }
    assert name not in others and len(others) == 5
    expected_id = HKDF(hashes.SHA256(), 8, None, b"kvseal/store/v1/key-id").derive(K)
    assert keys.key_id == expected_id
    other = StoreKeys(DeploymentKey(bytearray(bytes(range(1, 33))), "other"))
    try:
        assert other.key_id != keys.key_id
        assert other.object_name(NS, TENANT, EPOCH, HASH) != name
    finally:
        other.close()


def test_each_seal_draws_a_fresh_salt_and_nonce(keys: StoreKeys, slot: KeySlot) -> None:
    seen = set()
    for _ in range(50):
        data, header = make(keys, slot, b"same plaintext")
        seen.add((header.salt, header.nonce, bytes(data[HEADER_BYTES:])))
    assert len({s for s, _, _ in seen}) == len({n for _, n, _ in seen}) == 50
    assert len({c for _, _, c in seen}) == 50


def test_generations_strictly_increase() -> None:
    gens = [next_generation() for _ in range(1000)]
    assert gens == sorted(gens) and len(set(gens)) == 1000


def test_record_key_is_wiped_after_use(keys: StoreKeys, slot: KeySlot) -> None:
    header = RecordHeader.fresh(KIND_BLOCK, keys.key_id, 1, 3)
    rk = keys.record_key(slot, KIND_BLOCK, header.salt)
    assert any(rk)
    data = seal(rk, header, Binding(NS, TENANT, EPOCH, HASH), b"abc")
    assert rk == bytearray(32)
    rk2 = keys.record_key(slot, KIND_BLOCK, header.salt)
    assert bytes(open_record(rk2, data, header, Binding(NS, TENANT, EPOCH, HASH))) == b"abc"
    assert rk2 == bytearray(32)
    rk3 = keys.record_key(slot, KIND_BLOCK, header.salt)
    with pytest.raises(RecordAuthenticationFailed):
        open_record(rk3, data, header, Binding(NS, TENANT, EPOCH, ident("other")))
    assert rk3 == bytearray(32)


# ---------------------------------------------------------------- strict parsing


def test_every_truncation_is_detected_before_any_cipher(keys: StoreKeys, slot: KeySlot) -> None:
    data, _ = make(keys, slot, b"x" * 40)
    for n in range(len(data)):
        with pytest.raises(RecordTruncated):
            RecordHeader.parse(data[:n], max_ct_len=1 << 20)


def test_trailing_bytes_and_oversize(keys: StoreKeys, slot: KeySlot) -> None:
    data, _ = make(keys, slot, b"x" * 40)
    with pytest.raises(LengthMismatch):
        RecordHeader.parse(data + b"\0", max_ct_len=1 << 20)
    with pytest.raises(LengthMismatch):
        RecordHeader.parse(data, max_ct_len=39)
    bigger = bytearray(data)
    struct.pack_into(">Q", bigger, 56, 2**63)
    with pytest.raises(LengthMismatch):
        RecordHeader.parse(bigger, max_ct_len=1 << 20)
    shorter = bytearray(data)
    struct.pack_into(">Q", shorter, 56, 39)
    with pytest.raises(LengthMismatch):
        RecordHeader.parse(shorter, max_ct_len=1 << 20)


@pytest.mark.parametrize(
    ("offset", "value", "error"),
    [
        (0, b"KVSEALSX", BadMagic),
        (0, b"\0" * 8, BadMagic),
        (8, struct.pack(">H", 2), UnsupportedVersion),
        (8, struct.pack(">H", 0), UnsupportedVersion),
        (10, struct.pack(">H", 9), WrongKind),
        (10, struct.pack(">H", KIND_SCOPE), WrongKind),
        (10, struct.pack(">H", KIND_FLOOR), WrongKind),
        (12, b"\xff" * 8, ForeignKey),
    ],
)
def test_header_fields_are_checked(
    keys: StoreKeys, slot: KeySlot, offset: int, value: bytes, error: type[Exception]
) -> None:
    data, _ = make(keys, slot, b"x" * 40)
    data[offset : offset + len(value)] = value
    with pytest.raises(error):
        reopen(keys, slot, data)
    # An unknown version is a newer writer's record (the store: a miss), not tampering.
    assert issubclass(error, StoreIntegrityError) != (error is UnsupportedVersion)


def test_every_flipped_bit_fails(keys: StoreKeys, slot: KeySlot) -> None:
    """Every bit of a small record: a format error or an authentication failure
    (or, in the version field, an unknown version: a miss for the store), never
    other bytes (the header bits too: the header is associated data)."""
    pt = b"0123456789abcdef"
    data, _ = make(keys, slot, pt)
    for i in range(len(data) * 8):
        bad = bytearray(data)
        bad[i // 8] ^= 1 << (i % 8)
        with pytest.raises((StoreIntegrityError, UnsupportedVersion)):
            reopen(keys, slot, bad)


@pytest.mark.parametrize("field", ["namespace", "tenant", "epoch_id", "block_hash"])
def test_every_binding_field_is_bound(keys: StoreKeys, slot: KeySlot, field: str) -> None:
    data, _ = make(keys, slot, b"payload")
    good = Binding(NS, TENANT, EPOCH, HASH)
    values = {
        "namespace": ident("ns2"),
        "tenant": ident("t2"),
        "epoch_id": b"\x09" * 8,
        "block_hash": ident("h2"),
    }
    other = Binding(**{**{f: getattr(good, f) for f in values}, field: values[field]})
    with pytest.raises(RecordAuthenticationFailed):
        reopen(keys, slot, data, other)


def test_another_scope_key_fails(keys: StoreKeys, slot: KeySlot) -> None:
    data, _ = make(keys, slot, b"payload")
    other = keys.take_scope_slot(NS, TENANT, EPOCH, bytearray(b"t" * 32))  # another seed
    try:
        with pytest.raises(RecordAuthenticationFailed):
            reopen(keys, other, data)
    finally:
        keys.give_slot(other)


def test_keys_close_wipes_and_refuses(keys: StoreKeys, slot: KeySlot) -> None:
    view = slot_view(slot)
    assert any(view)
    assert "key_id=" in repr(keys) and K.hex() not in repr(keys)
    keys.close()
    assert not any(view)
    with pytest.raises(Exception, match="closed"):
        keys.object_name(NS, TENANT, EPOCH, HASH)
