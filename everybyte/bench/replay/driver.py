"""The replay driver: session lanes (or open-loop arrivals) sending each session's turns in order.

A lane takes the next session, sends its turns one after another (waiting the scaled gap before
each), and builds every prompt from the previous prompt + the ids the server generated + the new
input. The run stops at --max-requests sent or --duration seconds; what was skipped or failed
is counted, never dropped.
"""
from __future__ import annotations

import asyncio
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass

from everybyte.bench.replay.backend import GenRequest, GenResult
from everybyte.bench.replay.clock import GapClock
from everybyte.bench.replay.joiner import Joiner
from everybyte.bench.replay.metrics import turn_record
from everybyte.traces.model import Session, Trace
from everybyte.traces.scaling import Scaling
from everybyte.traces.tokens import SessionPrompts, TokenSpace


@dataclass
class ReplayConfig:
    concurrency: int = 4              # session lanes (open loop: most sessions at once, 0 = no limit)
    mode: str = "lanes"               # lanes | open
    rate: float | None = None         # open loop: sessions/s (Poisson); None: recorded arrivals
    max_requests: int = 48            # turns sent, warm-up included
    duration_s: float = 600.0
    warmup: int = 1                   # first turns sent, excluded from the results
    park: bool = False                # call /v1/sessions/{id}/park|resume around gaps
    park_min_gap_s: float = 0.5
    idle_skip_s: float | None = 10.0
    recycle: bool = False             # replay sessions again (new marker) when the trace runs out
    metrics_interval_s: float = 1.0
    drain_s: float = 30.0             # after the wall-time bound, in-flight turns get this long
    progress: bool = True
    seed: int = 0


class Replay:
    def __init__(self, trace: Trace, backend, scaling: Scaling, cfg: ReplayConfig, space: TokenSpace,
                 run_marker: str):
        self.trace, self.backend, self.scaling, self.cfg = trace, backend, scaling, cfg
        self.space, self.run_marker = space, run_marker
        self.joiner = Joiner(backend)
        self.turns: list[dict] = []
        self.samples: list[dict] = []
        self.skipped: Counter = Counter()
        self.park_results: Counter = Counter()
        self.park_errors: dict[str, str] = {}
        self.sent = 0
        self.stopped_by: str | None = None

    # ---- the run ------------------------------------------------------------------------------
    async def run(self) -> dict:
        cfg = self.cfg
        self.clock = GapClock(cfg.idle_skip_s)
        self.clock.start()
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + cfg.duration_s
        self.bar = _bar(min(cfg.max_requests, self._plannable()), cfg.progress)
        sampler = asyncio.ensure_future(self._sample_loop())
        self.queue = self._sessions()
        self.drained = False
        if cfg.mode == "open":
            main = asyncio.ensure_future(self._open_loop())
        else:
            main = asyncio.gather(*(self._lane(i) for i in range(max(1, cfg.concurrency))))
        watchdog = asyncio.ensure_future(self._watch_deadline(main))
        try:
            try:
                await main
            except asyncio.CancelledError:
                if not self.drained:
                    raise
        finally:
            self.stopped_by = self.stopped_by or "trace_end"
            watchdog.cancel()
            sampler.cancel()
            await self.clock.close()
            self.bar.close()
        return {"t_start": 0.0, "t_end": time.perf_counter() - self.t0, "stopped_by": self.stopped_by,
                "requests_sent": self.sent, "skipped_turns": dict(self.skipped),
                "idle_skipped_s": round(self.clock.skipped_s, 3), "idle_skips": self.clock.skips,
                "park": {**self.park_results, **self.park_errors}, "output_join": self.joiner.describe()}

    def _plannable(self) -> int:
        return 10 ** 9 if self.cfg.recycle else self.trace.num_turns

    def _sessions(self):
        instance = 0
        while True:
            for s in self.trace.sessions:
                yield s, instance
            if not self.cfg.recycle:
                return
            instance += 1

    def _stop(self, why: str) -> None:
        if self.stopped_by is None:
            self.stopped_by = why
        self.clock.stop()

    async def _watch_deadline(self, main: asyncio.Future) -> None:
        await asyncio.sleep(max(0.0, self.deadline - time.perf_counter()))
        self._stop("duration")
        await asyncio.sleep(self.cfg.drain_s)
        self.drained = True
        main.cancel()

    async def _sample_loop(self) -> None:
        while True:
            s = await self.backend.sample()
            if s is not None:
                s["t"] = round(time.perf_counter() - self.t0, 3)
                self.samples.append(s)
            await asyncio.sleep(self.cfg.metrics_interval_s)

    async def _lane(self, lane: int) -> None:
        while not self.clock.stopped:
            nxt = next(self.queue, None)
            if nxt is None:
                return
            await self._session(*nxt, lane=lane)

    async def _open_loop(self) -> None:
        cfg = self.cfg
        rng = random.Random(cfg.seed)
        limit = asyncio.Semaphore(cfg.concurrency) if cfg.concurrency > 0 else None
        start, t, tasks = self.clock.now(), 0.0, []

        async def one(session, instance, lane):
            if limit is None:
                return await self._session(session, instance, lane)
            async with limit:
                return await self._session(session, instance, lane)

        for lane, (session, instance) in enumerate(self.queue):
            t = t + rng.expovariate(cfg.rate) if cfg.rate else session.arrival_s * self.scaling.arrival_scale
            if not await self.clock.sleep_until(start + t):
                break
            tasks.append(asyncio.ensure_future(one(session, instance, lane)))
        await asyncio.gather(*tasks)

    # ---- one session --------------------------------------------------------------------------
    async def _session(self, session: Session, instance: int, lane: int) -> None:
        prompts = SessionPrompts(session, self.scaling, self.space, self.run_marker, self.trace.name, instance)
        last_use = {t.parent: k for k, t in enumerate(session.turns) if t.parent is not None}
        outputs: dict[int, list[int]] = {}
        texts: dict[int, str] = {}
        base_sid = session.id if instance == 0 else f"{session.id}#{instance}"
        parked: str | None = None
        for k, turn in enumerate(session.turns):
            left = len(session.turns) - k
            sid = base_sid if turn.agent == 0 else f"{base_sid}.sub{turn.agent}"
            gap = self.scaling.gap(turn) if k else 0.0
            if k and gap > 0:
                prev_sid = parked
                if not await self.clock.sleep(gap):
                    self.skipped["stopped_by_bound"] += left
                    return
                if prev_sid:
                    await self._session_call(prev_sid, "resume")
            if self.clock.stopped:
                self.skipped["stopped_by_bound"] += left
                return
            ids = prompts.prompt(k, outputs)
            n_out = self.scaling.output_len(turn)
            if len(ids) + n_out > self.scaling.max_context:
                self.skipped["over_max_context"] += left
                return
            if self.sent >= self.cfg.max_requests:
                self.skipped["stopped_by_bound"] += left
                self._stop("max_requests")
                return
            no = self.sent
            self.sent += 1
            text = prompts.text(k, texts, {j: len(v) for j, v in outputs.items()}) \
                if self.backend.prompt_mode == "text" else None
            req = GenRequest(sid, f"{base_sid}-t{k}", None if text is not None else ids, text, n_out)
            self.clock.in_flight += 1
            t_send = time.perf_counter()
            try:
                res = await self.backend.generate(req)
            except asyncio.CancelledError:
                res = GenResult(t_send=t_send).fail("cancelled: still running when the drain after the "
                                                    "wall-time bound ran out", time.perf_counter())
                self.turns.append(turn_record(res, self.t0, session=session.id, instance=instance,
                                              agent=turn.agent, turn=k, lane=lane, request_no=no,
                                              warmup=no < self.cfg.warmup, max_tokens=n_out, prompt_len=len(ids)))
                raise
            finally:
                self.clock.in_flight -= 1
            join, round_trip = None, None
            if res.ok:
                outputs[k], join, round_trip = await self.joiner.output_ids(res, prompts, k)
                texts[k] = res.output_text
            rec = turn_record(res, self.t0, session=session.id, instance=instance, agent=turn.agent, turn=k,
                              lane=lane, request_no=no, warmup=no < self.cfg.warmup, max_tokens=n_out,
                              prompt_len=len(ids), recorded_input_tokens=turn.input_tokens,
                              recorded_output_tokens=turn.output_tokens, gap_s=round(gap, 3), join=join,
                              round_trip=round_trip, parked_before=parked is not None and k > 0)
            self.turns.append(rec)
            self.bar.update(1)
            if not res.ok:
                self.bar.set_postfix(errors=sum(1 for t in self.turns if not t["ok"]))
                self.skipped["after_error_in_session"] += left - 1
                return
            for j in [j for j, last in last_use.items() if last == k] + ([] if k in last_use else [k]):
                prompts.forget(j)
            parked = None
            nxt = session.turns[k + 1] if k + 1 < len(session.turns) else None
            if self.cfg.park and nxt is not None and self.scaling.gap(nxt) >= self.cfg.park_min_gap_s:
                if await self._session_call(sid, "park", {"expected_gap_s": round(self.scaling.gap(nxt), 3)}) == "ok":
                    parked = sid

    async def _session_call(self, sid: str, action: str, body: dict | None = None) -> str:
        r = await self.backend.session_call(sid, action, body)
        self.park_results[f"{action}:{r.split(':')[0]}"] += 1
        if r.startswith("error") and f"first_{action}_error" not in self.park_errors:
            self.park_errors[f"first_{action}_error"] = r[:300]
        return r


def _bar(total: int, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc="agentic replay", unit="turn", file=sys.stderr, disable=not enabled,
                dynamic_ncols=True, leave=False)
