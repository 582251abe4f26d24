"""Agent sessions: which named blocks hold a session's context, and whether it is parked."""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Session:
    session_id: str
    state: str = "active"                      # active | parked
    num_tokens: int = 0                        # tokens of its latest context
    names: list[bytes] = field(default_factory=list)   # full blocks of that context, in order
    expected_return: float | None = None
    last_active: float = field(default_factory=time.time)


class SessionTable:
    def __init__(self):
        self.sessions: dict[str, Session] = {}

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.sessions

    def get(self, session_id: str) -> Session:
        try:
            return self.sessions[session_id]
        except KeyError:
            raise KeyError(f"unknown session {session_id!r}") from None

    def touch(self, session_id: str) -> Session:
        s = self.sessions.get(session_id)
        if s is None:
            s = self.sessions[session_id] = Session(session_id)
        s.state, s.expected_return, s.last_active = "active", None, time.time()
        return s

    def record_context(self, session_id: str, num_tokens: int, names: list[bytes]) -> None:
        s = self.sessions.get(session_id)
        if s is not None:
            s.num_tokens, s.names = num_tokens, list(names)

    def pop(self, session_id: str) -> Session:
        s = self.get(session_id)
        del self.sessions[session_id]
        return s

    def __len__(self) -> int:
        return len(self.sessions)

    def counts(self) -> dict[str, int]:
        parked = sum(s.state == "parked" for s in self.sessions.values())
        return {"sessions": len(self.sessions), "parked": parked, "active": len(self.sessions) - parked}
