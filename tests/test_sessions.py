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


def test_count_names_compiled_matches_python(monkeypatch):
    """block_names.count_names against the Python loop: the same counts after random adds and
    releases (starts past the end, repeats within a list), and the same KeyError for a release of
    a name nobody holds."""
    import random

    from everybyte.kv import sessions
    if sessions.compiled_names() is None:
        pytest.skip("compiled block names unavailable")
    rng = random.Random(3)
    pool = [bytes([i]) * 16 for i in range(12)]
    native, python = {}, {}
    for _ in range(400):
        names = [rng.choice(pool) for _ in range(rng.randint(0, 8))]
        start, delta = rng.randint(-1, 9), rng.choice([1, 1, 2, -1])
        results = []
        for refs, compiled in ((native, True), (python, False)):
            if not compiled:
                monkeypatch.setattr(sessions, "compiled_names", lambda: None)
            try:
                sessions.count_names(refs, names, start, delta)
                results.append("ok")
            except KeyError as e:
                results.append(e.args)
            monkeypatch.undo()
        assert results[0] == results[1]
        assert native == python
        assert all(v > 0 for v in native.values())
    with pytest.raises(TypeError):
        sessions.count_names([], pool, 0, 1)
