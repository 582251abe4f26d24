"""The replay's clock for gaps and arrivals: real time, plus the idle time it was allowed to skip.

When nothing is in flight and the next wake-up is more than `idle_skip_s` away, the clock jumps
so that it is `idle_skip_s` away (AgentX does the same); the total skipped is reported.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import time


class GapClock:
    def __init__(self, idle_skip_s: float | None = None, tick_s: float = 0.01):
        self.idle_skip_s, self.tick_s = idle_skip_s, tick_s
        self.skew = 0.0
        self.skipped_s = 0.0
        self.skips = 0
        self.in_flight = 0
        self._sleepers: list = []
        self._seq = itertools.count()
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    def now(self) -> float:
        return time.perf_counter() + self.skew

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        """Wake every sleeper (they return False) and stop the ticker."""
        self._stop.set()
        for _, _, fut in self._sleepers:
            if not fut.done():
                fut.set_result(False)
        self._sleepers.clear()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    async def sleep(self, seconds: float) -> bool:
        return await self.sleep_until(self.now() + max(0.0, seconds))

    async def sleep_until(self, deadline: float) -> bool:
        """True when the deadline came, False when the clock was stopped first."""
        if self.stopped:
            return False
        if deadline <= self.now():
            return True
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (deadline, next(self._seq), fut))
        return await fut

    async def _run(self) -> None:
        while not self.stopped:
            now = self.now()
            while self._sleepers and self._sleepers[0][0] <= now:
                _, _, fut = heapq.heappop(self._sleepers)
                if not fut.done():
                    fut.set_result(True)
            if self.idle_skip_s is not None and self.in_flight == 0 and self._sleepers:
                ahead = self._sleepers[0][0] - now
                if ahead > self.idle_skip_s:
                    jump = ahead - self.idle_skip_s
                    self.skew += jump
                    self.skipped_s += jump
                    self.skips += 1
            await asyncio.sleep(self.tick_s)

    async def close(self) -> None:
        self.stop()
        if self._task is not None:
            await self._task
