"""Imbalance of expert placements on recorded routing (bench/micro/moe_routing.Routing).

"before": the contiguous split with no replicas (rank r holds experts [r*E/N, (r+1)*E/N)).
"after" (replay): the real EplbController stepped over the recorded steps; each placement is
computed from the load of the previous `window` steps (the engine's --eplb-window; 0 = its
default of several intervals) and judged on the next `interval` steps (what a server sees: it
never balances on load it has not seen). The first interval has no placement yet and is left out.
"in_sample": one placement from all the recorded load, judged on the same load (the bound).

Per layer and judged interval: max / mean tokens per rank, three ways:
- "after": each step's tokens split over replicas by the rule the dispatcher serves with
  (models/replica_choice: a replicated expert's tokens to its least-loaded ranks of the step), the
  interval's per-rank sums compared;
- "after_even_split": an expert's tokens split evenly over its replicas (the figure printed before
  the dispatcher chose replicas per step; what a fixed split such as token t -> replica t mod count
  approaches);
- "after_per_step": sum over the interval's steps of the busiest rank's tokens / sum of the mean
  rank's (served rule): what the layer costs when every step waits for its busiest rank, as
  TensorRT-LLM's per-iteration figure (DeepSeek-R1 at EP 32, 2.56 -> 1.11) counts it, but weighted
  by tokens so that one-token decode steps do not outvote prefills.
"before_per_step" is the same for the contiguous split.
"""
from __future__ import annotations

from statistics import mean

import torch

from everybyte.bench.micro.moe_routing import Routing
from everybyte.models.eplb import rebalance
from everybyte.models.expert_load import EplbController, EplbSettings, ExpertLoad, identity_maps, layer_imbalance
from everybyte.models.replica_choice import rank_loads_chosen


def _summary(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"mean": 1.0, "max": 1.0, "n": 0}
    return {"mean": round(mean(values), 4), "max": round(max(values), 4), "n": len(values)}


def _step_rank_loads(counts: torch.Tensor, maps: list[list[int]], num_ranks: int) -> torch.Tensor:
    """[L, N] tokens per rank of one step's counts [L, E] under the served replica rule."""
    if all(len(m) == counts.shape[1] for m in maps):          # no replicas: each expert's one slot decides
        slot_rank = torch.arange(counts.shape[1]) // (counts.shape[1] // num_ranks)
        rank_of = slot_rank[torch.argsort(torch.tensor(maps), dim=1)]     # rank of each logical expert
        return torch.zeros(len(maps), num_ranks, dtype=torch.int64).scatter_add_(1, rank_of, counts.long())
    return torch.tensor([rank_loads_chosen(row, m, num_ranks) for row, m in zip(counts.tolist(), maps)])


class _Judge:
    """Per-layer imbalance of the intervals a placement served, aggregated and per step."""

    def __init__(self, num_layers: int, num_ranks: int):
        self.n, self.num_layers = num_ranks, num_layers
        self.values: dict[str, list[float]] = {k: [] for k in ("before", "after", "after_even_split",
                                                             "before_per_step", "after_per_step")}
        self.reset()

    def reset(self) -> None:
        self.counts = torch.zeros(0)
        self.sums = {k: torch.zeros(self.num_layers, self.n, dtype=torch.float64) for k in ("before", "after")}
        self.peaks = {k: torch.zeros(self.num_layers, dtype=torch.float64) for k in ("before", "after")}

    def step(self, counts: torch.Tensor, before_maps: list[list[int]], maps: list[list[int]]) -> None:
        self.counts = counts.clone() if not self.counts.numel() else self.counts + counts
        for key, m in (("before", before_maps), ("after", maps)):
            loads = _step_rank_loads(counts, m, self.n).double()
            self.sums[key] += loads
            self.peaks[key] += loads.max(1).values

    def close(self, before_maps: list[list[int]], maps: list[list[int]]) -> None:
        if self.counts.numel() and int(self.counts.sum()):
            for key in ("before", "after"):
                total = self.sums[key]
                self.values[key].extend((total.max(1).values / total.mean(1)).nan_to_num(1.0).tolist())
                self.values[f"{key}_per_step"].extend((self.peaks[key] / total.mean(1)).nan_to_num(1.0).tolist())
            self.values["after_even_split"].extend(layer_imbalance(self.counts, maps, self.n))
        self.reset()


def replay_imbalance(routing: Routing, num_ranks: int, redundant: int, interval: int, window: int = 0) -> dict:
    """Before/after imbalance over the recorded steps for one EP size, redundancy and load window."""
    settings = EplbSettings(redundant=redundant, interval=interval, window=window)
    layers, experts = routing.moe_layers, routing.num_experts
    load = ExpertLoad(layers, experts, window=settings.window_steps)
    pending: dict[int, list[int]] = {}
    ctl = EplbController(load, num_ranks, settings, lambda layer, row: pending.__setitem__(layer, row))
    before_maps = identity_maps(len(layers), experts)
    current: list[list[int]] | None = None
    judge = _Judge(len(layers), num_ranks)
    for counts in routing.steps:
        load.add(counts)
        if current is not None:
            judge.step(counts, before_maps, current)
        if ctl.on_step():
            if current is not None:
                judge.close(before_maps, current)
            current = [pending[layer] for layer in layers]
    if current is not None:
        judge.close(before_maps, current)
    total = routing.total()
    in_sample_maps = rebalance(total, ctl.num_replicas, 1, 1, num_ranks)[0]
    return {"ep": num_ranks, "redundant_per_rank": redundant, "window_steps": settings.window_steps,
            "slots_per_rank": ctl.num_replicas // num_ranks, "rebalances": ctl.rebalances,
            **{key: _summary(v) for key, v in judge.values.items()},
            "in_sample_before": _summary(layer_imbalance(total, before_maps, num_ranks)),
            "in_sample_after": _summary(layer_imbalance(total, in_sample_maps, num_ranks))}


def expert_skew(routing: Routing) -> dict[str, float | int]:
    """How uneven the experts themselves are: max / mean tokens per expert, per layer (all steps)."""
    per_layer = [max(row) / (sum(row) / len(row)) for row in routing.total().tolist() if sum(row)]
    return _summary(per_layer)
