"""NVFP4: E2M1 codes, one E4M3 scale per 16 values along the last dim, one float32 tensor scale.

x ~= E2M1(code) * float(e4m3 block scale) * s_dec, s_dec = amax / 2688 (decode form, ModelOpt's
`weight_scale_2`; the encode form 2688 / amax is its reciprocal). Bit-exact on the spec's test
vectors (shared/specs/nvfp4.md TV1, TV2, TV3, TV5). Choices where references disagree:

- divide form (ModelOpt): block scale sf = vmax / (6 * s_dec) -> E4M3 (round to nearest even,
  saturate at 448); elements y = x / (float(sf8) * s_dec), not x * reciprocal.
- E2M1 rounding: to nearest, ties to the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2,
  2.5->2, 3.5->4, 5->4), saturating at +-6.
- all-zero block: scale byte 0x00 (TensorRT-LLM, FlashInfer, vLLM), codes 0. A block whose
  scale underflows E4M3 (sf <= 2^-10) gets 0x00 too and decodes to zeros.
- sign: the code's sign bit is the input's sign bit, so negatives that round to zero and -0.0
  give 0x8 (-0), as ModelOpt. With that, re-quantizing dequantized values at the same amax
  reproduces the bytes of every block whose scale is 0x00 or a normal E4M3 number (a block with
  a subnormal scale, max |x| < amax / 28672, may legitimately re-encode differently).
- tensor scale: global_amax=None uses max |x|; s_dec = amax / 2688 in float32. amax 0 gives
  s_dec 0 and an all-zero tensor (no NaN). A global_amax below max |x| saturates.
- dequantize computes (E2M1 * float(sf8)) * s_dec in float32, then casts to `dtype`
  (round to nearest even).

The per-block work is `nvfp4_blocks.quantize_blocks` / `dequantize_blocks` (also the KV cache's
hot path): an eager torch reference and fused fast paths with identical bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from everybyte.formats import container
from everybyte.formats.nvfp4_blocks import BLOCK, abs_max, dequantize_blocks, quantize_blocks

__all__ = ["NVFP4Tensor", "quantize", "dequantize", "quantize_blocks", "dequantize_blocks", "BLOCK"]
AMAX_TO_SCALE = 6.0 * 448.0


def _padded(n: int) -> int:
    return -(-n // BLOCK) * BLOCK


@dataclass
class NVFP4Tensor:
    data: torch.Tensor          # uint8 [..., n_padded / 2], two codes a byte, low nibble first
    scales: torch.Tensor        # float8_e4m3fn [..., n_padded / 16], linear layout
    global_scale: torch.Tensor  # float32 0-d, decode form amax / 2688
    shape: tuple[int, ...]      # original shape; shape[-1] < n_padded only if quantized with pad=True

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scales.numel() + 4

    def to_bytes(self) -> bytes:
        return container.pack("nvfp4", self.shape, [self.data, self.scales, self.global_scale.reshape(())])

    @classmethod
    def from_bytes(cls, buf) -> "NVFP4Tensor":
        shape, tensors = container.unpack(buf, "nvfp4")
        if len(tensors) != 3 or not shape:
            raise ValueError(f"nvfp4 buffer holds {len(tensors)} tensors and shape {shape}, expected 3 and >= 1 dim")
        data, scales, gs = tensors
        n = _padded(shape[-1])
        want = ((*shape[:-1], n // 2), (*shape[:-1], n // BLOCK), ())
        got = (tuple(data.shape), tuple(scales.shape), tuple(gs.shape))
        if got != want or (data.dtype, scales.dtype, gs.dtype) != (torch.uint8, torch.float8_e4m3fn, torch.float32):
            raise ValueError(f"nvfp4 buffer is inconsistent: tensors {got}, expected {want} for shape {shape}")
        return cls(data, scales, gs, shape)


def _global_scale(amax: torch.Tensor, global_amax) -> torch.Tensor:
    if global_amax is not None:
        amax = torch.as_tensor(global_amax, dtype=torch.float32, device=amax.device).reshape(())
        if not bool(torch.isfinite(amax)) or bool(amax < 0):
            raise ValueError(f"global_amax must be finite and >= 0, got {amax.item()}")
    s = amax.float() / AMAX_TO_SCALE
    # an amax of a few denormals would make the scale 0 (every block then decodes to 0 while the
    # format promises |error| <= 6 * 2^-10 * scale): keep it at the smallest normal float instead
    return torch.where((s == 0) & (amax > 0), torch.finfo(torch.float32).tiny, s)


def quantize(x: torch.Tensor, global_amax: float | torch.Tensor | None = None, pad: bool = False) -> NVFP4Tensor:
    """Quantize along the last dim (a multiple of 16, or any length with pad=True: zero-padded)."""
    container.check_float(x)
    if x.dim() == 0:
        raise ValueError("nvfp4 needs at least one dimension (blocks of 16 along the last one); got a 0-d tensor")
    n = x.shape[-1]
    if n % BLOCK and not pad:
        raise ValueError(f"last dimension of shape {tuple(x.shape)} is {n}, not a multiple of {BLOCK} "
                         f"(pass pad=True to zero-pad it)")
    amax = abs_max(x)
    container.check_finite(x, amax)
    s_dec = _global_scale(amax, global_amax)
    xp = F.pad(x, (0, _padded(n) - n)) if n % BLOCK else x
    data, scales = quantize_blocks(xp, s_dec)
    return NVFP4Tensor(data, scales, s_dec, tuple(x.shape))


def dequantize(t: NVFP4Tensor, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """Values of `t` in `dtype`, shape `t.shape`; written into `out` (that shape and dtype) when given."""
    n = t.shape[-1]
    if t.data.shape[-1] * 2 == n:
        return dequantize_blocks(t.data, t.scales, t.global_scale, dtype, out=out)
    full = dequantize_blocks(t.data, t.scales, t.global_scale, dtype)[..., :n]
    return full.contiguous() if out is None else out.copy_(full)
