"""EPLB: DeepSeek's reference example exactly, hierarchical vs global, replication, range errors,
the sliding load window, the controller and the per-rank expert ledger."""
from __future__ import annotations

import random

import pytest
import torch

from everybyte.models.config import ModelConfig
from everybyte.models.eplb import balanced_packing, rank_loads, rebalance, replicate
from everybyte.models.expert_ledger import ExpertShape, rank_ledger
from everybyte.models.expert_load import (
    EplbController,
    EplbSettings,
    ExpertLoad,
    attach_eplb,
    identity_maps,
    layer_imbalance,
)
from everybyte.models.moe import MoEBlock

# ../shared/specs/nvfp4.md, "Wide-EP facts" (DeepSeek's EPLB README example)
WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
          [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
           [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
LAYER0_GPU_LOADS = [121.5, 86.5, 125, 113, 147.5, 131.5, 156, 152]


def test_reference_example_exact():
    phy2log, log2phy, logcnt = rebalance(torch.tensor(WEIGHT), 16, 4, 2, 8)
    assert phy2log.tolist() == PHY2LOG
    loads = rank_loads(WEIGHT[0], PHY2LOG[0], 8)
    assert loads == LAYER0_GPU_LOADS
    assert round(max(loads) / (sum(loads) / 8), 3) == 1.208
    assert layer_imbalance(WEIGHT, phy2log, 8)[0] == pytest.approx(1.208, abs=5e-4)
    for layer in range(2):                       # log2phy and logcnt agree with phy2log
        for e in range(12):
            slots = [s for s in log2phy[layer, e].tolist() if s >= 0]
            assert len(slots) == logcnt[layer, e] == PHY2LOG[layer].count(e)
            assert all(PHY2LOG[layer][s] == e for s in slots)
    assert logcnt.sum(-1).tolist() == [16, 16]


def test_hierarchical_keeps_groups_on_a_node_global_otherwise():
    phy2log, _, _ = rebalance(WEIGHT, 16, 4, 2, 8)
    for row in phy2log.tolist():                  # groups of 3 experts: every replica on one node
        for g in range(4):
            nodes = {s // 8 for s, e in enumerate(row) if e // 3 == g}
            assert len(nodes) == 1
    # 4 groups do not divide among 3 nodes: one global pass, the same as one group on one node
    glob, _, _ = rebalance(WEIGHT, 18, 4, 3, 6)
    assert glob.tolist() == rebalance(WEIGHT, 18, 1, 1, 6)[0].tolist()
    flat, _, _ = rebalance(WEIGHT, 16, 1, 1, 8)
    assert flat.tolist() != PHY2LOG               # the hierarchy changes the placement
    # global packing balances at least as well on this load (it has no node constraint)
    assert max(rank_loads(WEIGHT[0], flat[0].tolist(), 8)) <= max(LAYER0_GPU_LOADS)


def test_replicas_go_to_the_highest_load_per_replica():
    experts, replica, count = replicate([10, 1, 1, 4], 7)
    assert experts == [0, 1, 2, 3, 0, 0, 3]       # 10 -> 5 -> 4 = 3.33: 0, 0, then 3 (4 > 3.33)
    assert replica == [0, 0, 0, 0, 1, 2, 1]
    assert count == [3, 1, 1, 2]
    pack, pos = balanced_packing([5, 1, 4, 2], 2)  # heaviest first into the lightest pack with room:
    assert pack == [0, 0, 1, 1] and pos == [0, 1, 0, 1]   # 5 -> 0, 4 -> 1, 2 -> 1 (4 < 5), 1 -> 0
    assert balanced_packing([3, 9], 2) == ([0, 1], [0, 0])   # one item a pack keeps the order


def test_replicas_of_one_expert_go_to_different_gpus_when_they_can():
    # one hot expert, 3 replicas over 2 GPUs of 3 slots: plain packing would put two on the lighter GPU
    pack, _ = balanced_packing([10, 10, 10, 1, 1, 1], 2)
    assert sorted(pack[:3]) == [0, 0, 1]
    pack, _ = balanced_packing([10, 10, 10, 1, 1, 1], 2, labels=[0, 0, 0, 1, 2, 3])
    assert sorted(pack[:3]) == [0, 0, 1]                          # 3 replicas, 2 GPUs: one must share
    pack, _ = balanced_packing([6, 6, 5, 5], 2, labels=[0, 0, 1, 1])
    assert pack[0] != pack[1] and pack[2] != pack[3]            # unlabelled: 6, 6 -> 0, 1; 5, 5 -> 0, 1 too
    pack, _ = balanced_packing([9, 5, 5, 1], 2, labels=[0, 1, 1, 2])
    assert pack[1] != pack[2]                                   # unlabelled: 9 -> 0, 5 -> 1, 5 -> 1 (lighter)
    assert balanced_packing([9, 5, 5, 1], 2)[0][1] == balanced_packing([9, 5, 5, 1], 2)[0][2]
    rng = random.Random(3)
    shared = {False: 0, True: 0}                                # replicas sharing a GPU, 20 skewed layers
    unavoidable = 0                                             # an expert with more replicas than GPUs
    for _ in range(20):
        load = [rng.paretovariate(1.0) * 100 for _ in range(8)]
        experts, _, count = replicate(load, 16)                 # 2 redundant a GPU at 4 GPUs
        weights = [load[e] / count[e] for e in experts]
        unavoidable += sum(max(0, c - 4) for c in count)
        for labelled in (False, True):
            pack, _ = balanced_packing(weights, 4, labels=experts if labelled else None)
            shared[labelled] += len(experts) - len({(e, g) for e, g in zip(experts, pack)})
    assert shared[True] == unavoidable < shared[False]


def test_redundant_experts_cut_imbalance_on_skewed_load():
    rng = random.Random(0)
    load = [[rng.paretovariate(1.2) * 100 for _ in range(16)] for _ in range(6)]
    before = layer_imbalance(load, identity_maps(6, 16), 4)
    after = [layer_imbalance(load, rebalance(load, 16 + 4 * r, 1, 1, 4)[0], 4) for r in (0, 1, 2)]
    assert sum(after[0]) < sum(before)
    assert sum(after[2]) <= sum(after[1]) <= sum(after[0])
    assert max(after[2]) < 1.15
    assert layer_imbalance([[5] * 8], identity_maps(1, 8), 2) == [1.0]


@pytest.mark.parametrize("args,match", [
    ((16, 4, 2, 6), "not a multiple of num_gpus 6"),
    ((8, 4, 2, 8), "cannot hold 12 experts"),
    ((16, 5, 1, 8), "do not split into 5 equal groups"),
    ((16, 4, 3, 8), "8 GPUs do not split into 3 nodes"),
    ((16, 4, 0, 8), "num_nodes must be >= 1"),
])
def test_range_errors(args, match):
    with pytest.raises(ValueError, match=match):
        rebalance(WEIGHT, *args)


def test_bad_loads_error():
    with pytest.raises(ValueError, match="finite and >= 0"):
        rebalance([[1, -1, 2, 3]], 4, 1, 1, 2)
    with pytest.raises(ValueError, match="2-D"):
        rebalance([[1, 2], [3]], 4, 1, 1, 2)


def test_settings_errors():
    with pytest.raises(ValueError, match="--eplb-redundant must be >= 0"):
        EplbSettings(redundant=-1)
    with pytest.raises(ValueError, match="--eplb-interval must be >= 1"):
        EplbSettings(interval=0)
    with pytest.raises(ValueError, match=r"use one of \[1, 2, 4, 8\]"):
        EplbSettings().num_replicas(8, 3)
    with pytest.raises(ValueError, match="use at most 6"):
        EplbSettings(redundant=7).num_replicas(8, 4)
    assert EplbSettings(redundant=2).num_replicas(8, 4) == 16
    with pytest.raises(ValueError, match="--eplb-window 3 is shorter than --eplb-interval 5"):
        EplbSettings(interval=5, window=3)
    with pytest.raises(ValueError, match="--eplb-window must be >= 0"):
        EplbSettings(window=-1)
    assert EplbSettings(interval=5).window_steps == 20 and EplbSettings(interval=5, window=7).window_steps == 7


def test_controller_uses_the_window_not_just_the_interval():
    """A rebalance every step from 3 steps of history: the placement sees the old hot expert too."""
    load = ExpertLoad([0], num_experts=4, window=3)
    applied: list[list[int]] = []
    ctl = EplbController(load, 2, EplbSettings(interval=1, window=3), lambda layer, row: applied.append(row))
    load.count(0, torch.tensor([[0, 1]] * 10))        # experts 0 and 1 (rank 0) hot in step 1
    ctl.on_step()
    load.count(0, torch.tensor([[2, 3]] * 2))         # a quiet step 2
    ctl.on_step()
    assert load.window_counts().tolist() == [[10, 10, 2, 2]]
    assert sorted(applied[-1][:2]) != [2, 3]          # an interval-long window would put 2, 3 together
    assert layer_imbalance(load.window_counts(), [applied[-1]], 2) == [1.0]


def test_sliding_window():
    load = ExpertLoad([1, 3], num_experts=4, window=2)
    load.count(1, torch.tensor([[0, 1], [0, 2]]))
    load.count(3, torch.tensor([[3, 3]]))
    assert load.end_step().tolist() == [[2, 1, 1, 0], [0, 0, 0, 2]]
    load.count(1, torch.tensor([[1, 1]]))
    load.end_step()
    load.count(3, torch.tensor([[2, 0]]))
    load.end_step()                               # the first step leaves the window
    assert load.window_counts().tolist() == [[0, 2, 0, 0], [1, 0, 1, 0]]
    with pytest.raises(ValueError, match="layer 2 is not a MoE layer"):
        load.count(2, torch.tensor([[0]]))
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        load.count(1, torch.tensor([[4]]))


def test_controller_rebalances_every_interval():
    load = ExpertLoad([0, 1], num_experts=4, window=2)
    applied: list[tuple[int, list[int]]] = []
    ctl = EplbController(load, 2, EplbSettings(redundant=1, interval=2), lambda layer, row: applied.append((layer, row)))
    hot = torch.tensor([[0, 1]] * 30 + [[2, 3]] * 2)      # experts 0 and 1 (both on rank 0) are hot
    for step in range(4):
        for layer in (0, 1):
            load.count(layer, hot)
        assert ctl.on_step() == (step % 2 == 1)
    assert ctl.rebalances == 2 and [a[0] for a in applied] == [0, 1, 0, 1]
    counts = load.window_counts()
    assert len(applied[-1][1]) == 6
    before = layer_imbalance(counts, identity_maps(2, 4), 2)
    after = layer_imbalance(counts, [row for _, row in applied[-2:]], 2)
    assert before[0] == pytest.approx(60 / 32) and after[0] < 1.1


def test_rank_ledger_deepseek_r1_facts():
    r1 = ExpertShape(hidden_size=7168, moe_intermediate_size=2048, num_experts=256, num_moe_layers=58,
                     weights_format="nvfp4")
    assert r1.expert_bytes() // 2**10 == int(23.625 * 2**10)          # 23.625 MiB (+ 3 tensor scales)
    kv = [(1, 576)] * 61                          # MLA latent cache, one "head" of 576 per layer
    ep64 = rank_ledger(r1, 64, 0, dense_bytes=0, budget_bytes=140 * 2**30, layer_shapes=kv, kv_cache_dtype="fp8")
    assert ep64.experts_per_layer * 58 == 232
    assert round(ep64.expert_bytes / 2**30, 2) == 5.35
    ep8 = rank_ledger(r1, 8, 0, 0, 140 * 2**30, kv, "fp8")
    assert ep8.expert_bytes == 8 * ep64.expert_bytes and ep64.kv_tokens > ep8.kv_tokens
    ep64r = rank_ledger(r1, 64, 2, 0, 140 * 2**30, kv, "fp8")
    assert ep64r.replica_bytes == 2 * 58 * r1.expert_bytes() == ep64r.expert_bytes - ep64.expert_bytes
    assert ep64.freed_kv_tokens == ep64.freed_bytes // (61 * 2 * 576)
    with pytest.raises(ValueError, match="exceed its budget"):
        rank_ledger(r1, 8, 0, 0, 2**30, kv, "fp8")


def _block(cfg: ModelConfig, layer: int, hot: tuple[int, int]) -> MoEBlock:
    """A real MoEBlock whose router sends every all-ones token to experts `hot`."""
    block = MoEBlock(cfg, torch.float32, layer)
    with torch.no_grad():
        block.gate.weight.zero_()
        block.gate.weight[hot[0]] = 1.0
        block.gate.weight[hot[1]] = 0.5
    return block


def test_attach_eplb_counts_every_block_and_applies_per_layer():
    cfg = ModelConfig("qwen3_moe", vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=4, moe_layers=(0, 2))
    model = torch.nn.Sequential(_block(cfg, 0, (0, 1)), torch.nn.Identity(), _block(cfg, 2, (3, 2)))
    applied: dict[int, list[int]] = {}
    ctl = attach_eplb(model, [0, 2], 4, 2, EplbSettings(redundant=1, interval=1), applied.__setitem__)
    assert ctl.load.steps.maxlen == 4                          # the default window: 4 intervals
    for block in (model[0], model[2]):                          # each fed all-ones: routing is not left to random init
        block(torch.ones(6, 8))
    assert ctl.on_step() and sorted(applied) == [0, 2]
    assert ctl.load.window_counts().tolist() == [[6, 6, 0, 0], [0, 0, 6, 6]]
    assert layer_imbalance(ctl.load.window_counts(), [applied[0], applied[2]], 2) == [1.0, 1.0]
    with pytest.raises(ValueError, match="no MoE block"):
        attach_eplb(torch.nn.Linear(2, 2), [0], 4, 2, EplbSettings(), applied.__setitem__)
