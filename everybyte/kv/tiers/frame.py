"""The frame every persisted or transferred block value travels in (magic, length, xxh3-64 of the
payload): disk, shared-dir and Redis tiers store it, the KV connector sends it. Torch-free, so the
connector's control side (kv/connector) checks frames without the data plane."""
from __future__ import annotations

import struct

import xxhash

FRAME = struct.Struct("<4s4xQQ")   # magic, padding (payloads stay 8-byte aligned), payload length, checksum
FRAME_MAGIC = b"EBT2"


def checksum(data: bytes | bytearray | memoryview) -> int:
    """xxh3-64 of a byte view. It runs at ~23 GB/s here against zlib.crc32's ~3, which made the
    checks a third of a disk tier load."""
    return int(xxhash.xxh3_64_intdigest(data))


def frame_header(payload: memoryview) -> bytes:
    return FRAME.pack(FRAME_MAGIC, len(payload), checksum(payload))


def unframe(buf: bytes | bytearray | memoryview) -> memoryview | None:
    """The payload of a framed value, None when truncated or corrupt."""
    mv = memoryview(buf).cast("B")
    if len(mv) < FRAME.size:
        return None
    magic, n, crc = FRAME.unpack(mv[:FRAME.size])
    payload = mv[FRAME.size:]
    if magic != FRAME_MAGIC or n != len(payload) or checksum(payload) != crc:
        return None
    return payload
