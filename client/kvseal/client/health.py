"""The ``grpc.health.v1`` Check call's messages, encoded by hand.

The client installs with grpcio and protobuf only, so it does not depend on
grpcio-health-checking for two one-field messages: HealthCheckRequest is
``{string service = 1}``, HealthCheckResponse is ``{ServingStatus status = 1}``.
"""

from __future__ import annotations

HEALTH_METHOD = "/grpc.health.v1.Health/Check"
# ServingStatus values by number.
HEALTH_STATUS = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def encode_health_request(service: str) -> bytes:
    """A HealthCheckRequest for ``service`` ("" for the whole daemon)."""
    raw = service.encode()
    return b"\x0a" + _varint(len(raw)) + raw if raw else b""


def decode_health_status(data: bytes) -> int:
    """The ``status`` of a HealthCheckResponse (0, UNKNOWN, when absent); other
    fields are skipped."""
    i, status = 0, 0
    while i < len(data):
        key = data[i]
        i += 1
        value, shift = 0, 0
        while True:  # every field of this message is a varint or length-delimited
            b = data[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        if key == 0x08:
            status = value
        elif key & 7 == 2:
            i += value
    return status
