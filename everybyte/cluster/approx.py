"""Approximate mode (no KV events): the router predicts each worker's cache from its own decisions.

The blocks of a prompt the router sent to a worker are assumed cached there (G1) for `ttl_s`
after the last request that used them, then forgotten; the predictions live in the same KVIndex
the events would fill, so the policies do not know the difference (Dynamo's --no-kv-events).
"""
from __future__ import annotations

import heapq
import time
from typing import Callable

from everybyte.cluster.kv_index import KVIndex
from everybyte.kv.events import BlockRemoved, BlockStored


class ApproxTracker:
    def __init__(self, index: KVIndex, ttl_s: float = 120.0, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.index, self.ttl_s, self.clock = index, ttl_s, clock
        self._expiry: dict[str, dict[bytes, float]] = {}
        self._heap: list[tuple[float, int, str, list[bytes]]] = []
        self._n = 0

    def record(self, worker: str, names: list[bytes], block_size: int) -> None:
        if not names:
            return
        self.expire()
        until = self.clock() + self.ttl_s
        mine = self._expiry.setdefault(worker, {})
        for h in names:
            mine[h] = until
        self.index.apply(worker, [BlockStored(list(names), block_size)])
        self._n += 1
        heapq.heappush(self._heap, (until, self._n, worker, list(names)))

    def expire(self) -> None:
        now = self.clock()
        while self._heap and self._heap[0][0] <= now:
            _, _, worker, names = heapq.heappop(self._heap)
            mine = self._expiry.get(worker, {})
            gone = [h for h in names if mine.get(h, now + 1) <= now]   # a later request renewed the rest
            for h in gone:
                del mine[h]
            if gone:
                self.index.apply(worker, [BlockRemoved(gone)])

    def forget(self, worker: str) -> None:
        self._expiry.pop(worker, None)
