"""Protobuf wire-format helpers and structure-aware byte mutators for the fuzzer.

A serialized message is split into its top-level fields (number, wire type,
body); mutators change the message at that level (drop, duplicate, reorder a
field, change its wire type, lie about a length, overlong or huge varints,
non-UTF-8 or NUL bytes inside a length-delimited payload, unknown fields,
nested mutation of a sub-message) or at the byte level (bit flips, truncation,
insertion, deletion, splicing two messages). No mutator raises: each returns
bytes, and whether they still parse is decided by the real protobuf parser
(``google.protobuf``), the same one the daemon uses, so the fuzzer knows which
status the daemon owes (a body that does not parse is INVALID_ARGUMENT /
BAD_REQUEST).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

VARINT, I64, LEN, SGROUP, EGROUP, I32 = 0, 1, 2, 3, 4, 5


def enc_varint(n: int) -> bytes:
    """Varint of ``n`` (negative numbers as their 64-bit two's complement)."""
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def read_varint(data: bytes, i: int) -> tuple[int, int] | None:
    """(value, next index), or None when the varint runs off the end or past 10 bytes."""
    n = shift = 0
    for k in range(10):
        if i + k >= len(data):
            return None
        b = data[i + k]
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i + k + 1
    return None


@dataclass
class Field:
    """One top-level field. ``body``: the varint bytes, the 4/8 fixed bytes, or
    a length-delimited payload (without its length prefix)."""

    number: int
    wire: int
    body: bytes

    def encode(self) -> bytes:
        tag = enc_varint((self.number << 3) | self.wire)
        if self.wire == LEN:
            return tag + enc_varint(len(self.body)) + self.body
        return tag + self.body


def field(number: int, wire: int, body: bytes) -> bytes:
    return Field(number, wire, body).encode()


def split(data: bytes) -> list[Field] | None:
    """The top-level fields of ``data``, or None if it is not well-formed wire
    format (groups count as not well-formed here)."""
    out: list[Field] = []
    i = 0
    while i < len(data):
        t = read_varint(data, i)
        if t is None:
            return None
        tag, i = t
        number, wire = tag >> 3, tag & 7
        if number == 0:
            return None
        if wire == VARINT:
            v = read_varint(data, i)
            if v is None:
                return None
            out.append(Field(number, wire, data[i : v[1]]))
            i = v[1]
        elif wire in (I64, I32):
            size = 8 if wire == I64 else 4
            if i + size > len(data):
                return None
            out.append(Field(number, wire, data[i : i + size]))
            i += size
        elif wire == LEN:
            v = read_varint(data, i)
            if v is None or v[1] + v[0] > len(data):
                return None
            out.append(Field(number, wire, data[v[1] : v[1] + v[0]]))
            i = v[1] + v[0]
        else:
            return None
    return out


def join(fields: list[Field]) -> bytes:
    return b"".join(f.encode() for f in fields)


# ----------------------------------------------------------------- mutators

NASTY_BYTES = (b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x00", b"\n", b"\x80")
Mutator = Callable[[random.Random, bytes], bytes]


def _pick_len(rnd: random.Random, fields: list[Field]) -> int | None:
    idx = [i for i, f in enumerate(fields) if f.wire == LEN]
    return rnd.choice(idx) if idx else None


def m_flip(rnd: random.Random, data: bytes) -> bytes:
    if not data:
        return b"\x00"
    b = bytearray(data)
    i = rnd.randrange(len(b))
    b[i] ^= 1 << rnd.randrange(8)
    return bytes(b)


def m_set_byte(rnd: random.Random, data: bytes) -> bytes:
    if not data:
        return bytes([rnd.randrange(256)])
    b = bytearray(data)
    b[rnd.randrange(len(b))] = rnd.choice((0x00, 0xFF, 0x80, 0x7F, rnd.randrange(256)))
    return bytes(b)


def m_truncate(rnd: random.Random, data: bytes) -> bytes:
    return data[: rnd.randrange(len(data))] if data else data


def m_insert(rnd: random.Random, data: bytes) -> bytes:
    i = rnd.randrange(len(data) + 1)
    junk = rnd.choice((rnd.randbytes(rnd.randint(1, 8)), *NASTY_BYTES))
    return data[:i] + junk + data[i:]


def m_delete(rnd: random.Random, data: bytes) -> bytes:
    if not data:
        return data
    i = rnd.randrange(len(data))
    return data[:i] + data[i + rnd.randint(1, 8) :]


def m_splice(rnd: random.Random, data: bytes) -> bytes:
    """Protobuf concatenation is a merge: repeated fields grow, scalars take the last."""
    if not data:
        return data
    i = rnd.randrange(len(data) + 1)
    return data[:i] + data if rnd.random() < 0.5 else data + data[i:]


def _fieldwise(fn: Callable[[random.Random, list[Field]], list[Field] | None]) -> Mutator:
    def mutate(rnd: random.Random, data: bytes) -> bytes:
        fields = split(data)
        if fields is None:
            return m_flip(rnd, data)
        out = fn(rnd, fields)
        return m_flip(rnd, data) if out is None else join(out)

    mutate.__name__ = fn.__name__
    return mutate


@_fieldwise
def m_drop_field(rnd: random.Random, fields: list[Field]) -> list[Field] | None:
    if not fields:
        return None
    del fields[rnd.randrange(len(fields))]
    return fields


@_fieldwise
def m_dup_field(rnd: random.Random, fields: list[Field]) -> list[Field] | None:
    """Repeat a field 1..200 times: duplicates in repeated fields, last-wins scalars."""
    if not fields:
        return None
    i = rnd.randrange(len(fields))
    n = rnd.choice((1, 1, 2, 5, 200))
    return fields[: i + 1] + [fields[i]] * n + fields[i + 1 :]


@_fieldwise
def m_shuffle(rnd: random.Random, fields: list[Field]) -> list[Field] | None:
    rnd.shuffle(fields)
    return fields


@_fieldwise
def m_wire_type(rnd: random.Random, fields: list[Field]) -> list[Field] | None:
    """Re-tag a field with another wire type, re-encoding its body to fit."""
    if not fields:
        return None
    i = rnd.randrange(len(fields))
    f = fields[i]
    wire = rnd.choice([w for w in (VARINT, I64, LEN, I32) if w != f.wire])
    body = {
        VARINT: enc_varint(len(f.body)),
        I64: (f.body + bytes(8))[:8],
        I32: (f.body + bytes(4))[:4],
        LEN: f.body,
    }[wire]
    fields[i] = Field(f.number, wire, body)
    return fields


def m_bad_length(rnd: random.Random, data: bytes) -> bytes:
    """A length prefix that claims more (or fewer) bytes than follow."""
    fields = split(data)
    if not fields:
        return m_truncate(rnd, data)
    i = _pick_len(rnd, fields)
    if i is None:
        return m_truncate(rnd, data)
    f = fields[i]
    claim = rnd.choice((len(f.body) + 1, len(f.body) + 1000, 2**31, 2**63, max(0, len(f.body) - 1)))
    raw = enc_varint((f.number << 3) | LEN) + enc_varint(claim) + f.body
    return join(fields[:i]) + raw + join(fields[i + 1 :])


@_fieldwise
def m_varint(rnd: random.Random, fields: list[Field]) -> list[Field] | None:
    """Huge, negative, overlong (valid, padded with 0x80) or 11-byte varints."""
    idx = [i for i, f in enumerate(fields) if f.wire == VARINT]
    if not idx:
        return None
    i = rnd.choice(idx)
    kind = rnd.randrange(4)
    if kind == 0:
        body = enc_varint(rnd.choice((2**32, 2**32 - 1, 2**63, 2**64 - 1, 2**31)))
    elif kind == 1:
        body = enc_varint(-rnd.randint(1, 2**31))
    elif kind == 2:
        v = read_varint(fields[i].body, 0)
        n = v[0] if v else 0
        raw = bytearray(enc_varint(n))
        raw[-1] |= 0x80
        body = bytes(raw) + b"\x80" * max(0, 8 - len(raw)) + b"\x00"
    else:
        body = b"\xff" * 10 + b"\x01"
    fields[i] = Field(fields[i].number, VARINT, body)
    return fields


@_fieldwise
def m_nasty_payload(rnd: random.Random, fields: list[Field]) -> list[Field] | None:
    """NUL, newline or non-UTF-8 bytes inside a length-delimited payload."""
    i = _pick_len(rnd, fields)
    if i is None:
        return None
    f = fields[i]
    j = rnd.randrange(len(f.body) + 1)
    fields[i] = Field(f.number, LEN, f.body[:j] + rnd.choice(NASTY_BYTES) + f.body[j:])
    return fields


@_fieldwise
def m_resize_payload(rnd: random.Random, fields: list[Field]) -> list[Field] | None:
    """A length-delimited field of another size: empty, one byte off, or large."""
    i = _pick_len(rnd, fields)
    if i is None:
        return None
    f = fields[i]
    size = rnd.choice((0, max(0, len(f.body) - 1), len(f.body) + 1, 64, 4096, 100_000))
    body = (f.body * (size // max(1, len(f.body)) + 1))[:size] if f.body else bytes(size)
    fields[i] = Field(f.number, LEN, body)
    return fields


@_fieldwise
def m_unknown_field(rnd: random.Random, fields: list[Field]) -> list[Field] | None:
    """An extra field of a number the schema does not have (proto3 ignores it)."""
    number = rnd.choice((15, 99, 1000, 2**29 - 1))
    wire = rnd.choice((VARINT, I64, LEN, I32))
    body = {
        VARINT: enc_varint(rnd.getrandbits(64)),
        I64: rnd.randbytes(8),
        I32: rnd.randbytes(4),
        LEN: rnd.randbytes(rnd.randint(0, 64)),
    }[wire]
    fields.insert(rnd.randrange(len(fields) + 1), Field(number, wire, body))
    return fields


@_fieldwise
def m_nested(rnd: random.Random, fields: list[Field]) -> list[Field] | None:
    """Mutate a sub-message (e.g. the geometry, a buffer, a segment) and wrap it
    again with a correct length, so the outer message stays well-formed."""
    idx = [i for i, f in enumerate(fields) if f.wire == LEN and split(f.body)]
    if not idx:
        return None
    i = rnd.choice(idx)
    inner = rnd.choice(STRUCTURAL)(rnd, fields[i].body)
    fields[i] = Field(fields[i].number, LEN, inner)
    return fields


STRUCTURAL: tuple[Mutator, ...] = (
    m_drop_field,
    m_dup_field,
    m_shuffle,
    m_wire_type,
    m_varint,
    m_nasty_payload,
    m_resize_payload,
    m_unknown_field,
    m_flip,
    m_set_byte,
)

MUTATORS: tuple[Mutator, ...] = (
    *STRUCTURAL,
    m_nested,
    m_nested,
    m_nested,
    m_bad_length,
    m_truncate,
    m_insert,
    m_delete,
    m_splice,
)


def mutate(rnd: random.Random, data: bytes) -> tuple[bytes, list[str]]:
    """Apply 1..3 random mutators; returns the bytes and the mutators' names."""
    names = []
    for _ in range(rnd.choice((1, 1, 1, 2, 3))):
        m = rnd.choice(MUTATORS)
        names.append(m.__name__)
        data = m(rnd, data)
    return data, names
