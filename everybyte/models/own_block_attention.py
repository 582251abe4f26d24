"""Prefill attention where each query sees its own KV block unquantized (engine.exact_tail).

A query at position p attends to the stored (quantized) keys of every block before its own and
to the exact keys of its own block up to p. Within a chunk, queries of different blocks need
different versions of the same positions, so this runs as causal attention over the stored
keys (one fused kernel, which also gives each query's log-sum-exp), then a per-block swap: the
own block's stored-key terms are taken out of the softmax sums and the exact ones put in,
in float32 (per block and KV head: the group's queries against the 16 stored and 16 exact keys).
"""
from __future__ import annotations

import torch


def attention_with_lse(q, k, v, causal_offset: int, scale: float):
    """q [Hq, n, D], k/v [Hkv, L, D] (Hq a multiple of Hkv); query i sees keys <= causal_offset + i.
    -> (out [Hq, n, D], lse [Hq, n] float32)."""
    n, length = q.shape[1], k.shape[1]
    mask = None
    if causal_offset or n != length:
        keys = torch.arange(length, device=q.device)
        allowed = keys[None, :] <= torch.arange(causal_offset, causal_offset + n, device=q.device)[:, None]
        mask = torch.zeros(n, length, dtype=q.dtype, device=q.device).masked_fill_(~allowed, float("-inf"))
    if q.device.type == "cpu":          # the fused CPU kernel takes grouped KV heads as they are
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], 0.0, mask is None, attn_mask=mask, scale=scale)
        return out[0], lse[0].float()
    return attention_with_lse_reference(q, k, v, mask, scale)


def attention_with_lse_reference(q, k, v, mask, scale: float):
    """The same in plain float32 torch ops (devices without the fused CPU kernel); mask None =
    causal."""
    n, length, group = q.shape[1], k.shape[1], q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    if mask is None:
        mask = torch.zeros(n, length, device=q.device).masked_fill_(
            torch.ones(n, length, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    scores = (q.float() @ k.float().transpose(1, 2)) * scale + mask.float()
    return (torch.softmax(scores, -1) @ v.float()).to(q.dtype), torch.logsumexp(scores, -1)


def own_block_attention(q, k, v, k_exact, v_exact, scale: float, block_size: int) -> torch.Tensor:
    """q [n, Hq, D] for positions [ctx - n, ctx); k/v [ctx, Hkv, D] as stored; k_exact/v_exact the
    unquantized K/V of positions [b0, ctx), b0 = the block start of position ctx - n. -> [n, Hq, D]."""
    n, num_heads, dim = q.shape
    ctx, num_kv = k.shape[0], k.shape[1]
    group, start, bs = num_heads // num_kv, ctx - n, block_size
    b0 = start // bs * bs
    out, lse = attention_with_lse(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), start, scale)
    nb = -(-(ctx - b0) // bs)
    span, lead = nb * bs, start - b0

    def padded(t, first):           # [len, ...] at positions [first, ...) -> [span, ...] float32
        if first == b0 and t.shape[0] == span:
            return t.float()
        pad = t.new_zeros((span, *t.shape[1:]), dtype=torch.float32)
        pad[first - b0:first - b0 + t.shape[0]] = t
        return pad

    # per (block, kv head): the group's queries [g * bs, D] against stored then exact keys [2 bs, D]
    qb = padded(q, start).view(nb, bs, num_kv, group, dim).permute(0, 2, 3, 1, 4).reshape(nb, num_kv, group * bs, dim)
    keys = torch.cat([padded(k[b0:], b0).view(nb, bs, num_kv, dim), padded(k_exact, b0).view(nb, bs, num_kv, dim)], 1)
    vals = torch.cat([padded(v[b0:], b0).view(nb, bs, num_kv, dim), padded(v_exact, b0).view(nb, bs, num_kv, dim)], 1)
    keys, vals = keys.transpose(1, 2), vals.transpose(1, 2)               # [nb, Hkv, 2 bs, D]
    pos = torch.arange(span, device=q.device).view(nb, 1, bs)
    valid = (pos.transpose(1, 2) >= pos) & (pos < ctx - b0)               # [nb, i, j]
    valid = valid.repeat(1, group, 2).view(nb, 1, group * bs, 2 * bs)
    lse_b = lse.new_full((num_heads, span), float("inf"))
    lse_b[:, lead:lead + n] = lse
    lse_b = lse_b.view(num_kv, group, nb, bs).permute(2, 0, 1, 3).reshape(nb, num_kv, group * bs, 1)
    w = torch.where(valid, torch.exp(qb @ keys.transpose(-1, -2) * scale - lse_b), 0.0)
    w[..., :bs].neg_()                                                    # stored terms out, exact in
    delta = (w @ vals).view(nb, num_kv, group, bs, dim).permute(0, 3, 1, 2, 4).reshape(span, num_heads, dim)
    norm = (1.0 + w.sum(-1)).view(nb, num_kv, group, bs).permute(0, 3, 1, 2).reshape(span, num_heads, 1)
    fixed = (out.transpose(0, 1) + delta[lead:lead + n]) / norm[lead:lead + n]
    return fixed.to(q.dtype)
