"""Expert load over a sliding window of steps, the imbalance of a placement, and the controller
that rebalances every `--eplb-interval` steps from the load of the last `--eplb-window` steps.

`ExpertLoad.count` is what `MoEBlock.load_counter` is set to: (layer index, logical ids [T, k]).
`end_step()` closes a step; the window keeps the last `window` closed steps. The imbalance of a
placement is max / mean tokens per rank, per layer, with an expert's tokens split evenly over
its replicas (rank r holds physical slots [r*S, (r+1)*S)).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from everybyte.models.eplb import imbalance, rank_loads, rebalance
from everybyte.models.moe import MoEBlock

WINDOW_INTERVALS = 4    # default load window, in rebalance intervals


@dataclass(frozen=True)
class EplbSettings:
    """--eplb-redundant R (extra slots per rank), --eplb-interval STEPS (how often to rebalance) and
    --eplb-window STEPS (how much history the placement is computed from; 0 = WINDOW_INTERVALS
    intervals: like DeepSeek and vLLM, a longer history than the rebalance step, since a short
    window's per-expert counts are too noisy to predict the next interval from)."""
    redundant: int = 0
    interval: int = 1000
    window: int = 0
    num_groups: int = 1
    num_nodes: int = 1

    def __post_init__(self) -> None:
        if self.redundant < 0:
            raise ValueError(f"--eplb-redundant must be >= 0 redundant experts per rank, got {self.redundant}")
        if self.interval < 1:
            raise ValueError(f"--eplb-interval must be >= 1 step, got {self.interval}")
        if self.window < 0:
            raise ValueError(f"--eplb-window must be >= 0 steps (0 = {WINDOW_INTERVALS} intervals), got {self.window}")
        if self.window and self.window < self.interval:
            raise ValueError(f"--eplb-window {self.window} is shorter than --eplb-interval {self.interval}: "
                             f"steps between rebalances would never count; use 0 (default) or >= {self.interval}")

    @property
    def window_steps(self) -> int:
        """The load window in steps: --eplb-window, or WINDOW_INTERVALS intervals when 0."""
        return self.window or WINDOW_INTERVALS * self.interval

    def num_replicas(self, num_experts: int, num_ranks: int) -> int:
        """Physical slots in all for `num_experts` over `num_ranks` ranks; a clear error when the
        ranks do not divide the experts or a rank would hold more slots than there are experts."""
        if num_ranks < 1 or num_experts % num_ranks:
            ok = [n for n in range(1, num_experts + 1) if num_experts % n == 0]
            raise ValueError(f"{num_ranks} ranks do not divide {num_experts} experts; use one of {ok}")
        per_rank = num_experts // num_ranks + self.redundant
        if per_rank > num_experts:
            raise ValueError(f"--eplb-redundant {self.redundant} gives each of {num_ranks} ranks {per_rank} slots, "
                             f"more than the {num_experts} experts; use at most {num_experts - num_experts // num_ranks}")
        return per_rank * num_ranks


class ExpertLoad:
    """Tokens per logical expert for each MoE layer over the last `window` steps."""

    def __init__(self, moe_layers: Sequence[int], num_experts: int, window: int):
        if window < 1:
            raise ValueError(f"the load window must be >= 1 step, got {window}")
        if num_experts < 1 or not moe_layers:
            raise ValueError("expert load needs at least one MoE layer and one expert")
        self.moe_layers = list(moe_layers)
        self.row = {layer: i for i, layer in enumerate(self.moe_layers)}
        self.num_experts = num_experts
        self.current = torch.zeros(len(self.moe_layers), num_experts, dtype=torch.int64)
        self.steps: deque[torch.Tensor] = deque(maxlen=window)
        self.total = torch.zeros_like(self.current)
        self.closed_steps = 0

    def count(self, layer_idx: int, ids: torch.Tensor) -> None:
        """The MoEBlock.load_counter: add one forward's routed logical ids [T, k] of a layer."""
        if layer_idx not in self.row:
            raise ValueError(f"layer {layer_idx} is not a MoE layer ({self.moe_layers})")
        flat = ids.reshape(-1).to(torch.int64).cpu()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_experts):
            raise ValueError(f"layer {layer_idx}: expert ids outside [0, {self.num_experts})")
        self.current[self.row[layer_idx]] += torch.bincount(flat, minlength=self.num_experts)

    def add(self, counts: torch.Tensor) -> None:
        """Add counts [L, E] already tallied (a recorded step) to the open step."""
        if tuple(counts.shape) != tuple(self.current.shape):
            raise ValueError(f"counts of shape {tuple(counts.shape)}; expected {tuple(self.current.shape)}")
        self.current += counts.to(torch.int64)

    def end_step(self) -> torch.Tensor:
        """Close the step: its counts [L, E] join the window (the oldest leaves when full)."""
        done, self.current = self.current, torch.zeros_like(self.current)
        if len(self.steps) == self.steps.maxlen:
            self.total -= self.steps[0]
        self.steps.append(done)
        self.total += done
        self.closed_steps += 1
        return done

    def window_counts(self) -> torch.Tensor:
        """[L, E] tokens per expert over the window."""
        return self.total.clone()


def layer_imbalance(counts: torch.Tensor | Sequence[Sequence[float]], phy2log: torch.Tensor | Sequence[Sequence[int]],
                    num_ranks: int) -> list[float]:
    """max/mean tokens per rank of each layer, for per-layer loads [L, E] under maps [L, R]."""
    c = counts.tolist() if isinstance(counts, torch.Tensor) else counts
    p = phy2log.tolist() if isinstance(phy2log, torch.Tensor) else phy2log
    if len(c) != len(p):
        raise ValueError(f"{len(c)} layers of load for {len(p)} layers of placement")
    return [imbalance(rank_loads(load, row, num_ranks)) for load, row in zip(c, p)]


def identity_maps(num_layers: int, num_experts: int) -> list[list[int]]:
    """The placement before any balancing: slot i holds expert i (contiguous split over ranks)."""
    return [list(range(num_experts)) for _ in range(num_layers)]


ApplyFn = Callable[[int, list[int]], None]    # (layer index, physical_to_logical of that layer)


def moe_blocks(model: torch.nn.Module) -> list[MoEBlock]:
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


class EplbController:
    """Every `settings.interval` closed steps: a new placement from the window's load with
    `settings.redundant` extra slots per rank, handed to `apply` layer by layer (the EP layer's
    apply_placement behind it). Call `on_step()` once per engine step, on every rank alike."""

    def __init__(self, load: ExpertLoad, num_ranks: int, settings: EplbSettings, apply: ApplyFn):
        self.load, self.num_ranks, self.settings, self.apply = load, num_ranks, settings, apply
        self.num_replicas = settings.num_replicas(load.num_experts, num_ranks)
        self.maps: list[list[int]] | None = None
        self.rebalances = 0

    def on_step(self) -> bool:
        """Close the step; True when it rebalanced."""
        self.load.end_step()
        if self.load.closed_steps % self.settings.interval:
            return False
        counts = self.load.window_counts()
        if int(counts.sum()) == 0:
            return False
        s = self.settings
        phy2log, _, _ = rebalance(counts, self.num_replicas, s.num_groups, s.num_nodes, self.num_ranks)
        self.maps = phy2log.tolist()
        for layer, row in zip(self.load.moe_layers, self.maps):
            self.apply(layer, row)
        self.rebalances += 1
        return True


def attach_eplb(model: torch.nn.Module, moe_layers: Sequence[int], num_experts: int, num_ranks: int,
                settings: EplbSettings, apply: ApplyFn) -> EplbController:
    """Count every MoE block's routing into a window of `settings.window_steps` steps and return the
    controller; the caller runs `on_step()` after each step (on every rank: each routes the same
    tokens, so each computes the same placement)."""
    blocks = moe_blocks(model)
    if not blocks:
        raise ValueError("EPLB needs a mixture-of-experts model; this one has no MoE block")
    load = ExpertLoad(moe_layers, num_experts, window=settings.window_steps)
    for block in blocks:
        block.load_counter = load.count
    return EplbController(load, num_ranks, settings, apply)
