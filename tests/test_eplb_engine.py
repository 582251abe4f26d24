"""EPLB in the engine: `--eplb-interval`/`--eplb-redundant` with `--expert-parallel 2` on a tiny
random Qwen3-MoE (rank 1 a real process): experts move between ranks while requests run, and every
token equals EP=1's; settings out of range are clear errors."""
from __future__ import annotations

import argparse

import pytest
from test_expert_parallel import ENGINE, EXPERTS, GREEDY, PROMPTS, moe_dir, reference, run  # noqa: F401

from everybyte.engine.config import EngineConfig
from everybyte.engine.engine_args import add_engine_args, engine_kwargs
from everybyte.engine.llm import LLM


def test_rebalancing_while_serving_keeps_every_token(moe_dir, reference):  # noqa: F811
    llm = LLM(str(moe_dir), expert_parallel=2, eplb_interval=2, eplb_redundant=1, **ENGINE)
    try:
        tokens, _ = run(llm)                  # 3 prompts, 8 tokens each: rebalances mid-generation
        assert tokens == reference[0]
        stats = llm.stats()["eplb"]
        assert stats["rebalances"] >= 2 and stats["redundant_per_rank"] == 1
        blocks = llm.expert_parallel.blocks
        assert all(b.placement.slots_per_rank == EXPERTS // 2 + 1 and len(b.experts) == EXPERTS // 2 + 1
                   for b in blocks.values())
        assert len(stats["imbalance_now"]) == len(blocks) == 2
        assert all(x >= 1.0 for x in stats["imbalance_now"] + stats["imbalance_contiguous"])
        ledger = stats["ledger"]
        assert ledger["ranks"] == 2 and ledger["experts_per_layer"] == EXPERTS // 2 + 1
        assert ledger["replica_bytes"] * (EXPERTS // 2 + 1) == ledger["expert_bytes"]
        assert run(llm, PROMPTS[:1])[0] == reference[0][:1]        # and after it
    finally:
        llm.close()


@pytest.mark.parametrize("kwargs,message", [
    (dict(eplb_interval=5), "needs --expert-parallel N with N >= 2"),
    (dict(eplb_interval=-1, expert_parallel=2), "--eplb-interval must be an int >= 0"),
    (dict(eplb_redundant=1, expert_parallel=2), "--eplb-redundant needs --eplb-interval"),
    (dict(eplb_redundant=-2, eplb_interval=3, expert_parallel=2), "--eplb-redundant must be an int >= 0"),
    (dict(eplb_window=8, expert_parallel=2), "--eplb-window needs --eplb-interval"),
    (dict(eplb_window=-1, eplb_interval=3, expert_parallel=2), "--eplb-window must be an int >= 0"),
    (dict(eplb_window=2, eplb_interval=3, expert_parallel=2), "--eplb-window 2 is shorter than --eplb-interval 3"),
])
def test_settings_out_of_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_flags_reach_the_config():
    args = add_engine_args(argparse.ArgumentParser()).parse_args(
        ["--expert-parallel", "2", "--eplb-interval", "50", "--eplb-redundant", "2", "--eplb-window", "400"])
    cfg = EngineConfig(**engine_kwargs(args))
    assert (cfg.eplb_interval, cfg.eplb_redundant, cfg.expert_parallel, cfg.eplb_window) == (50, 2, 2, 400)
