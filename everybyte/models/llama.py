"""Llama / Qwen2 / Qwen3 decoder-only model over a paged KV cache, and its MoE variants (Qwen3-MoE,
Mixtral, OLMoE, llama_moe: models/moe.py) whose layers hold a MoEBlock in place of the MLP."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from everybyte.models import decode_step
from everybyte.models.attention import AttentionMetadata, LayerKVCache, paged_attention
from everybyte.models.config import ModelConfig
from everybyte.models.expert_placement import ExpertPlacement
from everybyte.models.layers import MLP, Embedding, Linear, RMSNorm
from everybyte.models.moe import MoEBlock
from everybyte.models.moe_weights import localize_experts
from everybyte.models.nvfp4_linear import SUFFIXES, PackedModule
from everybyte.models.rope import RotaryEmbedding

__all__ = ["MLP", "Attention", "CausalLM", "DecoderLayer", "Embedding", "Linear", "RMSNorm"]

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, False, dtype)
        if cfg.qk_norm:
            q_dim, k_dim = (self.q_size, self.kv_size) if cfg.qk_norm_whole else (self.head_dim, self.head_dim)
            self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps, dtype)
        self.qk_norm, self.qk_norm_whole, self.clip_qkv = cfg.qk_norm, cfg.qk_norm_whole, cfg.clip_qkv

    def shard_sizes(self) -> tuple[int, ...]:
        return self.q_size, self.kv_size, self.kv_size

    def forward(self, positions, x, rotary: RotaryEmbedding, cache: LayerKVCache, meta: AttentionMetadata):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm_whole:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k)
        out = paged_attention(q, k, v, cache, meta, self.scale)
        return self.o_proj(out.flatten(1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer_idx: int = 0,
                 placement: ExpertPlacement | None = None):
        super().__init__()
        self.self_attn = Attention(cfg, dtype)
        self.mlp: nn.Module = (MoEBlock(cfg, dtype, layer_idx, placement) if cfg.is_moe_layer(layer_idx)
                               else MLP(cfg.hidden_size, cfg.intermediate_size, dtype))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions, h, residual, rotary, cache, meta):
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, h, rotary, cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, placements: dict[int, ExpertPlacement] | None = None):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, i, (placements or {}).get(i))
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class CausalLM(nn.Module):
    fused_decode = True      # decode-only steps through models/decode_step where it applies (False: per op)

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 placements: dict[int, ExpertPlacement] | None = None):
        """placements: MoE layer index -> where its experts live (default: all here, identity)."""
        super().__init__()
        self.config, self.dtype = config, dtype
        self.model = Model(config, dtype, placements)
        self.rotary = self.make_rotary(config)
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, False, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[LayerKVCache]) -> torch.Tensor:
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"need {len(self.model.layers)} layer KV caches, got {len(kv_caches)}")
        if self.fused_decode:
            fused = decode_step.run(self, input_ids, positions, meta, kv_caches)
            if fused is not None:
                return fused
        h, residual = self.model.embed_tokens(input_ids), None
        for layer, cache in zip(self.model.layers, kv_caches):
            h, residual = layer(positions, h, residual, self.rotary, cache, meta)
        h, _ = self.model.norm(h, residual)
        return h

    @staticmethod
    def make_rotary(config: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                               config.rope_scaling)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.embed_tokens.logits if self.lm_head is None else self.lm_head
        return head(hidden).float()

    def linear_parts(self, name: str) -> list[tuple[str, int]]:
        """(HF name, rows) of each matrix module `name` holds: q/k/v for qkv_proj, gate/up for gate_up_proj."""
        prefix, _, leaf = name.rpartition(".")
        if leaf in FUSED:
            return [(f"{prefix}.{part}", rows) for part, rows in
                    zip(FUSED[leaf], self.get_submodule(prefix).shard_sizes())]
        return [(name, self.get_submodule(name).weight.shape[0])]

    def _weight_table(self) -> dict[str, tuple]:
        """HF name -> (parameter, row offset, rows) for every float weight the model needs, and
        HF matrix name -> (NVFP4 module, part index) for the packed ones."""
        table = {}
        for name, mod in self.named_modules():
            if isinstance(mod, PackedModule):
                table.update({part: (mod, i) for i, part in enumerate(mod.part_names)})
        for name, param in self.named_parameters():
            prefix, _, fused = name.rpartition(".")[0].rpartition(".")
            if fused not in FUSED:
                table[name] = (param, 0, param.shape[0])
                continue
            kind, offset = name.rpartition(".")[2], 0
            for part, rows in zip(FUSED[fused], self.get_submodule(prefix).shard_sizes()):
                table[f"{prefix}.{part}.{kind}"] = (param, offset, rows)
                offset += rows
        return table

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        table, loaded, unknown = self._weight_table(), set(), []
        for name, tensor in localize_experts(weights, self):
            matrix, _, suffix = name.rpartition(".")
            if suffix in SUFFIXES and isinstance(table.get(matrix, (None,))[0], PackedModule):
                module, part = table[matrix]
                module.accept(part, suffix, tensor, name)
                continue
            entry = table.get(name)
            if entry is None:
                if not (name.endswith("rotary_emb.inv_freq")
                        or (name == "lm_head.weight" and self.lm_head is None)):
                    unknown.append(name)
                continue
            param, offset, rows = entry
            dst = param.data.narrow(0, offset, rows)
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name}: shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(name)
        packed = {id(e[0]): e[0] for e in table.values() if isinstance(e[0], PackedModule)}
        missing = sorted(n for n, e in table.items() if not isinstance(e[0], PackedModule) and n not in loaded)
        missing += [n for m in packed.values() for n in m.finish()]
        if unknown or missing:
            raise ValueError(f"weights do not match the {self.config.architecture} model: "
                             f"unknown {unknown[:20]}{'...' if len(unknown) > 20 else ''}, "
                             f"missing {missing[:20]}{'...' if len(missing) > 20 else ''}")
