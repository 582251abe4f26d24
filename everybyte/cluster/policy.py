"""Routing policies: which worker gets a request.

`kv` (the default) is Dynamo's KV router cost, `overlap_weight * prefill_blocks + decode_blocks`,
where prefill_blocks are the prompt's blocks the worker must compute ((prompt tokens - overlap
tokens) / block size) and decode_blocks the blocks it already has active plus this request's,
lowest cost wins. Extended: a prefix block in the worker's G2 or G3, or in the pod-shared tier
(G3.5), costs its load time relative to prefill (the worker's /v1/kv/info speeds, defaults when it
states none) instead of zero or a full recompute; and a session goes back to the worker that holds
it unless another worker's cost is lower. `round-robin`, `random`, `least-loaded` ignore the
prefix; `session` keeps a session on its worker and spreads new ones round-robin.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

from everybyte.cluster.kv_index import Overlap
from everybyte.cluster.workers import Worker

POLICIES = ("kv", "round-robin", "random", "least-loaded", "session")


@dataclass
class Request:
    prompt_tokens: int
    block_size: int
    overlaps: dict[str, Overlap] = field(default_factory=dict)      # worker url -> prefix depths
    session_worker: str | None = None                                # where its session lives

    @property
    def blocks(self) -> int:
        return -(-self.prompt_tokens // self.block_size)


@dataclass
class Decision:
    worker: Worker
    cost: float = 0.0
    overlap: Overlap = field(default_factory=Overlap)


def prefill_blocks(req: Request, w: Worker, o: Overlap) -> float:
    """Blocks' worth of prefill work on `w`: what is missing, plus lower-tier loads at their price."""
    missing = max(0.0, req.prompt_tokens - o.total * req.block_size) / req.block_size
    if o.total == o.g1:                          # nothing to load from a lower tier
        return missing
    return missing + sum(n * w.load_fraction(t) for t, n in o.by_tier().items() if n and t != "G1")

def kv_cost(req: Request, w: Worker, overlap_weight: float) -> float:
    o = req.overlaps.get(w.url, Overlap())
    return overlap_weight * prefill_blocks(req, w, o) + w.active_blocks + req.blocks


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
        costs = [kv_cost(req, w, self.overlap_weight) for w in candidates]
        best = min(costs)
        ties = [i for i, c in enumerate(costs) if c == best]
        n = len(candidates)
        # equal costs: the less queued, then rotating, so a cold start spreads instead of piling up
        i = min(ties, key=lambda i: (candidates[i].queue_depth(), (i - self._next) % n)) if len(ties) > 1 else ties[0]
        w = candidates[i]
        if req.session_worker is not None and req.session_worker != w.url:
            for j, c in enumerate(candidates):              # a session stays unless elsewhere is cheaper
                if c.url == req.session_worker and costs[j] <= best:
                    w = c
        self._next += 1
        return Decision(w, best, req.overlaps.get(w.url, Overlap()))

    def _decision(self, req: Request, w: Worker) -> Decision:
        return Decision(w, 0.0, req.overlaps.get(w.url, Overlap()))

