"""bench moe: placements judged on recorded routing (replay and in-sample), the routing record's
round trip, bad arguments."""
from __future__ import annotations

import json
import random

import pytest
import torch
from test_loaders import save_hf_dir
from test_moe_models import tiny_moe

from everybyte.bench.micro.moe import main as bench_moe_main
from everybyte.bench.micro.moe_placement import expert_skew, replay_imbalance
from everybyte.bench.micro.moe_routing import Routing


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
    for r in (r0, r2):                   # a step waits for its busiest rank: never less than the interval's sums
        assert r["after_per_step"]["mean"] >= r["after"]["mean"] and r["before_per_step"]["mean"] >= r["before"]["mean"]
    assert r0["after"] == r0["after_even_split"]              # no replicas: nothing to choose
    # replicas chosen per step from the step's own load beat a fixed even split on the same placements
    assert r2["after"]["mean"] < r2["after_even_split"]["mean"]
    assert r2["after_per_step"]["mean"] < r0["after_per_step"]["mean"]


def test_replay_window_longer_than_interval():
    routing = _routing()
    short = replay_imbalance(routing, 4, 0, interval=10, window=10)
    long = replay_imbalance(routing, 4, 0, interval=10, window=30)
    assert (short["window_steps"], long["window_steps"]) == (10, 30)
    assert replay_imbalance(routing, 4, 0, interval=10)["window_steps"] == 40
    assert short["before"] == long["before"] and short["rebalances"] == long["rebalances"] == 4
    assert short["after"] != long["after"]                    # the window changes the placements


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
    (["--eplb-interval", "10", "--eplb-window", "0,5"], "--eplb-window 5 is shorter than --eplb-interval 10"),
])
def test_bad_arguments(argv, message, capsys):
    assert bench_moe_main(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_redundancy_for_the_controller():
    with pytest.raises(ValueError, match="--eplb-redundant 9"):
        replay_imbalance(_routing(steps=2), 2, 9, interval=1)


def test_bench_moe_end_to_end_on_a_tiny_moe(tmp_path):
    """Replay two shared agent sessions on a tiny random Qwen3-MoE (transformers writes it), EP 1 and 2."""
    model = save_hf_dir(tiny_moe("qwen3_moe"), tmp_path / "moe")
    rec, out = tmp_path / "routing.pt", tmp_path / "moe.json"
    common = ["--model", str(model), "--ep", "1,2", "--redundant", "0,2", "--eplb-interval", "3",
              "--kv-cache", "2MiB", "--kv-cache-dtype", "fp32"]
    assert bench_moe_main(common + ["--max-sessions", "2", "--max-turns", "3", "--concurrency", "2",
                                    "--token-scale", "4096", "--max-context", "96", "--max-output", "4",
                                    "--prefill-len", "24", "--decode-batch", "2", "--new-tokens", "3",
                                    "--save-routing", str(rec), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["num_experts"] == 8 and r["moe_layers"] == 2 and r["routing"]["requests"] >= 2
    assert r["routing"]["steps"] > 6 and r["routing"]["routed_tokens_per_layer"] > 0
    by = {(i["ep"], i["redundant_per_rank"]): i for i in r["imbalance"]}
    assert sorted(by) == [(2, 0), (2, 2)] and by[2, 0]["before"]["n"] > 0
    assert by[2, 2]["in_sample_after"]["mean"] <= by[2, 0]["in_sample_before"]["mean"]
    led = r["ledger"]
    assert led["expert_bytes_all_measured"] == led["expert_bytes_all_arithmetic"] > 0
    rows = {(x["ranks"], x["redundant_per_rank"]): x for x in led["per_rank"]}
    assert rows[2, 0]["expert_bytes"] * 2 == rows[1, 0]["expert_bytes"]              # 1/N
    assert rows[2, 2]["replica_bytes"] == rows[2, 2]["expert_bytes"] - rows[2, 0]["expert_bytes"] > 0
    assert rows[2, 0]["kv_tokens"] > rows[1, 0]["kv_tokens"] > 0
    speed = {t["ep"]: t for t in r["throughput"]}
    assert speed[1]["prefill_tok_s"] > 0 and speed[2]["decode_tok_s"] > 0
    # the kept record gives the same figures without a replay
    assert bench_moe_main(common + ["--routing", str(rec), "--no-throughput", "--json", str(out)]) == 0
    again = json.loads(out.read_text())
    assert again["imbalance"] == r["imbalance"] and again["throughput"] == []
