"""What a simulated run reports: per-turn latencies and the workers' own counters (the same
ledger and scheduler counters the real engine reports), summed over workers."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class TurnRecord:                        # one per simulated request: slots keep 6M of them small
    session: str
    turn: int
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    arrival: float
    first_token: float
    finished: float
    preemptions: int
    worker: int


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def _add(into: dict, d: dict) -> None:
    for k, v in d.items():
        if isinstance(v, dict):
            _add(into.setdefault(k, {}), v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            into[k] = into.get(k, 0) + v


def summarize(turns: list[TurnRecord], workers: list, wall_s: float, events: int, skipped: dict,
              rejected: list[str], stuck: int, weights_bytes: int = 0) -> dict[str, Any]:
    ttft = [t.first_token - t.arrival for t in turns]
    tpot = [(t.finished - t.first_token) / (t.output_tokens - 1) for t in turns if t.output_tokens > 1]
    out_tokens = sum(t.output_tokens for t in turns)
    t0 = min((t.arrival for t in turns), default=0.0)
    t1 = max((t.finished for t in turns), default=0.0)
    span = max(t1 - t0, 1e-12)
    g1: dict = {}
    prefill: dict = {}
    blocks: dict = {}
    preemptions = steps = 0
    busy = 0.0
    for w in workers:
        mem = w.memory.stats(weights_bytes)
        _add(g1, mem["g1"])
        _add(prefill, {k: v for k, v in mem["prefill_tokens"].items() if k != "reuse_fraction"})
        _add(blocks, mem["blocks"])
        preemptions += w.core.scheduler.num_preemptions
        steps += getattr(w.executor, "steps", 0)
        busy += getattr(w.executor, "busy_s", 0.0)
    computed, reused = prefill.get("computed", 0), prefill.get("reused_total", 0)
    return {
        "requests": len(turns), "sessions": len({t.session for t in turns}),
        "simulated_seconds": span, "output_tokens": out_tokens,
        "ttft_s": {"p50": _pct(ttft, 0.5), "p90": _pct(ttft, 0.9), "mean": sum(ttft) / len(ttft) if ttft else None},
        "tpot_s": {"p50": _pct(tpot, 0.5), "p90": _pct(tpot, 0.9), "mean": sum(tpot) / len(tpot) if tpot else None},
        "output_tok_s": out_tokens / span,
        "prefill_tokens": {"computed": computed, "reused": reused, "by_tier": prefill.get("reused", {}),
                           "reuse_fraction": reused / max(computed + reused, 1)},
        "preemptions": preemptions, "steps": steps, "worker_busy_fraction": busy / (span * max(len(workers), 1)),
        "g1_ledger_bytes": g1, "blocks": blocks,
        "skipped_turns": skipped, "rejected": rejected[:5], "unfinished_requests": stuck,
        "wall_s": wall_s, "events": events,
        "prefix_cache": type(workers[0].memory.cache).__name__ if workers else None,   # compiled: NativePrefixCache
        "sim_requests_per_wall_s": len(turns) / wall_s if wall_s > 0 else None,
    }
