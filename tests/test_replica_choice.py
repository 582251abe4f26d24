"""The per-step replica chooser: a crafted load balanced exactly, what the dispatcher's table does
with it, and bad input."""
from __future__ import annotations

import math
import random

import pytest
import torch

from everybyte.models.eplb import imbalance, rank_loads, rebalance
from everybyte.models.expert_placement import ExpertPlacement
from everybyte.models.moe_dispatch import ReplicaTable
from everybyte.models.replica_choice import rank_loads_chosen, slot_quotas

# 4 ranks x 3 slots: experts 0 (three replicas), 1 and 2 (two each), the rest alone
PLACEMENT = [0, 1, 2, 3, 4, 0, 5, 6, 1, 7, 0, 2]


def test_a_hot_step_is_balanced_across_replicas():
    counts = [30, 10, 5, 5, 5, 5, 5, 5]                       # 70 tokens: 17.5 a rank at best
    quota = slot_quotas(counts, PLACEMENT, 4)
    assert sum(quota) == 70
    for e, n in enumerate(counts):                            # every token served by a replica of its expert
        assert sum(q for q, x in zip(quota, PLACEMENT) if x == e) == n
    assert sorted(rank_loads_chosen(counts, PLACEMENT, 4)) == [17, 17, 18, 18]
    even = rank_loads(counts, PLACEMENT, 4)                   # the fixed even split: ranks 0 and 3 carry more
    assert imbalance(even) > 1.1 > imbalance(rank_loads_chosen(counts, PLACEMENT, 4))


def test_the_chooser_follows_the_step_not_the_average():
    # expert 0 on ranks 0 and 1; rank 0 also holds expert 1, which is hot this step: expert 0 goes to rank 1
    p2l = [0, 1, 0, 2]
    assert slot_quotas([6, 6, 0], p2l, 2) == [0, 6, 6, 0]
    assert slot_quotas([6, 0, 6], p2l, 2) == [6, 0, 0, 6]     # and the other way round when expert 2 is hot
    assert slot_quotas([7, 0, 0], p2l, 2) == [4, 0, 3, 0]     # alone: split, the remainder to the lower rank
    assert slot_quotas([0, 3, 1], p2l, 2) == [0, 3, 0, 1]


def test_balances_random_skewed_steps_better_than_an_even_split():
    rng = random.Random(1)
    weights = [rng.paretovariate(1.0) for _ in range(16)]
    p2l = rebalance([weights], 24, 1, 1, 4)[0][0].tolist()    # 2 redundant a rank, from the average load
    chosen, even = [], []
    for _ in range(50):                                        # steps of 64 top-2 tokens drawn around it
        counts = [0] * 16
        for e in rng.choices(range(16), weights=weights, k=128):
            counts[e] += 1
        chosen.append(max(rank_loads_chosen(counts, p2l, 4)))
        even.append(max(rank_loads(counts, p2l, 4)))          # fractional tokens: a bound, not a rule
    assert sum(chosen) < 0.95 * sum(even)
    assert all(c <= math.ceil(e) for c, e in zip(chosen, even))    # never a whole token worse


def test_dispatch_table_fills_the_quotas_in_token_order():
    placement = ExpertPlacement(8, 2, 0, [0, 2, 4, 6, 7, 7, 1, 3, 5, 0], 5)
    table = ReplicaTable(placement, torch.device("cpu"))
    ids = torch.tensor([[7, 2], [7, 0], [7, 0], [5, 3]])
    # single-slot experts load rank 0 with 1 (expert 2) and rank 1 with 2 (experts 5, 3): expert 7's
    # three tokens go 2 to rank 0 (slot 4) and 1 to rank 1 (slot 5), expert 0's 1 and 1 (slots 0, 9)
    assert table.choose(ids).tolist() == [[4, 1], [4, 0], [5, 9], [8, 7]]
    assert table.choose(ids[:0]).shape == (0, 2)
    single = ReplicaTable(ExpertPlacement.identity(8, 2), torch.device("cpu"))
    assert torch.equal(single.choose(ids), ids)                # no replicas: each expert's own slot


@pytest.mark.parametrize("counts,p2l,ranks,match", [
    ([1, 1], [0, 1, 0], 2, "3 slots do not split over 2 ranks"),
    ([1, -1], [0, 1], 2, "must be >= 0"),
    ([1, 1], [0, 5], 2, "slot 1 holds expert 5, outside 0..1"),
    ([1, 1, 1], [0, 1], 1, "expert 2 has no slot"),
    ([1], [0], 0, "1 slots do not split over 0 ranks"),
])
def test_bad_input(counts, p2l, ranks, match):
    with pytest.raises(ValueError, match=match):
        slot_quotas(counts, p2l, ranks)
