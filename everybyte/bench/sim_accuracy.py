"""`everybyte bench sim-accuracy`: does the simulator predict the real engine? (issue #20 item 4)

Calibrate on some agent sessions: replay them on the real engine in this process (sim/runner's
Runner with the engine as its worker, bench/sim_real) and fit the step time to every whole step
and the host tier's load bandwidth to what the engine measured. Then replay held-out sessions on
a fresh real engine and on the simulator with that fit (same pool geometry, budgets, trace,
scaling, arrivals, parking) and print TTFT p50, output tok/s and prefill tokens computed side by
side with the relative error of each (target: within 10%).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Any

from everybyte.bench.agentic import default_trace
from everybyte.bench.report import emit
from everybyte.cli_args import count, non_negative_int, positive
from everybyte.engine.engine_args import add_engine_args, engine_kwargs
from everybyte.json_output import check_writable
from everybyte.sim.calibration import StepFit, fit_steps
from everybyte.sim.cost_model import CostModel
from everybyte.sim.executor import CostExecutor
from everybyte.sim.hardware import CPU, get_hardware
from everybyte.sim.models import get_model
from everybyte.sim.runner import RunConfig, Runner
from everybyte.sim.worker import SimPool, SimWorker, WorkerSpec
from everybyte.traces import TraceError, load_trace
from everybyte.traces.scaling import Scaling
from everybyte.traces.tokens import TokenSpace

PROG = "everybyte bench sim-accuracy"
TARGET = 0.10
METRICS = ("ttft_p50_s", "output_tok_s", "prefill_tokens_computed")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t = p.add_argument_group("trace (the importers and scaling of `bench agentic`)")
    t.add_argument("--trace", default=None, help="agent sessions (default: the shared ones), or synthetic:...")
    t.add_argument("--calibration-sessions", type=count, default=3, help="the first N sessions calibrate")
    t.add_argument("--held-out-sessions", type=count, default=3, help="the next M sessions are predicted")
    t.add_argument("--turns-per-session", type=non_negative_int, default=6, help="each session's first K turns (0: all)")
    t.add_argument("--token-scale", type=float, default=None, help="default: 256 for agent sessions (~60-600 "
                   "token contexts), else the format's")
    t.add_argument("--output-scale", type=float, default=None)
    t.add_argument("--max-output", type=int, default=8)
    t.add_argument("--max-context", type=int, default=1024)
    t.add_argument("--gap-scale", type=float, default=None)
    t.add_argument("--max-gap", type=float, default=1.0)
    t.add_argument("--rate", type=positive, default=1.0, help="sessions/s (the recorded starts are all 0)")
    t.add_argument("--no-park", action="store_true", help="do not park sessions during tool gaps")
    t.add_argument("--vocab-range", default="1000,30000")
    p.add_argument("--no-bracket", action="store_true", help="calibrate only before the held-out run (default: "
                   "replay the calibration sessions again after it and fit both)")
    p.add_argument("--calibration-out", default=None, help="save the fit here (a `sim run --calibration` file)")
    p.add_argument("--json", default=None)
    add_engine_args(p)
    p.set_defaults(kv_cache="16MiB", max_num_seqs=4, max_num_batched_tokens=256)
    return p


def _sessions(trace, start: int, n: int, turns: int | None):
    """Sessions [start, start + n), each cut to its first `turns` turns: every run replays the same
    turns (a --max-requests bound would pick them by timing, which differs between the runs)."""
    part = copy.copy(trace)
    part.sessions = [copy.copy(x) for x in trace.sessions[start:start + n]]
    if not part.sessions:
        raise ValueError(f"the trace has {len(trace.sessions)} sessions; none left at {start} for {n}")
    for x in part.sessions:
        x.turns = x.turns[:turns] if turns else x.turns
    return part


def _picked(summary: dict) -> dict:
    return {"ttft_p50_s": summary["ttft_s"]["p50"], "output_tok_s": summary["output_tok_s"],
            "prefill_tokens_computed": summary["prefill_tokens"]["computed"],
            "prefill_tokens_reused": summary["prefill_tokens"]["reused"], "requests": summary["requests"],
            "simulated_seconds": summary["simulated_seconds"], "preemptions": summary["preemptions"],
            "blocks": summary["blocks"]}


def relative_errors(real: dict, sim: dict) -> dict[str, float | None]:
    return {k: None if not real[k] else abs(sim[k] - real[k]) / abs(real[k]) for k in METRICS}


class Setup:
    """The trace, scaling and engine options both runs share."""

    def __init__(self, args):
        self.args = args
        self.trace = load_trace(args.trace or default_trace())
        token_scale = args.token_scale or (256.0 if self.trace.format == "agent_sessions" else None)
        self.scaling = Scaling.defaults(self.trace.format, None, token_scale=token_scale,
                                        output_scale=args.output_scale, max_context=args.max_context,
                                        max_output=args.max_output, gap_scale=args.gap_scale,
                                        max_gap_s=args.max_gap)
        self.space = TokenSpace.parse(args.vocab_range)
        self.run_cfg = RunConfig(park=not args.no_park, max_requests=None, rate=args.rate)
        kw = engine_kwargs(args)
        kw["max_model_len"] = args.max_model_len or self.scaling.max_context
        self.engine_kwargs = kw
        self.loaded = None

    def real_run(self, trace) -> tuple[dict, Any]:
        from everybyte.bench.sim_real import RealWorker, WallClock
        from everybyte.engine.llm_engine import LLMEngine
        from everybyte.engine.sampling_params import SamplingParams
        clock = WallClock()
        engine = LLMEngine(self.loaded, clock=clock, **self.engine_kwargs)
        self.loaded = engine.loaded
        _warm_up(engine, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        worker = RealWorker(engine, clock)
        worker.core.samples.clear()                                   # the warm-up's steps are not data
        worker.core.stepping_s = 0.0
        before = engine.block_manager.stats(engine.weights_bytes)
        clock.start()
        summary = Runner(trace, self.scaling, self.space, [worker], self.run_cfg, None, engine.weights_bytes).run()
        _minus_warm_up(summary, before)
        summary["wall_split_s"] = {"stepping": worker.core.stepping_s, "waiting_for_arrivals": clock.slept_s,
                                   "outside_steps": summary["wall_s"] - worker.core.stepping_s - clock.slept_s}
        return summary, worker

    def sim_run(self, trace, real_worker, fit: StepFit) -> tuple[dict, CostModel]:
        eng = real_worker.engine
        cost = CostModel(get_hardware(CPU), get_model("smollm2"), "bf16", eng.pool.kv_cache_dtype, 1, 0.0, fit)
        pool = SimPool(eng.pool.num_blocks, eng.pool.block_size, eng.pool.bytes_per_token)
        host = sum(t.capacity_bytes for t in eng.block_manager.tiers.tiers if t.level == "G2")
        spec = WorkerSpec(pool, model_id=eng.model_config.model_id, kv_format=eng.pool.kv_cache_dtype,
                          host_tier_bytes=host, max_num_seqs=eng.config.max_num_seqs,
                          max_num_batched_tokens=eng.config.max_num_batched_tokens,
                          max_model_len=eng.max_model_len, offload_on_park=eng.config.offload_on_park,
                          restart_blocks=eng.block_manager.restart_blocks)
        worker = SimWorker(0, spec, lambda clock: CostExecutor(clock, cost.batch_seconds), cost.transfer_seconds,
                           eos=eng.eos_token_ids)
        summary = Runner(trace, self.scaling, self.space, [worker], self.run_cfg, None, eng.weights_bytes).run()
        summary["steps_outside_calibrated_range"] = cost.outside_range
        return summary, cost


def _minus_warm_up(summary: dict, before: dict) -> None:
    """The engine's counters minus what they held before the run (the warm-up's prefill and blocks)."""
    pre, blocks = summary["prefill_tokens"], summary["blocks"]
    pre["computed"] -= before["prefill_tokens"]["computed"]
    pre["reused"] -= before["prefill_tokens"]["reused_total"]
    for k, v in before["prefill_tokens"]["reused"].items():
        pre["by_tier"][k] -= v
    for k, v in before["blocks"].items():
        blocks[k] -= v


def _warm_up(engine, params) -> None:
    """First uses cost what later ones do not (kernels built and loaded, buffers sized): a chunked
    prefill, a batched decode, a park to the host tier and a resume from it, outside the data."""
    n = max(8, min(300, engine.max_model_len - 48))
    a, b = list(range(1000, 1000 + n)), list(range(2000, 2000 + n))
    engine.generate([a, b], params, session_id="warm-up")
    engine.park("warm-up")
    engine.resume("warm-up")
    engine.generate([a + list(range(3000, 3040))], params, session_id="warm-up")


def calibrate(samples, bandwidths: list[dict[str, float]], info: dict) -> StepFit:
    """The fit to every sample, with each tier's load bandwidth averaged over the runs measuring it."""
    fit = fit_steps(samples, info)
    levels = {level for bw in bandwidths for level, v in bw.items() if v > 0}
    for level in sorted(levels):
        seen = [bw[level] for bw in bandwidths if bw.get(level, 0) > 0]
        fit.tiers[level] = {"bytes_per_s": sum(seen) / len(seen), "latency_s": 0.0}
    return fit


def host_drift(first, second, held_out, fit: StepFit) -> dict:
    """Each calibration run fitted alone, judged on the held-out run's step shapes: how much the
    host's speed moved between them; and the combined fit's error on the held-out steps' time."""
    info = {"machine": "this machine"}
    a, b = fit_steps(first, info).total_seconds(held_out), fit_steps(second, info).total_seconds(held_out)
    measured = sum(x.seconds for x in held_out)
    return {"calibration_after_vs_before": b / a - 1 if a else None,
            "held_out_steps_measured_vs_fit": measured / fit.total_seconds(held_out) - 1}


def run(args) -> dict:
    s = Setup(args)
    calib = _sessions(s.trace, 0, args.calibration_sessions, args.turns_per_session)
    held = _sessions(s.trace, args.calibration_sessions, args.held_out_sessions, args.turns_per_session)
    print(f"{PROG}: calibrating on {len(calib.sessions)} sessions, predicting {len(held.sessions)} held-out "
          f"sessions ({s.scaling.describe()['rule']})", file=sys.stderr)
    load: dict[str, float] = {}
    calib_summary, calib_worker = s.real_run(calib)
    load["calibration"] = os.getloadavg()[0]
    real_summary, real_worker = s.real_run(held)
    load["held_out"] = os.getloadavg()[0]
    runs = [calib_worker]
    if not args.no_bracket:
        runs.append(s.real_run(calib)[1])
        load["calibration_after"] = os.getloadavg()[0]
    info = {"machine": "this machine (cpu-this-machine)", "trace_sessions": [x.id for x in calib.sessions],
            "model": calib_worker.engine.model_config.model_id, "runs": len(runs)}
    fit = calibrate([x for w in runs for x in w.core.samples], [w.tier_bandwidth for w in runs], info)
    if args.calibration_out:
        fit.save(args.calibration_out)
    sim_summary, cost = s.sim_run(held, real_worker, fit)
    real, sim = _picked(real_summary), _picked(sim_summary)
    err = relative_errors(real, sim)
    host: dict[str, Any] = {"load_average_1m_after": load}
    if len(runs) == 2:
        host["drift"] = host_drift(runs[0].core.samples, runs[1].core.samples, real_worker.core.samples, fit)
        moved = host["drift"]["calibration_after_vs_before"]
        if moved is not None and abs(moved) > TARGET:
            host["warning"] = (f"the host's step time moved {moved:+.0%} between the two calibration runs: "
                               "the errors include that, not only the simulator's")
    return {"benchmark": "sim-accuracy", "real": real, "sim": sim, "relative_error": err, "target": TARGET,
            "within_target": {k: v is not None and v <= TARGET for k, v in err.items()},
            "calibration": {"coefficients": fit.coefficients, "residuals": fit.residuals, "samples": fit.samples,
                            "tiers": fit.tiers, "range": fit.range(), "sessions": [x.id for x in calib.sessions],
                            "requests": calib_summary["requests"], "runs": len(runs)},
            "host": host,
            "held_out_sessions": [x.id for x in held.sessions],
            "real_wall_split_s": real_summary["wall_split_s"],
            "steps": {"real": len(real_worker.core.samples), "sim": sim_summary["steps"],
                      "sim_outside_calibrated_range": sim_summary["steps_outside_calibrated_range"]},
            "assumptions": {"trace": s.trace.describe(), "scaling": s.scaling.describe(),
                            "engine": {k: str(v) for k, v in s.engine_kwargs.items()},
                            "arrivals": f"{args.rate} sessions/s" if args.rate else "recorded (all at 0)",
                            "park": not args.no_park, "cost_model": cost.describe()["step_time"],
                            "calibration": "before and after the held-out run, fitted together" if len(runs) == 2
                                           else "before the held-out run",
                            "definitions": "both runs: sim/runner's Runner (same arrivals, tool gaps, park/"
                                           "resume); the real one on the wall clock, steps timed whole; TTFT = "
                                           "first token - arrival; output tok/s over first arrival to last "
                                           "finish; relative error = |sim - real| / real"}}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_writable(args.calibration_out, args.json)     # before both runs, not after
        result = run(args)
    except (ValueError, TraceError, OSError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    emit(result, args.json)
    return 0
