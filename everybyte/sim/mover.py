"""The simulator's KV mover (the KVMover protocol of kv/mover.py): a load of named blocks from
the tiers finishes when the virtual clock passes latency + bytes / bandwidth of the tier each
block is found in (sim.cost_model), and the tier set observes that bandwidth, as it does the real
loader's, to weigh loading against recomputing; a store costs nothing on the step (write-back
runs beside compute). No byte moves: a stored block is its name. `horizon` bounds how far wait() may move the
clock (the runner's next event), so a wait never jumps over an arrival."""
from __future__ import annotations

from typing import Callable

from everybyte.kv.clock import VirtualClock
from everybyte.kv.mover import LoadJob
from everybyte.kv.tier_movement import TierSet


class Done:
    def done(self) -> bool:
        return True


class SimMover:
    def __init__(self, tiers: TierSet, clock: VirtualClock, block_bytes: int,
                 transfer_seconds: Callable[[str, int], float]):
        self.tiers, self.clock, self.nbytes = tiers, clock, block_bytes
        self.transfer_seconds = transfer_seconds
        self.jobs: list[LoadJob] = []
        self.inflight: dict[bytes, tuple[LoadJob, int]] = {}
        self._levels: dict[LoadJob, list[str]] = {}
        self._reads: dict[LoadJob, list[tuple]] = {}
        self.horizon = float("inf")
        self.stored = self.loaded = 0
        self.waited = 0.0

    def store(self, block_ids, names, pin_memory=False):
        self.stored += len(names)
        return list(names)

    def start(self, names, blocks, owner=None, prestage=False) -> LoadJob:
        found = self.tiers.locate(list(names))
        per_tier: dict = {}
        for tier in found:
            per_tier[tier] = per_tier.get(tier, 0) + 1
        reads = [(tier, n * self.nbytes, self.transfer_seconds(tier.level, n * self.nbytes))
                 for tier, n in per_tier.items()]
        job = LoadJob(list(names), list(blocks), owner, prestage,
                      self.clock.monotonic() + sum(seconds for *_, seconds in reads))
        self._levels[job] = [t.level for t in found]     # where each leading block comes from
        self._reads[job] = reads
        for i, n in enumerate(job.names):
            self.inflight.setdefault(n, (job, i))
        self.jobs.append(job)
        return job

    def in_flight(self, names):
        out = []
        for n in names:
            got = self.inflight.get(n)
            if got is None:
                break
            out.append(got)
        return out

    def next_deadline(self) -> float | None:
        return min((j.deadline for j in self.jobs), default=None)

    def finished(self) -> list[LoadJob]:
        now = self.clock.monotonic()
        done = [j for j in self.jobs if j.deadline <= now]
        for job in done:
            for tier, nbytes, seconds in self._reads.pop(job):
                self.tiers.observe(tier, nbytes, seconds)  # the bandwidth load-vs-recompute weighs
            for name, level in zip(job.names, self._levels.pop(job)):
                if not any(t.contains(name) for t in self.tiers.tiers):
                    break                                 # dropped from its tier meanwhile: a miss
                job.loaded.append(level)
            job.finished, job.future = True, Done()
            self.jobs.remove(job)
            self.loaded += len(job.loaded)
            for n in job.names:
                if self.inflight.get(n, (None,))[0] is job:
                    del self.inflight[n]
        return done

    def wait(self, timeout: float) -> bool:
        if not self.jobs:
            return False
        target = min(self.next_deadline() or 0.0, self.clock.monotonic() + timeout, self.horizon)
        dt = max(target - self.clock.monotonic(), 0.0)
        self.clock.advance(dt)
        self.waited += dt
        return True
