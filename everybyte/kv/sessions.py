"""Agent sessions: which named blocks hold a session's context, and whether it is parked.

The table is bounded: at most `max_sessions` sessions, and a session idle (no request, park or
resume) for `idle_timeout_s` expires; the least recently active go first. Every block name is
reference-counted across the sessions whose context holds it, so forgetting one session can
tell which of its blocks no other session needs.
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from everybyte.kv.name_counts import Counts, new_name_counts
from everybyte.kv.name_memo import equal_blocks

MAX_GAP_S = 7 * 24 * 3600.0        # an expected tool-call gap longer than a week is a client bug


@dataclass
class Session:
    session_id: str
    state: str = "active"                      # active | parked
    num_tokens: int = 0                        # tokens of its latest context
    names: list[bytes] = field(default_factory=list)   # full blocks of that context, in order
    expected_return: float | None = None
    last_active: float = 0.0


def check_gap(expected_gap_s: object) -> float | None:
    """An expected gap is None or a finite number of seconds in [0, MAX_GAP_S]."""
    if expected_gap_s is None:
        return None
    if isinstance(expected_gap_s, bool) or not isinstance(expected_gap_s, (int, float)) \
            or not math.isfinite(expected_gap_s) or not 0 <= expected_gap_s <= MAX_GAP_S:
        raise ValueError(f"expected_gap_s must be a finite number of seconds in [0, {MAX_GAP_S:.0f}], "
                         f"got {expected_gap_s!r}")
    return float(expected_gap_s)


class SessionTable:
    def __init__(self, max_sessions: int = 10000, idle_timeout_s: float = 3600.0,
                 clock: Callable[[], float] = time.time):
        if max_sessions < 1 or not idle_timeout_s > 0:
            raise ValueError(f"need max_sessions >= 1 and idle_timeout_s > 0, got {max_sessions}, "
                             f"{idle_timeout_s}")
        self.max_sessions, self.idle_timeout_s, self.clock = max_sessions, idle_timeout_s, clock
        self.sessions: OrderedDict[str, Session] = OrderedDict()    # least recently active first
        self.refs: Counts = new_name_counts()                       # name -> sessions holding it
        self.min_active = math.inf      # at or below every session's last_active: none expires before it + the timeout

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.sessions

    def get(self, session_id: str) -> Session:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise KeyError(f"unknown session {session_id!r}") from None

    def touch(self, session_id: str) -> Session:
        """Mark the session active now, creating it when new."""
        s = self.sessions.get(session_id)
        if s is None:
            s = self.sessions[session_id] = Session(session_id)
        self.sessions.move_to_end(session_id)
        s.state, s.expected_return, s.last_active = "active", None, self.clock()
        if s.last_active < self.min_active:
            self.min_active = s.last_active
        return s

    def park(self, session_id: str, expected_gap_s: float | None) -> Session:
        gap = check_gap(expected_gap_s)
        s = self.get(session_id)
        now = self.clock()
        s.state, s.last_active = "parked", now
        if now < self.min_active:
            self.min_active = now
        s.expected_return = None if gap is None else now + gap
        self.sessions.move_to_end(session_id)
        return s

    def record_context(self, session_id: str, num_tokens: int, names: list[bytes]) -> None:
        """The session's context is now these names' blocks. The list becomes the session's, not
        a copy: the caller passes one it no longer changes."""
        s = self.sessions.get(session_id)
        if s is None:
            return
        old, refs = s.names, self.refs
        kept = len(old)
        # the context grew: only the new names gain a holder (compared in C, by identity first)
        grew = kept <= len(names) and equal_blocks(names, old, kept, 1) == kept
        refs.add(names, kept if grew else 0, 1)
        if not grew:
            refs.add(old, 0, -1)
        s.num_tokens, s.names = num_tokens, names

    def pop(self, session_id: str) -> Session:
        s = self.get(session_id)
        del self.sessions[session_id]
        self.refs.add(s.names, 0, -1)
        return s

    def held(self, name: bytes) -> bool:
        """Whether some session's context holds this block."""
        return self.refs.get(name) > 0

    def over_limits(self, keep: str | None = None) -> list[str]:
        """Sessions to expire now: idle past the timeout, then the least recently active beyond
        max_sessions (never `keep`, the one being used)."""
        out: list[str] = []
        cutoff = self.clock() - self.idle_timeout_s
        excess = len(self.sessions) - self.max_sessions
        if excess <= 0 and cutoff <= self.min_active:      # the common case: none can be idle past the timeout
            return out
        if excess <= 0 and self.sessions:        # the least recently active is fresh: its time bounds the rest
            first = next(iter(self.sessions))
            if first != keep and (last := self.sessions[first].last_active) >= cutoff:
                self.min_active = max(self.min_active, last)
                return out
        for sid, s in self.sessions.items():
            if sid == keep:
                continue
            if s.last_active < cutoff or len(out) < excess:
                out.append(sid)
            else:
                break
        return out

    def __len__(self) -> int:
        return len(self.sessions)

    def counts(self) -> dict[str, int]:
        parked = sum(s.state == "parked" for s in self.sessions.values())
        return {"sessions": len(self.sessions), "parked": parked, "active": len(self.sessions) - parked}
