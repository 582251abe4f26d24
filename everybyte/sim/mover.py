"""The simulator's KV mover (the KVMover protocol of kv/mover.py): a load of named blocks from
the tiers finishes when its reads have gone through the links of the tiers its blocks are found
in (sim/link_lanes: each link a FIFO lane, so concurrent loads share its bandwidth; tiers are read
one after another, as the real loader reads them), and not before the writes that put those blocks
there have landed; the tier set observes the bandwidth each read got, as it does the real
loader's, to weigh loading against recomputing. A write (a block offloaded, spilled down or
written through) costs nothing on the step (it runs beside compute) but holds its link's write
lane. No byte moves: a stored block is its name. `horizon` bounds how far wait() may move the
clock (the runner's next event), so a wait never jumps over an arrival."""
from __future__ import annotations

from everybyte.kv.clock import VirtualClock
from everybyte.kv.mover import LoadJob
from everybyte.kv.tier_movement import TierSet, held_run
from everybyte.sim.link_lanes import Lanes


class Done:
    def done(self) -> bool:
        return True


class SimMover:
    def __init__(self, tiers: TierSet, clock: VirtualClock, block_bytes: int, lanes: Lanes):
        self.tiers, self.clock, self.nbytes, self.lanes = tiers, clock, block_bytes, lanes
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

    def wrote(self, tier, names: list[bytes]) -> None:
        """A put of `names` into `tier` (SyncTierSet.on_write): it holds the tier's write lane, and
        a read of those blocks waits until it has landed (NameTier.landed_at)."""
        now = self.clock.monotonic()
        end = self.lanes.write(tier.level, now, len(names) * self.nbytes) if names else None
        landed = getattr(tier, "landed_at", None)
        if landed is None:
            return
        while landed:                           # forget writes that have landed, oldest first
            first = next(iter(landed))
            if landed[first] > now:
                break
            del landed[first]
        if end is not None and end > now:
            for n in names:
                landed[n] = end

    def start(self, names, blocks, owner=None, prestage=False) -> LoadJob:
        names = list(names)
        found = self.tiers.locate(names)
        per_tier: dict = {}
        for name, tier in zip(names, found):
            per_tier.setdefault(tier, []).append(name)
        now = end = self.clock.monotonic()
        reads = []
        for tier, held in per_tier.items():
            landed = getattr(tier, "landed_at", None)
            written = max((landed.get(n, 0.0) for n in held), default=0.0) if landed else 0.0
            ready, nbytes = max(end, written), len(held) * self.nbytes
            end = self.lanes.read(tier.level, now, nbytes, ready)
            reads.append((tier, nbytes, end - ready))
        job = LoadJob(names, list(blocks), owner, prestage, end)
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
        best: float | None = None                # a loop, not min() over a generator: asked every step
        for j in self.jobs:
            if best is None or j.deadline < best:
                best = j.deadline
        return best

    def finished(self) -> list[LoadJob]:
        now = self.clock.monotonic()
        done = [j for j in self.jobs if j.deadline <= now]
        for job in done:
            for tier, nbytes, seconds in self._reads.pop(job):
                self.tiers.observe(tier, nbytes, seconds)  # the bandwidth load-vs-recompute weighs
            levels = self._levels.pop(job)                # a block dropped from its tier meanwhile: a miss
            job.loaded.extend(levels[:len(held_run(self.tiers.tiers, job.names))])
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
