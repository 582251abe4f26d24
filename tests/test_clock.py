"""The injected clock (kv/clock): an engine on a virtual clock reads no other time. Its requests'
timestamps are the clock's, and a tier load's deadline passes only when the clock is advanced."""
import pytest

from everybyte import LLM, SamplingParams
from everybyte.kv.clock import VirtualClock


def test_engine_timestamps_come_from_the_injected_clock():
    clock = VirtualClock(5000.0)
    llm = LLM(kv_cache_bytes="16MiB", max_model_len=256, kv_tiers="none", clock=clock)
    rid = llm.add_request("The capital of France is", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    steps = 0
    while llm.has_unfinished_requests():
        for out in llm.step():
            last = out
        steps += 1
        clock.advance(0.25)
    m = last.metrics
    assert last.request_id == rid and m.arrival_time == 5000.0
    assert m.first_token_time == 5000.0                         # the first step, before any advance
    assert m.token_times == [5000.0 + 0.25 * i for i in range(3)]
    assert m.finished_time == 5000.0 + 0.25 * (steps - 1)
    llm.close()


def test_virtual_clock_only_moves_forward():
    clock = VirtualClock(0.0)
    clock.advance(1.5)
    assert clock.monotonic() == clock.time() == 1.5
    with pytest.raises(ValueError):
        clock.advance(-1)
    with pytest.raises(ValueError):
        clock.advance(float("nan"))


def test_advance_each_sums_as_single_advances():
    import random
    r = random.Random(3)
    steps = [r.random() * 10 ** r.randrange(-7, 2) for _ in range(500)]
    one, each = VirtualClock(1e6), VirtualClock(1e6)
    for s in steps:
        one.advance(s)
    each.advance_each(steps)
    assert each.now == one.now                     # bit for bit: the same additions in the same order
    each.advance_each([])
    assert each.now == one.now
    for bad in ([1.0, -1e-9], [float("nan")], [0.5, float("nan"), 0.5]):
        with pytest.raises(ValueError, match="only moves forward"):
            each.advance_each(bad)
        assert each.now == one.now                 # a refused batch moves nothing
