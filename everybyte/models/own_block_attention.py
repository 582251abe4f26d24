"""Prefill attention where each query sees its own KV block unquantized (engine.exact_tail).

A query at position p attends to the stored (quantized) keys of every block before its own and
to the exact keys of its own block up to p. Within a chunk, queries of different blocks need
different versions of the same positions, so this runs as causal attention over the stored
keys (one fused kernel, which also gives each query's log-sum-exp), then a per-block swap: the
own block's stored-key terms are taken out of the softmax sums and the exact ones put in,
in float32 (a 16 x 16 score tile per block and head).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def attention_with_lse(q, k, v, causal_offset: int, scale: float):
    """q [H, n, D], k/v [H, L, D]; query i sees keys <= causal_offset + i. -> (out, lse [H, n])."""
    n, length = q.shape[1], k.shape[1]
    mask = None
    if causal_offset or n != length:
        keys = torch.arange(length, device=q.device)
        allowed = keys[None, :] <= torch.arange(causal_offset, causal_offset + n, device=q.device)[:, None]
        mask = torch.zeros(n, length, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], 0.0, mask is None, attn_mask=mask, scale=scale)
        return out[0], lse[0].float()
    scores = (q.float() @ k.float().transpose(1, 2)) * scale
    scores = scores + (mask.float() if mask is not None else
                       torch.zeros(n, length, device=q.device).masked_fill_(
                           torch.ones(n, length, dtype=torch.bool, device=q.device).triu_(1), float("-inf")))
    lse = torch.logsumexp(scores, -1)
    return (torch.softmax(scores, -1) @ v.float()).to(q.dtype), lse


def own_block_attention(q, k, v, k_exact, v_exact, scale: float, block_size: int) -> torch.Tensor:
    """q [n, Hq, D] for positions [ctx - n, ctx); k/v [ctx, Hkv, D] as stored; k_exact/v_exact the
    unquantized K/V of positions [b0, ctx), b0 = the block start of position ctx - n. -> [n, Hq, D]."""
    n, num_heads, dim = q.shape
    ctx, num_kv = k.shape[0], k.shape[1]
    group, start, bs = num_heads // num_kv, ctx - n, block_size
    b0 = start // bs * bs
    rep = lambda t: t.transpose(0, 1).repeat_interleave(group, 0)           # [Hq, L, D]
    out, lse = attention_with_lse(q.transpose(0, 1), rep(k), rep(v), start, scale)
    # pad positions [b0, b0 + nb * bs) to whole blocks; queries only at [start, ctx)
    nb = -(-(ctx - b0) // bs)
    span, lead = nb * bs, start - b0

    def blocks(t, first):           # [len, H, D] at positions [first, ...) -> [H, nb, bs, D] fp32
        if first == b0 and t.shape[0] == span:      # already whole blocks: no padded copy
            return t.float().view(nb, bs, t.shape[1], dim).permute(2, 0, 1, 3)
        pad = torch.zeros(span, t.shape[1], dim, dtype=torch.float32, device=t.device)
        pad[first - b0:first - b0 + t.shape[0]] = t.float()
        return pad.view(nb, bs, t.shape[1], dim).permute(2, 0, 1, 3)

    qb = blocks(q, start).reshape(num_kv, group, nb, bs, dim)
    kq, vq = blocks(k[b0:], b0)[:, None], blocks(v[b0:], b0)[:, None]
    ke, ve = blocks(k_exact, b0)[:, None], blocks(v_exact, b0)[:, None]
    pos = torch.arange(span, device=q.device).view(nb, bs)
    valid = (pos[:, None, :] <= pos[:, :, None]) & (pos[:, None, :] < ctx - b0)    # [nb, i, j]
    lse_b = torch.full((num_heads, span), float("inf"), device=q.device)
    lse_b[:, lead:lead + n] = lse
    lse_b = lse_b.view(num_kv, group, nb, bs, 1)
    weight = lambda keys: torch.where(valid, torch.exp(qb @ keys.transpose(-1, -2) * scale - lse_b), 0.0)
    wq, we = weight(kq), weight(ke)
    ob = blocks(out.transpose(0, 1), start).reshape(num_kv, group, nb, bs, dim)
    fixed = (ob - wq @ vq + we @ ve) / (1.0 - wq.sum(-1, keepdim=True) + we.sum(-1, keepdim=True))
    fixed = fixed.reshape(num_heads, span, dim)[:, lead:lead + n]
    return fixed.transpose(0, 1).to(q.dtype)
