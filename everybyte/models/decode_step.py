"""A decode step in one C call (native/csrc/decode_step.c): the fast path of CausalLM.forward
when every sequence brings one new token, on CPU, in float32, with NVFP4 weights and an NVFP4 KV
pool, for dense models (MoE layers and q/k norms take the per-op path). At batch 1 a step is ~15
small ops a layer, and their Python and dispatch cost is a large part of the step once the weights are 4-bit; here the whole stack of layers runs in one OpenMP
team. `run` returns None when the step is not of that kind, and the per-op path runs.

The per-layer table of weight and pool addresses is built once per (model, KV caches) and kept;
the per-step arguments (positions, slots, block tables, lengths, tails) are rebuilt each step.
"""
from __future__ import annotations

import ctypes

import torch

from everybyte.formats.kv_layout import hadamard
from everybyte.formats.nvfp4_kv import divisors
from everybyte.models import native_ops
from everybyte.models.nvfp4_gemm import GEMV_MAX_ROWS

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Weight(ctypes.Structure):
    _fields_ = [("nseg", _i64), ("q", _p), ("s", _p), ("gs", _p), ("rows", _p), ("bias", _p)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Weight), ("o", _Weight), ("gate_up", _Weight), ("down", _Weight),
                ("in_norm", _p), ("post_norm", _p), ("kd", _p), ("ks", _p), ("vd", _p), ("vs", _p),
                ("k_scale", _f32), ("v_scale", _f32), ("tail_k", _p), ("tail_v", _p)]


class _Args(ctypes.Structure):
    _fields_ = [(n, _i64) for n in ("B", "hidden", "hq", "hkv", "D", "inter", "bs", "max_blocks", "span", "nd")] + [
        ("eps", _f32), ("attn_scale", _f32), ("rope", _p), ("H", _p), ("divs", _p), ("final_norm", _p),
        ("no_tail", _p), ("pos", _p), ("slots", _p), ("tables", _p), ("ctx", _p), ("tail_slot", _p), ("tail_own", _p)]


def _lib():
    lib = native_ops.lib()
    if lib is not None and lib.decode_step.argtypes is None:
        lib.decode_step.restype = None
        lib.decode_step.argtypes = [ctypes.POINTER(_Args), ctypes.POINTER(_Layer), _i64, _p, _p, ctypes.c_int]
    return lib


def _weight(module, keep: list) -> _Weight | None:
    packed = getattr(module, "packed", None)
    if packed is None or packed.device.type != "cpu":
        return None
    q, s, gs, rows, n = packed._c
    bias = None if getattr(module, "bias", None) is None else module.bias.detach().float().contiguous()
    keep.append(bias)
    return _Weight(n, ctypes.addressof(q), ctypes.addressof(s), ctypes.addressof(gs), ctypes.addressof(rows),
                   None if bias is None else bias.data_ptr())


class _Plan:
    """The layer table of one model over one set of layer KV caches (None fields: does not apply)."""

    def __init__(self, lm, kv_caches):
        self.kv_caches, self.keep, self.layers = list(kv_caches), [], None
        cfg, model = lm.config, lm.model
        attn0 = model.layers[0].self_attn
        if (cfg.qk_norm or cfg.is_moe or cfg.clip_qkv is not None or attn0.head_dim % 16
                or attn0.head_dim > 256 or not native_ops.f32_cpu(lm.rotary.cos_sin, model.norm.weight)):
            return
        layers = (_Layer * len(model.layers))()
        for i, (layer, cache) in enumerate(zip(model.layers, kv_caches)):
            ws = [_weight(m, self.keep) for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                  layer.mlp.gate_up_proj, layer.mlp.down_proj)]
            stores = (cache.k.get("data"), cache.k.get("scales"), cache.v.get("data"), cache.v.get("scales"))
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if (None in ws or cache.fmt.name != "nvfp4" or None in stores
                    or not all(t.device.type == "cpu" and t.is_contiguous() for t in stores)
                    or not native_ops.f32_cpu(*norms)):
                return
            tails = cache.tail_k is not None and native_ops.f32_cpu(cache.tail_k, cache.tail_v)
            if cache.tail_k is not None and not tails:
                return
            layers[i] = _Layer(*ws, *(n.data_ptr() for n in norms), *(t.data_ptr() for t in stores),
                               float(cache.k_scale), float(cache.v_scale),
                               cache.tail_k.data_ptr() if tails else None, cache.tail_v.data_ptr() if tails else None)
        self.layers = layers
        D = attn0.head_dim
        self.H = hadamard(D, torch.float32, "cpu") if cache.fmt.rotate and D & (D - 1) == 0 else None
        self.divs = divisors("cpu")
        self.span = kv_caches[0].tail_k.shape[1] if kv_caches[0].tail_k is not None else None
        self.tails = kv_caches[0].tail_k is not None
        self.shape = (cfg.hidden_size, attn0.num_heads, attn0.num_kv_heads, D, lm.model.layers[0].mlp.intermediate_size)
        self.eps, self.scale = float(model.norm.eps), float(attn0.scale)

    def valid_for(self, kv_caches) -> bool:
        return len(kv_caches) == len(self.kv_caches) and all(a is b for a, b in zip(kv_caches, self.kv_caches))


def run(lm, input_ids: torch.Tensor, positions: torch.Tensor, meta, kv_caches) -> torch.Tensor | None:
    """The final-normed hidden states [B, hidden] of a decode-only step, or None (not applicable)."""
    B = len(meta.query_lens)
    if (lm.dtype is not torch.float32 or not 0 < B <= GEMV_MAX_ROWS or input_ids.shape[0] != B
            or any(n != 1 for n in meta.query_lens) or input_ids.device.type != "cpu"
            or max(meta.context_lens) > lm.rotary.cos_sin.shape[0]):
        return None
    plan = getattr(lm, "_decode_plan", None)
    if plan is None or not plan.valid_for(kv_caches):
        plan = lm._decode_plan = _Plan(lm, kv_caches)
    lib = _lib() if plan.layers is not None else None
    if lib is None:
        return None
    tails = plan.tails and meta.tail_slots is not None
    E, hq, hkv, D, inter = plan.shape
    bs = kv_caches[0].block_size
    span = plan.span if tails else bs
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long)
    pos, ctx = positions.to(torch.long).contiguous(), as_long(meta.context_lens)
    slots, tables = meta.slot_mapping.to(torch.long).contiguous(), meta.block_tables.to(torch.long).contiguous()
    no_tail = torch.full((B,), -1, dtype=torch.long)
    tail_slot = as_long(meta.tail_slots) if tails else no_tail
    tail_own = as_long([(c - 1) // span for c in meta.context_lens])
    h = lm.model.embed_tokens(input_ids).float().contiguous()
    residual = torch.empty_like(h)
    ptr = lambda t: None if t is None else t.data_ptr()
    args = _Args(B, E, hq, hkv, D, inter, bs, tables.shape[1], span, plan.divs.numel(), plan.eps, plan.scale,
                 lm.rotary.cos_sin.data_ptr(), ptr(plan.H), plan.divs.data_ptr(), lm.model.norm.weight.data_ptr(),
                 no_tail.data_ptr(), pos.data_ptr(), slots.data_ptr(), tables.data_ptr(), ctx.data_ptr(),
                 tail_slot.data_ptr(), tail_own.data_ptr())
    lib.decode_step(ctypes.byref(args), plan.layers, len(plan.layers), h.data_ptr(), residual.data_ptr(),
                    torch.get_num_threads())
    return h
