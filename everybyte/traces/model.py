"""Trace model: a trace is sessions of turns; a turn's input is given by chained hash blocks.

Token counts, times and hash ids are kept as recorded (unscaled); scaling.py and tokens.py turn
them into what is sent. A turn that shares its whole hash prefix with an earlier turn of the same
session *extends* it: at replay its prompt is that turn's prompt + the tokens the server generated
for it + the new input. Sub-agent requests form their own chains (child agents) in the session.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Turn:
    index: int                      # position in the session (recorded order)
    t: float                        # recorded start, seconds since the session started
    input_tokens: int               # recorded input length (the whole context)
    output_tokens: int              # recorded output length
    hash_ids: list[int] = field(default_factory=list)   # one id per block of the input, chained
    gap_s: float = 0.0              # recorded gap before this turn (tool call / think time)
    agent: int = 0                  # 0: the main agent; k > 0: the k-th sub-agent chain
    parent: int | None = None       # index of the turn whose context this one builds on
    shared_blocks: int = 0          # leading hash blocks shared with `parent`
    extends: bool = False           # shares all of parent's blocks: prompt = parent + its output + new
    stop: str | None = None
    api_time: float | None = None
    ttft: float | None = None


@dataclass(slots=True)
class Session:
    id: str
    turns: list[Turn]
    block_size: int = 64
    hash_scope: str = "local"       # "local": ids mean something inside this session only;
                                    # "global": equal ids are equal content across sessions
    arrival_s: float = 0.0          # recorded start of the session (for open-loop arrivals)
    source: str = ""                # file it came from

    @property
    def num_agents(self) -> int:
        return 1 + max((t.agent for t in self.turns), default=0)


@dataclass
class Trace:
    name: str
    format: str                     # agent_sessions | mooncake | azure | synthetic
    sessions: list[Session]
    files: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)    # "file:line: why" for each skipped record
    params: dict = field(default_factory=dict)          # generator parameters (synthetic)

    @property
    def num_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def describe(self) -> dict:
        turns = [t for s in self.sessions for t in s.turns]
        ins = sorted(t.input_tokens for t in turns) or [0]
        outs = sorted(t.output_tokens for t in turns) or [0]
        gaps = sorted(t.gap_s for t in turns if t.index > 0) or [0.0]
        med = lambda v: v[len(v) // 2]
        return {"name": self.name, "format": self.format, "files": len(self.files),
                "sessions": len(self.sessions), "turns": len(turns),
                "sub_agent_turns": sum(1 for t in turns if t.agent > 0),
                "turns_extending_a_previous_turn": sum(1 for t in turns if t.extends),
                "recorded_input_tokens_p50": med(ins), "recorded_input_tokens_max": ins[-1],
                "recorded_output_tokens_p50": med(outs), "recorded_gap_s_p50": med(gaps),
                "skipped_records": len(self.skipped), **({"params": self.params} if self.params else {})}


def link_session(session: Session) -> Session:
    """Find each turn's parent: the latest earlier turn with the longest common hash prefix.

    Chained ids make the common prefix of two turns the largest m with equal ids at position m-1,
    so one map id -> (position, latest turn) answers it with a binary search.
    """
    seen: dict[int, tuple[int, int]] = {}      # hash id -> (position, latest turn index holding it)
    for k, turn in enumerate(session.turns):
        h = turn.hash_ids
        lo, hi, best = 0, len(h), None          # largest m in [0, len(h)] with h[m-1] seen at m-1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            hit = seen.get(h[mid - 1])
            if hit is not None and hit[0] == mid - 1:
                lo, best = mid, hit[1]
            else:
                hi = mid - 1
        if best is not None and lo > 0:
            # the latest turn holding h[lo-1] at that position shares exactly lo blocks or more;
            # prefer one whose whole block list is that prefix (a pure extension)
            for j in range(k - 1, -1, -1):
                prev = session.turns[j].hash_ids
                if len(prev) == lo and prev[lo - 1] == h[lo - 1]:
                    best = j
                    break
            turn.parent, turn.shared_blocks = best, lo
            turn.extends = len(session.turns[best].hash_ids) == lo
        for pos, hid in enumerate(h):
            seen[hid] = (pos, k)
    return session


def assign_agents(session: Session, is_sub: list[bool]) -> None:
    """Main-agent turns are agent 0; a sub-agent turn continues the chain of the sub-agent turn it
    extends, else it starts a new chain."""
    chains = 0
    for turn, sub in zip(session.turns, is_sub):
        if not sub:
            turn.agent = 0
            continue
        p = session.turns[turn.parent] if turn.parent is not None else None
        if p is not None and turn.extends and p.agent > 0:
            turn.agent = p.agent
        else:
            chains += 1
            turn.agent = chains
