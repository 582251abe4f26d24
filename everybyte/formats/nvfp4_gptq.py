"""Error-compensating NVFP4 rounding (GPTQ, Frantar et al. 2022) for `everybyte quantize --method gptq`.

Round-to-nearest treats every weight alone. GPTQ quantizes a matrix one input column at a time
and spreads each column's rounding error over the columns not yet quantized, weighted by the
inverse Hessian H = sum x x^T of the layer's inputs on calibration text, so the layer's output
error (not the weights') is what it minimises. Each 16-column NVFP4 block picks its E4M3 scales
(best of WEIGHT_DIVISORS, as round-to-nearest does) from the block's values as they stand when
the block is reached; the output is ordinary NVFP4 (codes, block scales, tensor scale).
"""
from __future__ import annotations

import torch

from everybyte.formats import nvfp4_blocks as nb
from everybyte.formats import nvfp4_weights
from everybyte.formats.nvfp4_kv import quantize_blocks_best_scale
from everybyte.formats.nvfp4_weights import PackedPart, check_weight, tensor_scale

DAMP = 0.01          # of H's mean diagonal, added to its diagonal (GPTQ's default)


def _inverse_cholesky(h: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor of H^-1 (dampened; dead inputs get a unit diagonal)."""
    h = h.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    h += DAMP * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


def _round_column(w: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of w / d (d > 0: ties to even, saturating), as nvfp4_blocks does."""
    y = torch.where(d > 0, w / d, torch.zeros_like(w))
    code = torch.bucketize(y.abs(), nb._table(nb.TIE_BOUNDS, w.device)).to(torch.uint8)
    return code | (torch.signbit(w).to(torch.uint8) << 3)


def gptq_weight(w: torch.Tensor, h: torch.Tensor, global_scale: float) -> PackedPart:
    """w [out, in] quantized against input Hessian h [in, in] at the given tensor scale."""
    rows, n = w.shape
    u = _inverse_cholesky(h).float()
    w = w.float().clone()
    values = nb._table(nb.E2M1_VALUES, w.device)
    codes = torch.empty(rows, n, dtype=torch.uint8)
    scales = torch.empty(rows, n // nb.BLOCK, dtype=torch.float8_e4m3fn)
    for b0 in range(0, n, nb.BLOCK):
        _, sf = quantize_blocks_best_scale(w[:, b0:b0 + nb.BLOCK].contiguous(), global_scale,
                                           nvfp4_weights.WEIGHT_DIVISORS)
        scales[:, b0 // nb.BLOCK] = sf[:, 0]
        d = sf[:, 0].float() * global_scale
        for j in range(b0, b0 + nb.BLOCK):
            c = _round_column(w[:, j], d)
            codes[:, j] = c
            err = (w[:, j] - values[c.long()] * d) / u[j, j]
            w[:, j + 1:] -= err[:, None] * u[j, j + 1:][None, :]
    pairs = codes.view(rows, n // 2, 2)
    return PackedPart(pairs[..., 0] | (pairs[..., 1] << 4), scales, float(global_scale))


def gptq_group(named: list[tuple[str, torch.Tensor]], h: torch.Tensor) -> list[PackedPart]:
    """A fused group (same input, one shared tensor scale), as quantize_group."""
    for name, w in named:
        check_weight(name, w)
    s = tensor_scale([w for _, w in named])
    return [gptq_weight(w, h, s) for _, w in named]
