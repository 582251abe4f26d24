"""NVFP4 encoding tuned for the KV cache: per block, the best of several scales.

Standard NVFP4 maps a block's max to 6 (scale = amax/6). Because E2M1 is sparse near its top
(4 -> 6), mapping the max lower (amax/5, amax/4, ...) is often closer for the rest of the block.
Each 16-value block is encoded with every candidate divisor and keeps the one with the least
squared error (the first on ties). The output is ordinary NVFP4: any NVFP4 decoder reads it
unchanged. Only new tokens are encoded (the cache is written once per token), so the extra
passes are cheap. This is the reference; formats.cpu_kernels.kv_write gives the same bytes.
"""
from __future__ import annotations

import torch

from everybyte.formats import nvfp4_blocks as nb

# amax/6 (the standard scale) first, then four steps down to amax/4: about one E4M3 scale step
# apart. Measured on SmolLM2-135M (argparse.py, 2,048 tokens): K error drives the perplexity
# cost; five candidates measured ppl +4.9% over fp16 KV against +5.1% for {6, 4}.
KV_DIVISORS = (6.0, 5.5, 5.0, 4.5, 4.0)
_divisor_tensors: dict = {}


def divisors(device, values: tuple[float, ...] = KV_DIVISORS) -> torch.Tensor:
    key = (str(device), values)
    if key not in _divisor_tensors:
        _divisor_tensors[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return _divisor_tensors[key]


def _tree_sum16(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (16) as a halving tree: one fixed order, the C kernel's."""
    for w in (8, 4, 2, 1):
        t = t[..., :w] + t[..., w:2 * w]
    return t[..., 0]


def quantize_blocks_best_scale(x: torch.Tensor, s_dec, divs: tuple[float, ...] = KV_DIVISORS
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., n] (n % 16 == 0) -> (uint8 [..., n//2] packed codes, float8_e4m3fn [..., n//16]).
    s_dec: a float, a 0-d tensor, or one value per 16-value block ([..., n//16])."""
    lead, n = x.shape[:-1], x.shape[-1]
    xb = x.reshape(-1, nb.BLOCK).float()
    s = torch.as_tensor(s_dec, dtype=torch.float32, device=x.device)
    s = s.reshape(()) if s.numel() == 1 else s.reshape(-1, 1)
    vmax = xb.abs().amax(-1, keepdim=True)
    dv = divisors(x.device, tuple(divs)).view(-1, 1, 1)
    # every candidate in one pass: [candidates, blocks, ...], amax/6 first
    sf8 = torch.where(s > 0, vmax / (dv * s), 0.0).clamp_(max=nb.E4M3_MAX).to(torch.float8_e4m3fn)
    d = sf8.float() * s
    y = torch.where(d > 0, xb / d, 0.0)
    code = torch.bucketize(y.abs_(), nb._table(nb.TIE_BOUNDS, x.device)).to(torch.uint8)
    code |= torch.signbit(xb).to(torch.uint8) << 3
    err = _tree_sum16((nb._table(nb.E2M1_VALUES, x.device)[code.long()] * d - xb).square_())
    pick = err.argmin(0)                                       # first least error
    code = code.gather(0, pick.view(1, -1, 1).expand(1, -1, nb.BLOCK))[0]
    scales = sf8.view(torch.uint8).gather(0, pick.view(1, -1, 1))[0].view(torch.float8_e4m3fn)
    pairs = code.view(-1, nb.BLOCK // 2, 2)
    packed = pairs[..., 0] | (pairs[..., 1] << 4)
    return packed.reshape(*lead, n // 2), scales.reshape(*lead, n // nb.BLOCK)
