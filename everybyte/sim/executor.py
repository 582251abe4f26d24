"""Simulated executors for EngineCore: a step advances the worker's virtual clock by what it
costs and yields deterministic placeholder tokens (the real tokens do not matter to scheduling;
output lengths come from max_tokens + ignore_eos). RecordedExecutor replays a real run's step
times and tokens instead (the decision-equivalence test)."""
from __future__ import annotations

from typing import Callable, Final, Protocol

from everybyte.engine.core import StepResult
from everybyte.engine.sequence import Sequence
from everybyte.kv.clock import VirtualClock

TOKEN_LOW: Final = 1000
TOKEN_SPAN: Final = 29000


def placeholder_token(position: int) -> int:
    """The token sampled at `position` (the sequence's length): the same for every request, so equal
    prompts stay equal with their outputs and keep sharing prefix blocks."""
    table = _BY_POSITION
    if position >= len(table):
        placeholder_tokens(position, 1)      # grows the table
    return table[position]


_TOKENS: Final = tuple(range(TOKEN_LOW, TOKEN_LOW + TOKEN_SPAN))     # one int object per value, shared
_BY_POSITION: Final[list[int]] = []                                 # placeholder_token(p) at index p


def placeholder_tokens(start: int, n: int) -> list[int]:
    """placeholder_token at positions start .. start + n - 1: a slice of a table by position, grown
    as longer contexts ask (the shared int objects: millions of simulated tokens allocate none)."""
    end = start + n
    table = _BY_POSITION
    if end > len(table):
        t = _TOKENS
        table.extend([t[(p * 2654435761) % TOKEN_SPAN] for p in range(len(table), max(end, 2 * len(table)))])
    return table[start:end]


class DecodePricing(Protocol):
    """What multi-step decode asks of a cost model (CostModel is one)."""

    def decode_run_seconds(self, num_seqs: int, attended: int, steps: int) -> list[float]: ...

    def count_decode(self, num_seqs: int, attended: int, steps: int) -> None: ...


class CostExecutor:
    def __init__(self, clock: VirtualClock, batch_seconds: Callable[[list[Sequence], list[int]], float],
                 token: Callable[[int], int] = placeholder_token, record_releases: bool = False,
                 decode: DecodePricing | None = None):
        """decode: prices decode steps ahead, so EngineCore can run several at once (engine/decode_run)."""
        self.clock, self.batch_seconds, self.token = clock, batch_seconds, token
        self.steps, self.busy_s, self.tokens = 0, 0.0, 0
        self.released: list[str] | None = [] if record_releases else None
        self.decode = decode

    # ---- multi-step decode (engine/decode_run.DecodeExecutor) ---------------------------------
    def decode_costs(self, seqs: list[Sequence], steps: int) -> list[float] | None:
        if self.decode is None:
            return None
        return self.decode.decode_run_seconds(len(seqs), sum(s.num_computed_tokens + 1 for s in seqs), steps)

    def decode_tokens(self, seq: Sequence, n: int) -> list[int]:
        start, token = len(seq.token_ids), self.token
        if token is placeholder_token:            # a slice of the table: a call per simulated token adds up
            return placeholder_tokens(start, n)
        return [token(p) for p in range(start, start + n)]

    def advance_decode(self, num_seqs: int, attended: int, costs: list[float]) -> None:
        if self.decode is not None:
            self.decode.count_decode(num_seqs, attended, len(costs))
        self.clock.advance_each(costs)    # step by step: the clock sums them as single steps do
        busy = self.busy_s
        for c in costs:
            busy += c
        self.busy_s = busy
        self.steps += len(costs)
        self.tokens += num_seqs * len(costs)

    def execute(self, seqs: list[Sequence], num_new_tokens: list[int]) -> StepResult:
        cost = self.batch_seconds(seqs, num_new_tokens)
        self.clock.advance(cost)
        self.steps += 1
        self.busy_s += cost
        rows, toks = [], []
        token, placeholder = self.token, self.token is placeholder_token
        for i, (s, n) in enumerate(zip(seqs, num_new_tokens)):
            if s.num_computed_tokens + n == len(s.token_ids):
                rows.append(i)
                # the module's own function is a direct call compiled; a stored callable is not
                toks.append(placeholder_token(len(s.token_ids)) if placeholder else token(len(s.token_ids)))
        self.tokens += sum(num_new_tokens)
        return StepResult(rows, toks, [None] * len(rows), cost)

    def release(self, request_id: str) -> None:
        if self.released is not None:
            self.released.append(request_id)


class RecordedExecutor:
    """Step k takes the k-th recorded duration; a request's i-th sampled token is the i-th token the
    real engine gave it. Raises if the simulated batch samples for a request the real one did not."""

    def __init__(self, clock: VirtualClock, step_seconds: list[float], tokens: dict[str, list[int]]):
        self.clock, self.step_seconds, self.tokens = clock, list(step_seconds), tokens
        self.steps = 0
        self.given: dict[str, int] = {}

    def execute(self, seqs: list[Sequence], num_new_tokens: list[int]) -> StepResult:
        if self.steps >= len(self.step_seconds):
            raise RuntimeError(f"the simulated engine took more steps than the real one ({len(self.step_seconds)})")
        cost = self.step_seconds[self.steps]
        self.steps += 1
        self.clock.advance(cost)
        rows, toks = [], []
        for i, (s, n) in enumerate(zip(seqs, num_new_tokens)):
            if s.num_computed_tokens + n == len(s.token_ids):
                k = self.given.get(s.request_id, 0)
                rows.append(i)
                toks.append(self.tokens[s.request_id][k])
                self.given[s.request_id] = k + 1
        return StepResult(rows, toks, [None] * len(rows), cost)

    def release(self, request_id: str) -> None:
        pass
