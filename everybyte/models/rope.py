"""Rotary position embedding (HF rotate_half convention) with default, linear and llama3 scaling."""
from __future__ import annotations

import math

import torch
from torch import nn

from everybyte.models import native_ops

ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, rope_scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    scaling = rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, rope_scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, rope_scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)
        self._checked: tuple = (None, False)       # (positions tensor, in the table)

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotate each x [T, H, D] at positions [T]; computed in fp32, returned in x's dtype."""
        if len(xs) == 2 and self._fusable(positions, *xs):
            return native_ops.rope(*xs, self.cos_sin, positions)
        cos, sin = self.cos_sin.float()[positions].unsqueeze(1).chunk(2, dim=-1)
        out = []
        for x in xs:
            x1, x2 = x.float().chunk(2, dim=-1)
            out.append(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype))
        return tuple(out)

    def _fusable(self, positions, q, k) -> bool:
        """The C kernel (same float steps) takes float32 CPU q/k whose heads lie dense in each row."""
        dense = lambda t: (t.dtype is torch.float32 and t.device.type == "cpu" and t.dim() == 3
                           and t.stride(2) == 1 and t.stride(1) == t.shape[2])
        return (dense(q) and dense(k) and q.shape[2] == k.shape[2] == self.cos_sin.shape[1]
                and self.cos_sin.dtype is torch.float32 and self.cos_sin.device.type == "cpu"
                and self._in_table(positions) and native_ops.available())

    def _in_table(self, positions) -> bool:
        """int64, contiguous, every position a row of the table (the kernel does not bounds-check).
        Checked once per positions tensor: every layer of a forward passes the same one."""
        if positions is not self._checked[0]:
            ok = (positions.dtype is torch.int64 and positions.is_contiguous() and positions.numel() > 0
                  and int(positions.max()) < self.cos_sin.shape[0] and int(positions.min()) >= 0)
            self._checked = (positions, ok)
        return self._checked[1]
