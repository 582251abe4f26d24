"""One run of `everybyte bench memory`: the planned sessions replayed against an in-process
LLMEngine in real time (turns arrive after their gaps while other sessions run; sessions are
parked during gaps and resumed ahead of their next turn when asked), with the prefill tokens
computed counted from the scheduler's output and the G1 byte ledger sampled over time."""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

from everybyte.bench.micro.memory_plan import Plan
from everybyte.traces.tokens import SessionPrompts

G1_KEYS = ("weights", "running_kv", "parked_kv", "cached_kv", "free", "waste", "total")


@dataclass
class _Live:
    plan: Plan
    prompts: SessionPrompts
    sid: str
    pos: int = 0
    next_at: float | None = None             # when the next turn arrives (time.time())
    resume_at: float | None = None
    rid: str | None = None
    arrival: float = 0.0
    outputs: dict = field(default_factory=dict)
    rec: dict | None = None                  # this turn's record
    ids: list[int] | None = None             # this turn's prompt


class Replay:
    def __init__(self, engine, plans: list[Plan], scaling, space, marker: str, trace_name: str, park: bool,
                 resume_lead_s: float, park_min_gap_s: float, sample_s: float):
        self.eng, self.park, self.lead, self.min_gap = engine, park, resume_lead_s, park_min_gap_s
        self.sample_s = sample_s
        self.live = [_Live(p, SessionPrompts(p.session, scaling, space, marker, trace_name), p.session.id)
                     for p in plans]
        self.turns, self.series, self.seen = [], [], []
        self.prefill = self.prestaged = 0
        self.busy = 0.0                      # seconds inside engine.step()
        self._last_sample = 0.0
        sched = engine.scheduler
        schedule = sched.schedule

        def counted():                       # prompt tokens computed, incl. recompute after preemption
            out = schedule()
            for seq, n in zip(out.seqs, out.num_new_tokens):
                decode = seq.num_computed_tokens + n == len(seq) and len(seq) > seq.num_prompt_tokens
                self.prefill += n - int(decode)
            return out
        sched.schedule = counted

    def g1(self) -> dict:
        s = self.eng.stats()
        if "memory" in s:
            return s["memory"]["g1"]
        from everybyte.kv.ledger import waste_bytes
        e, pool = self.eng, self.eng.pool
        bm = e.block_manager
        w = waste_bytes([q for q in e.scheduler.running if q.block_table], pool.block_size, pool.bytes_per_token)
        g1 = {"weights": e.weights_bytes, "running_kv": bm.num_used_blocks * pool.bytes_per_block - w,
              "parked_kv": 0, "cached_kv": 0, "free": bm.num_free_blocks * pool.bytes_per_block,
              "waste": w + max(pool.budget_bytes - pool.nbytes, 0)}
        return {**g1, "total": sum(g1.values())}

    def _sample(self, force: bool = False) -> None:
        now = time.time()
        if force or now - self._last_sample >= self.sample_s:
            g1 = self.g1()
            self.series.append({"t": round(now - self.t0, 3), **{k: int(g1[k]) for k in G1_KEYS}})
            self._last_sample = now

    def _submit(self, lv: _Live, now: float) -> None:
        from everybyte.engine.sampling_params import SamplingParams
        k = lv.plan.turns[lv.pos]
        ids = lv.prompts.prompt(k, lv.outputs)
        n_out = lv.plan.lengths[lv.pos][1]
        lv.rid, lv.arrival, lv.next_at = f"{lv.sid}-t{k}", lv.next_at, None
        self.eng.add_request(ids, SamplingParams(max_tokens=n_out, ignore_eos=True, temperature=0.0),
                             request_id=lv.rid, session_id=lv.sid)
        lcp = max((_common(ids, s) for s in self.seen), default=0)
        self.turns.append({"session": lv.sid, "turn": lv.pos, "prompt_tokens": len(ids), "new_tokens": len(ids) - lcp,
                           "arrival_s": round(lv.arrival - self.t0, 3), "submit_lag_s": round(now - lv.arrival, 3)})
        lv.rec, lv.ids = self.turns[-1], ids

    def _finish(self, lv: _Live, out, now: float) -> None:
        k = lv.plan.turns[lv.pos]
        lv.outputs[k] = list(out.token_ids)
        self.seen.append(lv.ids + lv.outputs[k])
        m = out.metrics
        lv.rec.update(ttft_s=m.first_token_time - lv.arrival, e2e_s=now - lv.arrival, output_tokens=len(out.token_ids),
                      cached_tokens=out.num_cached_tokens, preemptions=m.num_preemptions, t_end=now - self.t0)
        lv.rid, lv.pos = None, lv.pos + 1
        if lv.pos < len(lv.plan.turns):
            gap = lv.plan.gaps[lv.pos]
            lv.next_at = now + gap
            if self.park and gap >= self.min_gap:
                self.eng.park(lv.sid, expected_gap_s=gap)
                lv.resume_at = lv.next_at - min(self.lead, gap / 2)

    def run(self) -> dict:
        eng, self.t0 = self.eng, time.time()
        for lv in self.live:
            lv.next_at = self.t0
        by_rid, stalled = {}, 0
        self._sample(force=True)
        while any(lv.pos < len(lv.plan.turns) for lv in self.live):
            now = time.time()
            for lv in self.live:
                if lv.resume_at is not None and now >= lv.resume_at:
                    lv.resume_at = None
                    self.prestaged += eng.resume(lv.sid)
                if lv.rid is None and lv.next_at is not None and now >= lv.next_at:
                    self._submit(lv, now)
                    by_rid[lv.rid] = lv
            if eng.has_unfinished_requests():
                t_step = time.time()
                outs = eng.step()
                now = time.time()
                self.busy += now - t_step
                for out in outs:
                    if out.finished:
                        self._finish(by_rid.pop(out.request_id), out, now)
                self._sample()
                stalled = stalled + 1 if not outs and not eng.scheduler.running else 0
                if stalled > 1000:
                    raise RuntimeError(f"engine stalled: {len(eng.scheduler.waiting)} waiting, nothing running")
            else:
                wake = [t for lv in self.live for t in (lv.next_at, lv.resume_at) if t is not None]
                self._sample()
                time.sleep(max(0.0, min(min(wake, default=now) - time.time(), self.sample_s)))
        end = time.time()
        self._sample(force=True)
        return self._summary(end - self.t0)

    def _summary(self, wall_s: float) -> dict:
        stats = self.eng.stats()
        mem = stats.get("memory") or {}
        resumed = sorted(t["ttft_s"] for t in self.turns if t["turn"] > 0)
        out_tokens = sum(t["output_tokens"] for t in self.turns)
        cats = [k for k in G1_KEYS if k != "total"]
        return {"prefill_tokens_computed": self.prefill, "min_prefill_tokens": sum(t["new_tokens"] for t in self.turns),
                "ttft_resumed_p50_s": _pct(resumed, 50), "ttft_resumed_p90_s": _pct(resumed, 90),
                "output_tok_s": out_tokens / wall_s,
                "reuse_by_tier": dict((mem.get("prefill_tokens") or {}).get("reused") or {}),
                "ttft_first_turn_p50_s": _pct(sorted(t["ttft_s"] for t in self.turns if t["turn"] == 0), 50),
                "output_tokens": out_tokens, "wall_s": wall_s, "engine_busy_s": self.busy,
                "output_tok_s_busy": out_tokens / max(self.busy, 1e-9), "turns": len(self.turns),
                "preemptions": stats.get("num_preemptions"), "prestaged_blocks": self.prestaged,
                "engine_ledger_prefill_computed": (mem.get("prefill_tokens") or {}).get("computed"),
                "blocks": mem.get("blocks"), "kv_pool": stats.get("kv_pool"),
                "g1_ledger": {"samples": len(self.series),
                              "peak": {c: max(r[c] for r in self.series) for c in cats},
                              "mean": {c: round(statistics.fmean(r[c] for r in self.series)) for c in cats}}}


def _common(a: list[int], b: list[int]) -> int:
    return len(os.path.commonprefix([a, b]))


def _pct(v: list[float], p: float) -> float | None:
    if not v:
        return None
    i = (len(v) - 1) * p / 100
    lo = int(i)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (i - lo)
