"""Imbalance of expert placements on recorded routing (bench/micro/moe_routing.Routing).

"before": the contiguous split with no replicas (rank r holds experts [r*E/N, (r+1)*E/N)).
"after" (replay): the real EplbController stepped over the recorded steps; each placement is
computed from the load of the previous `window` steps (the engine's --eplb-window; 0 = its
default of several intervals) and judged on the next `interval` steps (what a server sees: it never balances on load it has not seen). The first interval has
no placement yet and is left out of both figures.
"in_sample": one placement from all the recorded load, judged on the same load (the bound).
Per layer and window: max / mean tokens per rank, an expert's tokens split evenly over its replicas.
"""
from __future__ import annotations

from statistics import mean

import torch

from everybyte.bench.micro.moe_routing import Routing
from everybyte.models.eplb import rebalance
from everybyte.models.expert_load import EplbController, EplbSettings, ExpertLoad, identity_maps, layer_imbalance


def _summary(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"mean": 1.0, "max": 1.0, "n": 0}
    return {"mean": round(mean(values), 4), "max": round(max(values), 4), "n": len(values)}


def replay_imbalance(routing: Routing, num_ranks: int, redundant: int, interval: int, window: int = 0) -> dict:
    """Before/after imbalance over the recorded steps for one EP size, redundancy and load window."""
    settings = EplbSettings(redundant=redundant, interval=interval, window=window)
    layers, experts = routing.moe_layers, routing.num_experts
    load = ExpertLoad(layers, experts, window=settings.window_steps)
    pending: dict[int, list[int]] = {}
    ctl = EplbController(load, num_ranks, settings, lambda layer, row: pending.__setitem__(layer, row))
    before_maps = identity_maps(len(layers), experts)
    current: list[list[int]] | None = None
    bucket = torch.zeros(len(layers), experts, dtype=torch.int64)
    before: list[float] = []
    after: list[float] = []

    def judge() -> None:
        if current is not None and int(bucket.sum()):
            before.extend(layer_imbalance(bucket, before_maps, num_ranks))
            after.extend(layer_imbalance(bucket, current, num_ranks))

    for counts in routing.steps:
        load.add(counts)
        bucket += counts
        if ctl.on_step():
            judge()
            current, bucket = [pending[layer] for layer in layers], torch.zeros_like(bucket)
    judge()
    total = routing.total()
    in_sample_maps = rebalance(total, ctl.num_replicas, 1, 1, num_ranks)[0]
    return {"ep": num_ranks, "redundant_per_rank": redundant, "window_steps": settings.window_steps, "slots_per_rank": ctl.num_replicas // num_ranks,
            "rebalances": ctl.rebalances, "before": _summary(before), "after": _summary(after),
            "in_sample_before": _summary(layer_imbalance(total, before_maps, num_ranks)),
            "in_sample_after": _summary(layer_imbalance(total, in_sample_maps, num_ranks))}


def expert_skew(routing: Routing) -> dict[str, float | int]:
    """How uneven the experts themselves are: max / mean tokens per expert, per layer (all steps)."""
    per_layer = [max(row) / (sum(row) / len(row)) for row in routing.total().tolist() if sum(row)]
    return _summary(per_layer)
