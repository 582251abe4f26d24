"""The clock the control plane reads, injected: the system's by default, a virtual one in tests
and in the simulator, so time there advances only by what the caller says. No torch."""
from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds for deadlines and durations."""
        ...

    def time(self) -> float:
        """Wall-clock seconds since the epoch, for timestamps reported to clients."""
        ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()


class VirtualClock:
    """Stands still until advanced; monotonic and wall time move together."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def advance(self, seconds: float) -> None:
        if not seconds >= 0:
            raise ValueError(f"a clock only moves forward, got {seconds!r}")
        self.now += seconds

    def advance_each(self, steps: list[float]) -> None:
        """advance(s) for each s in turn, the same float sums, in one pass."""
        now = self.now
        for s in steps:
            if not s >= 0:                     # a negative step, or a NaN
                raise ValueError(f"a clock only moves forward, got steps {steps!r}")
            now += s
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


SYSTEM = SystemClock()
