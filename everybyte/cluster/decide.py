"""The router's decisions without HTTP: from a prompt's tokens and the candidate workers to a
`Plan` (the KV index's prefix depths, the policy's choice, the session map), and the bookkeeping
of what the router has in flight on each worker. cluster/routing wraps it with the HTTP side
(request bodies, health polls, event feeds, metrics); the simulator's fleet
(sim/fleet_router) drives it directly on a virtual clock.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from everybyte.cluster.kv_index import KVIndex, Overlap
from everybyte.cluster.policy import Decision, Policy, Request
from everybyte.cluster.request_blocks import block_names
from everybyte.cluster.worker_state import Worker
from everybyte.kv.block_id import KVNamespace

MAX_SESSIONS = 100_000


@dataclass
class Plan:
    worker: Worker
    tokens: list[int] | None
    names: list[bytes] = field(default_factory=list)     # the prompt's block names in the worker's namespace
    session: str | None = None
    overlap: Overlap = field(default_factory=Overlap)
    best_overlap: int = 0                                  # deepest prefix any candidate holds (blocks)
    prefill_blocks: float = 0.0                            # what the worker computes for it

    @property
    def blocks(self) -> int:
        return len(self.names)


class NoWorker(Exception):
    pass


class Decider:
    def __init__(self, policy: Policy, index: KVIndex | None = None):
        self.policy = policy
        self.index = index or KVIndex()
        self.lock = threading.Lock()          # event feeds' threads write the index the decisions read
        self.sessions: OrderedDict[str, str] = OrderedDict()

    def plan(self, candidates: Sequence[Worker], tokens: list[int] | None, salt: str | None = None,
             session: str | None = None) -> Plan:
        if not candidates:
            raise NoWorker("no worker to route to")
        names_by_ns: dict[KVNamespace, list[bytes]] = {}
        overlaps: dict[str, Overlap] = {}            # only the workers holding some of the prefix
        if tokens:
            for ns, group in _by_namespace(candidates):
                names_by_ns[ns] = block_names(ns, tokens, salt)
                with self.lock:
                    overlaps.update(self.index.reached(names_by_ns[ns], group))
        block_size = candidates[0].namespace.block_size if candidates[0].namespace else 16
        home = self.sessions.get(session) if session else None
        new_session = session is not None and home is None
        if new_session:                        # only the new-session balance rule reads them
            with self.lock:
                for w in candidates:
                    w.cached_blocks = self.index.held(w.url, "G1")
        req = Request(len(tokens or ()), block_size, overlaps, home, new_session=new_session)
        d: Decision = self.policy.choose(req, candidates)
        names = names_by_ns.get(d.worker.namespace, []) if d.worker.namespace else []
        best = max((o.total for o in overlaps.values()), default=0)
        return Plan(d.worker, tokens, names, session, d.overlap, best, d.prefill_blocks if tokens else 0.0)

    def begin(self, plan: Plan) -> None:
        w = plan.worker
        w.in_flight += 1
        w.active_blocks += plan.blocks
        w.queued_prefill_blocks += plan.prefill_blocks
        if plan.session:
            self.remember_session(plan.session, w.url)

    def prefilled(self, plan: Plan) -> None:
        """The worker's output began: this request's prefill no longer queues ahead of others there."""
        plan.worker.queued_prefill_blocks -= plan.prefill_blocks
        plan.prefill_blocks = 0.0

    def end(self, plan: Plan) -> None:
        plan.worker.in_flight -= 1
        plan.worker.active_blocks -= plan.blocks
        plan.worker.queued_prefill_blocks -= plan.prefill_blocks

    def remember_session(self, session: str, url: str) -> None:
        self.sessions[session] = url
        self.sessions.move_to_end(session)
        while len(self.sessions) > MAX_SESSIONS:
            self.sessions.popitem(last=False)


def _by_namespace(candidates: Sequence[Worker]) -> list[tuple[KVNamespace, list[str]]]:
    """The candidates' urls grouped by namespace, in first-seen order. Equal namespaces have equal
    digests, which hash and compare faster than the namespaces' fields (a router asks per request)."""
    spaces = [w.namespace for w in candidates]
    first = spaces[0]
    if first is not None and spaces.count(first) == len(spaces):   # one namespace (count tries `is` first)
        return [(first, [w.url for w in candidates])]
    groups: dict[bytes, tuple[KVNamespace, list[str]]] = {}
    for w in candidates:
        if w.namespace is not None:
            found = groups.get(w.namespace.digest)
            if found is None:
                groups[w.namespace.digest] = (w.namespace, [w.url])
            else:
                found[1].append(w.url)
    return list(groups.values())


def disagg_wanted(plan: Plan, threshold: int, prefill_workers: bool) -> bool:
    """Conditional disaggregation (Dynamo's): the uncached prefill (prompt tokens minus the deepest
    prefix any candidate holds) exceeds the threshold and a prefill worker is there."""
    if not plan.tokens or not prefill_workers:
        return False
    block_size = plan.worker.namespace.block_size if plan.worker.namespace else 16
    return len(plan.tokens) - plan.best_overlap * block_size > threshold
