"""Routing policies: which worker gets a request.

`kv` (the default) is Dynamo's KV router cost, `overlap_weight * prefill_blocks + decode_blocks`,
where prefill_blocks are the prompt's blocks the worker must compute ((prompt tokens - overlap
tokens) / block size) and decode_blocks the blocks it already has active plus this request's,
lowest cost wins. Extended: a prefix block in the worker's G2 or G3, or in the pod-shared tier
(G3.5), costs its load time relative to prefill (the worker's /v1/kv/info speeds, defaults when it
states none) instead of zero or a full recompute; and a request goes back to its home, the worker
holding its session (without one: the one worker holding its deepest prefix when that covers
more than half the prompt, e.g. a sub-agent forked from a session), unless leaving saves more
wait than it adds work: the pick's time to the KV (the prefill the router has queued there plus
this request's) must beat the home's by more than the recompute of what the home holds. A home
with every sequence slot taken yields to a worker with a free one. Dynamo's decode blocks do not count against the home: they are KV in
use, not work ahead of the first token, and leaving the home recomputes the whole prefix (the
agentic replay showed the cost term moving sessions off a worker whose only load was another
session's decode). `round-robin`, `random`, `least-loaded` ignore the prefix; `session` keeps a
session on its worker and spreads new ones round-robin.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

from everybyte.cluster.kv_index import Overlap
from everybyte.cluster.worker_state import Worker

POLICIES = ("kv", "round-robin", "random", "least-loaded", "session")
# A sessionless request's home needs more than this share of its prompt cached there (SGLang's
# cache-aware router uses the same 0.5 as its cache_threshold for the best-match worker).
HOME_MIN_MATCH = 0.5
# A new session leaves cost's pick for the lightest worker when the pick holds more KV than this
# times the lightest's plus the session's own prompt (SGLang's balance_rel/abs thresholds, in blocks;
# 4 rather than 2: on the shared agent sessions 2 moved 5 sessions and 4 moved 2, as plain cost does).
BALANCE_REL = 4.0
NOTHING = Overlap()                        # a worker that holds none of the prompt's prefix


@dataclass
class Request:
    prompt_tokens: int
    block_size: int
    overlaps: dict[str, Overlap] = field(default_factory=dict)      # worker url -> prefix depths
    session_worker: str | None = None                                # where its session lives
    new_session: bool = False                                        # a session's first request

    @property
    def blocks(self) -> int:
        return -(-self.prompt_tokens // self.block_size)


@dataclass
class Decision:
    worker: Worker
    cost: float = 0.0
    overlap: Overlap = NOTHING
    prefill_blocks: float = 0.0          # what the worker computes (lower tiers priced), for its queue


def prefill_blocks(req: Request, w: Worker, o: Overlap) -> float:
    """Blocks' worth of prefill work on `w`: what is missing, plus lower-tier loads at their price."""
    missing = max(0.0, req.prompt_tokens - o.total * req.block_size) / req.block_size
    if o.total == o.g1:                          # nothing to load from a lower tier
        return missing
    return missing + sum(n * w.load_fraction(t) for t, n in o.by_tier().items() if n and t != "G1")

def kv_cost(req: Request, w: Worker, overlap_weight: float) -> float:
    o = req.overlaps.get(w.url, NOTHING)
    return overlap_weight * prefill_blocks(req, w, o) + w.active_blocks + req.blocks


def time_to_kv(req: Request, w: Worker) -> float:
    """Blocks' worth of prefill before this request's KV is ready on `w`: the router's queued prefill
    there plus this request's own."""
    return w.queued_prefill_blocks + prefill_blocks(req, w, req.overlaps.get(w.url, NOTHING))


class Policy:
    def __init__(self, name: str = "kv", overlap_weight: float = 1.0, seed: int | None = None):
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
        self.name, self.overlap_weight = name, overlap_weight
        self._next = 0
        self._rng = random.Random(seed)

    def choose(self, req: Request, candidates: Sequence[Worker]) -> Decision:
        if not candidates:
            raise ValueError("no worker to choose from")
        if self.name == "kv":
            return self._kv(req, candidates)
        if self.name == "session" and req.session_worker is not None:
            sticky = [w for w in candidates if w.url == req.session_worker]
            if sticky:
                return self._decision(req, sticky[0])
        if self.name == "random":
            return self._decision(req, self._rng.choice(list(candidates)))
        if self.name == "least-loaded":
            return self._decision(req, min(candidates, key=lambda w: (w.queue_depth(), w.active_blocks)))
        w = candidates[self._next % len(candidates)]          # round-robin, and new sessions
        self._next += 1
        return self._decision(req, w)

    def _kv(self, req: Request, candidates: Sequence[Worker]) -> Decision:
        costs = self._kv_costs(req, candidates)
        best = min(costs)
        ties = [i for i, c in enumerate(costs) if c == best]
        n = len(candidates)
        # equal costs: the less queued, then rotating, so a cold start spreads instead of piling up
        i = min(ties, key=lambda i: (candidates[i].queue_depth(), (i - self._next) % n)) if len(ties) > 1 else ties[0]
        w, cost = candidates[i], best
        home = self._home(req, candidates)
        if home is None and req.new_session:
            # a new session stays where its turns will follow: if cost picked a worker holding far
            # more KV than the lightest (BALANCE_REL), it goes to the lightest
            # instead, or a prefix every session shares (a system prompt the first worker computed)
            # would gather all of them on that worker, as cost alone does at light load
            held = [c.cached_blocks + c.active_blocks for c in candidates]
            if held[i] > BALANCE_REL * min(held) + req.blocks:
                i = min(range(n), key=lambda j: (held[j], costs[j]))
                w, cost = candidates[i], costs[i]
        elif home is not None and home != i:
            j = self._leave_home(req, candidates, costs, home, i)
            w, cost = candidates[j], costs[j]
        self._next += 1
        return self._decision(req, w, cost)

    def _kv_costs(self, req: Request, candidates: Sequence[Worker]) -> list[float]:
        """kv_cost of each candidate, each sum in kv_cost's order. Many workers share one Overlap
        (the index's groups: no prefix, a prefix most hold); without lower-tier blocks the
        prefill part depends on the Overlap alone, so it is computed once per Overlap."""
        ow, overlaps, blocks = self.overlap_weight, req.overlaps, req.blocks
        weighted: dict[int, float] = {}
        costs = []
        for w in candidates:
            o = overlaps.get(w.url, NOTHING)
            if o.total != o.g1:                  # lower-tier loads at this worker's prices
                costs.append(kv_cost(req, w, ow))
                continue
            part = weighted.get(id(o))
            if part is None:
                part = weighted[id(o)] = ow * prefill_blocks(req, w, o)
            costs.append(part + w.active_blocks + blocks)
        return costs

    @staticmethod
    def _leave_home(req: Request, candidates: Sequence[Worker], costs: list[float], home: int, pick: int) -> int:
        """Where a request with a home goes when cost picked another worker. A home whose slots are
        all taken yields to the pick (or the cheapest worker with a free slot; none: it stays).
        Otherwise it leaves only when the wait it saves exceeds the work it adds: the pick's KV
        ready sooner by more than the recompute of what the home holds (queued prefill, then its
        own, in blocks). On a saturated fleet every move adds prefill; the agentic what-if moved
        216 of 758 turns and computed 1.8x the prefill of session-sticky workers when any gain in
        time-to-KV sufficed."""
        if candidates[home].full():
            free = [j for j in range(len(candidates)) if not candidates[j].full()]
            return pick if pick in free else min(free, key=costs.__getitem__, default=home)
        h, p = candidates[home], candidates[pick]
        h_ready, p_ready = time_to_kv(req, h), time_to_kv(req, p)
        added = (p_ready - p.queued_prefill_blocks) - (h_ready - h.queued_prefill_blocks)   # own prefill: pick - home
        return pick if h_ready - p_ready > added else home

    @staticmethod
    def _home(req: Request, candidates: Sequence[Worker]) -> int | None:
        """The session's worker; else the one worker whose prefix is deeper than every other's and
        covers more than HOME_MIN_MATCH of the prompt (a fork of a session's context). A shorter
        prefix, such as a system prompt the first worker computed for an earlier session, makes no
        home: otherwise no other worker would ever compute it and every new session would follow it
        there (the simulated fleet showed all turns on one worker). A prefix all hold equally has
        no home either: Dynamo's cost spreads those."""
        for j, c in enumerate(candidates):
            if c.url == req.session_worker:
                return j
        depth = [req.overlaps.get(c.url, NOTHING).total for c in candidates]
        deepest = max(depth)
        if deepest <= HOME_MIN_MATCH * req.blocks or depth.count(deepest) > 1:
            return None
        return depth.index(deepest)

    def _decision(self, req: Request, w: Worker, cost: float = 0.0) -> Decision:
        o = req.overlaps.get(w.url, NOTHING)
        return Decision(w, cost, o, prefill_blocks(req, w, o))

