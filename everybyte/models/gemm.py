"""Which CPU GEMM library runs an fp32 linear layer.

torch's `F.linear` runs fp32 on CPU through MKL's sgemm. oneDNN's matmul (the one torch ships for
its bf16 path and inductor's CPU fusions) is 1.5-3x faster for wide outputs (N >= 2048: the fused
gate/up projection, the LM head) at decode batch sizes and ~10% faster for large prefill chunks,
while MKL is faster for narrow outputs at small batches. Both sum in
fp32; results differ only by summation order (~1e-4 relative). Mixing the two per shape was slower
than oneDNN for every layer (decode B=32: 66 vs 91 tok/s, MKL alone 64; measured interleaved
on a 2-core Zen 1), so oneDNN runs every fp32 CPU linear when torch has it.
EVERYBYTE_GEMM=mkl selects torch's default instead.

Batch invariance: oneDNN's fp32 GEMM gives a row the same bits whatever other rows share the call
(M >= 2, measured for the model's shapes and M up to 600), but a single row takes its GEMV path,
which sums in another order (~4e-6 apart). So a one-row input is run as two rows (the row twice):
a decode step alone computes what it computes next to other requests, and a seeded request
samples the same tokens either way. MKL's sgemm is not row-invariant (its kernels change with M).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

BACKENDS = ("onednn", "mkl")


def _onednn_linear():
    op = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        x, w = torch.randn(3, 32), torch.randn(40, 32)
        if not torch.allclose(op(x, w, None, "none", [], ""), F.linear(x, w), atol=1e-4):
            return None
    except RuntimeError:
        return None
    return lambda x, w, b: op(x, w, b, "none", [], "")


def _backend() -> str:
    name = os.environ.get("EVERYBYTE_GEMM", "onednn")
    if name not in BACKENDS:
        raise ValueError(f"EVERYBYTE_GEMM={name!r}: choose one of {', '.join(BACKENDS)}")
    return name


_ONEDNN = _onednn_linear()
_MODE = _backend()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if (x.dtype is torch.float32 and x.device.type == "cpu" and x.dim() == 2 and weight.is_contiguous()
            and _ONEDNN is not None and _MODE == "onednn"):
        if x.shape[0] == 1:
            return _ONEDNN(x.expand(2, -1).contiguous(), weight, bias)[:1]
        return _ONEDNN(x, weight, bias)
    return F.linear(x, weight, bias)


def onednn_available() -> bool:
    return _ONEDNN is not None
