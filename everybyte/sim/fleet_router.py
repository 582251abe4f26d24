"""KV-aware routing in the simulator with the cluster router's own code: the KV index
(cluster/kv_index) fed by the simulated workers' KV events, the policy (cluster/policy: Dynamo's
cost and the home rule) and the router's bookkeeping (cluster/decide). Only the transport
differs: each worker's memory manager records its events (`KVMemoryManager.kv_events`, what
`serve --kv-events` publishes) and the router applies them, in order, before each decision, and its
load and speeds (TierSet.speeds, what serve/kv_info answers) are read when a request is routed
instead of polled each second (read live when the policy asks: nothing in the fleet changes
while a request is routed, so that is what a poll just before would have said).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from everybyte.cluster.decide import Decider, Plan
from everybyte.cluster.policy import Policy
from everybyte.cluster.worker_state import Worker
from everybyte.kv.block_id import KVNamespace
from everybyte.kv.events import EventLog
from everybyte.sim.runner import SimRequest
from everybyte.sim.worker import SimWorker


@dataclass(eq=False)
class SimWorkerView(Worker):
    """The router's Worker for a simulated one (url sim://i): its /v1/kv/info answered live."""
    sim: Any = None
    role_name: str = "both"

    def __post_init__(self) -> None:
        self.info = {"role": self.role_name, "namespace_digest": self.namespace.digest.hex()}

    @property
    def load(self) -> dict[str, Any]:
        sched = self.sim.core.scheduler
        return {"num_running": len(sched.running), "num_waiting": len(sched.waiting) + len(sched.loading),
                "max_num_seqs": sched.max_num_seqs}

    @property
    def speeds(self) -> dict[str, Any]:
        return self.sim.memory.tiers.speeds()


class FleetRouter:
    """route(request) -> worker index for the Runner, with the cluster's policy; the decode side
    of disaggregation (sim/fleet_disagg) plans through it too."""

    def __init__(self, workers: list[SimWorker], roles: list[str], policy: Policy):
        self.decider = Decider(policy)
        self.workers = workers
        spaces: dict[KVNamespace, KVNamespace] = {}             # one object per namespace: the router
        self.views = [SimWorkerView(f"sim://{w.index}", True, None,  # groups candidates by it per request
                                    spaces.setdefault(ns := w.memory.ns.with_tenant(None), ns), sim=w, role_name=r)
                      for w, r in zip(workers, roles)]
        self.index_of = {v.url: i for i, v in enumerate(self.views)}
        self.plans: dict[str, Plan] = {}             # request id -> its plan, until it finishes
        self.events = 0
        self._logs: list[tuple[str, EventLog]] = []
        for w, v in zip(workers, self.views):
            self.decider.index.add_worker(v.url, v.digest)
            self._subscribe(w, v.url)
            w.core.observers.append(self._observer(v))
            w.core.on_finish = self._finished

    def _subscribe(self, w: SimWorker, url: str) -> None:
        # the index is read only when routing: a worker's events wait in its EventLog, in order,
        # and go in as one drained batch then, as the real publisher drains it (the same index at
        # every decision; applying each event as it happened was a quarter of a fleet run)
        self._logs.append((url, w.memory.kv_events()))

    def flush(self) -> None:
        """Apply every worker's waiting KV events to the index (before it is read)."""
        index = self.decider.index
        for url, log in self._logs:
            if log.pending:
                events = log.drain().events
                index.apply(url, events)
                self.events += len(events)

    def _observer(self, view: SimWorkerView):
        def observe(sched, res) -> None:
            if res is None:
                return
            for i in res.rows:                      # a first token: its prefill no longer queues there
                seq = sched.seqs[i]
                if seq.num_completion_tokens == 0 and (plan := self.plans.get(seq.request_id)) is not None:
                    self.decider.prefilled(plan)
        observe.every_step = False                  # type: ignore[attr-defined]  # a decode run has no first token
        return observe

    def _finished(self, seq) -> None:
        self._finished_id(seq.request_id)

    def forget(self, request_id: str) -> None:
        """The engine refused a routed turn: it is no longer in flight there."""
        self._finished_id(request_id)

    def _finished_id(self, request_id: str) -> None:
        plan = self.plans.pop(request_id, None)
        if plan is not None:
            self.decider.end(plan)

    def candidates(self, roles: tuple[str, ...] = ("both", "decode"), digest: str | None = None) -> list[SimWorkerView]:
        self.flush()
        return [v for v in self.views if v.role_name in roles and (digest is None or v.digest == digest)]

    def plan(self, tokens: list[int], session: str | None, roles: tuple[str, ...] = ("both", "decode"),
             digest: str | None = None) -> Plan:
        return self.decider.plan(self.candidates(roles, digest), tokens, None, session)

    def begin(self, plan: Plan, request_id: str) -> int:
        self.decider.begin(plan)
        self.plans[request_id] = plan
        return self.index_of[plan.worker.url]

    def __call__(self, req: SimRequest) -> int:
        return self.begin(self.plan(req.prompt, req.session_id), req.request_id)

    def describe(self) -> dict[str, Any]:
        self.flush()
        return {"policy": self.decider.policy.name, "kv_events_applied": self.decider.index.events_applied,
                "roles": [v.role_name for v in self.views]}

