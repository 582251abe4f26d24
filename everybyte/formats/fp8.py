"""FP8 E4M3 (float8_e4m3fn) with a float32 scale per tensor or per channel (`axis`).

x ~= float(q) * scale. `quantize` picks scale = amax / 448 (per tensor, or per slice along
`axis`); an all-zero tensor or channel gets scale 1.0 so it decodes to zeros. Values beyond
+-448 * scale saturate to +-448 (never NaN), rounding is to nearest, ties to even (torch's
float32 -> float8_e4m3fn conversion). Bad input: NaN/Inf -> ValueError naming the first bad
index; non-float dtype -> TypeError; empty tensors round-trip.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from everybyte.formats import container
from everybyte.formats.fastpath import Compiled

E4M3_MAX = 448.0


def _quantize_raw(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    y = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX)
    return torch.nan_to_num(y, nan=0.0).to(torch.float8_e4m3fn)


def _dequantize_raw(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


_quantize_path = Compiled(_quantize_raw, _quantize_raw)
_dequantize_path = Compiled(_dequantize_raw, _dequantize_raw)


def quantize_raw(x: torch.Tensor, scale, *, fast: str | None = None) -> torch.Tensor:
    """x / scale as float8_e4m3fn, saturating at +-448; a zero scale gives 0 for 0 (never NaN). No checks."""
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    return _quantize_path(x, s, numel=x.numel(), fast=fast)


def dequantize_raw(q: torch.Tensor, scale, dtype: torch.dtype = torch.float32, *, fast: str | None = None) -> torch.Tensor:
    s = torch.as_tensor(scale, dtype=torch.float32, device=q.device)
    return _dequantize_path(q, s, dtype, numel=q.numel(), fast=fast)


@dataclass
class FP8Tensor:
    data: torch.Tensor      # float8_e4m3fn, the input's shape
    scale: torch.Tensor     # float32: 0-d, or [shape[axis]] per channel
    axis: int | None
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scale.numel() * 4

    def broadcast_scale(self) -> torch.Tensor:
        return _broadcast(self.scale, self.axis, len(self.shape))

    def to_bytes(self) -> bytes:
        axis = torch.tensor(-1 if self.axis is None else self.axis, dtype=torch.int64)
        return container.pack("fp8_e4m3", self.shape, [self.data, self.scale, axis])

    @classmethod
    def from_bytes(cls, buf) -> "FP8Tensor":
        shape, tensors = container.unpack(buf, "fp8_e4m3")
        if len(tensors) != 3:
            raise ValueError(f"fp8 buffer holds {len(tensors)} tensors, expected 3")
        data, scale, axis = tensors
        axis = int(axis)
        if tuple(data.shape) != shape or data.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
            raise ValueError(f"fp8 buffer is inconsistent: data {tuple(data.shape)} {data.dtype}, shape {shape}")
        if scale.numel() != (1 if axis < 0 else shape[axis]):
            raise ValueError(f"fp8 buffer scale has {scale.numel()} values for axis {axis} of shape {shape}")
        return cls(data, scale, None if axis < 0 else axis, shape)


def _broadcast(scale: torch.Tensor, axis: int | None, ndim: int) -> torch.Tensor:
    return scale if axis is None else scale.reshape([-1] + [1] * (ndim - axis - 1))


def _normalize_axis(axis: int | None, ndim: int) -> int | None:
    if axis is None:
        return None
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} out of range for a {ndim}-d tensor")
    return axis % ndim


def _amax(x: torch.Tensor, axis: int | None) -> torch.Tensor:
    if axis is None:
        return container.abs_max(x)
    if x.numel() == 0:
        return torch.zeros(x.shape[axis], dtype=torch.float32, device=x.device)
    dims = [d for d in range(x.dim()) if d != axis]
    return x.abs().amax(dim=dims).float() if dims else x.abs().float()


def _check_scale(scale, axis: int | None, x: torch.Tensor) -> torch.Tensor:
    s = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    want = () if axis is None else (x.shape[axis],)
    if s.numel() == 1 and axis is None:
        s = s.reshape(())
    if tuple(s.shape) != want:
        raise ValueError(f"scale has shape {tuple(s.shape)}, expected {want} for axis={axis}")
    if not bool((torch.isfinite(s) & (s > 0)).all()):
        raise ValueError("scale must be finite and positive")
    return s


def quantize(x: torch.Tensor, scale=None, axis: int | None = None) -> FP8Tensor:
    container.check_float(x)
    axis = _normalize_axis(axis, x.dim())
    amax = _amax(x, axis)
    container.check_finite(x, amax)
    if scale is None:
        s = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    else:
        s = _check_scale(scale, axis, x)
    data = quantize_raw(x, _broadcast(s, axis, x.dim()))
    return FP8Tensor(data, s, axis, tuple(x.shape))


def dequantize(t: FP8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_raw(t.data, t.broadcast_scale(), dtype)
