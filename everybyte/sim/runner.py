"""The event-driven replay: agent sessions from a trace (the importers, scaling and token rules of
`bench agentic`) on N simulated workers that share one virtual timeline.

Events are (time, kind): a session's turn arriving (after its scaled tool gap; the session was
parked during the gap and is resumed now, as the bench does with --park) and a worker's next
step. Each worker steps on its own virtual clock, which never runs ahead of the event being
handled; when a worker has nothing to compute until a load or an arrival, no step is taken and
time jumps to that event. route(request) -> worker index chooses the worker for each turn.

Multi-step decode (RunConfig.multi_step): after a step, a worker whose batch cannot change until
something outside it happens plans its next decode steps as one run (EngineCore.plan_decode)
and is next woken at the run's end. An arrival (it routes, adds a request, resumes a parked
session) or a `later` call (a disaggregated turn's decode starting) is an outside event: before
one is handled, every worker applies the steps of its run that start before it, and the workers
it touches drop the rest and step again where they would have. At equal times arrivals go before
calls, calls before steps, and steps in worker order, so both ways make the same decisions at the
same times.
"""
from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Final, Iterator, cast

from everybyte.engine.decode_run import DecodeRun
from everybyte.engine.outputs import RequestOutput
from everybyte.engine.sampling_params import SamplingParams
from everybyte.engine.sequence import Sequence
from everybyte.sim.event_queue import Events, new_event_queue
from everybyte.sim.metrics import TurnRecord, summarize
from everybyte.sim.routes import SessionSticky
from everybyte.sim.worker import SimWorker
from everybyte.traces.model import Session, Trace
from everybyte.traces.scaling import Scaling
from everybyte.traces.tokens import SessionPrompts, TokenSpace

# at equal times: arrivals, then calls, then steps (Final: constants mypyc inlines, not global lookups)
ARRIVE: Final = 0
CALL: Final = 1
STEP: Final = 2
LOOP_GC_THRESHOLDS = (200_000, 100, 1000)
INF: Final = float("inf")


@contextmanager
def rare_collections() -> Iterator[None]:
    """The event loop allocates many short-lived objects while millions of long-lived ones (the
    trace, the caches' state) stay: with the default thresholds the cycle collector rescans those
    often (19% of the loop at 20,000 sessions). Collections are rarer, not off, and reset after."""
    old = gc.get_threshold()
    gc.set_threshold(*LOOP_GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*old)


def _apply_before(w: SimWorker, run: DecodeRun, t: float) -> None:
    """The run's steps that start before t happen now (none when its next one starts at t or later)."""
    if run.times[run.done] < t:
        w.core.advance_decode(run, run.steps_before(t) - run.done)


@dataclass
class SimRequest:
    session_id: str          # the agent (or sub-agent) session the turn belongs to
    base_session: str        # the trace session
    turn: int
    prompt: list[int]
    max_tokens: int
    arrival: float

    def __init__(self, session_id: str, base_session: str, turn: int, prompt: list[int], max_tokens: int,
                 arrival: float) -> None:                 # compiled (see engine.scheduler.SchedulerOutput)
        self.session_id, self.base_session, self.turn = session_id, base_session, turn
        self.prompt, self.max_tokens, self.arrival = prompt, max_tokens, arrival

    @property
    def request_id(self) -> str:
        return f"{self.base_session}-t{self.turn}"


@dataclass
class SessionState:
    session: Session
    prompts: SessionPrompts
    base: str
    next_turn: int = 0
    outputs: dict[int, list[int]] = field(default_factory=dict)
    last_use: dict[int, int] = field(default_factory=dict)
    parked: tuple[str, int] | None = None        # (session id, worker) parked during the gap


@dataclass
class RunConfig:
    park: bool = True
    park_min_gap_s: float = 0.5
    max_requests: int | None = None
    rate: float | None = None                  # sessions/s; None: the recorded arrivals x arrival_scale
    run_marker: str = "sim"
    multi_step: bool = True                    # jump over decode steps that cannot change the batch


class Runner:
    def __init__(self, trace: Trace, scaling: Scaling, space: TokenSpace, workers: list[SimWorker],
                 cfg: RunConfig, route: Callable[[SimRequest], int] | None = None, weights_bytes: int = 0,
                 dispatch: Callable[["Runner", SimRequest, Sequence, SessionState], bool] | None = None,
                 isolated: bool = False) -> None:
        """dispatch(runner, request, seq, state): a hook that may take a turn instead of route
        (True), e.g. disaggregated prefill (sim/fleet_disagg), submitting it later itself.
        isolated: no worker's state is read outside its own events (a route that reads no worker,
        no disaggregation, no tier or link shared between workers; sim/fleet_build.Fleet.isolated),
        so an arrival catches up only the runs of the workers it touches."""
        self.trace, self.scaling, self.space, self.workers, self.cfg = trace, scaling, space, workers, cfg
        self.route = route or SessionSticky(len(workers))
        self.dispatch = dispatch
        self.isolated = isolated
        self.side: dict[str, Callable[[RequestOutput, SimWorker], None]] = {}       # request id -> what to do when a non-turn request finishes
        self.weights_bytes = weights_bytes
        self.events: Events = new_event_queue()              # what, by (time, kind, tie, n)
        self.n_events = 0
        self.now = 0.0
        self.sent = 0
        self.turns: list[TurnRecord] = []
        self.skipped: dict[str, int] = {}
        self.rejected: list[str] = []
        self.live: dict[str, tuple[SessionState, int, int, int]] = {}  # request id -> (state, turn, worker, prompt tokens)
        self.step_event: dict[int, int] = {}                 # worker index -> its one live step event
        self.runs: dict[int, tuple[SimWorker, DecodeRun]] = {}   # worker index -> its planned decode run
        self.firsts: list[tuple[float, int]] = []            # (first arrival, session index), in order
        self.next_first = 0
        self.params: dict[int, SamplingParams] = {}

    # ---- events ---------------------------------------------------------------------------------
    def _push(self, t: float, kind: int, what: object, tie: int | None = None) -> int:
        self.n_events += 1
        self.events.push(t, kind, self.n_events if tie is None else tie, self.n_events, what)
        return self.n_events

    def _wake(self, w: SimWorker, t: float, replace: bool = False) -> None:
        if replace or not w.scheduled:
            w.scheduled = True
            self.step_event[w.index] = self._push(max(t, w.clock.now), STEP, w, w.index)

    def _catch_up(self, t: float) -> None:
        """Every planned run's steps that start before t happen now (an arrival at t is next)."""
        for w, run in self.runs.values():
            _apply_before(w, run, t)

    def _stop_run(self, w: SimWorker) -> None:
        """Something outside changes the worker now: its run's steps that start before now happen
        (when _catch_up has not applied them), the rest is dropped; it steps next where it would
        have (its clock: the end of the last step applied)."""
        planned = self.runs.pop(w.index, None)
        if planned is not None:
            _apply_before(w, planned[1], self.now)
            self._wake(w, w.clock.now, replace=True)

    def run(self) -> dict[str, Any]:
        # sessions start in arrival order; only the next one's first turn waits in the queue and a
        # session's state is made when that turn arrives, so the queue and the states stay as
        # small as the live sessions (1M sessions). Its tie, session index + 1, and the counter
        # starting past it keep every order of pushing them all up front.
        rate, scale = self.cfg.rate, self.scaling.arrival_scale
        self.firsts = sorted(((i / rate if rate else s.arrival_s * scale), i) for i, s in enumerate(self.trace.sessions))
        self.n_events = len(self.firsts)
        self._push_next_session()
        with rare_collections():
            wall, cpu = self._loop()
        stuck = sum(len(w.core.requests) for w in self.workers)
        out = summarize(self.turns, self.workers, wall, self.n_events, self.skipped, self.rejected, stuck,
                        self.weights_bytes)
        out["cpu_s"] = cpu                 # the event loop's processor time: steadier than wall on a shared host
        return out

    def _loop(self) -> tuple[float, float]:
        """Handle events until none is left; its wall and processor seconds."""
        wall0, cpu0 = time.perf_counter(), time.process_time()
        events = self.events
        while len(events):
            t, kind, n, what = events.pop()
            self.now = t
            if kind == STEP:
                w = cast(SimWorker, what)                           # a native read of w.index below
                if self.step_event.get(w.index) == n:
                    self._step(w)
                continue
            if self.runs and not (kind == ARRIVE and self.isolated):   # an outside event: runs catch up first
                self._catch_up(t)
            if kind == ARRIVE:
                if isinstance(what, int):                            # a session's first turn
                    what = self._start_session(what)
                self._arrive(what)                                  # type: ignore[arg-type]
            else:
                what()                                              # type: ignore[operator]
        return time.perf_counter() - wall0, time.process_time() - cpu0

    # ---- a turn arrives ---------------------------------------------------------------------------
    def _push_next_session(self) -> None:
        if self.next_first < len(self.firsts):
            t, i = self.firsts[self.next_first]
            self.next_first += 1
            self.events.push(t, ARRIVE, i + 1, i + 1, i)

    def _start_session(self, i: int) -> SessionState:
        s = self.trace.sessions[i]
        st = SessionState(s, SessionPrompts(s, self.scaling, self.space, self.cfg.run_marker, self.trace.name), s.id)
        st.last_use = {t.parent: k for k, t in enumerate(s.turns) if t.parent is not None}
        self._push_next_session()
        return st

    def _skip(self, why: str, n: int) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + n

    def _arrive(self, st: SessionState) -> None:
        s, k = st.session, st.next_turn
        left = len(s.turns) - k
        if self.cfg.max_requests is not None and self.sent >= self.cfg.max_requests:
            self._skip("stopped_by_bound", left)
            return
        turn = s.turns[k]
        sid = st.base if turn.agent == 0 else f"{st.base}.sub{turn.agent}"
        if st.parked is not None:
            psid, pw = st.parked
            st.parked = None
            self._stop_run(self.workers[pw])
            self.workers[pw].core.resume(psid)
        last_child = turn.parent is not None and st.last_use.get(turn.parent) == k
        ids = st.prompts.prompt(k, st.outputs, last_child)
        n_out = self.scaling.output_len(turn)
        if len(ids) + n_out > self.scaling.max_context:
            self._skip("over_max_context", left)
            return
        req = SimRequest(sid, st.base, k, ids, n_out, self.now)
        params = self.params.get(n_out)
        if params is None:               # one per output length: the engine never changes a request's
            params = self.params[n_out] = SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True)
        seq = Sequence(ids, params, req.request_id, None, arrival_time=self.now, adopt=True)   # it appends the output
        seq.session_id = sid
        if self.dispatch is not None and self.dispatch(self, req, seq, st):
            return
        self.submit(seq, self.route(req), st)

    def _on(self, wi: int) -> SimWorker:
        w = self.workers[wi]
        self._stop_run(w)
        if w.clock.now < self.now:
            w.clock.advance(self.now - w.clock.now)
        return w

    def submit(self, seq: Sequence, wi: int, st: SessionState) -> bool:
        """Add a turn's request to worker wi now; False (counted as rejected) when the engine refuses it."""
        w = self._on(wi)
        try:
            w.core.add(seq)
        except ValueError as e:
            self.rejected.append(f"{seq.request_id}: {e}")
            self._skip("rejected", len(st.session.turns) - st.next_turn)
            if (forget := getattr(self.route, "forget", None)) is not None:
                forget(seq.request_id)                  # a router that counted it in flight
            return False
        self.sent += 1
        self.live[seq.request_id] = (st, st.next_turn, wi, seq.num_prompt_tokens)
        self._wake(w, self.now)
        return True

    def add_side(self, seq: Sequence, wi: int, then: Callable[[RequestOutput, SimWorker], None]) -> None:
        """A request that is no turn of its own (a disaggregated prefill): then(output, worker) when
        it finishes. ValueError when the engine refuses it."""
        w = self._on(wi)
        w.core.add(seq)
        self.side[seq.request_id] = then
        self._wake(w, self.now)

    def later(self, t: float, fn: Callable[[], None]) -> None:
        """fn() at time t, an outside event: the workers it adds to stop their runs (submit, add_side)."""
        self._push(t, CALL, fn)

    # ---- a worker steps ---------------------------------------------------------------------------
    def _step(self, w: SimWorker) -> None:
        w.scheduled = False
        if (planned := self.runs.pop(w.index, None)) is not None:
            w.core.advance_decode(planned[1], planned[1].steps)      # its end is now
        if w.clock.now < self.now:
            w.clock.advance(self.now - w.clock.now)
        w.mover.horizon = self.events.first_time()
        before = w.clock.now
        for out in w.core.step():
            if out.finished:
                self._finished(out, w)
        if not (w.core.has_unfinished_requests() or w.mover.jobs):
            return
        if w.clock.now > before:
            run = self._plan(w) if self.cfg.multi_step else None
            self._wake(w, w.clock.now if run is None else run.end)
        elif w.mover.jobs:
            self._wake(w, max(w.mover.next_deadline() or w.clock.now, w.clock.now))
        # else: waiting requests that cannot be admitted until something on this worker changes

    def _plan(self, w: SimWorker) -> DecodeRun | None:
        plan, deadline = getattr(w.core, "plan_decode", None), w.mover.next_deadline()
        run = plan(INF if deadline is None else deadline) if plan is not None else None
        if run is not None:
            self.runs[w.index] = (w, run)
        return run

    def _finished(self, out: RequestOutput, w: SimWorker) -> None:
        then = self.side.pop(out.request_id, None)
        if then is not None:
            then(out, w)
            return
        st, k, wi, n_prompt = self.live.pop(out.request_id)
        m, end = out.metrics, out.metrics.finished_time
        assert end is not None                      # a finished request's
        self.turns.append(TurnRecord(st.base, k, n_prompt, len(out.token_ids),
                                     out.num_cached_tokens, m.arrival_time, m.first_token_time or end,
                                     end, m.num_preemptions, wi))
        done = [j for j, last in st.last_use.items() if last == k]
        if k in st.last_use:
            st.outputs[k] = out.token_ids          # a later turn builds on this one's output
        else:
            done.append(k)
        for j in done:
            st.prompts.forget(j)
            st.outputs.pop(j, None)
        s = st.session
        st.next_turn = k + 1
        if st.next_turn >= len(s.turns):
            return
        gap = self.scaling.gap(s.turns[st.next_turn])
        sid = out.session_id
        if self.cfg.park and sid is not None and gap >= self.cfg.park_min_gap_s:
            try:
                w.core.park(sid, expected_gap_s=gap)
                st.parked = (sid, wi)
            except (KeyError, ValueError):
                pass
        self._push(w.clock.now + gap, ARRIVE, st)
