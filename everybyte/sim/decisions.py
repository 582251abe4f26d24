"""A record of an engine's scheduling decisions, step by step (EngineCore.observers): which
requests ran and how many tokens each computed from where (admissions, chunked prefill, prefix
hits show as num_computed at admission), which were preempted, and the prefix cache's eviction
and hit counters. Two engines fed the same requests make the same decisions exactly when their
records are equal; the step durations come along so a simulator can replay them."""
from __future__ import annotations

from typing import Any

from everybyte.engine.core import EngineCore, StepResult
from everybyte.engine.scheduler import SchedulerOutput


class DecisionLog:
    def __init__(self, core: EngineCore):
        self.core = core
        self.steps: list[dict[str, Any]] = []
        self.seconds: list[float] = []
        core.observers.append(self.record)

    def record(self, sched: SchedulerOutput, res: StepResult | None) -> None:
        bm = self.core.block_manager
        cache = getattr(bm, "cache", None)
        step: dict[str, Any] = {
            "batch": [(s.request_id, n, s.num_computed_tokens, s.num_cached_tokens)
                      for s, n in zip(sched.seqs, sched.num_new_tokens)],
            "preempted": [s.request_id for s in sched.preempted],
            "sampled": [sched.seqs[i].request_id for i in res.rows] if res is not None else [],
            "free_blocks": bm.num_free_blocks,
        }
        if cache is not None:
            step["evictions"] = cache.stats["evictions"]
            step["hit_blocks"] = cache.stats["hit_blocks"]
        self.steps.append(step)
        if res is not None:
            self.seconds.append(res.seconds)
