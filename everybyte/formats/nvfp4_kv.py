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

DIVISORS = (6.0, 4.0)


def quantize_blocks_best_scale(x: torch.Tensor, s_dec) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] (n % 16 == 0) -> (uint8 [..., n//2] packed codes, float8_e4m3fn [..., n//16])."""
    lead, n = x.shape[:-1], x.shape[-1]
    xb = x.reshape(-1, nb.BLOCK).float()
    s = torch.as_tensor(s_dec, dtype=torch.float32, device=x.device)
    vmax = xb.abs().amax(-1, keepdim=True)
    bounds, values = nb._table(nb.TIE_BOUNDS, x.device), nb._table(nb.E2M1_VALUES, x.device)
    best_code = best_sf8 = best_err = None
    for div in DIVISORS:
        sf8 = torch.where(s > 0, vmax / (div * s), 0.0).clamp(max=nb.E4M3_MAX).to(torch.float8_e4m3fn)
        d = sf8.float() * s
        y = torch.where(d > 0, xb / d, 0.0)
        code = torch.bucketize(y.abs(), bounds).to(torch.uint8) | (torch.signbit(y).to(torch.uint8) << 3)
        err = (values[code.long()] * d - xb).square_().sum(-1, keepdim=True)
        if best_code is None:
            best_code, best_sf8, best_err = code, sf8, err
        else:
            better = err < best_err
            best_code = torch.where(better, code, best_code)
            best_sf8 = torch.where(better, sf8.float(), best_sf8.float()).to(torch.float8_e4m3fn)
            best_err = torch.minimum(err, best_err)
    pairs = best_code.view(-1, nb.BLOCK // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed.reshape(*lead, n // 2), best_sf8.reshape(*lead, n // nb.BLOCK)
