"""The router's decisions: from a request body to a worker, and what it learns from each choice.

`Routing` owns the KV index (filled by the workers' events, or predicted in approximate mode),
the workers' health, the session map and the policy; the HTTP front (cluster/router) asks it for
a `Plan` and tells it when the request started and ended.
"""
from __future__ import annotations

import time
from typing import AbstractSet, Any

from everybyte.cluster.approx import ApproxTracker
from everybyte.cluster.decide import Decider, NoWorker, Plan
from everybyte.cluster.event_feed import EventFeed
from everybyte.cluster.kv_index import TIERS
from everybyte.cluster.policy import Policy
from everybyte.cluster.request_blocks import RequestBlocks
from everybyte.cluster.router_metrics import RouterMetrics
from everybyte.cluster.workers import Worker, WorkerSet
from everybyte.kv.block_id import KVNamespace
from everybyte.kv.events import KVEvent

__all__ = ["NoWorker", "Plan", "Routing"]


class Routing:
    def __init__(self, urls: list[str], blocks: RequestBlocks, policy: Policy, *, events: bool = True,
                 approx_ttl_s: float = 120.0, fallback_namespace: KVNamespace | None = None):
        self.decider = Decider(policy)
        self.index, self.lock, self.sessions = self.decider.index, self.decider.lock, self.decider.sessions
        self.policy, self.blocks, self.use_events = policy, blocks, events
        self.approx = ApproxTracker(self.index, approx_ttl_s)
        self.feed = EventFeed(self._on_batch, self._on_reset)
        fallback = fallback_namespace or KVNamespace("router-local")
        self.workers = WorkerSet(urls, fallback, on_up=self._up, on_down=self._down)
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
        if tokens:
            with self.lock:
                self.approx.expire()
        plan = self.decider.plan(candidates, tokens, salt, session)
        self.metrics.decision_seconds.observe(time.perf_counter() - t0)
        return plan

    def begin(self, plan: Plan) -> None:
        w = plan.worker
        self.decider.begin(plan)
        self.metrics.decisions.labels(self.policy.name, w.url).inc()
        self.metrics.prompt_blocks.inc(plan.blocks)
        for tier, n in plan.overlap.by_tier().items():
            if n:
                self.metrics.overlap_blocks.labels(tier).inc(n)
        if not self.event_fed(w) and plan.names:
            with self.lock:
                self.approx.record(w.url, plan.names, w.namespace.block_size if w.namespace else 16)

    def prefilled(self, plan: Plan) -> None:
        self.decider.prefilled(plan)

    def end(self, plan: Plan) -> None:
        self.decider.end(plan)

    def remember_session(self, session: str, url: str) -> None:
        self.decider.remember_session(session, url)

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
