"""The model catalog: shapes the cost model needs (parameters touched per token, weight bytes per
format, KV bytes per token per format), from a Hugging Face config.json or a built-in entry.
Byte sizes come from formats.sizes, the arithmetic the real KV pool and NVFP4 packer use.

DeepSeek-R1 attends with MLA: each layer caches one latent of kv_lora_rank + qk_rope_head_dim
values per token (no separate K and V). It is sized as one KV head of half that width for K and
for V, so formats.sizes applies unchanged (the byte count is the same; nvfp4 scales per 16 values).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from everybyte.formats.sizes import kv_bytes_per_token, weight_matrix_bytes

# SmolLM2-135M-Instruct (the default model): its config.json as the engine reads it.
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
           "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
           "tie_word_embeddings": True}
# DeepSeek-R1 (DeepSeek-V3 architecture). MoE facts from ../shared/specs/nvfp4.md "Wide-EP facts"
# (61 layers, 58 MoE, 256 routed + 1 shared expert, top-8, hidden 7168, moe_intermediate 2048);
# attention and dense-layer fields as in deepseek-ai/DeepSeek-V3's config.json.
DEEPSEEK_R1 = {"architectures": ["DeepseekV3ForCausalLM"], "_name_or_path": "deepseek-ai/DeepSeek-R1",
               "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
               "num_attention_heads": 128, "num_key_value_heads": 128, "max_position_embeddings": 163840,
               "first_k_dense_replace": 3, "n_routed_experts": 256, "n_shared_experts": 1,
               "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "q_lora_rank": 1536,
               "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
               "tie_word_embeddings": False}
BUILTIN = {"smollm2": SMOLLM2, "deepseek-r1": DEEPSEEK_R1}


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    vocab: int
    heads: int
    kv_layer_shape: tuple[int, int]          # (kv heads, head dim) of one layer's K (and of its V)
    attn_matrices: tuple[tuple[int, int], ...]   # [rows, cols] of one layer's attention weights
    qk_dim: int                              # per head, for attention FLOPs over the context
    v_dim: int
    dense_mlp: int                           # intermediate size of a dense layer's MLP
    moe_layers: int = 0
    experts: int = 0
    experts_per_token: int = 0
    shared_experts: int = 0
    moe_mlp: int = 0
    tied: bool = False
    max_len: int = 2048

    # ---- parameters ---------------------------------------------------------------------------
    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    def mlp_matrices(self, inter: int) -> list[tuple[int, int]]:
        return [(inter, self.hidden), (inter, self.hidden), (self.hidden, inter)]      # gate, up, down

    def weight_bytes(self, fmt: str) -> dict[str, int]:
        """Bytes per part in `fmt` (embeddings and norms stay 16-bit, as the engine keeps them)."""
        def m(mats: Iterable[tuple[int, int]]) -> int:
            return sum(weight_matrix_bytes(fmt, r, c) for r, c in mats)

        attn = self.layers * m(self.attn_matrices)
        dense = self.dense_layers * m(self.mlp_matrices(self.dense_mlp))
        expert = m(self.mlp_matrices(self.moe_mlp)) if self.moe_layers else 0
        shared = self.moe_layers * self.shared_experts * expert
        router = self.moe_layers * weight_matrix_bytes("bf16", self.experts, self.hidden)
        embed = weight_matrix_bytes("bf16", self.vocab, self.hidden) * (1 if self.tied else 2)
        norms = weight_matrix_bytes("bf16", 2 * self.layers + 1, self.hidden)
        return {"attention": attn, "dense_mlp": dense, "shared_experts": shared, "router": router,
                "embeddings": embed, "norms": norms, "expert": expert,
                "routed_experts": self.moe_layers * self.experts * expert}

    def total_weight_bytes(self, fmt: str) -> int:
        return sum(v for k, v in self.weight_bytes(fmt).items() if k != "expert")

    def active_params(self) -> int:
        """Parameters a token's forward multiplies by (routed experts: top-k of them)."""
        def p(mats: Iterable[tuple[int, int]]) -> int:
            return sum(r * c for r, c in mats)

        n = self.layers * p(self.attn_matrices) + self.dense_layers * p(self.mlp_matrices(self.dense_mlp))
        n += self.moe_layers * (self.shared_experts + self.experts_per_token) * p(self.mlp_matrices(self.moe_mlp))
        return n + self.vocab * self.hidden                        # the LM head

    # ---- KV -----------------------------------------------------------------------------------
    @property
    def layer_shapes(self) -> list[tuple[int, int]]:
        return [self.kv_layer_shape] * self.layers

    def kv_bytes_per_token(self, kv_format: str) -> int:
        return kv_bytes_per_token(self.layer_shapes, kv_format)

    def describe(self, weights_format: str, kv_format: str) -> dict[str, Any]:
        return {"name": self.name, "layers": self.layers, "moe_layers": self.moe_layers, "experts": self.experts,
                "active_params": self.active_params(), "weights_format": weights_format,
                "weight_bytes": self.total_weight_bytes(weights_format), "kv_format": kv_format,
                "kv_bytes_per_token": self.kv_bytes_per_token(kv_format)}


def from_hf_config(c: dict[str, Any], name: str = "") -> ModelShape:
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads") if k not in c]
    if missing:
        raise ValueError(f"model config {name!r}: missing {', '.join(missing)}")
    h, heads, layers = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    experts = c.get("n_routed_experts") or c.get("num_experts") or c.get("num_local_experts") or 0
    first_dense = c.get("first_k_dense_replace", 0) if experts else layers
    if c.get("kv_lora_rank"):                               # MLA (DeepSeek-V2/V3/R1)
        rank, rope, nope, v = c["kv_lora_rank"], c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
        q = c.get("q_lora_rank")
        attn: tuple[tuple[int, int], ...] = ((q, h), (heads * (nope + rope), q)) if q else ((heads * (nope + rope), h),)
        attn += ((rank + rope, h), (heads * (nope + v), rank), (h, heads * v))
        kv_shape, qk_dim, v_dim = (1, (rank + rope) // 2), rank + rope, rank       # absorbed attention
    else:
        d = c.get("head_dim") or h // heads
        kvh = c.get("num_key_value_heads") or heads
        attn = ((heads * d, h), (kvh * d, h), (kvh * d, h), (h, heads * d))
        kv_shape, qk_dim, v_dim = (kvh, d), d, d
    return ModelShape(
        name=name or c.get("_name_or_path", "model"), layers=layers, hidden=h, vocab=c["vocab_size"], heads=heads,
        kv_layer_shape=kv_shape, attn_matrices=attn, qk_dim=qk_dim, v_dim=v_dim,
        dense_mlp=c.get("intermediate_size", 4 * h), moe_layers=layers - first_dense if experts else 0,
        experts=experts, experts_per_token=c.get("num_experts_per_tok", 0) if experts else 0,
        shared_experts=c.get("n_shared_experts", 0) or 0, moe_mlp=c.get("moe_intermediate_size", 0) or 0,
        tied=bool(c.get("tie_word_embeddings", False)), max_len=c.get("max_position_embeddings", 2048))


def get_model(name_or_path: str) -> ModelShape:
    """A built-in name (smollm2, deepseek-r1), a config.json, or a directory holding one."""
    if name_or_path.lower() in BUILTIN:
        return from_hf_config(BUILTIN[name_or_path.lower()], name_or_path.lower())
    p = Path(name_or_path)
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise ValueError(f"unknown model {name_or_path!r}: not one of {', '.join(BUILTIN)} and no config.json "
                         f"at that path")
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: cannot read a Hugging Face config.json: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: a config.json holds one JSON object")
    return from_hf_config(config, str(file))
