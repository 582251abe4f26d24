"""Continuous batching with chunked prefill, FCFS admission by free blocks, preemption by recompute.

Each step gets a token budget (max_num_batched_tokens). Running sequences go first, oldest
first: a decoding one takes 1 token, one still in prefill takes its next chunk. If the pool has
no block for a decoding sequence, the newest running sequence is preempted (its blocks freed,
its KV recomputed later) and put back at the front of the waiting queue. With budget left and
no preemption this step, waiting sequences are admitted in arrival order while their prompt's
blocks fit; the head of the queue is never overtaken, so nothing starves. A sequence whose prefix
the block manager loads from a lower tier waits in `loading` (out of compute, taking no budget)
and joins the running ones at the first step after its blocks are in.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from everybyte.engine.sequence import Sequence, SequenceStatus
from everybyte.kv.block_manager import BlockManager
from everybyte.kv.clock import SYSTEM, Clock


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]
    num_new_tokens: list[int]
    preempted: list[Sequence]

    def __init__(self, seqs: list[Sequence] | None = None, num_new_tokens: list[int] | None = None,
                 preempted: list[Sequence] | None = None) -> None:
        # written out (here and in the control plane's other per-step dataclasses): mypyc compiles
        # it, while the one @dataclass generates runs as interpreted Python, about 5x slower
        self.seqs = [] if seqs is None else seqs
        self.num_new_tokens = [] if num_new_tokens is None else num_new_tokens
        self.preempted = [] if preempted is None else preempted

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager[Sequence], max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, max_model_len: int = 2048, clock: Clock = SYSTEM) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.block_manager, self.clock = block_manager, clock
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.loading: list[Sequence] = []
        self.num_preemptions = 0

    def max_tokens_of(self, seq: Sequence) -> int:
        return min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)

    def check(self, seq: Sequence) -> None:
        """Reject a request the whole pool could never hold (it would wait forever)."""
        need = self.block_manager.blocks_for(self.max_tokens_of(seq))
        if need > self.block_manager.num_blocks:
            bs = self.block_manager.block_size
            raise ValueError(
                f"request needs up to {self.max_tokens_of(seq)} tokens of KV ({need} blocks of {bs}), "
                f"more than the whole pool ({self.block_manager.num_blocks} blocks, "
                f"{self.block_manager.num_blocks * bs} tokens)")

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running and not self.loading

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        for seq in bm.poll_loads():
            if seq in self.loading:
                self.loading.remove(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
        kept: deque[Sequence] = deque()
        while self.running:
            seq = self.running.popleft()
            n = min(seq.num_uncomputed_tokens, budget)
            if n <= 0:
                kept.append(seq)
                continue
            while not bm.can_append(seq):
                if self.running:
                    victim = self.running.pop()
                    self._preempt(victim)
                    out.preempted.append(victim)
                else:
                    self._preempt(seq)
                    out.preempted.append(seq)
                    break
            else:
                bm.may_append(seq)
                kept.append(seq)
                out.seqs.append(seq)
                out.num_new_tokens.append(n)
                budget -= n
        self.running = kept
        if out.preempted:
            return out
        now = self.clock.time()
        while self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.max_num_seqs:
            seq = self.waiting[0]
            if not bm.can_allocate(seq):
                break
            self.waiting.popleft()
            bm.allocate(seq)
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
            if bm.is_loading(seq):
                seq.status = SequenceStatus.LOADING
                self.loading.append(seq)
                continue
            seq.status = SequenceStatus.RUNNING
            n = min(seq.num_uncomputed_tokens, budget)
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        return out

    def _preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        seq.metrics.finished_time = self.clock.time()
        self.block_manager.deallocate(seq)
        for queue in (self.running, self.waiting, self.loading):
            if seq in queue:
                queue.remove(seq)
                break

    def abort(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.loading, *self.waiting):
            if seq.request_id == request_id:
                self.finish(seq, "abort")
                return seq
        return None
