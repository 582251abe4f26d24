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
