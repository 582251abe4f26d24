"""The router's decisions: from a request body to a worker, and what it learns from each choice.

`Routing` owns the KV index (filled by the workers' events, or predicted in approximate mode),
the workers' health, the session map and the policy; the HTTP front (cluster/router) asks it for
a `Plan` and tells it when the request started and ended.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import AbstractSet, Any

from everybyte.cluster.approx import ApproxTracker
from everybyte.cluster.event_feed import EventFeed
from everybyte.cluster.kv_index import TIERS, KVIndex, Overlap
from everybyte.cluster.policy import Decision, Policy, Request
from everybyte.cluster.request_blocks import RequestBlocks, block_names
from everybyte.cluster.router_metrics import RouterMetrics
from everybyte.cluster.workers import Worker, WorkerSet
from everybyte.kv.block_id import KVNamespace
from everybyte.kv.events import KVEvent

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


class Routing:
    def __init__(self, urls: list[str], blocks: RequestBlocks, policy: Policy, *, events: bool = True,
                 approx_ttl_s: float = 120.0, fallback_namespace: KVNamespace | None = None):
        self.index = KVIndex()
        self.lock = threading.Lock()          # the event feeds' threads write the index the event loop reads
        self.policy, self.blocks, self.use_events = policy, blocks, events
        self.approx = ApproxTracker(self.index, approx_ttl_s)
        self.feed = EventFeed(self._on_batch, self._on_reset)
        fallback = fallback_namespace or KVNamespace("router-local")
        self.workers = WorkerSet(urls, fallback, on_up=self._up, on_down=self._down)
        self.sessions: OrderedDict[str, str] = OrderedDict()
        self.metrics = RouterMetrics(self.snapshot)

    # ---- worker lifecycle -------------------------------------------------------------------
    def event_fed(self, w: Worker) -> bool:
        return self.use_events and bool(w.events)

    def _up(self, w: Worker) -> None:
        with self.lock:
            self.index.add_worker(w.url, w.digest)
        if self.event_fed(w):
            ev = w.events or {}
            self.feed.start(w.url, ev["endpoint"], ev.get("replay_endpoint"))

    def _down(self, w: Worker) -> None:
        self.feed.stop(w.url, timeout=0)
        with self.lock:
            self.index.drop_worker(w.url)
            self.approx.forget(w.url)
        self.feed.lag_s.pop(w.url, None)

    def _on_batch(self, worker: str, events: list[KVEvent], ts: float) -> None:
        w = self.workers.workers.get(worker)
        if w is not None and w.healthy:
            with self.lock:
                self.index.apply(worker, events)

    def _on_reset(self, worker: str) -> None:
        w = self.workers.workers.get(worker)
        with self.lock:
            self.index.drop_worker(worker)
            if w is not None and w.healthy:
                self.index.add_worker(worker, w.digest)

    # ---- decisions --------------------------------------------------------------------------
    def plan(self, path: str, body: dict[str, Any] | None, session: str | None, exclude: AbstractSet[str] = frozenset(),
             roles: tuple[str, ...] = ("both", "decode"), tenant: str | None = None, digest: str | None = None) -> Plan:
        """The worker for this body; `tenant` salts blocks as a worker with --cache-salt-from-api-key
        does, `digest` keeps to workers of one namespace (a KV transfer's two ends)."""
        t0 = time.perf_counter()
        candidates = [w for w in self.workers.healthy(roles)
                      if w.url not in exclude and (digest is None or w.digest == digest)]
        if not candidates:
            raise NoWorker(f"no healthy worker (role {'/'.join(roles)}) to route to")
        tokens = self.blocks.prompt_tokens(path, body) if body is not None else None
        salt = body.get("cache_salt") if body is not None else None
        salt = salt if isinstance(salt, str) else None
        if tenant is not None:
            salt = tenant if salt is None else f"{tenant}/{salt}"
        names_by_ns: dict[KVNamespace, list[bytes]] = {}
        overlaps: dict[str, Overlap] = {}
        if tokens:
            with self.lock:
                self.approx.expire()
            for ns in {w.namespace for w in candidates if w.namespace is not None}:
                names_by_ns[ns] = block_names(ns, tokens, salt)
                group = [w.url for w in candidates if w.namespace == ns]
                with self.lock:
                    overlaps.update(self.index.overlap(names_by_ns[ns], group))
        block_size = candidates[0].namespace.block_size if candidates[0].namespace else 16
        req = Request(len(tokens or ()), block_size, overlaps, self.sessions.get(session) if session else None)
        d: Decision = self.policy.choose(req, candidates)
        self.metrics.decision_seconds.observe(time.perf_counter() - t0)
        names = names_by_ns.get(d.worker.namespace, []) if d.worker.namespace else []
        best = max((o.total for o in overlaps.values()), default=0)
        return Plan(d.worker, tokens, names, session, d.overlap, best, d.prefill_blocks if tokens else 0.0)

    def begin(self, plan: Plan) -> None:
        w = plan.worker
        w.in_flight += 1
        w.active_blocks += plan.blocks
        w.queued_prefill_blocks += plan.prefill_blocks
        self.metrics.decisions.labels(self.policy.name, w.url).inc()
        self.metrics.prompt_blocks.inc(plan.blocks)
        for tier, n in plan.overlap.by_tier().items():
            if n:
                self.metrics.overlap_blocks.labels(tier).inc(n)
        if not self.event_fed(w) and plan.names:
            with self.lock:
                self.approx.record(w.url, plan.names, w.namespace.block_size if w.namespace else 16)
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

    def snapshot(self) -> dict[str, Any]:
        workers = {}
        for url, w in self.workers.workers.items():
            load = {k: v for k, v in w.load.items() if isinstance(v, (int, float))}
            load.update(in_flight=w.in_flight, active_blocks=w.active_blocks)
            with self.lock:
                counts = self.index.counts(url)
            workers[url] = {"healthy": w.healthy, "load": load, "event_lag_s": self.feed.lag_s.get(url),
                            "blocks": {t: counts.get(t, 0) for t in TIERS}}
        return {"workers": workers, "events": dict(self.feed.stats)}
