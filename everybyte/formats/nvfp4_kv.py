"""NVFP4 encoding tuned for the KV cache: per block, the better of two scales.

Standard NVFP4 maps a block's max to 6 (scale = amax/6). Because E2M1 is sparse near its top
(4 -> 6), mapping the max to 4 instead (scale = amax/4) is often closer for the rest of the
block. Each 16-value block is encoded both ways and keeps the one with the lower squared error
("four over six"). The output is ordinary NVFP4: any NVFP4 decoder reads it unchanged. Only
new tokens are encoded (the cache is written once per token), so the extra pass is cheap.
"""
from __future__ import annotations

import torch

from everybyte.formats import nvfp4_blocks as nb

_DIVISORS: dict = {}


def quantize_blocks_best_scale(x: torch.Tensor, s_dec) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] (n % 16 == 0) -> (uint8 [..., n//2] packed codes, float8_e4m3fn [..., n//16]).
    s_dec: a float, a 0-d tensor, or one value per 16-value block ([..., n//16])."""
    lead, n = x.shape[:-1], x.shape[-1]
    xb = x.reshape(-1, nb.BLOCK).float()
    s = torch.as_tensor(s_dec, dtype=torch.float32, device=x.device)
    s = s.reshape(()) if s.numel() == 1 else s.reshape(-1, 1)
    if x.device not in _DIVISORS:
        _DIVISORS[x.device] = torch.tensor([6.0, 4.0], device=x.device).view(2, 1, 1)
    vmax = xb.abs().amax(-1, keepdim=True)
    # both candidates in one pass: [2, blocks, ...], amax/6 first (the standard NVFP4 scale)
    sf8 = torch.where(s > 0, vmax / (_DIVISORS[x.device] * s), 0.0).clamp_(max=nb.E4M3_MAX).to(torch.float8_e4m3fn)
    d = sf8.float() * s
    y = torch.where(d > 0, xb / d, 0.0)
    code = torch.bucketize(y.abs_(), nb._table(nb.TIE_BOUNDS, x.device)).to(torch.uint8)
    code |= torch.signbit(xb).to(torch.uint8) << 3
    err = (nb._table(nb.E2M1_VALUES, x.device)[code.long()] * d - xb).square_().sum(-1)
    pick = (err[1] < err[0]).unsqueeze(-1)
    code = torch.where(pick, code[1], code[0])
    scales = torch.where(pick, sf8[1].view(torch.uint8), sf8[0].view(torch.uint8)).view(torch.float8_e4m3fn)
    pairs = code.view(-1, nb.BLOCK // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed.reshape(*lead, n // 2), scales.reshape(*lead, n // nb.BLOCK)
