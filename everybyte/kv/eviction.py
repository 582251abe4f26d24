"""Which evictable device block goes first.

A policy holds only evictable blocks (reference count 0, content named); the prefix cache inserts a
block when its last user frees it and removes it when a request reuses it. `ParkedFirst` puts the
blocks of parked sessions in front (the session expected back last goes first) and defers to an
inner policy (LRU by default) for the rest. Blocks of running requests are never in a policy.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from itertools import count

from everybyte.kv.parked_runs import ParkedRuns


class EvictionPolicy(ABC):
    @abstractmethod
    def insert(self, block_id: int) -> None:
        """The block became evictable (most recently used)."""

    @abstractmethod
    def remove(self, block_id: int) -> None:
        """The block is no longer evictable (reused or dropped); unknown ids are ignored."""

    @abstractmethod
    def pop(self) -> int | None:
        """Remove and return the next victim, None when nothing is evictable."""

    @abstractmethod
    def order(self) -> list[int]:
        """All evictable blocks, next victim first (for tests and reports; may be O(n log n))."""

    @abstractmethod
    def __contains__(self, block_id: int) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def touch(self, block_id: int) -> None:
        if block_id in self:
            self.remove(block_id)
            self.insert(block_id)

    def insert_many(self, block_ids: list[int]) -> None:
        """insert() each block in turn (a policy may do it faster: the prefix cache's hot path)."""
        for b in block_ids:
            self.insert(b)

    def remove_many(self, block_ids: list[int]) -> None:
        """remove() each block in turn."""
        for b in block_ids:
            self.remove(b)

    def set_parked(self, block_id: int, expected_return: float | None) -> None:
        """Hook for session-aware policies (None = return time unknown); plain policies ignore it."""

    def unpark(self, block_id: int) -> None:
        """The block's session is back (or dropped): ordinary eviction order again."""

    def set_classes(self, block_ids: list[int], ranks: list[float | None]) -> None:
        """For each block in turn: unpark() where its rank is None, else set_parked() with it
        (ranks as park_rank gives them)."""
        for b, r in zip(block_ids, ranks):
            if r is None:
                self.unpark(b)
            else:
                self.set_parked(b, r)

    def unpark_many(self, block_ids: list[int]) -> None:
        """unpark() each block in turn."""
        for b in block_ids:
            self.unpark(b)

    def remove_present(self, block_ids: list[int]) -> set[int]:
        """Remove those of the blocks it holds; returns them."""
        present = {b for b in block_ids if b in self}
        self.remove_many(list(present))
        return present

    def num_parked(self) -> int:
        return 0


class LRUPolicy(EvictionPolicy):
    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def insert(self, block_id: int) -> None:
        self._order[block_id] = None
        self._order.move_to_end(block_id)

    def remove(self, block_id: int) -> None:
        self._order.pop(block_id, None)

    def insert_many(self, block_ids: list[int]) -> None:
        order, to_end = self._order, self._order.move_to_end     # (OrderedDict.update is slower)
        for b in block_ids:
            order[b] = None
            to_end(b)

    def remove_many(self, block_ids: list[int]) -> None:
        pop = self._order.pop
        for b in block_ids:
            pop(b, None)

    def remove_present(self, block_ids: list[int]) -> set[int]:
        pop = self._order.pop
        return {b for b in block_ids if pop(b, 0) is None}    # held blocks map to None

    def touch(self, block_id: int) -> None:
        if block_id in self._order:
            self._order.move_to_end(block_id)

    def pop(self) -> int | None:
        if not self._order:
            return None
        return self._order.popitem(last=False)[0]

    def order(self) -> list[int]:
        return list(self._order)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._order

    def __len__(self) -> int:
        return len(self._order)


class FIFOPolicy(LRUPolicy):
    """Evicts in the order blocks became evictable; reuse does not refresh."""

    def touch(self, block_id: int) -> None:
        pass


class ParkedFirst(EvictionPolicy):
    """Parked sessions' blocks first, latest expected return first (unknown return = +inf, so
    first), ties in the order they became evictable; then the inner policy's order."""

    def __init__(self, inner: EvictionPolicy | None = None) -> None:
        self.inner = inner or LRUPolicy()
        self._parked: dict[int, float] = {}      # block id -> expected return, parked blocks only
        self._evictable_parked: dict[int, int] = {}   # evictable parked block -> its tick in _runs
        self._runs = ParkedRuns()
        self._tick = count()

    def set_parked(self, block_id: int, expected_return: float | None) -> None:
        # remove, re-rank, insert again when evictable (a session parks all its blocks: kept lean)
        if block_id in self._evictable_parked:
            del self._evictable_parked[block_id]       # its heap entry goes stale
        elif block_id in self.inner:
            self.inner.remove(block_id)
        else:
            self._parked[block_id] = park_rank(expected_return)
            return
        self._parked[block_id] = park_rank(expected_return)
        self.insert(block_id)

    def unpark(self, block_id: int) -> None:
        if self._parked.pop(block_id, None) is not None and block_id in self._evictable_parked:
            del self._evictable_parked[block_id]
            self.inner.insert(block_id)

    def set_classes(self, block_ids: list[int], ranks: list[float | None]) -> None:
        # set_parked / unpark inlined (a session parks and unparks all its blocks at once); the
        # inner policy's removals and insertions are batched (distinct blocks: the same order)
        ep, parked, tick = self._evictable_parked, self._parked, self._tick
        moved = self.inner.remove_present([b for b, r in zip(block_ids, ranks) if r is not None and b not in ep])
        back: list[int] = []
        run: list[int] = []                   # consecutive ticks, one rank: one entry in _runs
        run_rank, run_tick = 0.0, 0
        for b, r in zip(block_ids, ranks):
            if r is None:
                if parked.pop(b, None) is not None and b in ep:
                    del ep[b]
                    back.append(b)
                continue
            parked[b] = r
            if b in ep or b in moved:         # evictable: a fresh tick (an old entry goes stale)
                t = ep[b] = next(tick)
                if run and r != run_rank:
                    self._runs.push(run_rank, run, run_tick)
                    run = []
                if not run:
                    run_rank, run_tick = r, t
                run.append(b)
        self._runs.push(run_rank, run, run_tick)
        self.inner.insert_many(back)
        self._runs.compact(ep)

    def unpark_many(self, block_ids: list[int]) -> None:
        pop, ep = self._parked.pop, self._evictable_parked
        back = [b for b in block_ids if pop(b, None) is not None and b in ep]
        for b in back:
            del ep[b]
        self.inner.insert_many(back)

    def insert(self, block_id: int) -> None:
        if block_id in self._parked:
            tick = self._evictable_parked[block_id] = next(self._tick)
            self._runs.push(self._parked[block_id], [block_id], tick)
            self._runs.compact(self._evictable_parked)
        else:
            self.inner.insert(block_id)

    def remove(self, block_id: int) -> None:
        if self._evictable_parked.pop(block_id, None) is None:   # else its heap entry goes stale
            self.inner.remove(block_id)

    def insert_many(self, block_ids: list[int]) -> None:
        if self._parked.keys().isdisjoint(block_ids):     # the common case: no parked block among them
            self.inner.insert_many(block_ids)
        else:
            super().insert_many(block_ids)

    def remove_many(self, block_ids: list[int]) -> None:
        if self._evictable_parked.keys().isdisjoint(block_ids):
            self.inner.remove_many(block_ids)
        else:
            super().remove_many(block_ids)

    def touch(self, block_id: int) -> None:
        if block_id not in self._evictable_parked:
            self.inner.touch(block_id)

    def pop(self) -> int | None:
        b = self._runs.pop(self._evictable_parked)
        if b is None:
            return self.inner.pop()
        del self._evictable_parked[b]
        del self._parked[b]                   # the block leaves; its id will hold other content
        return b

    def order(self) -> list[int]:
        return self._runs.order(self._evictable_parked) + self.inner.order()

    def num_parked(self) -> int:
        return len(self._evictable_parked)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._evictable_parked or block_id in self.inner

    def __len__(self) -> int:
        return len(self._evictable_parked) + len(self.inner)


def park_rank(expected_return: float | None) -> float:
    """The ordering key ParkedFirst uses (unknown return = +inf)."""
    return math.inf if expected_return is None else float(expected_return)
