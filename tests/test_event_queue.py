"""The compiled event queue against the heapq reference: the same random pushes and pops (equal
times, kinds and ties, so every level of the order decides somewhere) give the same events."""
import math
import random

import pytest

from everybyte.sim import event_queue
from everybyte.sim.event_queue import EventQueue

Native = event_queue._native()
pytestmark = pytest.mark.skipif(Native is None, reason="compiled event queue unavailable")


@pytest.mark.parametrize("seed", range(6))
def test_native_matches_heapq(seed):
    rng = random.Random(seed)
    ref, nat = EventQueue(), Native.EventQueue()
    n, popped = 0, 0
    for _ in range(4000):
        if rng.random() < 0.55 or not len(ref):
            n += 1
            t = rng.choice([0.0, 0.5, 1.0, rng.random() * 3, math.inf])
            kind, tie = rng.randint(0, 2), rng.choice([n, rng.randint(0, 5)])
            what = object() if rng.random() < 0.5 else (n, "x")
            ref.push(t, kind, tie, n, what)
            nat.push(t, kind, tie, n, what)
        else:
            a, b = ref.pop(), nat.pop()
            assert a == b and a[3] is b[3]
            popped += 1
        assert len(ref) == len(nat)
        assert ref.first_time() == nat.first_time()
    while len(ref):
        assert ref.pop() == nat.pop()
    assert len(nat) == 0 and popped > 1000


def test_empty_and_bad_input():
    for q in (EventQueue(), Native.EventQueue()):
        assert q.first_time() == math.inf and len(q) == 0 and not q
        with pytest.raises(IndexError):
            q.pop()
        with pytest.raises(ValueError):
            q.push(float("nan"), 0, 0, 1, None)
        with pytest.raises(TypeError):
            q.push("soon", 0, 0, 1, None)
        q.push(2, 1, 0, 1, "a")               # an int time comes back as a float
        t, kind, n, what = q.pop()
        assert (t, kind, n, what) == (2.0, 1, 1, "a") and isinstance(t, float)


def test_queue_keeps_what_alive():
    import gc
    q = Native.EventQueue()
    q.push(1.0, 0, 0, 1, [1, 2, 3])
    gc.collect()
    assert q.pop()[3] == [1, 2, 3]
