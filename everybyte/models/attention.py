"""Paged attention over a block-structured KV cache (torch reference path)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from everybyte.formats.kv_layout import KVFormat, hadamard


@dataclass
class LayerKVCache:
    fmt: KVFormat
    k: dict[str, torch.Tensor]
    v: dict[str, torch.Tensor]
    k_scale: float
    v_scale: float
    block_size: int


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor        # [T] cache slot of each new token, -1 = do not store
    query_lens: list[int]             # new tokens per sequence (sum = T)
    context_lens: list[int]           # tokens per sequence including the new ones
    block_tables: torch.Tensor        # [B, max_blocks], padded with 0
    derived: dict = field(default_factory=dict, repr=False, compare=False)  # per-step memo


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]. Stores k/v at meta.slot_mapping, then each
    sequence's new queries attend causally over its whole context read back from the cache."""
    head_dim = q.shape[-1]
    if cache.fmt.rotate and head_dim & (head_dim - 1) == 0:
        h = hadamard(head_dim, q.dtype, str(q.device))
        return _attend(q @ h, k @ h, v @ h, cache, meta, scale) @ h
    return _attend(q, k, v, cache, meta, scale)


def _attend(q, k, v, cache: LayerKVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    cache.fmt.write_kv(cache.k, cache.v, meta.slot_mapping, k, v, cache.k_scale, cache.v_scale)
    plan = meta.derived.get("plan")
    if plan is None:
        plan = meta.derived["plan"] = _plan(meta, cache.block_size, q.device)
    decode_tokens, decode_rows, decode_mask, prefills = plan
    if not prefills:
        return _decode(q, cache, meta.block_tables, decode_mask, scale)
    out = torch.empty_like(q)
    if decode_tokens is not None:
        out[decode_tokens] = _decode(q[decode_tokens], cache, meta.block_tables[decode_rows],
                                     decode_mask, scale)
    for row, start, n, ctx in prefills:
        out[start:start + n] = _prefill(q[start:start + n], cache, meta.block_tables[row], ctx, scale)
    return out


def _plan(meta: AttentionMetadata, block_size: int, device):
    """Split the batch into one batched decode group (sequences with one new token) and a list of
    (row, start, query_len, context_len) prefill chunks."""
    starts, rows, tokens, lens, prefills = 0, [], [], [], []
    for row, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
        if n == 1:
            rows.append(row)
            tokens.append(starts)
            lens.append(ctx)
        else:
            prefills.append((row, starts, n, ctx))
        starts += n
    if len(rows) == 1 and prefills:
        prefills.append((rows[0], tokens[0], 1, lens[0]))
        rows = []
    if not rows:
        return None, None, None, prefills
    num_blocks = -(-max(lens) // block_size)
    positions = torch.arange(num_blocks * block_size, device=device)
    mask = positions[None, :] < torch.tensor(lens, device=device)[:, None]
    as_index = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)
    return as_index(tokens), as_index(rows), mask, prefills


def _gather(cache: LayerKVCache, block_ids: torch.Tensor, dtype):
    k = cache.fmt.read(cache.k, block_ids, cache.k_scale, dtype)
    v = cache.fmt.read(cache.v, block_ids, cache.v_scale, dtype)
    shape = (*block_ids.shape[:-1], -1, *k.shape[-2:])
    return k.reshape(shape), v.reshape(shape)


def _decode(q, cache, block_tables, mask, scale):
    """One new token per sequence: one gather over the padded block tables, one masked SDPA.
    The query heads of a KV group stand in the query-length dimension, so no KV repeat is needed."""
    batch, num_heads, head_dim = q.shape
    num_blocks = mask.shape[1] // cache.block_size
    k, v = _gather(cache, block_tables[:, :num_blocks], q.dtype)      # [B, L, Hkv, D]
    num_kv_heads = k.shape[2]
    qg = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def _prefill(q, cache, block_table, context_len, scale):
    n = q.shape[0]
    num_blocks = -(-context_len // cache.block_size)
    k, v = _gather(cache, block_table[:num_blocks], q.dtype)
    k, v = k[:context_len].transpose(0, 1), v[:context_len].transpose(0, 1)
    mask = None
    if n != context_len:
        keys = torch.arange(context_len, device=q.device)
        mask = keys[None, :] <= torch.arange(context_len - n, context_len, device=q.device)[:, None]
    # 4-D inputs: CPU SDPA takes its fused kernel only with a batch dimension
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                         is_causal=mask is None, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
