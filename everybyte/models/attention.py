"""Paged attention over a block-structured KV cache (torch reference path)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from everybyte.formats.kv_layout import KVFormat, hadamard
from everybyte.models import native_ops
from everybyte.models.decode_attention import nvfp4_decode
from everybyte.models.own_block_attention import own_block_attention


@dataclass
class LayerKVCache:
    fmt: KVFormat
    k: dict[str, torch.Tensor]
    v: dict[str, torch.Tensor]
    k_scale: float
    v_scale: float
    block_size: int
    tail_k: torch.Tensor | None = None    # [slots, span, Hkv, D]: engine.exact_tail
    tail_v: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor        # [T] cache slot of each new token, -1 = do not store
    query_lens: list[int]             # new tokens per sequence (sum = T)
    context_lens: list[int]           # tokens per sequence including the new ones
    block_tables: torch.Tensor        # [B, max_blocks], padded with 0
    tail_slots: list[int] | None = None   # each sequence's exact-tail slot (None: no exact tails)
    derived: dict = field(default_factory=dict, repr=False, compare=False)  # per-step memo


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]. Stores k/v at meta.slot_mapping, then each
    sequence's new queries attend causally over its whole context read back from the cache."""
    head_dim = q.shape[-1]
    rotation = None
    if cache.fmt.rotate and head_dim & (head_dim - 1) == 0:
        rotation = hadamard(head_dim, q.dtype, str(q.device))
    return _attend(q, k, v, cache, meta, scale, rotation)


def _attend(q, k, v, cache: LayerKVCache, meta: AttentionMetadata, scale: float, h=None) -> torch.Tensor:
    """h: the format's rotation (KV stored as x @ h). Decode rotates its queries and outputs; a
    prefill chunk does the same, or, when its context is short next to its queries (a first chunk),
    rotates the gathered K/V back instead, which costs fewer matmul rows."""
    kr, vr = (k, v) if h is None else (_rotate(k, h), _rotate(v, h))
    cache.fmt.write_kv(cache.k, cache.v, meta.slot_mapping, kr, vr, cache.k_scale, cache.v_scale)
    tails = meta.tail_slots is not None and cache.tail_k is not None
    span = cache.tail_k.shape[1] if tails else cache.block_size
    plan = meta.derived.get("plan")
    if plan is None:
        plan = meta.derived["plan"] = _plan(meta, span, q.device)
    decode_tokens, decode_rows, decode_mask, prefills = plan
    back = [h is not None and ctx * k.shape[1] < n * q.shape[1] for _, _, n, ctx in prefills]
    exact = [(_exact_own_span(k, v, cache, meta, p, h) if b else _exact_own_span(kr, vr, cache, meta, p))
             if tails else None for p, b in zip(prefills, back)]
    if tails:
        index = meta.derived.get("tail_index")
        if index is None:
            index = meta.derived["tail_index"] = _tail_index(meta, span, q.device)
        tokens, flat = index
        ks, vs = (kr, vr) if tokens is None else (kr.index_select(0, tokens), vr.index_select(0, tokens))
        cache.tail_k.view(-1, *k.shape[1:]).index_copy_(0, flat, ks.to(cache.tail_k.dtype))
        cache.tail_v.view(-1, *v.shape[1:]).index_copy_(0, flat, vs.to(cache.tail_v.dtype))
    rot = (lambda x: x) if h is None else (lambda x: x @ h)

    def decode(q, tables):
        dt = _decode_tails(meta, decode_rows, tails, span)
        fused = nvfp4_decode(q, cache, tables, _decode_lens(meta, decode_rows), scale, dt, h is not None)
        if fused is not None:
            return fused
        return rot(_decode(rot(q), cache, tables, decode_mask, scale, dt, _decode_len_list(meta, decode_rows)))

    if not prefills:
        return decode(q, meta.block_tables)
    out = torch.empty_like(q)
    if decode_tokens is not None:
        out[decode_tokens] = decode(q[decode_tokens], meta.block_tables[decode_rows])
    for (row, start, n, ctx), own, b in zip(prefills, exact, back):
        chunk = q[start:start + n]
        if b:
            out[start:start + n] = _prefill(chunk, cache, meta.block_tables[row], ctx, scale, own, h)
        else:
            out[start:start + n] = rot(_prefill(rot(chunk), cache, meta.block_tables[row], ctx, scale, own))
    return out


def _rotate(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """x @ h; on CPU in float32 the C rotation, which the fused decode step (models/decode_step)
    also takes, so the two write the same KV bytes (and a row's bytes do not depend on the batch)."""
    if x.dtype is torch.float32 and x.device.type == "cpu":
        out = native_ops.rotate_rows(x.contiguous(), h)
        if out is not None:
            return out
    return x @ h


def _tail_index(meta: AttentionMetadata, bs: int, device):
    """(token rows, flat tail positions) of the new tokens in each sequence's last span (bs tokens)."""
    tokens, flat, first = [], [], 0
    for slot, n, ctx in zip(meta.tail_slots, meta.query_lens, meta.context_lens):
        last = (ctx - 1) // bs * bs
        for pos in range(max(last, ctx - n), ctx):
            tokens.append(first + pos - (ctx - n))
            flat.append(slot * bs + pos % bs)
        first += n
    as_index = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)
    every = tokens == list(range(first))          # decode steps: every new token, in order
    return (None if every else as_index(tokens)), as_index(flat)


def _exact_own_span(k, v, cache: LayerKVCache, meta: AttentionMetadata, prefill, h=None):
    """Unquantized K/V of positions [own span start of the chunk's first token, context end):
    the tail slot's earlier tokens, then the chunk's own (read before the slot is overwritten).
    With h, k/v are unrotated and the slot's (stored, rotated) tokens are rotated back."""
    row, first, n, ctx = prefill
    start, bs = ctx - n, cache.tail_k.shape[1]
    slot, before = meta.tail_slots[row], start % bs
    ks, vs = k[first:first + n], v[first:first + n]
    if before:
        tk, tv = cache.tail_k[slot, :before].to(k.dtype), cache.tail_v[slot, :before].to(v.dtype)
        if h is not None:
            tk, tv = tk @ h, tv @ h
        ks, vs = torch.cat([tk, ks]), torch.cat([tv, vs])
    return ks, vs


def _decode_tails(meta: AttentionMetadata, rows, tails: bool, bs: int):
    """(slot per decode row, own span index per decode row) as index tensors, once per step."""
    if not tails or rows is None:
        return None
    if "decode_tails" not in meta.derived:
        picked = rows.tolist()
        slots = torch.tensor([meta.tail_slots[r] for r in picked], dtype=torch.long, device=rows.device)
        blocks = torch.tensor([(meta.context_lens[r] - 1) // bs for r in picked], dtype=torch.long,
                              device=rows.device)
        meta.derived["decode_tails"] = (slots, blocks)
    return meta.derived["decode_tails"]


def _decode_len_list(meta: AttentionMetadata, rows) -> list[int]:
    """Context length of each decode row, once per step."""
    if "decode_len_list" not in meta.derived:
        meta.derived["decode_len_list"] = [meta.context_lens[r] for r in rows.tolist()]
    return meta.derived["decode_len_list"]


def _decode_lens(meta: AttentionMetadata, rows) -> torch.Tensor:
    """_decode_len_list as an int64 tensor, once per step."""
    if "decode_lens" not in meta.derived:
        meta.derived["decode_lens"] = torch.tensor(_decode_len_list(meta, rows), dtype=torch.long)
    return meta.derived["decode_lens"]


def _plan(meta: AttentionMetadata, granule: int, device):
    """Split the batch into one batched decode group (sequences with one new token) and a list of
    (row, start, query_len, context_len) prefill chunks. The decode mask covers whole granules
    (blocks, or exact-tail spans). A decoding sequence takes the decode path even when it is the
    only one next to prefill chunks, so its token is computed the same whatever shares the step."""
    starts, rows, tokens, lens, prefills = 0, [], [], [], []
    for row, (n, ctx) in enumerate(zip(meta.query_lens, meta.context_lens)):
        if n == 1:
            rows.append(row)
            tokens.append(starts)
            lens.append(ctx)
        else:
            prefills.append((row, starts, n, ctx))
        starts += n
    if not rows:
        return None, None, None, prefills
    positions = torch.arange(-(-max(lens) // granule) * granule, device=device)
    mask = positions[None, :] < torch.tensor(lens, device=device)[:, None]
    as_index = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)
    return as_index(tokens), as_index(rows), mask, prefills


def _gather(cache: LayerKVCache, block_ids: torch.Tensor, dtype):
    k, v = cache.fmt.read_kv(cache.k, cache.v, block_ids, cache.k_scale, cache.v_scale, dtype)
    shape = (*block_ids.shape[:-1], -1, *k.shape[-2:])
    return k.reshape(shape), v.reshape(shape)


def _decode(q, cache, block_tables, mask, scale, tails, lens):
    """One new token per sequence: one gather over the padded block tables, one masked SDPA.
    The query heads of a KV group stand in the query-length dimension, so no KV repeat is needed.
    With exact tails, each sequence's own (last) span is replaced by its unquantized slot.
    On CPU each sequence is computed alone, over its own granules: the CPU attention kernel's
    result for one sequence changes with the batch around it (its GEMMs block over the batch;
    seen on an AMD EPYC host, 1e-7 apart), and a request's logprobs must not. lens: each
    sequence's context length (the mask's row sums)."""
    if q.device.type == "cpu" and q.shape[0] > 1:
        granule = cache.block_size if tails is None else cache.tail_k.shape[1]
        return torch.cat([_decode(q[i:i + 1], cache, block_tables[i:i + 1], mask[i:i + 1, :-(-n // granule) * granule],
                                  scale, None if tails is None else (tails[0][i:i + 1], tails[1][i:i + 1]), [n])
                          for i, n in enumerate(lens)])
    batch, num_heads, head_dim = q.shape
    num_blocks = mask.shape[1] // cache.block_size
    if block_tables.shape[1] < num_blocks:              # the mask covers whole spans: pad the tables
        block_tables = F.pad(block_tables, (0, num_blocks - block_tables.shape[1]))
    k, v = _gather(cache, block_tables[:, :num_blocks], q.dtype)      # [B, L, Hkv, D]
    if tails is not None:
        slots, own = tails
        span = cache.tail_k.shape[1]
        spans = mask.shape[1] // span
        at = own + torch.arange(batch, device=q.device) * spans            # [B] flat span rows
        k.view(batch * spans, span, *k.shape[2:]).index_copy_(0, at, cache.tail_k.index_select(0, slots).to(k.dtype))
        v.view(batch * spans, span, *v.shape[2:]).index_copy_(0, at, cache.tail_v.index_select(0, slots).to(v.dtype))
    num_kv_heads = k.shape[2]
    qg = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def _prefill(q, cache, block_table, context_len, scale, exact=None, unrotate=None):
    n = q.shape[0]
    num_blocks = -(-context_len // cache.block_size)
    k, v = _gather(cache, block_table[:num_blocks], q.dtype)
    k, v = k[:context_len], v[:context_len]
    if unrotate is not None:
        k, v = k @ unrotate, v @ unrotate
    if exact is not None:
        return own_block_attention(q, k, v, *exact, scale, cache.tail_k.shape[1])
    k, v = k.transpose(0, 1), v.transpose(0, 1)
    mask = None
    if n != context_len:
        keys = torch.arange(context_len, device=q.device)
        mask = keys[None, :] <= torch.arange(context_len - n, context_len, device=q.device)[:, None]
    # 4-D inputs: CPU SDPA takes its fused kernel only with a batch dimension
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                         is_causal=mask is None, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
