"""A seeded synthetic agent workload in the same trace model as the recorded ones.

Every session starts with one system prompt shared by all sessions (global hash ids), then turns
whose input is the previous input + the previous output + an appended tool result; sizes are
lognormal around the given medians, gaps lognormal around `gap_s`. Sizes are at model scale
(the default scaling for this format divides nothing).
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, fields

from everybyte.traces.model import Session, Trace, Turn, link_session


@dataclass
class SyntheticSpec:
    sessions: int = 8
    turns: int = 6                  # mean turns per session (geometric, at least 1)
    system_tokens: int = 512        # shared by every session (rounded up to whole blocks)
    first_tokens: int = 256         # first user message, median
    append_tokens: int = 96         # tool result appended per turn, median
    output_tokens: int = 24         # median output
    gap_s: float = 5.0              # median gap between a response and the next turn
    sigma: float = 0.6              # lognormal spread of the sizes
    gap_sigma: float = 1.0
    arrival_s: float = 1.0          # mean time between session starts (exponential)
    block_size: int = 64
    seed: int = 0

    @classmethod
    def parse(cls, text: str) -> "SyntheticSpec":
        """'sessions=4,turns=3,seed=7' (any field; unknown keys are an error)."""
        spec, kinds = cls(), {f.name: f.type for f in fields(cls)}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key not in kinds:
                raise ValueError(f"synthetic trace option {part!r}: expected KEY=VALUE with KEY one of "
                                 f"{', '.join(kinds)}")
            is_float = kinds[key] in (float, "float")
            try:
                number = float(value) if is_float else int(value)
            except ValueError:
                number = math.nan
            if not number >= 0:                               # a negative, or nan (not a number)
                raise ValueError(f"synthetic trace option {part!r}: expected "
                                 f"{'a number' if is_float else 'a whole number'} >= 0")
            if math.isinf(number):
                raise ValueError(f"synthetic trace option {part!r}: expected a finite number")
            setattr(spec, key, number)
        if spec.sessions < 1 or spec.turns < 1 or spec.block_size < 1 or spec.output_tokens < 1:
            raise ValueError("synthetic trace: sessions, turns, block_size and output_tokens must be >= 1")
        return spec


def _lognormal(rng: random.Random, median: float, sigma: float, low: int = 1) -> int:
    return max(low, int(round(median * math.exp(rng.gauss(0.0, sigma))))) if median > 0 else 0


def generate(spec: SyntheticSpec) -> Trace:
    rng = random.Random(spec.seed)
    bs = spec.block_size
    sys_blocks = -(-spec.system_tokens // bs)
    next_id = sys_blocks + 1
    sessions, arrival = [], 0.0
    for s in range(spec.sessions):
        n_turns = 1
        while rng.random() > 1.0 / spec.turns:
            n_turns += 1
        turns, ids, t, n_in = [], list(range(1, sys_blocks + 1)), 0.0, sys_blocks * bs
        for k in range(n_turns):
            n_in += _lognormal(rng, spec.first_tokens if k == 0 else spec.append_tokens, spec.sigma)
            if k:
                n_in += turns[-1].output_tokens
            while len(ids) < n_in // bs:
                ids.append(next_id)
                next_id += 1
            gap = 0.0 if k == 0 else max(0.0, spec.gap_s * math.exp(rng.gauss(0.0, spec.gap_sigma)))
            t += gap
            turns.append(Turn(index=k, t=round(t, 3), input_tokens=n_in, hash_ids=list(ids), gap_s=round(gap, 3),
                              output_tokens=_lognormal(rng, spec.output_tokens, spec.sigma)))
            t += 1.0
        sessions.append(link_session(Session(id=f"syn{s}", turns=turns, block_size=bs, hash_scope="global",
                                             arrival_s=round(arrival, 3), source="synthetic")))
        arrival += rng.expovariate(1.0 / spec.arrival_s) if spec.arrival_s > 0 else 0.0
    return Trace(name=f"synthetic(seed={spec.seed})", format="synthetic", sessions=sessions,
                 files=[], params=asdict(spec))
