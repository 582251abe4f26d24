"""Where the simulator sends a turn when no fleet router is configured: route(request) -> worker index."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from everybyte.sim.runner import SimRequest


class RoundRobin:
    def __init__(self, n: int):
        self.n, self.i = n, -1

    def __call__(self, req: "SimRequest") -> int:
        self.i = (self.i + 1) % self.n
        return self.i


class SessionSticky:
    """A session's turns go where its first turn went (round-robin over first turns)."""

    def __init__(self, n: int):
        self.first = RoundRobin(n)
        self.where: dict[str, int] = {}

    def __call__(self, req: "SimRequest") -> int:
        w = self.where.get(req.base_session)
        if w is None:
            w = self.where[req.base_session] = self.first(req)
        return w


ROUTES = {"sticky": SessionSticky, "round-robin": RoundRobin}
