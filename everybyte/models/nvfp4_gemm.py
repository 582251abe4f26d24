"""x @ W^T for a weight kept in NVFP4: the fused CPU kernel and the dequantize-then-matmul path.

`linear(x, weight, bias)` picks, per call:
- small batches (x rows <= GEMV_MAX_ROWS) on CPU: the C kernel (native/csrc/nvfp4_gemm.c, via models/native_ops), which
  decodes codes and block scales in registers and accumulates in float32 (AVX-512, AVX2 or
  portable C, whatever this CPU has);
- anything else (prefill chunks, other devices, no C compiler): the weight dequantized into a
  reused panel of the compute dtype, then the ordinary GEMM (`gemm.linear`: oneDNN on CPU, at
  most PANEL_BYTES of panel at a time). This is also the reference the kernel is tested against.
"""
from __future__ import annotations

import ctypes
import threading

import torch

from everybyte.formats.nvfp4_weights import PackedPart
from everybyte.models import gemm, native_ops

GEMV_MAX_ROWS = 32          # the fused kernel is faster up to here (measured: 32-64 rows), see README "Weights"
PANEL_BYTES = 16 << 20
_scratch = threading.local()


def kernel_available() -> bool:
    return native_ops.lib() is not None


class PackedWeight:
    """A linear layer's NVFP4 weight: one part, or several stacked by rows (fused q/k/v, gate/up),
    each keeping its own tensors (memory-mapped ones stay in place) and tensor scale."""

    def __init__(self, parts: list[PackedPart]):
        k2 = {p.data.shape[1] for p in parts}
        if len(k2) != 1:
            raise ValueError(f"parts of one weight have different in-dimensions: {sorted(2 * k for k in k2)}")
        self.parts = parts
        self.in_features, self.out_features = 2 * k2.pop(), sum(p.rows for p in parts)
        self.device = parts[0].data.device
        n = len(parts)
        self._c = ((ctypes.c_int64 * n)(*(p.data.data_ptr() for p in parts)),
                   (ctypes.c_int64 * n)(*(p.scales.data_ptr() for p in parts)),
                   (ctypes.c_float * n)(*(p.global_scale for p in parts)),
                   (ctypes.c_int64 * n)(*(p.rows for p in parts)), n)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantize(self, dtype: torch.dtype, out: torch.Tensor | None = None, rows: tuple[int, int] | None = None,
                   unscaled: bool = False) -> torch.Tensor:
        """Rows [r0, r1) (default all) as [r1 - r0, in] of dtype, written into `out` when given.
        unscaled: without the parts' tensor scales (E2M1 x E4M3 has at most 6 significant bits,
        so these values are exact in bfloat16 too)."""
        r0, r1 = rows or (0, self.out_features)
        out = torch.empty(r1 - r0, self.in_features, dtype=dtype, device=self.device) if out is None else out
        at = 0
        for p in self.parts:
            lo, hi = max(r0, at), min(r1, at + p.rows)
            if lo < hi:
                sub = PackedPart(p.data[lo - at:hi - at], p.scales[lo - at:hi - at], 1.0 if unscaled else p.global_scale)
                sub.dequantize(dtype, out=out[lo - r0:hi - r0])
            at += p.rows
        return out


def _panel(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    key = (dtype, str(device))
    buf = getattr(_scratch, "panels", {}).get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        _scratch.__dict__.setdefault("panels", {})[key] = buf
    return buf[:numel]


def _scaled(out: torch.Tensor, w: PackedWeight, r0: int, r1: int, bias: torch.Tensor | None) -> torch.Tensor:
    """Columns [r0, r1) of the unscaled product times each part's tensor scale, plus bias."""
    at = 0
    for p in w.parts:
        lo, hi = max(r0, at), min(r1, at + p.rows)
        if lo < hi:
            out[..., lo - r0:hi - r0].mul_(p.global_scale)
        at += p.rows
    return out if bias is None else out.add_(bias[r0:r1])


def reference_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize-then-matmul, PANEL_BYTES of weight at a time: the panel holds E2M1 x E4M3
    (exact in the compute dtype), the tensor scales multiply the product."""
    n, k = w.out_features, w.in_features
    step = max(1, PANEL_BYTES // (k * x.element_size()))
    out = None if step >= n else torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        panel = _panel((r1 - r0) * k, x.dtype, x.device).view(r1 - r0, k)
        y = _scaled(gemm.linear(x, w.dequantize(x.dtype, panel, (r0, r1), unscaled=True)), w, r0, r1, bias)
        if out is None:
            return y
        out[..., r0:r1] = y
    return out


def fused_linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The C kernel: x [M, K] float32/bfloat16 contiguous on CPU."""
    lib = native_ops.lib()
    if lib is None:
        raise RuntimeError(f"NVFP4 GEMM kernel unavailable: {native_ops.error()}")
    m = x.shape[0]
    out = torch.empty(m, w.out_features, dtype=x.dtype)
    if bias is not None:
        bias = bias.float().contiguous()
    bf16 = int(x.dtype is torch.bfloat16)
    q, s, gs, rows, nseg = w._c
    lib.nvfp4_linear(x.data_ptr(), bf16, m, w.in_features, nseg, q, s, gs, rows,
                     None if bias is None else bias.data_ptr(), out.data_ptr(), bf16, torch.get_num_threads())
    return out


def linear(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if (x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and x.device.type == "cpu" and x.is_contiguous()
            and x.dtype in (torch.float32, torch.bfloat16) and x.shape[1] == w.in_features and native_ops.lib() is not None):
        return fused_linear(x, w, bias)
    return reference_linear(x, w, bias)
