"""Scheduler and block manager on fake sequences (no model): the control plane alone."""
import pytest

from everybyte.engine.sampling_params import SamplingParams
from everybyte.engine.scheduler import Scheduler
from everybyte.engine.sequence import Sequence, SequenceStatus
from everybyte.kv.block_manager import BlockManager


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_model_len=256):
    return Scheduler(BlockManager(num_blocks, block_size), max_num_seqs, budget, max_model_len)


def seq(n_prompt, max_tokens=4, start=0):
    return Sequence(list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens))


def step(s: Scheduler):
    """What the engine does after a forward: mark computed, sample at the end of a prompt, finish."""
    out = s.schedule()
    for q, n in zip(out.seqs, out.num_new_tokens):
        q.num_computed_tokens += n
        if q.num_uncomputed_tokens == 0:
            q.append_token(7)
            if q.num_completion_tokens >= q.params.max_tokens:
                s.finish(q, "length")
    return out


def run_all(s, max_steps=1000):
    trace = []
    for _ in range(max_steps):
        if s.is_finished():
            return trace
        trace.append(step(s))
    raise AssertionError("scheduler did not finish")


def test_block_manager_allocate_append_free():
    bm = BlockManager(num_blocks=5, block_size=4)
    a = seq(6)
    assert bm.can_allocate(a)
    bm.allocate(a)
    assert len(a.block_table) == 2 and bm.num_free_blocks == 3
    a.append_token(1), a.append_token(1)
    assert bm.can_append(a)
    bm.may_append(a)
    assert len(a.block_table) == 2
    a.append_token(1)
    bm.may_append(a)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 2
    big = seq(12)
    assert not bm.can_allocate(big)
    bm.deallocate(a)
    assert a.block_table == [] and bm.num_free_blocks == 5
    assert sorted(bm.free_block_ids) == list(range(5))


def test_chunked_prefill_respects_budget():
    s = make(budget=5)
    a = seq(12)
    s.add(a)
    outs = [step(s) for _ in range(3)]
    assert [o.num_new_tokens for o in outs] == [[5], [5], [2]]
    assert a.num_completion_tokens == 1 and a.num_computed_tokens == 12


def test_continuous_batching_mixes_decode_and_prefill():
    s = make(budget=8)
    a, b = seq(3), seq(10)
    s.add(a)
    step(s)                       # a prefilled, has its first token
    s.add(b)                      # joins while a decodes
    out = step(s)
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 7]
    out = step(s)
    assert out.seqs == [a, b] and out.num_new_tokens == [1, 3]
    run_all(s)
    assert a.is_finished and b.is_finished and s.block_manager.num_free_blocks == 64


def test_max_num_seqs():
    s = make(max_num_seqs=2)
    seqs = [seq(3) for _ in range(4)]
    for q in seqs:
        s.add(q)
    out = step(s)
    assert out.seqs == seqs[:2] and len(s.waiting) == 2
    run_all(s)
    assert all(q.is_finished for q in seqs)


def test_admission_waits_for_blocks_fcfs():
    s = make(num_blocks=6, block_size=4, budget=100)
    a, b, c = seq(17, max_tokens=2), seq(8, max_tokens=2), seq(2, max_tokens=2)
    for q in (a, b, c):
        s.add(q)
    out = step(s)
    assert out.seqs == [a]        # b does not fit; c must not overtake it
    assert list(s.waiting) == [b, c]
    run_all(s)
    assert all(q.is_finished for q in (a, b, c))


def test_preemption_newest_goes_back_to_front():
    s = make(num_blocks=4, block_size=4, budget=100)
    a, b = seq(4, max_tokens=8), seq(4, max_tokens=8)
    s.add(a), s.add(b)
    step(s)                       # both prefilled: 1 block each + 1 token sampled
    step(s)                       # both need a second block: 4 used
    assert s.block_manager.num_free_blocks == 0
    for _ in range(3):
        step(s)                   # fill the second blocks
    out = step(s)                 # a needs a third block: b (newest) is preempted
    assert out.preempted == [b] and out.seqs == [a]
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert s.waiting[0] is b
    run_all(s)
    assert a.is_finished and b.is_finished
    assert b.num_completion_tokens == 8 and s.num_preemptions >= 1
    assert s.block_manager.num_free_blocks == 4


def test_request_larger_than_pool_rejected():
    s = make(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="more than the whole pool"):
        s.add(seq(10, max_tokens=10))
    s.add(seq(10, max_tokens=6))  # exactly 16 tokens fits


def test_abort_frees_blocks():
    s = make()
    a, b = seq(5), seq(5)
    s.add(a), s.add(b)
    step(s)
    assert s.abort(a.request_id) is a and a.finish_reason == "abort"
    assert s.block_manager.num_free_blocks == 64 - len(b.block_table)
    assert s.abort("nope") is None
    run_all(s)


def test_many_requests_under_pressure_all_finish():
    s = make(num_blocks=10, block_size=4, max_num_seqs=6, budget=12, max_model_len=64)
    seqs = [seq(3 + (i * 7) % 11, max_tokens=1 + (i * 5) % 13, start=i) for i in range(30)]
    for q in seqs:
        s.add(q)
    run_all(s, max_steps=5000)
    assert all(q.is_finished and q.num_completion_tokens == q.params.max_tokens for q in seqs)
    assert s.block_manager.num_free_blocks == 10
    first = [q.metrics.first_scheduled_time for q in seqs]
    assert first == sorted(first)


def test_a_sequence_copies_its_prompt_unless_it_adopts_it():
    ids = [1, 2, 3]
    copied, adopted = Sequence(ids), Sequence(ids, adopt=True)
    copied.append_token(9)
    assert ids == [1, 2, 3] and copied.token_ids == [1, 2, 3, 9]
    adopted.append_token(8)
    assert adopted.token_ids is ids and ids == [1, 2, 3, 8]
    assert adopted.prompt_token_ids == [1, 2, 3] and adopted.completion_token_ids == [8]
