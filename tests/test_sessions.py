"""The session table: bounded by count and idle time (LRU), names reference-counted across sessions."""
from __future__ import annotations

import math

import pytest

from everybyte.kv.prefix_cache import SHARED, PrefixCache
from everybyte.kv.sessions import SessionTable


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_lru_count_and_idle_expiry():
    clock = Clock()
    t = SessionTable(max_sessions=2, idle_timeout_s=60, clock=clock)
    for sid in ("a", "b", "c"):
        t.touch(sid)
        clock.t += 1
    assert t.over_limits(keep="c") == ["a"]
    t.pop("a")
    t.touch("b")                       # b is now the most recent
    clock.t += 61
    t.touch("d")
    assert t.over_limits(keep="d") == ["c", "b"]


def test_idle_expiry_is_on_time_after_fresh_checks():
    """over_limits answers 'none' from a bound on the sessions' last activity; a session still
    expires at its timeout, whether the bound was set by a touch, a park or an earlier check."""
    clock = Clock()
    t = SessionTable(max_sessions=10, idle_timeout_s=60, clock=clock)
    t.touch("a")
    clock.t += 30
    t.touch("b")
    clock.t += 20
    t.park("b", None)                  # b active at 1050
    assert t.over_limits() == []
    clock.t = 1060.5                   # a idle 60.5 s
    assert t.over_limits() == ["a"]
    t.pop("a")
    assert t.over_limits() == []       # the bound moves up to b's 1050
    clock.t = 1110.0
    assert t.over_limits() == []       # exactly 60 s: not past the timeout
    clock.t = 1110.5
    assert t.over_limits(keep="c") == ["b"]
    assert t.over_limits(keep="b") == []


def test_names_are_counted_across_sessions():
    t = SessionTable()
    t.touch("a"), t.touch("b")
    t.record_context("a", 32, [b"p", b"a1"])
    t.record_context("b", 32, [b"p", b"b1"])
    t.pop("a")
    assert t.held(b"p") and not t.held(b"a1") and t.held(b"b1")
    t.record_context("b", 16, [b"b1"])
    assert not t.held(b"p")


@pytest.mark.parametrize("gap", [math.nan, math.inf, 1e999, -1, 10 ** 9, True, "5"])
def test_bad_gap_changes_nothing(gap):
    t = SessionTable()
    t.touch("a")
    with pytest.raises(ValueError, match="expected_gap_s"):
        t.park("a", gap)
    assert t.get("a").state == "active" and t.get("a").expected_return is None


def test_shared_owner_is_not_a_string():
    cache = PrefixCache(4, max_owners=1)
    assert not isinstance(SHARED, str)
    cache.park("<shared>")            # a client may call its session anything
    with pytest.raises(ValueError):
        cache.park(SHARED)


def test_context_refs_count_every_session_holding_a_name():
    t = SessionTable(max_sessions=8)
    names = [bytes([i]) * 16 for i in range(8)]
    for sid in ("a", "b"):
        t.touch(sid)
    t.record_context("a", 64, names[:3])
    t.record_context("a", 96, names[:5])                  # grew: the kept names are not counted twice
    t.record_context("b", 64, names[:2] + names[6:7])
    t.record_context("b", 32, names[6:8])                 # another context: the old names lose b
    want: dict = {}
    for s in t.sessions.values():
        for n in s.names:
            want[n] = want.get(n, 0) + 1
    assert dict(t.refs) == want
    t.pop("a")
    assert not t.held(names[0]) and t.held(names[6])


def test_name_counts_compiled_matches_python():
    """The compiled NameCounts against the dict reference: the same counts after random adds and
    releases (starts past either end, repeats within a list, enough names to grow the table and
    delete from the middle of its probe runs), the same KeyError for a release of a name nobody
    holds, and a TypeError for a name that is not bytes."""
    import random

    from everybyte.kv import name_counts
    if name_counts._native() is None:
        pytest.skip("compiled name counts unavailable")
    rng = random.Random(3)
    pool = [bytes([i % 256, i // 256]) * rng.choice([1, 4, 8, 9]) for i in range(300)]
    native, python = name_counts._native().NameCounts(), name_counts.NameCounts()
    for _ in range(3000):
        names = [rng.choice(pool) for _ in range(rng.randint(0, 8))]
        start, delta = rng.randint(-1, 9), rng.choice([1, 1, 2, -1, -1])
        results = []
        for c in (native, python):
            try:
                c.add(names, start, delta)
                results.append("ok")
            except KeyError as e:
                results.append(e.args)
        assert results[0] == results[1]
        assert len(native) == len(python) and sorted(native.keys()) == sorted(python.keys())
        probe = rng.choice(pool)
        assert native.get(probe) == python.get(probe) and (probe in native) == (probe in python)
    assert dict(native) == dict(python) and len(native) > 50
    assert all(v > 0 for v in dict(native).values())
    for c in (native, python):
        with pytest.raises(TypeError):
            c.add(["not bytes"], 0, 1)
        with pytest.raises(KeyError):
            c[b"nobody"]
