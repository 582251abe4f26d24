"""The router's per-request fast paths against plain references: the KV index's one walk for all
workers (depth groups, only the workers that reach something) against a per-worker, per-tier walk;
the kv policy's costs against kv_cost one worker at a time; the candidates' grouping by namespace."""
import random

import pytest

from everybyte.cluster.decide import Decider, _by_namespace
from everybyte.cluster.kv_index import TIERS, KVIndex, Overlap
from everybyte.cluster.policy import Policy, Request, kv_cost
from everybyte.cluster.workers import Worker
from everybyte.kv.block_id import KVNamespace, chain_block_ids
from everybyte.kv.events import BlockRemoved, BlockStored

NS = KVNamespace("m", block_size=4)
CHAINS = [chain_block_ids(NS, [c] * 4 + list(range(4 * 12))) for c in range(3)]    # 3 prompts, 13 blocks


def reference_depths(held: dict[str, list[set]], group: dict[str, str], chain) -> dict[str, Overlap]:
    """Per worker and cumulative tier set, the blocks of the chain it reaches, one block at a time."""
    pod: dict[str, set] = {}
    for w, sets in held.items():
        pod.setdefault(group[w], set()).update(sets[3])
    out = {}
    for w, sets in held.items():
        tiers = [sets[0], sets[0] | sets[1], sets[0] | sets[1] | sets[2]]
        tiers.append(tiers[2] | pod[group[w]])
        depths = []
        for have in tiers:
            d = 0
            while d < len(chain) and chain[d] in have:
                d += 1
            depths.append(d)
        out[w] = Overlap(*depths)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_one_walk_gives_each_worker_the_depths_of_its_own_walk(seed):
    rng = random.Random(seed)
    ix, held, group = KVIndex(), {}, {}
    workers = [f"w{i}" for i in range(rng.choice([1, 5, 40, 70]))]       # past 64: more than one word of bits
    for w in workers:
        group[w] = rng.choice(["ns1", "ns2"])
        ix.add_worker(w, group[w])
        held[w] = [set() for _ in TIERS]
    for _ in range(4 * len(workers)):
        w, tier, chain = rng.choice(workers), rng.randrange(4), rng.choice(CHAINS)
        lo = 0 if rng.random() < 0.5 else rng.randrange(len(chain))     # caches hold prefixes, mostly
        names = chain[lo:rng.randrange(lo, len(chain)) + 1]
        if rng.random() < 0.75:
            ix.apply(w, [BlockStored(names, 4, medium=TIERS[tier])])
            held[w][tier].update(names)
        else:
            ix.apply(w, [BlockRemoved(names, medium=TIERS[tier])])
            held[w][tier].difference_update(names)
    for chain in CHAINS + [CHAINS[0][:5] + CHAINS[1][5:]]:
        want = reference_depths(held, group, chain)
        assert ix.overlap(chain) == want
        assert ix.reached(chain) == {w: o for w, o in want.items() if o.total}
        some = workers[::3]
        assert ix.overlap(chain, some + ["unknown"]) == {w: want[w] for w in some}


def test_workers_at_equal_depths_share_one_overlap_and_none_reach_an_unknown_prompt():
    ix = KVIndex()
    for w in ("a", "b", "c"):
        ix.apply(w, [BlockStored(CHAINS[0][:3], 4)])
    ix.apply("c", [BlockStored(CHAINS[0][3:6], 4)])
    got = ix.reached(CHAINS[0])
    assert got == {"a": Overlap(3, 3, 3, 3), "b": Overlap(3, 3, 3, 3), "c": Overlap(6, 6, 6, 6)}
    assert got["a"] is got["b"]
    assert ix.reached(CHAINS[1]) == {} and ix.reached([]) == {}
    ix.drop_worker("c")
    ix.apply("d", [BlockStored(CHAINS[0][:1], 4)])          # c's slot again: its cached group bits are gone
    assert ix.reached(CHAINS[0]) == {"a": Overlap(3, 3, 3, 3), "b": Overlap(3, 3, 3, 3), "d": Overlap(1, 1, 1, 1)}


def _worker(i: int, rng: random.Random) -> Worker:
    w = Worker(f"http://w{i}", True, {"speeds": {"prefill_tok_s": 1000.0, "load_tok_s": {"G2": rng.choice([4e3, 2e4])}}})
    w.active_blocks = rng.randrange(20)
    return w


@pytest.mark.parametrize("seed", range(6))
def test_kv_policy_costs_equal_kv_cost_per_worker(seed):
    rng = random.Random(seed)
    workers = [_worker(i, rng) for i in range(30)]
    shared = Overlap(4, 4, 4, 4)
    overlaps = {}
    for w in workers:
        pick = rng.random()
        if pick < 0.4:
            overlaps[w.url] = shared                               # one Overlap for many workers
        elif pick < 0.7:
            g1 = rng.randrange(6)
            overlaps[w.url] = Overlap(g1, g1 + rng.randrange(3), g1 + 3, g1 + 3 + rng.randrange(2))
    req = Request(rng.randrange(1, 200), 4, overlaps)
    pol = Policy("kv", overlap_weight=rng.choice([1.0, 0.5, 2.0]))
    assert pol._kv_costs(req, workers) == [kv_cost(req, w, pol.overlap_weight) for w in workers]


def test_candidates_group_by_namespace_in_first_seen_order():
    a, b = KVNamespace("m", block_size=4), KVNamespace("m", block_size=8)
    ws = [Worker(f"http://w{i}", True, None, ns) for i, ns in enumerate([a, b, KVNamespace("m", block_size=4), None, b])]
    assert _by_namespace(ws) == [(a, ["http://w0", "http://w2"]), (b, ["http://w1", "http://w4"])]
    assert _by_namespace(ws[:1] + ws[2:3]) == [(a, ["http://w0", "http://w2"])]
    ix = KVIndex()
    ix.apply("http://w1", [BlockStored(chain_block_ids(b, list(range(16))), 8)])
    plan = Decider(Policy("kv"), ix).plan(ws, list(range(16)))
    assert plan.worker is ws[1] and plan.overlap == Overlap(2, 2, 2, 2) and plan.best_overlap == 2
