"""The real engine as a worker of the simulator's Runner (sim/runner.py), so `bench sim-accuracy`
replays the same sessions, arrivals, tool gaps and park/resume on the real engine and on the
simulated one: only the clock (the wall's, which advance() sleeps on) and the executor (the
model's forward) differ. Every whole step is timed with its batch shape, for the calibration."""
from __future__ import annotations

import time

from everybyte.engine.llm_engine import LLMEngine
from everybyte.sim.calibration import StepSample


class WallClock:
    """Seconds since start() on the system's monotonic clock. The real engine's steps move it by
    themselves; advance() is the Runner waiting for an arrival: it sleeps."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.slept_s = 0.0

    def start(self) -> None:
        self.t0 = time.monotonic()

    @property
    def now(self) -> float:
        return time.monotonic() - self.t0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)
            self.slept_s += seconds


class TimedCore:
    """The engine's EngineCore with every step() timed whole (scheduling, admission, tier waits and
    the forward) and recorded with its shape: tokens computed, context attended, sequences."""

    def __init__(self, core) -> None:
        self.core = core
        self.samples: list[StepSample] = []
        self.stepping_s = 0.0                 # every step() call, with a batch or without
        self._shape: tuple[int, int, int] | None = None
        core.observers.append(self._observe)

    def _observe(self, sched, res) -> None:
        if res is not None:
            attended = sum(n * s.num_computed_tokens + n * (n + 1) // 2
                           for s, n in zip(sched.seqs, sched.num_new_tokens))
            self._shape = (sched.num_batched_tokens, attended, len(sched.seqs))

    def step(self):
        t0 = time.perf_counter()
        out = self.core.step()
        dt = time.perf_counter() - t0
        self.stepping_s += dt
        if self._shape is not None:
            self.samples.append(StepSample(*self._shape, dt))
            self._shape = None
        return out

    def __getattr__(self, name):
        return getattr(self.core, name)


class _LoadsView:
    """What the Runner asks of a worker's mover: its jobs; a real load has no deadline to jump to,
    so the next step is now (EngineCore.step waits on the loads itself)."""

    def __init__(self, memory, clock: WallClock) -> None:
        self.memory, self.clock = memory, clock
        self.horizon = float("inf")

    @property
    def jobs(self) -> list:
        return list(self.memory.mover.jobs)

    def next_deadline(self) -> float:
        return self.clock.now


class RealWorker:
    def __init__(self, engine: LLMEngine, clock: WallClock, index: int = 0) -> None:
        self.index, self.engine, self.clock = index, engine, clock
        self.core = TimedCore(engine.core)
        self.memory = engine.block_manager
        self.mover = _LoadsView(self.memory, clock)
        self.executor = engine.core.executor
        self.scheduled = False

    @property
    def tier_bandwidth(self) -> dict[str, float]:
        """level -> the load bandwidth the engine measured (bytes/s, an EMA of its loads)."""
        return dict(self.memory.tiers.bandwidth)
