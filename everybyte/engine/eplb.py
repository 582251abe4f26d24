"""EPLB in the engine: `--eplb-interval STEPS` (0 = off) and `--eplb-redundant R` with
`--expert-parallel N`, from `--eplb-window STEPS` of load history. Rank 0 routes every token, so
it alone counts the load (MoEBlock.load_counter)
and, every STEPS engine steps, computes the new placement (models/expert_load) and moves the
experts through ExpertParallel.apply_placement. It runs as an EngineCore observer: after a step's
forward, before the next, so requests keep running and the next step uses the new placement.
"""
from __future__ import annotations

from typing import Any

from everybyte.models.expert_ledger import ExpertShape, rank_ledger, stored_format
from everybyte.models.expert_load import EplbController, EplbSettings, attach_eplb, layer_imbalance
from everybyte.models.expert_placement import ExpertPlacement


def check_eplb_settings(expert_parallel: int, eplb_interval: int, eplb_redundant: int, eplb_window: int = 0) -> None:
    """Clear errors for EPLB settings out of range (EngineConfig calls this)."""
    for name, v in (("eplb_interval", eplb_interval), ("eplb_redundant", eplb_redundant), ("eplb_window", eplb_window)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be an int >= 0, got {v!r}")
    if eplb_redundant and not eplb_interval:
        raise ValueError("--eplb-redundant needs --eplb-interval STEPS (how often to rebalance)")
    if eplb_window and not eplb_interval:
        raise ValueError("--eplb-window needs --eplb-interval STEPS (how often to rebalance)")
    if eplb_interval:
        EplbSettings(redundant=eplb_redundant, interval=eplb_interval, window=eplb_window)    # window >= interval
    if eplb_interval and expert_parallel < 2:
        raise ValueError("--eplb-interval balances experts across ranks; it needs --expert-parallel N with N >= 2")


def start_eplb(llm: Any) -> EplbController | None:
    """Attach the load counter and the controller to an LLMEngine with EPLB on; None when off."""
    cfg, ep = llm.config, llm.expert_parallel
    if not cfg.eplb_interval or ep is None:
        return None
    mc, ranks = llm.model_config, ep.group.world_size
    settings = EplbSettings(redundant=cfg.eplb_redundant, interval=cfg.eplb_interval,
                            window=cfg.eplb_window)

    def apply(layer: int, physical_to_logical: list[int]) -> None:
        ep.apply_placement(layer, ExpertPlacement(mc.num_experts, ranks, 0, physical_to_logical,
                                                  len(physical_to_logical) // ranks))

    layers = sorted(ep.blocks)
    ctl = attach_eplb(llm.loaded.model, layers, mc.num_experts, ranks, settings, apply)
    llm.core.observers.append(lambda sched, res: res is not None and ctl.on_step())
    return ctl


def eplb_stats(llm: Any, ctl: EplbController) -> dict[str, Any]:
    """The controller's state, the window's imbalance under the contiguous split and under the
    placement in use, and the per-rank ledger: expert and replica bytes, and the KV tokens a rank
    holds at the memory one rank would need for the whole model (its weights + the KV budget)."""
    from everybyte.models.nvfp4_linear import weight_bytes

    mc, ranks, counts = llm.model_config, ctl.num_ranks, ctl.load.window_counts()
    blocks = [b for _, b in sorted(llm.expert_parallel.blocks.items())]
    current = [b.placement.physical_to_logical for b in blocks]
    identity = [list(range(mc.num_experts))] * len(blocks)
    shape = ExpertShape(mc.hidden_size, mc.moe_intermediate_size, mc.num_experts, len(blocks),
                        stored_format(llm.loaded.weights_format, str(next(llm.loaded.model.parameters()).dtype)))
    experts = sum(weight_bytes(b.experts) for b in blocks)       # rank 0's slots (replicas share modules)
    dense = llm.weights_bytes - experts
    one_rank = dense + shape.expert_bytes() * shape.num_experts * shape.num_moe_layers + int(llm.config.kv_cache_bytes)
    slots = blocks[0].placement.slots_per_rank
    ledger = rank_ledger(shape, ranks, slots - mc.num_experts // ranks, dense, one_rank, llm.layer_shapes,
                         llm.config.kv_cache_dtype, llm.config.block_size)
    return {"interval_steps": ctl.settings.interval, "redundant_per_rank": ctl.settings.redundant,
            "rebalances": ctl.rebalances, "window_steps": len(ctl.load.steps),
            "imbalance_contiguous": [round(x, 4) for x in layer_imbalance(counts, identity, ranks)],
            "imbalance_now": [round(x, 4) for x in layer_imbalance(counts, current, ranks)],
            "ledger": ledger.to_dict()}
