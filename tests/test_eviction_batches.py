"""ParkedFirst's batched calls and its runs of parked blocks (kv/parked_runs) against a plain model
of the policy it must equal: parked blocks by (latest expected return, tick), then LRU."""
from __future__ import annotations

import math
import random
from collections import OrderedDict

import pytest

from everybyte.kv.eviction import EvictionPolicy, LRUPolicy, ParkedFirst, park_rank
from everybyte.kv.prefix_cache import PrefixCache


class ModelParkedFirst:
    """The definition, recomputed from scratch at every pop (slow, obviously right)."""

    def __init__(self) -> None:
        self.rank: dict[int, float] = {}          # parked blocks (evictable or not)
        self.tick: dict[int, int] = {}            # evictable parked block -> when it was ranked
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.t = 0

    def insert(self, b: int) -> None:
        if b in self.rank:
            self.t += 1
            self.tick[b] = self.t
        else:
            self.lru[b] = None
            self.lru.move_to_end(b)

    def remove(self, b: int) -> None:
        if self.tick.pop(b, None) is None:
            self.lru.pop(b, None)

    def set_parked(self, b: int, expected: float | None) -> None:
        evictable = b in self.tick or b in self.lru
        self.tick.pop(b, None)
        self.lru.pop(b, None)
        self.rank[b] = park_rank(expected)
        if evictable:
            self.insert(b)

    def unpark(self, b: int) -> None:
        if self.rank.pop(b, None) is not None and self.tick.pop(b, None) is not None:
            self.lru[b] = None

    def touch(self, b: int) -> None:
        if b not in self.tick and b in self.lru:
            self.lru.move_to_end(b)

    def order(self) -> list[int]:
        return sorted(self.tick, key=lambda b: (-self.rank[b], self.tick[b])) + list(self.lru)

    def pop(self) -> int | None:
        order = self.order()
        if not order:
            return None
        b = order[0]
        if b in self.tick:
            del self.tick[b], self.rank[b]
        else:
            del self.lru[b]
        return b


RANKS = [None, 1.0, 2.0, 2.0, 5.0, math.inf]


SINGLE = ("insert", "remove", "unpark", "touch")
BATCHED = {"insert_many": "insert", "remove_many": "remove", "unpark_many": "unpark"}


def _step(rng: random.Random, real: EvictionPolicy, model: ModelParkedFirst) -> None:
    op = rng.randrange(10)
    blocks = rng.sample(range(40), rng.randint(1, 12))
    if op < len(SINGLE):
        getattr(real, SINGLE[op])(blocks[0])
        getattr(model, SINGLE[op])(blocks[0])
    elif op < 7:
        name = list(BATCHED)[op - len(SINGLE)]
        getattr(real, name)(blocks)
        for x in blocks:
            getattr(model, BATCHED[name])(x)
    elif op == 7:
        r = rng.choice(RANKS)
        real.set_parked(blocks[0], r)
        model.set_parked(blocks[0], r)
    elif op == 8:
        ranks = [None if r is None else park_rank(r) for r in (rng.choice(RANKS) for _ in blocks)]
        if rng.random() < 0.5:
            ranks = [ranks[0]] * len(blocks)     # a whole session parked at once: one run
        real.set_classes(blocks, ranks)
        for x, r in zip(blocks, ranks):
            model.unpark(x) if r is None else model.set_parked(x, r)
    else:
        for _ in range(rng.randint(1, 6)):
            assert real.pop() == model.pop()


@pytest.mark.parametrize("seed", range(8))
def test_parked_first_equals_its_definition(seed):
    rng = random.Random(seed)
    real, model = ParkedFirst(LRUPolicy()), ModelParkedFirst()
    for _ in range(3000):
        _step(rng, real, model)
        assert real.order() == model.order()
        assert len(real) == len(model.tick) + len(model.lru)
        assert real.num_parked() == len(model.tick)
    while (b := model.pop()) is not None:           # drains in the same order
        assert real.pop() == b
    assert real.pop() is None and len(real) == 0


def test_lru_batches_equal_single_calls():
    rng = random.Random(1)
    a, b = LRUPolicy(), LRUPolicy()
    for _ in range(2000):
        blocks = rng.sample(range(30), rng.randint(1, 8))
        if rng.random() < 0.5:
            a.insert_many(blocks)
            for x in blocks:
                b.insert(x)
        elif rng.random() < 0.5:
            a.remove_many(blocks)
            for x in blocks:
                b.remove(x)
        else:
            held = {x for x in blocks if x in b}
            assert a.remove_present(blocks) == held
            for x in held:
                b.remove(x)
        assert a.order() == b.order()


def _history(c: PrefixCache, rng: random.Random) -> None:
    """Sessions taking, naming, freeing, parking and unparking blocks; chains share prefixes."""
    held: list[list[int]] = []
    for _ in range(80):
        op, session = rng.randrange(4), rng.choice(["A", "B", "C"])
        if op == 0 and c.num_free_blocks >= 4:
            names = [bytes([rng.randrange(3), i]) for i in range(rng.randint(1, 4))]
            hits = c.acquire(names, session)
            fresh = c.allocate(len(names) - len(hits))
            for b, name in zip(fresh, names[len(hits):]):
                c.commit(b, name, session)
            held.append(hits + fresh)
        elif op == 1 and held:
            c.free(held.pop(rng.randrange(len(held))))
        elif op == 2:
            c.park(session, rng.choice([None, 1.0, 5.0]))
        else:
            c.unpark(session)


@pytest.mark.parametrize("seed", range(20))
def test_refresh_is_acquire_then_free(seed):
    pinned, refreshed = PrefixCache(24), PrefixCache(24)
    for c in (pinned, refreshed):
        rng = random.Random(seed)
        _history(c, rng)
        names, owner = [bytes([rng.randrange(3), i]) for i in range(4)], rng.choice(["A", "B", "D"])
    hits = pinned.acquire(names, owner)
    pinned.free(hits)
    assert refreshed.refresh(names, owner) == len(hits)
    def state(c: PrefixCache) -> list:
        return [c.stats, c.owners, c.session_blocks, c._freed_at, c.ref, c.evictable_order(), c.counts()]

    assert state(pinned) == state(refreshed)
    assert pinned.evict(24) == refreshed.evict(24)
