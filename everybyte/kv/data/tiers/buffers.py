"""Byte helpers the tier backends share: views of bytes-like data or uint8 tensors. The frame
(magic, length, checksum) that backends persisting bytes wrap each value in is kv/tiers/frame."""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

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
