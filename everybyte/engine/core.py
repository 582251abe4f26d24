"""The engine core: one step() over the scheduler, the KV memory control and an injected
executor and clock. It imports no torch, so the real engine (LLMEngine), the HTTP server, a
cluster worker and the simulator all drive this same loop: only the executor (what a forward
costs and which tokens it yields) and the clock differ.

A request is a Sequence plus an optional stop checker (the incremental detokenizer: it finds
stop strings and holds the text). The executor keeps whatever per-request state it needs (a
seeded generator) and is told when a request leaves (release).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol
from typing import Sequence as Seq

from everybyte.engine import decode_run
from everybyte.engine.outputs import RequestOutput
from everybyte.engine.scheduler import Scheduler, SchedulerOutput
from everybyte.engine.sequence import Sequence
from everybyte.kv.block_manager import BlockManager
from everybyte.kv.clock import Clock
from everybyte.kv.memory_manager import KVMemoryManager


@dataclass
class StepResult:
    rows: list[int]                  # index into the batch of each sequence that got a token
    token_ids: list[int]             # its token
    logprobs: list[Any]              # its logprobs entry (None when not asked for)
    seconds: float                   # what the forward took (measured, or what a cost model says)

    def __init__(self, rows: list[int], token_ids: list[int], logprobs: list[Any], seconds: float) -> None:
        self.rows, self.token_ids, self.logprobs, self.seconds = rows, token_ids, logprobs, seconds


class Executor(Protocol):
    def execute(self, seqs: list[Sequence], num_new_tokens: list[int]) -> StepResult:
        """Compute num_new_tokens[i] tokens of seqs[i]; sample for those that reach their end."""

    def release(self, request_id: str) -> None:
        """The request left the engine (finished or aborted): drop its state."""


class StopChecker(Protocol):
    text: str

    def add(self, token: int) -> str | None:
        """Take a token; the stop string it completes, if any."""

    def stable_text(self) -> str: ...


class _NoText:
    text = ""

    def add(self, token: int) -> str | None:
        return None

    def stable_text(self) -> str:
        return ""


@dataclass
class CoreRequest:
    seq: Sequence
    stop: StopChecker

    def __init__(self, seq: Sequence, stop: StopChecker) -> None:     # compiled (see SchedulerOutput)
        self.seq, self.stop = seq, stop


class EngineCore:
    LOAD_WAIT_S = 0.05

    def __init__(self, scheduler: Scheduler, executor: Executor, clock: Clock,
                 eos_token_ids: Seq[int] = (), max_model_len: int | None = None):
        self.scheduler, self.block_manager = scheduler, scheduler.block_manager
        self.executor, self.clock = executor, clock
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len or scheduler.max_model_len
        self.requests: dict[str, CoreRequest] = {}
        self._with_stop_checker = 0       # requests whose checker looks for stop strings (no decode runs)
        self.on_finish: Callable[[Sequence], None] | None = None    # e.g. publish its KV (engine/kv_transfer)
        # called once per step with the scheduling decision and what the executor did (None when
        # nothing ran): the simulator's decision-equivalence check records both engines with it
        self.observers: list[Callable[[SchedulerOutput, StepResult | None], None]] = []
        # step() outputs only the requests that finished (vLLM's FINAL_ONLY): a caller that
        # ignores partial outputs (the simulator) saves building them
        self.final_only = False
        # outputs carry the prompt's token ids (a copy of the prompt per output); a caller that
        # knows each prompt already (the simulator) turns it off and gets []
        self.prompt_in_outputs = True

    # ---- requests -------------------------------------------------------------------------
    def check(self, seq: Sequence) -> None:
        """The engine-side checks of a request (ValueError): its id is free and the whole pool
        could hold it. add() runs them; a caller admitting a batch all-or-none (LLMEngine) or
        answering before it streams runs them first."""
        if seq.request_id in self.requests:
            raise ValueError(f"request_id {seq.request_id!r} is already in use")
        self.scheduler.check(seq)

    def add(self, seq: Sequence, stop: StopChecker | None = None) -> str:
        self.check(seq)
        req = self.requests[seq.request_id] = CoreRequest(seq, stop or _NoText())
        self._with_stop_checker += type(req.stop) is not _NoText
        self.scheduler.add(seq)
        return seq.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self._drop(request_id)
        if req is None or self.scheduler.abort(request_id) is None:
            return None
        self.executor.release(request_id)
        return self.output(req)

    def _drop(self, request_id: str) -> CoreRequest | None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self._with_stop_checker -= type(req.stop) is not _NoText
        return req

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_pending_loads(self) -> bool:
        return self.block_manager.has_pending_loads()

    # ---- stepping -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling decision and one forward; outputs for every request that got a token.
        With nothing to compute but blocks loading from a tier, waits for a load (up to
        LOAD_WAIT_S, so a server loop still takes new requests) instead of returning at once."""
        sched = self.scheduler.schedule()
        bm = self.block_manager
        if not sched.seqs and bm.has_pending_loads():      # one wait: a virtual clock may stand still
            bm.wait_loads(self.LOAD_WAIT_S)
            sched = self.scheduler.schedule()
        if not sched.seqs:
            for observe in self.observers:
                observe(sched, None)
            return []
        res = self.executor.execute(sched.seqs, sched.num_new_tokens)
        for observe in self.observers:
            observe(sched, res)
        self._account_prefill(sched, res.seconds)
        for seq, n in zip(sched.seqs, sched.num_new_tokens):
            seq.num_computed_tokens += n
        now, outputs = self.clock.time(), []
        for k, i in enumerate(res.rows):
            req = self.requests[sched.seqs[i].request_id]
            self._append(req, res.token_ids[k], res.logprobs[k], now)
            seq = req.seq
            if not seq.is_finished:
                if not self.final_only:
                    outputs.append(self.output(req))
                continue
            if self.on_finish is not None:
                self.on_finish(seq)
            outputs.append(self.output(req))
            self._drop(seq.request_id)
            self.executor.release(seq.request_id)
        return outputs

    def plan_decode(self, until: float = float("inf"), max_steps: int = 512) -> decode_run.DecodeRun | None:
        """The next steps as one multi-step decode run (engine/decode_run), or None when the batch
        may change at the next step or the executor cannot price steps ahead. Nothing changes
        until advance_decode; the caller applies the run's steps that start before any outside
        event (add, abort, park, resume, a tier load finishing: `until` must be at or before the
        next load's deadline) and plans again after it."""
        if self._with_stop_checker:
            return None
        return decode_run.plan(self, until, max_steps)

    def advance_decode(self, run: decode_run.DecodeRun, steps: int) -> None:
        """Apply the next `steps` steps of a planned run: the effects of as many step() calls."""
        decode_run.apply(self, run, steps)

    def _account_prefill(self, sched: SchedulerOutput, seconds: float) -> None:
        prefill = sum(max(min(n, s.num_prompt_tokens - s.num_computed_tokens), 0)
                      for s, n in zip(sched.seqs, sched.num_new_tokens))
        if prefill:
            self.block_manager.record_prefill(prefill, seconds)

    def _append(self, req: CoreRequest, token: int, logprobs: Any, now: float) -> None:
        seq, p = req.seq, req.seq.params
        seq.append_token(token)
        m = seq.metrics
        m.token_times.append(now)
        if m.first_token_time is None:
            m.first_token_time = now
        if seq.logprobs is not None:
            seq.logprobs.append(logprobs)
        reason = None
        if token in p.stop_token_ids:
            reason, seq.stop_reason = "stop", token
        elif not p.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif (hit := req.stop.add(token)) is not None:
            reason, seq.stop_reason = "stop", hit
        elif seq.num_completion_tokens >= p.max_tokens or len(seq) >= self.max_model_len:
            reason = "length"
        if reason:
            self.scheduler.finish(seq, reason)

    def output(self, req: CoreRequest) -> RequestOutput:
        seq = req.seq
        text = req.stop.text if seq.finish_reason else req.stop.stable_text()
        prompt_ids = seq.prompt_token_ids if self.prompt_in_outputs else []
        return RequestOutput(seq.request_id, seq.prompt, prompt_ids, text,
                             seq.completion_token_ids, seq.finish_reason,
                             None if seq.logprobs is None else list(seq.logprobs), seq.metrics,
                             seq.stop_reason, seq.num_cached_tokens, seq.session_id, seq.kv_transfer_params)

    def run_to_completion(self, request_ids: list[str]) -> list[RequestOutput]:
        """Step until the given (added) requests finish; their outputs in order."""
        reqs = [self.requests[rid] for rid in request_ids]
        while not all(r.seq.is_finished for r in reqs):
            if self.scheduler.is_finished():
                raise RuntimeError("scheduler idle with unfinished requests")
            self.step()
        return [self.output(r) for r in reqs]

    # ---- sessions and the memory system -------------------------------------------------------
    @property
    def memory(self) -> KVMemoryManager:
        if not isinstance(self.block_manager, KVMemoryManager):
            raise ValueError("sessions need the memory system: enable_prefix_caching=True")
        return self.block_manager

    def park(self, session_id: str, expected_gap_s: float | None = None) -> int:
        return self.memory.park(session_id, expected_gap_s)

    def resume(self, session_id: str) -> int:
        return self.memory.resume(session_id)

    def drop(self, session_id: str) -> None:
        self.memory.drop(session_id)

    def session_info(self, session_id: str) -> dict[str, Any]:
        return self.memory.session_info(session_id)

    def reset_prefix_cache(self) -> int:
        bm = self.block_manager
        return bm.evict_all() if isinstance(bm, KVMemoryManager) else 0

    def pending_writes(self) -> list[Any]:
        """Futures of the write-through puts to shared tiers still in flight."""
        bm = self.block_manager
        return bm.tiers.pending_writes() if isinstance(bm, KVMemoryManager) else []

    def close(self) -> None:
        if isinstance(self.block_manager, KVMemoryManager):
            self.block_manager.tiers.flush()

    def stats(self, weights_bytes: int = 0) -> dict[str, Any]:
        bm: BlockManager[Any] = self.block_manager
        mem = bm.stats(weights_bytes) if isinstance(bm, KVMemoryManager) else {}
        extra: dict[str, Any] = {"memory": mem} if mem else {}
        if mem:
            extra["prefix_cache_queries"] = mem["prefix_cache"]["query_tokens"]
            extra["prefix_cache_hits"] = mem["prefix_cache"]["hit_tokens"]
        return {**extra, "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "num_preemptions": self.scheduler.num_preemptions,
                "kv_blocks_total": bm.num_blocks, "kv_blocks_free": bm.num_free_blocks,
                "kv_usage": bm.num_used_blocks / bm.num_blocks}
