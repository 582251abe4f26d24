"""Mixture-of-experts MLP: a router picks each token's top-k experts; their outputs are combined.

Routing (HF Qwen3-MoE / Mixtral / OLMoE): softmax over the router logits in float32, top-k,
renormalised to sum to 1 when `norm_topk_prob` (Mixtral always). With moe_combine "sum"
(llama_moe) the chosen experts' outputs are added with weight 1: the router only selects.

Every expert is its own pair of `Linear`s, so the NVFP4 path packs each like any other linear.
`experts` are this rank's physical slots (see ExpertPlacement); expert parallelism sets
`dispatcher` (tokens go to the ranks holding their experts), the load balancer `load_counter`.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from everybyte.models.config import ModelConfig
from everybyte.models.expert_placement import ExpertPlacement
from everybyte.models.layers import MLP, Linear

# HF names of the routers: kept float when weights are quantized at load (tiny, and routing-sensitive)
ROUTER_PATTERNS = ("model.layers.*.mlp.gate",)


class Expert(MLP):
    """One SwiGLU expert: gate_up_proj (HF gate_proj + up_proj, fused) and down_proj."""


class MoEBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer_idx: int,
                 placement: ExpertPlacement | None = None):
        super().__init__()
        placement = placement or ExpertPlacement.identity(cfg.num_experts)
        if placement.num_logical != cfg.num_experts:
            raise ValueError(f"layer {layer_idx}: placement is for {placement.num_logical} experts, "
                             f"the model has {cfg.num_experts}")
        self.layer_idx, self.top_k = layer_idx, cfg.num_experts_per_tok
        self.num_experts, self.norm_topk_prob = cfg.num_experts, cfg.norm_topk_prob
        self.weighted = cfg.moe_combine == "weighted"
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, False, dtype)
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, cfg.moe_intermediate_size, dtype)
                                     for _ in range(placement.num_local_slots))
        self.placement = placement
        self.dispatcher: Any | None = None
        self.load_counter: Callable[[int, torch.Tensor], None] | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logical expert ids [T, k] int64 and combine weights [T, k] float32."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if not self.weighted:
            return ids, torch.ones_like(weights)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def run_local(self, x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, H]; slots [N, k] local slot ids (-1: not here, contributes 0); weights [N, k] ->
        the weighted sum of the experts' outputs [N, H] (experts run in slot order, as HF does)."""
        out = torch.zeros_like(x)
        if x.shape[0] == 0:
            return out
        for slot in torch.unique(slots[slots >= 0]).tolist():
            rows, pos = torch.where(slots == slot)
            y = self.experts[slot](x[rows])
            out.index_add_(0, rows, y * weights[rows, pos, None].to(y.dtype))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        if self.load_counter is not None:
            self.load_counter(self.layer_idx, ids)
        if self.dispatcher is not None:
            return self.dispatcher.forward(self, x, ids, weights)
        return self.run_local(x, self.placement.to_local_slots(ids), weights)
