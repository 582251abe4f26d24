"""GGUF models: ModelConfig from metadata and weights under Hugging Face names, with llama.cpp's
q/k row permutation undone."""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from everybyte.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from everybyte.models.gguf_file import GGUFFile

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm"}


def hf_tensor_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m[2] in _BLOCK_NAMES:
        return f"model.layers.{m[1]}.{_BLOCK_NAMES[m[2]]}.{m[3]}"
    return None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's convert_hf_to_gguf LlamaModel.permute (rows of q/k weights and biases)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# llama.cpp's sampling metadata (the model author's recommended settings) -> SamplingParams names
GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                 "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                 "general.sampling.penalty_repeat": "repetition_penalty"}


def config_from_gguf(g: GGUFFile) -> ModelConfig:
    md, arch = g.metadata, g.metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{g.path}: unsupported model architecture {arch!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

    def key(name, default=KeyError):
        value = md.get(f"{arch}.{name}", default)
        if value is KeyError:
            raise ValueError(f"{g.path}: GGUF metadata lacks {arch}.{name}")
        if isinstance(value, list):  # per-layer values: only uniform ones are supported
            if len(set(value)) != 1:
                raise ValueError(f"{g.path}: {arch}.{name} varies across layers ({value})")
            value = value[0]
        return value

    if "token_embd.weight" not in g.tensors:
        raise ValueError(f"{g.path}: GGUF has no token_embd.weight tensor")
    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{g.path}: partial rotary embeddings are not supported")
    eos = [md[f"tokenizer.ggml.{k}_token_id"] for k in ("eos", "eot", "eom") if f"tokenizer.ggml.{k}_token_id" in md]
    theta, digest = float(key("rope.freq_base", 10000.0)), g.identity()
    return ModelConfig(
        architecture=arch, vocab_size=g.tensors["token_embd.weight"].shape[0], hidden_size=hidden,
        intermediate_size=key("feed_forward_length"), num_hidden_layers=key("block_count"),
        num_attention_heads=heads, num_key_value_heads=key("attention.head_count_kv", heads), head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)), rope_theta=theta,
        rope_scaling=_rope_scaling(g, key, head_dim, theta), max_position_embeddings=key("context_length", 2048),
        tie_word_embeddings="output.weight" not in g.tensors, attention_bias="blk.0.attn_q.bias" in g.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in g.tensors, bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos)), model_id=f"{md.get('general.name') or Path(g.path).stem}@{digest}",
        revision=digest, sampling_defaults={ours: md[k] for k, ours in GGUF_SAMPLING.items() if k in md})


def _rope_scaling(g: GGUFFile, key, head_dim: int, theta: float) -> dict | None:
    kind, factor = key("rope.scaling.type", "none"), key("rope.scaling.factor", 1.0)
    original = key("rope.scaling.original_context_length", None)
    if "rope_freqs.weight" in g.tensors:
        try:
            return llama3_rope_from_factors(g.load("rope_freqs.weight"), head_dim, theta, original or 8192)
        except ValueError as e:
            raise ValueError(f"{g.path}: {e}") from e
    if kind in ("linear", "yarn") and factor != 1.0:
        scaling = {"rope_type": kind, "factor": float(factor)}
        return scaling | ({"original_max_position_embeddings": original} if original else {})
    if kind not in ("none", "linear", "yarn"):
        raise ValueError(f"{g.path}: unsupported rope scaling {kind!r}")
    return None


def llama3_rope_factors(scaling: dict, head_dim: int, theta: float) -> torch.Tensor:
    """The per-frequency divisors llama.cpp's converter writes as rope_freqs for llama3 scaling."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi * theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    smooth = (old / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return torch.where(wavelen < old / high, 1.0, torch.where(wavelen > old / low, factor, mid))


def llama3_rope_from_factors(factors: torch.Tensor, head_dim: int, theta: float, original: int) -> dict:
    """Rebuild HF llama3 rope_scaling from rope_freqs: the smooth ramp is linear in 1/wavelength,
    so two of its points fix low/high_freq_factor for a given original context length."""
    f = factors.double().flatten()
    factor = f.max().item()
    inv_wavelen = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim) / (2 * math.pi)
    mid = (f > 1 + 1e-6) & (f < factor - 1e-6)
    if factor <= 1 or int(mid.sum()) < 2:
        raise ValueError("rope_freqs does not describe llama3 rope scaling")
    smooth = (1 / f[mid] - 1 / factor) / (1 - 1 / factor)
    slope, intercept = np.polyfit(inv_wavelen[mid].numpy(), smooth.numpy(), 1)
    span = original / slope
    low = -intercept * span
    scaling = {"rope_type": "llama3", "factor": round(factor, 4), "low_freq_factor": round(float(low), 3),
               "high_freq_factor": round(float(low + span), 3), "original_max_position_embeddings": original}
    if not torch.allclose(llama3_rope_factors(scaling, head_dim, theta), f, rtol=1e-4):
        raise ValueError("rope_freqs does not describe llama3 rope scaling")
    return scaling


def iter_gguf_weights(g: GGUFFile, config: ModelConfig, dtype: torch.dtype | None = None,
                      device="cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) per weight; dtype None leaves the casting to the consumer's copy."""
    for name in g.tensors:
        if name == "rope_freqs.weight":
            continue
        hf_name = hf_tensor_name(name)
        if hf_name is None:
            raise ValueError(f"{g.path}: unexpected tensor {name!r} for architecture {config.architecture}")
        w = g.load(name, dtype, device)
        if config.architecture == "llama" and re.search(r"\.attn_[qk]\.", name):
            w = unpermute_qk(w, config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads)
        yield hf_name, w
