"""Multi-step decode (engine/decode_run, issue #20 item 5): the simulator jumping over decode steps
makes exactly the decisions of stepping every token. The same trace runs twice, runs on and
off, on budgets small enough for preemptions, evictions, parked sessions and host-tier loads;
every turn's times, cached tokens and preemptions and the workers' counters must agree."""
import math

import pytest

from everybyte.engine.core import EngineCore
from everybyte.engine.sampling_params import SamplingParams
from everybyte.engine.sequence import Sequence
from everybyte.sim.build import SimConfig, build
from everybyte.sim.routes import ROUTES
from everybyte.sim.runner import RunConfig, Runner
from everybyte.traces import load_trace
from everybyte.traces.scaling import Scaling
from everybyte.traces.tokens import TokenSpace

TRACE = "synthetic:sessions=60,turns=3,gap_s=0.3,arrival_s=0.0001,seed=5,system_tokens=16,first_tokens=24," \
        "append_tokens=16,output_tokens=60,sigma=0.3"


def _replay(multi_step: bool, route: str = "sticky", kv: str = "4MiB", host: str | None = "64MiB",
            trace: str = TRACE, isolated: bool = False) -> dict:
    cfg = SimConfig(workers=3, kv_format="nvfp4", kv_cache=kv, host_tier=host, max_num_seqs=16,
                    max_num_batched_tokens=256)
    cost, workers, _ = build(cfg)
    tr = load_trace(trace)
    scaling = Scaling.defaults(tr.format, cost.model.max_len, gap_scale=1.0, max_gap_s=2.0)
    runner = Runner(tr, scaling, TokenSpace(), workers, RunConfig(park=True, park_min_gap_s=0.1,
                                                                     multi_step=multi_step),
                    ROUTES[route](len(workers)), cost.weight_bytes(), isolated=isolated)
    summary = runner.run()
    return {"summary": summary, "turns": sorted(runner.turns, key=lambda t: (t.session, t.turn))}


def _same(a: float, b: float) -> bool:
    return a == b or math.isclose(a, b, rel_tol=1e-9)


def _compare(on: dict, off: dict) -> None:
    assert len(on["turns"]) == len(off["turns"]) > 0
    for x, y in zip(on["turns"], off["turns"]):
        assert (x.session, x.turn, x.prompt_tokens, x.output_tokens, x.cached_tokens, x.preemptions, x.worker) == \
               (y.session, y.turn, y.prompt_tokens, y.output_tokens, y.cached_tokens, y.preemptions, y.worker)
        for f in ("arrival", "first_token", "finished"):
            assert _same(getattr(x, f), getattr(y, f)), (x, y, f)
    a, b = dict(on["summary"]), dict(off["summary"])
    assert a["events"] < b["events"]                   # it did jump: fewer events for the same steps
    for key in ("wall_s", "sim_requests_per_wall_s", "cpu_s", "events"):
        a.pop(key), b.pop(key)
    assert a == b


@pytest.mark.parametrize("route", ["sticky", "round-robin"])
def test_multi_step_decode_makes_the_same_decisions(route):
    on, off = _replay(True, route), _replay(False, route)
    s = off["summary"]
    # the budgets make the interesting things happen
    assert s["blocks"]["parked"] > 0 and s["blocks"]["loaded"] > 0
    assert s["blocks"]["evicted"] > 0 and s["prefill_tokens"]["reused"] > 0
    _compare(on, off)


@pytest.mark.parametrize("route", ["sticky", "round-robin"])
def test_isolated_workers_catch_up_lazily_with_the_same_decisions(route, monkeypatch):
    """With workers that share nothing, an arrival catches up only the runs of the workers it
    touches (Runner isolated=True): fewer, longer run applications, every decision the same."""
    calls = {"n": 0}
    advance = EngineCore.advance_decode

    def counted(self, run, steps):
        calls["n"] += 1
        advance(self, run, steps)
    monkeypatch.setattr(EngineCore, "advance_decode", counted)
    lazy = _replay(True, route, isolated=True)
    lazy_calls, calls["n"] = calls["n"], 0
    eager = _replay(True, route)
    assert 0 < lazy_calls < calls["n"]
    assert lazy["summary"]["blocks"]["parked"] > 0 and lazy["summary"]["blocks"]["loaded"] > 0
    assert lazy["turns"] == eager["turns"]            # every field, times to the bit
    a, b = dict(lazy["summary"]), dict(eager["summary"])
    for key in ("wall_s", "sim_requests_per_wall_s", "cpu_s"):
        a.pop(key), b.pop(key)
    assert a == b


def test_multi_step_without_a_host_tier():
    on, off = _replay(True, host=None), _replay(False, host=None)
    assert off["summary"]["preemptions"] > 0 and off["summary"]["blocks"]["evicted"] > 0
    _compare(on, off)


def _core_pair():
    cost, workers, _ = build(SimConfig(workers=2, kv_format="nvfp4", kv_cache="4MiB", max_num_seqs=4))
    return workers


def test_a_run_stops_before_a_finish_and_applies_like_single_steps():
    a, b = _core_pair()
    for w in (a, b):
        for i, n in enumerate((9, 40, 23)):
            seq = Sequence([1000 + 7 * i + j for j in range(30 + 11 * i)],
                           SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), f"r{i}", arrival_time=0.0)
            w.core.add(seq)
        w.core.step()                                   # the prefill (and first tokens)
    run = a.core.plan_decode()
    assert run is not None and run.steps == 9 - 1 - 1   # r0 finishes at its 9th token: the run stops before
    a.core.advance_decode(run, 3)                       # applied in two parts, as an arrival splits it
    a.core.advance_decode(run, run.steps)
    for _ in range(run.steps):
        assert not [o for o in b.core.step() if o.finished]
    assert a.clock.now == b.clock.now
    for ra, rb in zip(a.core.scheduler.running, b.core.scheduler.running):
        assert ra.token_ids == rb.token_ids and ra.block_table == rb.block_table
        assert ra.num_computed_tokens == rb.num_computed_tokens and ra.metrics.token_times == rb.metrics.token_times
    assert a.memory.cache.names == b.memory.cache.names
    assert a.executor.steps == b.executor.steps and a.executor.busy_s == b.executor.busy_s
    assert a.core.plan_decode() is None                 # r0's last token is next: a real step


class _LooksForStops:                                  # a stop checker (the detokenizer's interface)
    text = ""

    def add(self, token):
        return None

    def stable_text(self):
        return ""


def test_no_run_while_a_request_looks_for_stop_strings():
    """Stop strings need every token: a core plans no run while any request has a checker, and
    plans again once those requests have finished or been aborted."""
    a, _ = _core_pair()
    for i, (n, stop) in enumerate(((30, None), (3, _LooksForStops()), (30, _LooksForStops()))):
        a.core.add(Sequence([2000 + 5 * i + j for j in range(20)], SamplingParams(temperature=0.0, max_tokens=n,
                                                                               ignore_eos=True), f"r{i}"), stop)
    a.core.step()
    assert a.core.plan_decode() is None
    assert any(o.finished and o.request_id == "r1" for _ in range(3) for o in a.core.step())
    assert a.core.plan_decode() is None                 # r2 still looks for stop strings
    a.core.abort("r2")
    assert a.core.plan_decode() is not None


def test_final_only_outputs_only_finished_requests():
    """The simulator's cores output finished requests only (EngineCore.final_only); the stream of
    a core that outputs every step finishes the same requests with the same outputs."""
    a, b = _core_pair()
    b.core.final_only = False
    assert a.core.final_only
    got: dict[str, list] = {"a": [], "b": []}
    for w in (a, b):
        for i, n in enumerate((3, 7)):
            w.core.add(Sequence(list(range(1000 + i, 1040 + i)), SamplingParams(max_tokens=n, ignore_eos=True),
                                f"r{i}", arrival_time=0.0))
    partial = 0
    while a.core.has_unfinished_requests() or b.core.has_unfinished_requests():
        outs_a, outs_b = a.core.step(), b.core.step()
        assert all(o.finished for o in outs_a)
        partial += sum(not o.finished for o in outs_b)
        got["a"] += outs_a
        got["b"] += [o for o in outs_b if o.finished]
    assert partial > 0
    key = [(o.request_id, o.token_ids, o.finish_reason, o.metrics.finished_time) for o in got["a"]]
    assert key == [(o.request_id, o.token_ids, o.finish_reason, o.metrics.finished_time) for o in got["b"]]
    assert len(key) == 2


def test_no_run_with_a_stop_token_or_a_waiting_request():
    a, _ = _core_pair()
    seq = Sequence(list(range(1000, 1040)), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                          stop_token_ids=[a.executor.token(42)]), "s", arrival_time=0.0)
    a.core.add(seq)
    a.core.step()
    run = a.core.plan_decode()
    assert run is not None and run.steps == 1           # position 41's token, then the stop token at 42
    a.core.advance_decode(run, 1)
    a.core.add(Sequence(list(range(2000, 2020)), SamplingParams(max_tokens=4, ignore_eos=True), "w", arrival_time=0.0))
    assert a.core.plan_decode() is None                 # "w" waits: it may be admitted at the next step


@pytest.mark.parametrize("hw, model, weights, kv, weight", [
    ("H200", "smollm2", "bf16", "bf16", 1.0), ("H200", "smollm2", "nvfp4", "nvfp4", 4.0),
    ("GB300-NVL72", "deepseek-r1", "nvfp4", "nvfp4", 2.5), ("H200", "deepseek-r1", "fp8", "fp8", 1.0)])
def test_a_runs_step_prices_equal_single_steps_to_the_bit(hw, model, weights, kv, weight):
    """decode_run_seconds hoists the roofline's constants out of the loop: the same floats, exactly,
    so a run's clock equals the single steps' (MoE experts touched, a scaled trace's token weight)."""
    from everybyte.sim.cost_model import CostModel
    from everybyte.sim.hardware import get_hardware
    from everybyte.sim.models import get_model
    cost = CostModel(get_hardware(hw), get_model(model), weights, kv, step_overhead_s=3e-5, token_weight=weight)
    for n, attended, steps in ((1, 1, 1), (7, 7 * 913, 300), (64, 64 * 20_000 + 17, 40)):
        run = cost.decode_run_seconds(n, attended, steps)
        assert run == [cost.decode_seconds(n, attended + n * j) for j in range(steps)]
        assert len(set(run)) > 1 or steps == 1            # the context grows: steps cost more
    assert cost.decode_run_seconds(0, 0, 3) == [0.0, 0.0, 0.0]
