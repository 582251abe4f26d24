"""Name-only tiers for the simulator: a tier holds the names of the blocks stored in it (and a
byte count per block), never their bytes; full, it drops its least recently used names and hands
them to the tier below, as the real host and disk tiers do. Synchronous: the virtual clock, not a
thread pool, says when a transfer is done (sim.mover)."""
from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable

from everybyte.kv.tier_movement import TierSet
from everybyte.kv.tiers.base import TierBackend


def _done(value=None) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class NameTier(TierBackend):
    def __init__(self, capacity_bytes: int, level: str, block_bytes: int, kind: str = "host"):
        super().__init__(capacity_bytes, level)
        self.kind, self.block_bytes = kind, block_bytes
        self.held: OrderedDict[bytes, object] = OrderedDict()
        self.landed_at: dict[bytes, float] = {}     # blocks whose write has not landed yet (sim/mover)

    def put(self, name, data) -> bool:
        if name in self.held:
            self.held.move_to_end(name)
            return True
        if self.block_bytes > self.capacity_bytes:
            return False
        self.held[name] = data
        self.stats.add("puts")
        over = len(self.held) * self.block_bytes - self.capacity_bytes
        if over > 0:
            n = -(-over // self.block_bytes)
            gone = [self.held.popitem(last=False) for _ in range(n)]
            if self.landed_at:
                for k, _ in gone:
                    self.landed_at.pop(k, None)
            self._evicted([k for k, _ in gone], [v for _, v in gone])
        return True

    def get(self, name):
        if name not in self.held:
            return None
        self.held.move_to_end(name)
        return self.held[name]

    def contains(self, name) -> bool:
        return name in self.held

    def contains_many(self, names) -> list[bool]:
        held = self.held                  # the sim asks for every prompt's blocks, every tier
        return [n in held for n in names]

    def delete(self, name) -> bool:
        self.landed_at.pop(name, None)
        return self.held.pop(name, None) is not None

    @property
    def used_bytes(self) -> int:
        return len(self.held) * self.block_bytes

    def __len__(self) -> int:
        return len(self.held)

    def put_async(self, name, data) -> Future:
        return _done(self.put(name, data))

    def put_many_async(self, names, datas) -> Future:
        return _done(self.put_many(names, datas))

    def get_many(self, names):
        return [self.get(n) for n in names]


class SyncTierSet(TierSet):
    """The real TierSet with its background puts (spills down the chain, write-through to the pod
    tier) done at once: on a virtual clock a thread pool would make runs nondeterministic.
    on_write(tier, names), when set, is told of every put (the mover charges its link)."""

    on_write: Callable[[TierBackend, list[bytes]], None] | None = None

    def _put(self, tier, names, datas) -> list[bool]:
        ok = super()._put(tier, names, datas)
        if self.on_write is not None:
            self.on_write(tier, [n for n, good in zip(names, ok) if good])
        return ok

    def _put_async(self, tier, names, datas) -> Future:
        return _done(self._put(tier, names, datas))
