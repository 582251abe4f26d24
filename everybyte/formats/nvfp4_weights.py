"""NVFP4 for weight matrices: the quantizer `everybyte quantize` and `--weights-dtype nvfp4` share.

A weight [out, in] becomes ModelOpt's tensors: packed codes uint8 [out, in/2] (low nibble
first), E4M3 block scales [out, in/16] along `in`, and one float32 decode-form tensor scale
(`weight_scale_2` = amax / 2688). Each 16-value block takes, of the scales amax/d for the
divisors d in `WEIGHT_DIVISORS`, the one with the least squared error (the KV path's search,
nvfp4_kv.quantize_blocks_best_scale, with the C kernel's bytes where it is built); a fused group
(q/k/v, gate/up) is quantized with one shared tensor scale, as ModelOpt exports them, so engines
that fuse those layers (vLLM) read the block scales right.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from everybyte.formats import cpu_kernels
from everybyte.formats.nvfp4 import AMAX_TO_SCALE
from everybyte.formats.nvfp4_blocks import BLOCK, dequantize_blocks
from everybyte.formats.nvfp4_kv import divisors, quantize_blocks_best_scale
from everybyte.formats.sizes import weight_matrix_bytes

# amax/6 alone is the standard scale; the search adds four steps down to amax/4 (see README,
# "Weights", for what each choice measured on SmolLM2-135M).
WEIGHT_DIVISORS = (6.0, 5.5, 5.0, 4.5, 4.0)
ROWS_PER_CHUNK = 4096


@dataclass
class PackedPart:
    """One matrix's NVFP4 tensors (rows x in_features)."""
    data: torch.Tensor            # uint8 [rows, in/2]
    scales: torch.Tensor          # float8_e4m3fn [rows, in/16]
    global_scale: float           # decode form, amax / 2688
    input_scale: float | None = None

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return weight_matrix_bytes("nvfp4", self.rows, self.data.shape[1] * 2)

    def dequantize(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        return dequantize_blocks(self.data, self.scales, self.global_scale, dtype, out=out)


def check_weight(name: str, w: torch.Tensor) -> None:
    """A clear error for a weight NVFP4 cannot take: not 2-D, `in` not a multiple of 16, NaN/Inf."""
    if w.dim() != 2:
        raise ValueError(f"{name}: NVFP4 weights are 2-D [out, in]; got shape {tuple(w.shape)}")
    if w.shape[1] % BLOCK:
        raise ValueError(f"{name}: shape {tuple(w.shape)}: in-dimension {w.shape[1]} is not a multiple of {BLOCK}")
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(f"{name}: non-finite value {w[idx].item()} at index {list(idx)}; cannot quantize")


def tensor_scale(tensors: list[torch.Tensor]) -> float:
    """The decode-form tensor scale shared by a group: max |x| over all of them / 2688."""
    amax = max(float(t.abs().max()) for t in tensors)
    return max(amax / AMAX_TO_SCALE, torch.finfo(torch.float32).tiny) if amax > 0 else 0.0


def quantize_weight(w: torch.Tensor, global_scale: float, divs: tuple[float, ...] | None = None) -> PackedPart:
    """w [out, in] (checked by check_weight) at the given decode-form tensor scale; divs: the
    block-scale candidates (default WEIGHT_DIVISORS)."""
    divs = tuple(divs or WEIGHT_DIVISORS)
    rows, n = w.shape
    data = torch.empty(rows, n // 2, dtype=torch.uint8)
    scales = torch.empty(rows, n // BLOCK, dtype=torch.float8_e4m3fn)
    fast = cpu_kernels.available() and w.device.type == "cpu"
    for r0 in range(0, rows, ROWS_PER_CHUNK):
        chunk = w[r0:r0 + ROWS_PER_CHUNK].float().contiguous()
        if fast:
            slots = torch.arange(r0, r0 + chunk.shape[0])
            cpu_kernels.kv_write(data, scales, slots, chunk, global_scale, divisors("cpu", tuple(divs)))
        else:
            d, s = quantize_blocks_best_scale(chunk, global_scale, divs)
            data[r0:r0 + chunk.shape[0]], scales[r0:r0 + chunk.shape[0]] = d.cpu(), s.cpu()
    return PackedPart(data, scales, float(global_scale))


def quantize_group(named: list[tuple[str, torch.Tensor]], divs: tuple[float, ...] | None = None
                   ) -> list[PackedPart]:
    """Quantize matrices that an engine may fuse (same `in`) with one shared tensor scale."""
    for name, w in named:
        check_weight(name, w)
    s = tensor_scale([w for _, w in named])
    return [quantize_weight(w, s, divs) for _, w in named]
