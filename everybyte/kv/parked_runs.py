"""The parked side of ParkedFirst (kv/eviction): evictable parked blocks in eviction order, latest
expected return first (the smallest negated rank), ties by tick (the order they were ranked).

Kept as runs: the blocks a session parks at once share a rank and take consecutive ticks, so they
go into the heap as one entry instead of one each. No other entry has a tick inside a run's
range, so a run keeps its place in the heap while its front is consumed. An element is stale
(skipped) when `live` (block -> tick, owned by the caller) no longer gives its block that tick:
the block was reused, re-ranked or unparked since.
"""
from __future__ import annotations

import heapq
from typing import Sequence


class _Run:
    __slots__ = ("blocks", "ticks", "i")

    def __init__(self, blocks: list[int], ticks: Sequence[int]) -> None:
        self.blocks, self.ticks, self.i = blocks, ticks, 0      # i: the first element not consumed


class ParkedRuns:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, _Run]] = []          # (-rank, first tick, run): ticks never tie
        self.size = 0                                           # elements not consumed, live or stale

    def push(self, rank: float, blocks: list[int], first_tick: int) -> None:
        """Blocks ranked `rank` with ticks first_tick, first_tick + 1, ..."""
        if blocks:
            run = _Run(blocks, range(first_tick, first_tick + len(blocks)))
            heapq.heappush(self._heap, (-rank, first_tick, run))
            self.size += len(blocks)

    def pop(self, live: dict[int, int]) -> int | None:
        """Consume and return the first live block (the caller forgets its tick), None when none."""
        heap = self._heap
        while heap:
            run = heap[0][2]
            blocks, ticks, i = run.blocks, run.ticks, run.i
            start, n = i, len(blocks)
            while i < n:
                b = blocks[i]
                i += 1
                if live.get(b) == ticks[i - 1]:
                    run.i = i
                    self.size -= i - start
                    if i == n:
                        heapq.heappop(heap)
                    return b
            self.size -= n - start
            heapq.heappop(heap)
        return None

    def _live_runs(self, live: dict[int, int]) -> list[tuple[float, list[int], list[int]]]:
        out = []
        for neg_rank, _, run in self._heap:
            pairs = [(b, t) for b, t in zip(run.blocks[run.i:], run.ticks[run.i:]) if live.get(b) == t]
            if pairs:
                out.append((neg_rank, [b for b, _ in pairs], [t for _, t in pairs]))
        return out

    def order(self, live: dict[int, int]) -> list[int]:
        """The live blocks, first victim first."""
        entries = sorted((neg, t, b) for neg, blocks, ticks in self._live_runs(live) for b, t in zip(blocks, ticks))
        return [b for _, _, b in entries]

    def compact(self, live: dict[int, int]) -> None:
        """Drop stale elements when they are most of the heap."""
        if self.size > 2 * len(live) + 64:
            runs = self._live_runs(live)
            self._heap = [(neg, ticks[0], _Run(blocks, ticks)) for neg, blocks, ticks in runs]
            heapq.heapify(self._heap)
            self.size = sum(len(blocks) for _, blocks, _ in runs)
