"""bench moe: placements judged on recorded routing (replay and in-sample), the routing record's
round trip, bad arguments."""
from __future__ import annotations

import random

import pytest
import torch

from everybyte.bench.moe import main as bench_moe_main
from everybyte.bench.moe_placement import expert_skew, replay_imbalance
from everybyte.bench.moe_routing import Routing


def _routing(steps: int = 40, experts: int = 8, layers: int = 3, seed: int = 0) -> Routing:
    """Skewed routing whose hot experts stay hot (a slow drift), top-2, 16 tokens a step."""
    rng = random.Random(seed)
    hot = [[rng.paretovariate(1.0) for _ in range(experts)] for _ in range(layers)]
    out = []
    for _ in range(steps):
        counts = torch.zeros(layers, experts, dtype=torch.int64)
        for layer in range(layers):
            hot[layer] = [w * rng.uniform(0.95, 1.05) for w in hot[layer]]
            for _ in range(16):
                for e in rng.choices(range(experts), weights=hot[layer], k=2):
                    counts[layer, e] += 1
        out.append(counts)
    return Routing(moe_layers=[1, 2, 4][:layers], num_experts=experts, top_k=2, steps=out, requests=4,
                   prompt_tokens=600, generated_tokens=40, scaling={})


def test_replay_imbalance_before_and_after():
    routing = _routing()
    r0 = replay_imbalance(routing, 4, 0, interval=10)
    r2 = replay_imbalance(routing, 4, 2, interval=10)
    assert r0["rebalances"] == r2["rebalances"] == 4
    # the first interval has no placement yet: 3 judged windows x 3 layers
    assert r0["before"]["n"] == r0["after"]["n"] == 9
    assert r0["before"] == r2["before"]                       # "before" does not depend on replicas
    assert r2["after"]["mean"] < r0["before"]["mean"]
    assert r2["in_sample_after"]["mean"] <= r0["in_sample_after"]["mean"] <= r0["in_sample_before"]["mean"]
    assert r2["slots_per_rank"] == 4
    assert expert_skew(routing)["mean"] > 1.5


def test_routing_round_trip(tmp_path):
    routing = _routing(steps=5)
    path = str(tmp_path / "routing.pt")
    routing.save(path)
    back = Routing.load(path)
    assert back.moe_layers == routing.moe_layers and len(back.steps) == 5
    assert torch.equal(back.total(), routing.total())
    assert back.routed_tokens == 5 * 16
    torch.save({"x": 1}, str(tmp_path / "other.pt"))
    with pytest.raises(ValueError, match="not a routing record"):
        Routing.load(str(tmp_path / "other.pt"))


@pytest.mark.parametrize("argv,message", [
    (["--ep", "1,0"], "--ep sizes must be >= 1"),
    (["--eplb-interval", "0"], "--eplb-interval must be >= 1"),
])
def test_bad_arguments(argv, message, capsys):
    assert bench_moe_main(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_redundancy_for_the_controller():
    with pytest.raises(ValueError, match="--eplb-redundant 9"):
        replay_imbalance(_routing(steps=2), 2, 9, interval=1)
