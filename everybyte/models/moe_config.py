"""The MoE part of a Hugging Face config.json -> ModelConfig fields, per architecture.

qwen3_moe: `num_experts` (transformers 5 writes `num_local_experts`), `moe_intermediate_size`,
  `norm_topk_prob`, dense layers from `mlp_only_layers` and `decoder_sparse_step`, per-head q/k norm.
mixtral: `num_local_experts`, experts of `intermediate_size`, top-k always renormalised.
olmoe: `num_experts`, experts of `intermediate_size`, `norm_topk_prob`, q/k norm over the whole
  projection, `clip_qkv`.
llama_moe (everybyte's own, written by models/moe_from_dense): Llama attention, `num_local_experts`
  experts of `moe_intermediate_size`, chosen experts summed unweighted (`moe_combine: "sum"`).
A field this engine does not implement (shared experts, grouped or sigmoid routing, ...) fails
naming it rather than running a different model.
"""
from __future__ import annotations

from pathlib import Path

# field -> the values that mean "not used" (anything else is a feature this engine lacks)
UNSUPPORTED = {
    "shared_expert_intermediate_size": (None, 0), "n_shared_experts": (None, 0), "num_shared_experts": (None, 0),
    "n_group": (None, 1), "topk_group": (None, 1), "topk_method": (None, "greedy"),
    "scoring_func": (None, "softmax"), "routed_scaling_factor": (None, 1, 1.0), "first_k_dense_replace": (None, 0),
    "moe_layer_freq": (None, 1), "router_bias": (None, False), "expert_bias": (None, False),
    "hidden_act": (None, "silu"),
}


def moe_fields(c: dict, arch: str, file: Path) -> dict:
    """ModelConfig keyword arguments for the MoE architectures ({} for dense ones)."""
    if arch not in ("qwen3_moe", "mixtral", "olmoe", "llama_moe"):
        return {}
    for key, neutral in UNSUPPORTED.items():
        if key in c and c[key] not in neutral:
            raise ValueError(f"{file}: {arch} with {key}={c[key]!r} is not supported (this engine runs "
                             f"{'/'.join(map(str, neutral[1:] or neutral))} there)")
    experts = c.get("num_experts") or c.get("num_local_experts")
    top_k = c.get("num_experts_per_tok")
    if not experts or not top_k:
        raise ValueError(f"{file}: a {arch} config needs num_experts (or num_local_experts) and num_experts_per_tok")
    layers = c["num_hidden_layers"]
    out: dict = {"num_experts": int(experts), "num_experts_per_tok": int(top_k),
                 "norm_topk_prob": bool(c.get("norm_topk_prob", False))}
    if arch == "qwen3_moe":
        step, dense = int(c.get("decoder_sparse_step", 1) or 1), set(c.get("mlp_only_layers") or ())
        moe = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        out |= {"moe_intermediate_size": int(c["moe_intermediate_size"]), "qk_norm": True,
                "moe_layers": None if len(moe) == layers else moe}
    elif arch == "mixtral":
        if c.get("sliding_window") is not None:
            raise ValueError(f"{file}: mixtral with sliding_window={c['sliding_window']} is not supported")
        out |= {"moe_intermediate_size": int(c["intermediate_size"]), "norm_topk_prob": True}
    elif arch == "olmoe":
        clip = c.get("clip_qkv")
        out |= {"moe_intermediate_size": int(c["intermediate_size"]), "qk_norm": True, "qk_norm_whole": True,
                "clip_qkv": None if clip is None else float(clip)}
    else:
        out |= {"moe_intermediate_size": int(c["moe_intermediate_size"]), "moe_combine": c.get("moe_combine", "sum")}
    return out


def hf_moe_config(arch: str, cfg) -> dict:
    """The config.json fields that describe a ModelConfig's MoE part (hf_export)."""
    if not cfg.is_moe:
        return {}
    out = {"num_experts_per_tok": cfg.num_experts_per_tok}
    if arch == "qwen3_moe":
        dense = [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
        out |= {"num_experts": cfg.num_experts, "moe_intermediate_size": cfg.moe_intermediate_size,
                "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": 1, "mlp_only_layers": dense}
    elif arch == "mixtral":
        out |= {"num_local_experts": cfg.num_experts, "intermediate_size": cfg.moe_intermediate_size,
                "router_jitter_noise": 0.0, "sliding_window": None}
    elif arch == "olmoe":
        out |= {"num_experts": cfg.num_experts, "intermediate_size": cfg.moe_intermediate_size,
                "norm_topk_prob": cfg.norm_topk_prob, "clip_qkv": cfg.clip_qkv}
    else:
        out |= {"num_local_experts": cfg.num_experts, "moe_intermediate_size": cfg.moe_intermediate_size,
                "moe_combine": cfg.moe_combine}
    return out
