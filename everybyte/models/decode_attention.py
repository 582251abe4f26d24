"""Decode attention straight over the NVFP4 KV pool in one C call a layer (native/csrc/
decode_attention.c): the fast path of attention._decode for nvfp4 KV on CPU, with the Hadamard
rotation of queries and outputs and the exact-tail overlay inside the kernel. Returns None where
it does not apply (another format or device, no C compiler), and the torch path runs."""
from __future__ import annotations

import torch

from everybyte.formats.kv_layout import hadamard
from everybyte.models import native_ops


def nvfp4_decode(q: torch.Tensor, cache, block_tables: torch.Tensor, lens: torch.Tensor, scale: float,
                 tails, rotate: bool) -> torch.Tensor | None:
    """q [B, Hq, D] (unrotated) -> [B, Hq, D]; lens [B] context lengths; tails (slots, own span
    index) per row or None. None when the fused kernel does not apply."""
    if (cache.fmt.name != "nvfp4" or q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16)
            or q.shape[-1] % 16 or q.shape[-1] > 256 or native_ops.lib() is None):
        return None
    kd, ks, vd, vs = cache.k["data"], cache.k["scales"], cache.v["data"], cache.v["scales"]
    if not all(t.is_contiguous() for t in (kd, ks, vd, vs)):
        return None
    tail_k = tail_v = None
    B, hq, D = q.shape
    if tails is not None:
        tail_k, tail_v = cache.tail_k, cache.tail_v
        if tail_k.dtype != q.dtype or not (tail_k.is_contiguous() and tail_v.is_contiguous()):
            return None
        slots, own = tails
        span = tail_k.shape[1]
    else:
        slots, own, span = torch.full((B,), -1, dtype=torch.long), torch.zeros(B, dtype=torch.long), 1
    q = q.contiguous()
    tables = block_tables.contiguous()
    out = torch.empty_like(q)
    h = hadamard(D, torch.float32, "cpu") if rotate else None
    ptr = lambda t: None if t is None else t.data_ptr()
    native_ops.lib().nvfp4_decode_attention(
        q.data_ptr(), out.data_ptr(), int(q.dtype is torch.bfloat16), B, hq, kd.shape[2], D, kd.data_ptr(),
        ks.data_ptr(), vd.data_ptr(), vs.data_ptr(), cache.k_scale, cache.v_scale, cache.block_size,
        tables.data_ptr(), tables.shape[1], lens.data_ptr(), ptr(tail_k), ptr(tail_v), slots.data_ptr(),
        own.data_ptr(), span, ptr(h), scale, torch.get_num_threads())
    return out
