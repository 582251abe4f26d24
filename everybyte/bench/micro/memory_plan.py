"""The plan of `everybyte bench memory`: which trace sessions it replays, which of their turns,
how long every prompt and output is and the compressed tool gap before each turn."""
from __future__ import annotations

from dataclasses import dataclass

from everybyte.traces.model import Session
from everybyte.traces.scaling import Scaling
from everybyte.traces.tokens import SessionPrompts, TokenSpace

PROG = "everybyte bench memory"


@dataclass
class Plan:
    session: Session
    turns: list[int]                         # indexes into session.turns (main agent, a chain)
    lengths: list[tuple[int, int]]           # (prompt, output) tokens per turn
    gaps: list[float]                        # compressed gap before each turn (0 for the first)


def plan_sessions(trace, scaling: Scaling, space: TokenSpace, marker: str, n: int, turns: int,
                  min_context: int) -> list[Plan]:
    """The first n sessions whose first `turns` main-agent turns form a chain that fits max_context
    and whose last turn (prompt + output) has at least min_context tokens."""
    plans = []
    for s in trace.sessions:
        ks = [k for k, t in enumerate(s.turns) if t.agent == 0][:turns]
        if len(ks) < turns or any(s.turns[k].parent not in ks[:i] for i, k in enumerate(ks) if i):
            continue
        sp, outs, lengths = SessionPrompts(s, scaling, space, marker, trace.name), {}, []
        for k in ks:
            ids, n_out = sp.prompt(k, outs), scaling.output_len(s.turns[k])
            outs[k] = sp.filler(k, n_out)
            lengths.append((len(ids), n_out))
        if sum(lengths[-1]) > scaling.max_context or sum(lengths[-1]) < min_context:
            continue
        plans.append(Plan(s, ks, lengths, [0.0] + [scaling.gap(s.turns[k]) for k in ks[1:]]))
        if len(plans) == n:
            return plans
    raise SystemExit(f"{PROG}: only {len(plans)} sessions of {trace.name} have {turns} chained main-agent "
                     f"turns with a final context in [{min_context}, {scaling.max_context}] tokens; lower "
                     f"--sessions/--turns/--min-context or change --token-scale")
