"""Which replica serves each token of a replicated expert, decided per step from the step's own load.

When an expert has several physical slots (EPLB's redundant replicas), the dispatcher knows the
whole step's routing before it sends anything (rank 0 routes every token). So instead of a fixed
split (token t takes replica t mod count), each replicated expert's tokens go preferentially to
the replicas on the ranks that are least loaded in this step: the experts with one slot fix a base
load per rank, then each replicated expert, heaviest first, water-fills its tokens over the ranks
of its replicas (the lowest ranks are raised to a common level), and a second pass re-fills each
one against the others' final shares. This is the per-batch token redistribution that DeepSeek's
LPLB solves as a linear program and SGLang's LP dispatch approximates; here a greedy water-fill.
Replicas hold the same weights, so the choice changes where a token is computed, never its output.

`slot_quotas` is the rule on counts (tokens per physical slot); the dispatcher and the benchmark
both use it, so the imbalance measured is the one served.
"""
from __future__ import annotations

from collections.abc import Sequence

REFILL_PASSES = 2    # the first pass fills against a partial picture, the second against the others' final shares


def _waterfill(load: list[float], ranks: list[int], tokens: int) -> dict[int, int]:
    """Split `tokens` over the distinct `ranks` so the least-loaded ones rise to a common level
    (integer shares; ties and the remainder go to the lower load, then the lower rank)."""
    order = sorted(ranks, key=lambda r: (load[r], r))
    level, used = 0.0, 1
    for used in range(1, len(order) + 1):
        level = (tokens + sum(load[r] for r in order[:used])) / used
        if used == len(order) or level <= load[order[used]]:
            break
    share = {r: max(0, int(level - load[r])) for r in order[:used]}
    left = tokens - sum(share.values())
    while left > 0:                           # at most `used` rounds: each gets one more
        for r in sorted(order[:used], key=lambda r: (load[r] + share[r], r)):
            if left == 0:
                break
            share[r] += 1
            left -= 1
    return share


def slot_quotas(counts: Sequence[int], physical_to_logical: Sequence[int], num_ranks: int) -> list[int]:
    """Tokens each physical slot serves for one layer's step: `counts` tokens per logical expert,
    `physical_to_logical` the placement (rank r holds slots [r*S, (r+1)*S))."""
    num_slots = len(physical_to_logical)
    if num_ranks < 1 or num_slots % num_ranks:
        raise ValueError(f"{num_slots} slots do not split over {num_ranks} ranks")
    if any(c < 0 for c in counts):
        raise ValueError("token counts must be >= 0")
    per_rank = num_slots // num_ranks
    slots_of: list[list[int]] = [[] for _ in counts]
    for slot, e in enumerate(physical_to_logical):
        if not 0 <= e < len(counts):
            raise ValueError(f"slot {slot} holds expert {e}, outside 0..{len(counts) - 1}")
        slots_of[e].append(slot)
    quota = [0] * num_slots
    load = [0.0] * num_ranks
    replicated = []
    for e, slots in enumerate(slots_of):
        if not slots:
            raise ValueError(f"expert {e} has no slot in the placement")
        if len(slots) == 1 or counts[e] == 0:
            quota[slots[0]] = int(counts[e])
            load[slots[0] // per_rank] += counts[e]
        else:
            replicated.append(e)
    replicated.sort(key=lambda e: (-counts[e], e))
    share: dict[int, dict[int, int]] = {}
    for _ in range(REFILL_PASSES):
        for e in replicated:
            for r, n in share.pop(e, {}).items():
                load[r] -= n
            share[e] = _waterfill(load, sorted({s // per_rank for s in slots_of[e]}), int(counts[e]))
            for r, n in share[e].items():
                load[r] += n
    for e in replicated:
        for r, n in share[e].items():
            first_here = next(s for s in slots_of[e] if s // per_rank == r)
            quota[first_here] = n
    return quota


def rank_loads_chosen(counts: Sequence[int], physical_to_logical: Sequence[int], num_ranks: int) -> list[float]:
    """Tokens per rank for one layer's step when replicas are chosen by `slot_quotas`."""
    quota = slot_quotas(counts, physical_to_logical, num_ranks)
    per_rank = len(physical_to_logical) // num_ranks
    return [float(sum(quota[r * per_rank:(r + 1) * per_rank])) for r in range(num_ranks)]
