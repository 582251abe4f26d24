"""The building blocks every decoder layer uses: Linear, Embedding, RMSNorm and the SwiGLU MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from everybyte.models import gemm, native_ops


def _param(*shape, dtype, fill=None) -> nn.Parameter:
    data = torch.empty(*shape, dtype=dtype) if fill is None else torch.full(shape, fill, dtype=dtype)
    return nn.Parameter(data, requires_grad=False)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None

    def forward(self, x):
        return gemm.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(num, dim, dtype=dtype)

    def forward(self, ids):
        return F.embedding(ids, self.weight)

    def logits(self, h):
        """As a tied LM head."""
        return gemm.linear(h, self.weight)


class RMSNorm(nn.Module):
    """HF RMSNorm (fp32 statistics); with a residual, adds it first and returns the new residual."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = _param(size, dtype=dtype, fill=1.0)

    def forward(self, x, residual=None):
        if _fused(x, residual, self.weight):          # one C pass a row; residual updated in place
            out = native_ops.add_rmsnorm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if residual is not None:
            x = residual = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return h if residual is None else (h, residual)


def _fused(x, residual, weight) -> bool:
    """Whether the C add+RMSNorm takes these: float32, contiguous, x 2-D, CPU."""
    return (x.dim() == 2 and native_ops.f32_cpu(x, weight) and native_ops.available()
            and (residual is None or (native_ops.f32_cpu(residual) and residual.shape == x.shape)))


class MLP(nn.Module):
    """SwiGLU: gate and up projections fused into one Linear (HF gate_proj rows, then up_proj rows)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, False, dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, False, dtype)

    def shard_sizes(self) -> tuple[int, ...]:
        return self.intermediate_size, self.intermediate_size

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        # one C pass on float32 CPU rows: the fused decode step's own SiLU, the same bits for any row count
        act = native_ops.silu_mul(gate_up) if x.dim() == 2 else None
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act)
