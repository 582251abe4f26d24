"""NVFP4 block kernels: 16 values -> 16 E2M1 codes (8 bytes) + one E4M3 scale.

No validation here (that is `nvfp4.quantize`'s job; NaN/Inf give unspecified codes); any
leading dims, last dim a multiple of 16, CPU or CUDA. `s_dec` is the tensor scale in decode
form (amax / 2688): a float, a 0-d tensor, or a tensor broadcastable to the scales' shape
`[..., n // 16]`. Implementations with identical bytes (tests/test_nvfp4.py checks it): the
eager torch reference; on CPU the fused C kernels of `cpu_kernels`; elsewhere `torch.compile`
of an elementwise formulation (`fastpath` says which one runs).
"""
from __future__ import annotations

import torch

from everybyte.formats import container, cpu_kernels, fastpath

BLOCK = 16
E4M3_MAX = 448.0
# |y| > b for the i-th boundary -> code >= i + 1. Ties go to the even code, so the boundaries
# before an even code (0.75, 1.75, 3.5) are the float just below the tie.
TIE_BOUNDS = (0.25, 0.74999994, 1.25, 1.7499999, 2.5, 3.4999998, 5.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_tables: dict[tuple, torch.Tensor] = {}


def _table(values, device) -> torch.Tensor:
    key = (values, device)
    if key not in _tables:
        _tables[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return _tables[key]


def _block_scales(x: torch.Tensor, s: torch.Tensor):
    """x [N, 16] float32 -> (e4m3 scales [N, 1], float32 divisor float(scale) * s_dec [N, 1])."""
    vmax = x.abs().amax(-1, keepdim=True)
    sf = torch.where(s > 0, vmax / (6.0 * s), 0.0)
    sf8 = sf.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    return sf8, sf8.float() * s


def _quantize_ref(x: torch.Tensor, s: torch.Tensor):
    x = x.float()
    sf8, d = _block_scales(x, s)
    y = torch.where(d > 0, x / d, 0.0).abs_()
    code = torch.bucketize(y, _table(TIE_BOUNDS, x.device)).to(torch.uint8)
    code |= torch.signbit(x).to(torch.uint8) << 3
    pairs = code.view(-1, BLOCK // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), sf8.squeeze(-1)


def _quantize_elementwise(x: torch.Tensor, s: torch.Tensor):
    """The same codes as plain elementwise arithmetic, for torch.compile (Triton on CUDA)."""
    x = x.float()
    sf8, d = _block_scales(x, s)
    a = torch.where(d > 0, x / d, 0.0).abs()
    code = torch.where(a < 2.0, torch.round(a * 2.0), torch.where(a < 4.0, torch.round(a) + 2.0, torch.round(a * 0.5) + 4.0))
    code = code.clamp(max=7.0) + torch.signbit(x).float() * 8.0
    pairs = code.view(-1, BLOCK // 2, 2)
    return (pairs[..., 0] + pairs[..., 1] * 16.0).to(torch.uint8), sf8.squeeze(-1)


def _dequantize_ref(packed: torch.Tensor, scales: torch.Tensor, s: torch.Tensor, dtype: torch.dtype):
    codes = torch.stack((packed & 0xF, packed >> 4), -1).view(-1, BLOCK)
    values = _table(E2M1_VALUES, packed.device)[codes.long()]
    return (values * scales.float().unsqueeze(-1) * s).to(dtype)


def _dequantize_elementwise(packed: torch.Tensor, scales: torch.Tensor, s: torch.Tensor, dtype: torch.dtype):
    codes = torch.stack((packed & 0xF, packed >> 4), -1).view(-1, BLOCK).to(torch.int32)
    e, m = (codes >> 1) & 3, (codes & 1).float()
    mag = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * torch.exp2((e - 1).float()))
    values = torch.where((codes & 8) != 0, -mag, mag)
    return (values * scales.float().unsqueeze(-1) * s).to(dtype)


_quantize_compiled = fastpath.Compiled(_quantize_elementwise, _quantize_ref)
_dequantize_compiled = fastpath.Compiled(_dequantize_elementwise, _dequantize_ref)


def _per_block(s_dec, device, lead_shape) -> torch.Tensor:
    """s_dec as float32: 0-d, or one value per block [N, 1] (blocks flattened)."""
    s = torch.as_tensor(s_dec, dtype=torch.float32, device=device)
    return s.reshape(()) if s.numel() == 1 else s.expand(lead_shape).reshape(-1, 1)


def abs_max(x: torch.Tensor, *, fast: str | None = None) -> torch.Tensor:
    """max |x| as a float32 0-d tensor (non-finite if any element is NaN or Inf; 0 if empty)."""
    if x.numel() and fastpath.resolve(fast) != "never" and x.device.type == "cpu" and cpu_kernels.available():
        amax = cpu_kernels.abs_max(x)
        if amax is not None:
            return amax
    return container.abs_max(x)


def quantize_blocks(x: torch.Tensor, s_dec, *, fast: str | None = None):
    """x [..., n] (n % 16 == 0) -> (uint8 [..., n//2] packed codes, float8_e4m3fn [..., n//16] scales).

    `fast`: None follows `fastpath.get_mode()`; "always" / "never" force the fused or the eager path.
    """
    lead, n = x.shape[:-1], x.shape[-1]
    s = _per_block(s_dec, x.device, (*lead, n // BLOCK))
    xb = x.reshape(-1, BLOCK)
    mode = fastpath.resolve(fast)
    if mode != "never" and x.device.type == "cpu" and cpu_kernels.available():
        packed, scales = cpu_kernels.quantize(xb, s.reshape(-1))
    else:
        packed, scales = _quantize_compiled(xb, s, numel=x.numel(), fast="never" if x.device.type == "cpu" else mode)
    return packed.reshape(*lead, n // 2), scales.reshape(*lead, n // BLOCK)


def dequantize_blocks(packed: torch.Tensor, scales: torch.Tensor, s_dec, dtype: torch.dtype = torch.float32,
                      *, fast: str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of `quantize_blocks`: E2M1(code) * float(scale) * s_dec in float32, cast to dtype.
    `out` (shape [..., n], dtype) receives the result in place when given."""
    lead, nb = scales.shape[:-1], scales.shape[-1]
    s = _per_block(s_dec, packed.device, (*lead, nb))
    pb, sb = packed.reshape(-1, BLOCK // 2), scales.reshape(-1)
    mode = fastpath.resolve(fast)
    if mode != "never" and packed.device.type == "cpu" and cpu_kernels.available():
        result = cpu_kernels.dequantize(pb, sb, s.reshape(-1), dtype, out)
        return result if out is not None else result.view(*lead, nb * BLOCK)
    result = _dequantize_compiled(pb, sb, s, dtype, numel=pb.numel() * 2,
                                  fast="never" if packed.device.type == "cpu" else mode)
    result = result.reshape(*lead, nb * BLOCK)
    return result if out is None else out.copy_(result)
