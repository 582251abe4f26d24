"""Multi-step decode: when every running sequence only decodes and nothing inside the core can
change the batch for k steps (no sequence finishes, no waiting one can be admitted, the pool has
a block for every block boundary crossed, no step starts at or after the caller's horizon), plan
those k steps at once and apply their bookkeeping later in one call, with exactly the effects of
k step() calls: the same tokens, per-token timestamps, block allocations, evictions and commits
in the same order, the same clock.

Only an executor that can price steps without running them (DecodeExecutor: the simulator's)
makes runs; a real model needs each step's token before the next, so it never does. The caller
owns what happens outside the core: it applies a planned run no later than the next outside
event (an arrival, a load finishing, a park) and drops the rest of it then (EngineCore.
plan_decode / advance_decode). Core observers see every step, so a core with observers never runs,
unless each says it ignores pure decode steps (an `every_step = False` attribute).
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

from everybyte.engine.sequence import Sequence

if TYPE_CHECKING:
    from everybyte.engine.core import EngineCore


class DecodeExecutor(Protocol):
    def decode_costs(self, seqs: list[Sequence], steps: int) -> list[float] | None:
        """Seconds of each of `steps` pure decode steps of this batch (each context one longer per
        step), changing nothing; None when it cannot say."""

    def decode_tokens(self, seq: Sequence, n: int) -> list[int]:
        """The tokens the next n decode steps sample for seq, changing nothing."""

    def advance_decode(self, num_seqs: int, attended: int, costs: list[float]) -> None:
        """Account for decode steps of num_seqs sequences (attended: context over the batch at the
        first) that took `costs`, moving the clock by each in turn as execute() would."""


@dataclass(eq=False)
class DecodeRun:
    seqs: list[Sequence]            # the batch, in the scheduler's running order
    lens: list[int]                 # each one's length when the run was planned
    costs: list[float]              # step j's seconds
    times: list[float]              # times[j]: step j starts; times[j + 1]: it ends (its tokens' time)
    done: int                       # steps applied so far

    def __init__(self, seqs: list[Sequence], lens: list[int], costs: list[float], times: list[float],
                 done: int = 0) -> None:                  # compiled (see scheduler.SchedulerOutput)
        self.seqs, self.lens, self.costs, self.times, self.done = seqs, lens, costs, times, done

    @property
    def steps(self) -> int:
        return len(self.costs)

    @property
    def end(self) -> float:
        return self.times[-1]

    def steps_before(self, t: float) -> int:
        """How many of its steps start before t."""
        return bisect_left(self.times, t, 0, self.steps)


def _allocations(seqs: list[Sequence], lens: list[int], tables: list[int], bs: int, k: int) -> int:
    """Fresh blocks k decode steps take: step j schedules each sequence at length lens + j."""
    return sum(max(0, -(-(n + k - 1) // bs) - t) for n, t in zip(lens, tables))


def plan(core: "EngineCore", until: float, max_steps: int) -> DecodeRun | None:
    """The next steps as a run (see the module), None when the batch may change at the next step.
    The core has checked that no request has a stop checker (stop strings need every token)."""
    ex = cast(DecodeExecutor, core.executor)
    sch = core.scheduler
    if (core.observers and any(getattr(o, "every_step", True) for o in core.observers)) \
            or not hasattr(ex, "decode_costs") or max_steps < 1:
        return None
    if sch.waiting and len(sch.running) + len(sch.loading) < sch.max_num_seqs:
        return None                          # a waiting request might be admitted
    seqs = list(sch.running)
    if not seqs or len(seqs) > sch.max_num_batched_tokens:
        return None
    k = max_steps
    for s in seqs:
        if s.num_uncomputed_tokens != 1 or s.num_computed_tokens < s.num_prompt_tokens:
            return None                      # still in prefill
        p = s.params
        k = min(k, p.max_tokens - s.num_completion_tokens - 1, core.max_model_len - len(s) - 1)
        if k > 0 and (p.stop_token_ids or (not p.ignore_eos and core.eos_token_ids)):
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else core.eos_token_ids)
            for j, tok in enumerate(ex.decode_tokens(s, k)):
                if tok in stops:
                    k = j
                    break
    if k < 1:
        return None
    bm, lens = core.block_manager, [len(s) for s in seqs]
    tables, free = [len(s.block_table) for s in seqs], bm.num_free_blocks
    if _allocations(seqs, lens, tables, bm.block_size, k) > free:
        lo, hi = 0, k                        # the most steps whose new blocks all fit: no preemption
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _allocations(seqs, lens, tables, bm.block_size, mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        k = lo
    if k < 1:
        return None
    costs = ex.decode_costs(seqs, k)
    if costs is None:
        return None
    t = core.clock.monotonic()
    times = [t]
    for c in costs:
        t += c
        times.append(t)
    k = bisect_left(times, until, 0, k)      # steps that start before the horizon
    if k < 1:
        return None
    return DecodeRun(seqs, lens, costs[:k], times[:k + 1])


def apply(core: "EngineCore", run: DecodeRun, m: int) -> None:
    """Apply the run's next m steps as m step() calls would have."""
    j0, j1 = run.done, min(run.done + m, run.steps)
    if j1 <= j0:
        return
    ex, bm, bs = cast(DecodeExecutor, core.executor), core.block_manager, core.block_manager.block_size
    seqs, lens = run.seqs, run.lens
    n = len(seqs)
    attended = sum(ln + j0 for ln in lens)   # context over the batch at step j0: computed + 1 each
    # may_append acts only at a sequence's first step here (a commit left by its last step) and
    # where its computed tokens reach a block boundary (a block to name, a block to take); in
    # (step, sequence) order, as the keys j * n + i sort
    keys: list[int] = []
    for i in range(n):
        keys.append(j0 * n + i)
        j = j0 + (-(lens[i] - 1 + j0)) % bs
        if j == j0:
            j += bs
        while j < j1:
            keys.append(j * n + i)
            j += bs
    keys.sort()
    clock_at = j0
    for key in keys:
        j, i = key // n, key % n
        if j > clock_at:
            ex.advance_decode(n, attended + n * (clock_at - j0), run.costs[clock_at:j])
            clock_at = j
        s = seqs[i]
        _extend(ex, s, lens[i] + j)
        s.num_computed_tokens = lens[i] - 1 + j
        bm.may_append(s)
    ex.advance_decode(n, attended + n * (clock_at - j0), run.costs[clock_at:j1])
    times = run.times[j0 + 1:j1 + 1]
    for s, ln in zip(seqs, lens):
        _extend(ex, s, ln + j1)
        s.num_computed_tokens = ln - 1 + j1
        s.metrics.token_times.extend(times)
        if s.logprobs is not None:
            s.logprobs.extend([None] * (j1 - j0))    # type: ignore[list-item]  # no logprobs were computed
    run.done = j1


def _extend(ex: DecodeExecutor, s: Sequence, length: int) -> None:
    if len(s.token_ids) < length:
        s.token_ids.extend(ex.decode_tokens(s, length - len(s.token_ids)))
