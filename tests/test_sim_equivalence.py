"""Item 1's check (issue #20): the simulator runs the engine's own scheduler and memory system,
so on the same requests, with the real engine's step times and tokens replayed, it makes the
same scheduling decisions step by step: admissions, chunked prefill, prefix hits, preemptions
and evictions (a KV budget of a few blocks makes all of them happen)."""
import pytest

from everybyte.engine.llm_engine import LLMEngine
from everybyte.engine.sampling_params import SamplingParams
from everybyte.engine.sequence import Sequence
from everybyte.sim.decisions import DecisionLog
from everybyte.sim.executor import RecordedExecutor
from everybyte.sim.worker import SimPool, SimWorker, WorkerSpec

MAX_LEN, SEQS, BATCH = 96, 4, 40
PREFIX = list(range(2000, 2016))                       # one full block shared by every prompt
ARRIVALS = {0: [0, 1, 2], 2: [3, 4], 4: [6], 5: [5]}   # step index -> requests added before it


def _prompt(i: int) -> list[int]:
    if i == 6:                                         # r0's prompt and more: a 2-block hit, if still cached
        return _prompt(0) + [4000 + j for j in range(10)]
    return PREFIX + [3000 + 37 * i + j for j in range(28 + i)]     # 44-50 tokens: a 4th block soon


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _drive(core, make_seq) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    step = 0
    while step == 0 or core.has_unfinished_requests() or any(k >= step for k in ARRIVALS):
        for i in ARRIVALS.get(step, []):
            core.add(make_seq(i))
        for out in core.step():
            if out.finished:
                tokens[out.request_id] = list(out.token_ids)
        step += 1
        assert step < 500, "the engine did not finish"
    return tokens


@pytest.fixture(scope="module")
def runs():
    probe = LLMEngine(None, kv_cache_bytes="64MiB", kv_tiers="none", max_model_len=MAX_LEN)
    per_block = probe.pool.bytes_per_block
    del probe
    real = LLMEngine(None, kv_cache_bytes=11 * per_block, kv_tiers="none", max_num_seqs=SEQS,
                     max_num_batched_tokens=BATCH, max_model_len=MAX_LEN)
    real_log = DecisionLog(real.core)
    real_tokens = _drive(real.core, lambda i: real.make_sequence(_prompt(i), _params(), request_id=f"r{i}"))

    pool = SimPool(real.pool.num_blocks, real.pool.block_size, real.pool.bytes_per_token)
    spec = WorkerSpec(pool, kv_format=real.pool.kv_cache_dtype, max_num_seqs=SEQS, max_num_batched_tokens=BATCH,
                      max_model_len=MAX_LEN, restart_blocks=real.block_manager.restart_blocks)
    sim = SimWorker(0, spec, lambda clock: RecordedExecutor(clock, real_log.seconds, real_tokens),
                    lambda level, nbytes: 0.0, eos=real.eos_token_ids)
    sim_log = DecisionLog(sim.core)
    sim_tokens = _drive(sim.core, lambda i: Sequence(_prompt(i), _params(), f"r{i}", arrival_time=sim.clock.time()))
    return real, real_log, real_tokens, sim, sim_log, sim_tokens


def test_the_budget_forces_preemptions_evictions_and_hits(runs):
    real, log = runs[0], runs[1]
    assert real.pool.num_blocks == 11
    assert real.scheduler.num_preemptions > 0
    assert log.steps[-1]["evictions"] > 0 and log.steps[-1]["hit_blocks"] > 0
    admitted_past_a_hit = [rid for prev, st in zip([{"batch": []}] + log.steps, log.steps)
                           for rid, _, computed, _ in st["batch"]
                           if computed > 0 and rid not in {r for r, *_ in prev["batch"]}]
    assert admitted_past_a_hit                          # a (re)admission that skipped cached blocks


def test_simulated_engine_makes_the_same_decisions(runs):
    real, real_log, real_tokens, sim, sim_log, sim_tokens = runs
    assert len(sim_log.steps) == len(real_log.steps)
    for k, (a, b) in enumerate(zip(real_log.steps, sim_log.steps)):
        assert a == b, f"step {k} differs"
    assert sim_tokens == real_tokens
    assert sim.core.scheduler.num_preemptions == real.scheduler.num_preemptions
    assert sim.memory.cache.stats == real.block_manager.cache.stats


def test_simulated_time_is_the_real_step_times(runs):
    real_log, sim = runs[1], runs[3]
    assert sim.clock.now == pytest.approx(sum(real_log.seconds))
