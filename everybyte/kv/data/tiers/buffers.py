"""Byte helpers the tier backends share: views of bytes-like data or uint8 tensors, the xxh3
checksum, and the frame (magic, length, checksum) that backends persisting bytes (disk, shared
dir, Redis) wrap each value in."""
from __future__ import annotations

import struct
import warnings
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    import torch

FRAME = struct.Struct("<4s4xQQ")   # magic, padding (payloads stay 8-byte aligned), payload length, checksum
FRAME_MAGIC = b"EBT2"


def nbytes_of(data) -> int:
    return data.numel() * data.element_size() if hasattr(data, "numel") else len(memoryview(data))


def as_bytes_view(data) -> memoryview:
    """A byte view of bytes/bytearray/memoryview or a CPU uint8 tensor, without copying."""
    if hasattr(data, "numpy"):
        return memoryview(data.detach().contiguous().numpy()).cast("B")
    return memoryview(data).cast("B")


def as_uint8_tensor(data) -> torch.Tensor:
    """A 1-D uint8 CPU tensor over bytes-like data (no copy; read-only buffers are fine to read)."""
    import torch
    if isinstance(data, torch.Tensor):
        if data.dtype != torch.uint8 or data.dim() != 1 or data.is_cuda:
            raise TypeError("an encoded block tensor is 1-D uint8 on the CPU")
        return data
    if len(memoryview(data)) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(data, dtype=torch.uint8)


def checksum(data) -> int:
    """xxh3-64 of a byte view. It runs at ~23 GB/s here against zlib.crc32's ~3, which made the
    checks a third of a disk tier load."""
    return xxhash.xxh3_64_intdigest(data)


def frame_header(payload: memoryview) -> bytes:
    return FRAME.pack(FRAME_MAGIC, len(payload), checksum(payload))


def unframe(buf) -> memoryview | None:
    """The payload of a framed value, None when truncated or corrupt."""
    mv = memoryview(buf).cast("B")
    if len(mv) < FRAME.size:
        return None
    magic, n, crc = FRAME.unpack(mv[:FRAME.size])
    payload = mv[FRAME.size:]
    if magic != FRAME_MAGIC or n != len(payload) or checksum(payload) != crc:
        return None
    return payload
