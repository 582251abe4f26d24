"""The simulator's event queue: events ordered by (time, kind, tie, n), n unique. EventQueue is
the heapq reference; new_event_queue() gives the compiled one (native/csrc/event_queue.c: the
keys as C numbers, a few compares per level instead of tuple and float rich comparisons) when it
builds and EVERYBYTE_NATIVE_EVENTS is not 0 (tests/test_event_queue.py runs both on the same
random pushes and pops)."""
from __future__ import annotations

import functools
import heapq
import math
import os
from typing import Any, Protocol

from everybyte.native import loader


class Events(Protocol):
    def push(self, t: float, kind: int, tie: int, n: int, what: object) -> None: ...
    def pop(self) -> tuple[float, int, int, object]: ...
    def first_time(self) -> float: ...
    def __len__(self) -> int: ...


class EventQueue:
    def __init__(self) -> None:
        self.heap: list[tuple[float, int, int, int, object]] = []

    def push(self, t: float, kind: int, tie: int, n: int, what: object) -> None:
        """Queue `what` at time t; at equal times lower kinds, then lower ties, then lower n first."""
        if math.isnan(t):
            raise ValueError("an event time cannot be NaN")
        heapq.heappush(self.heap, (float(t), kind, tie, n, what))

    def pop(self) -> tuple[float, int, int, object]:
        """The least event as (t, kind, n, what); IndexError when none is left."""
        if not self.heap:
            raise IndexError("pop from an empty event queue")
        t, kind, _, n, what = heapq.heappop(self.heap)
        return t, kind, n, what

    def first_time(self) -> float:
        return self.heap[0][0] if self.heap else math.inf

    def __len__(self) -> int:
        return len(self.heap)


@functools.cache
def _native() -> Any:
    if os.environ.get("EVERYBYTE_NATIVE_EVENTS", "1") == "0":
        return None
    return loader.try_module("event_queue", "compiled event queue", "heapq")[0]


def new_event_queue() -> Events:
    module = _native()
    queue: Events = module.EventQueue() if module is not None else EventQueue()
    return queue
