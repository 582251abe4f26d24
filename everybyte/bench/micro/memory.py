"""`everybyte bench memory`: the memory levers off, each alone, and all together, on one agentic replay.

N concurrent agent sessions from the shared traces drive an in-process LLMEngine step by step in
real time: each turn is the previous context + the model's own output + new input, the recorded
tool gaps (compressed) are real waits while the other sessions keep running, and the G1 KV budget
(the same bytes in every run) cannot hold all sessions at once. Per run: prefill tokens computed vs
the tokens never seen before, resumed-turn TTFT, output tok/s, reuse by tier and the G1 byte ledger
over time; plus tier load bandwidths and loading a 2K-token prefix vs recomputing it.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

from everybyte.bench.agentic import default_trace
from everybyte.bench.micro.memory_plan import PROG, plan_sessions
from everybyte.bench.micro.memory_replay import Replay
from everybyte.bench.micro.memory_report import fmt_num, goals, markdown, plot
from everybyte.bench.micro.memory_tiers import measure_tiers
from everybyte.bench.report import emit, environment
from everybyte.cli_args import count, non_negative, non_negative_int, positive
from everybyte.traces import load_trace
from everybyte.traces.scaling import Scaling
from everybyte.traces.tokens import TokenSpace

RUNS = {   # name -> (kv_cache_dtype, prefix caching, kv_tiers, park during gaps)
    "levers_off": ("fp16", False, "none", False),
    "nvfp4": ("nvfp4", False, "none", False),
    "prefix_cache": ("fp16", True, "none", False),
    "tiers": ("fp16", True, "host:1GiB", False),
    "parking": ("fp16", True, "host:1GiB", True),
    "all": ("nvfp4", True, "host:1GiB", True),
}
QUICK = {"sessions": 3, "turns": 3, "token_scale": 192.0, "max_context": 768, "min_context": 256}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--trace", default=None, help="agent-session .json directory (default: the shared traces)")
    p.add_argument("--sessions", type=count, default=6, help="concurrent sessions")
    p.add_argument("--turns", type=count, default=4, help="turns replayed per session")
    p.add_argument("--token-scale", type=positive, default=64.0, help="recorded input tokens / this")
    p.add_argument("--output-scale", type=positive, default=16.0, help="recorded output tokens / this")
    p.add_argument("--max-output", type=count, default=64, help="cap on a turn's output tokens")
    p.add_argument("--max-context", type=count, default=2048, help="a session's last turn (prompt + output) must fit")
    p.add_argument("--min-context", type=non_negative_int, default=1024, help="... and have at least this many tokens")
    p.add_argument("--gap-scale", type=non_negative, default=0.1, help="multiply recorded tool gaps by this")
    p.add_argument("--max-gap", type=non_negative, default=3.0, help="cap on a compressed gap (s)")
    p.add_argument("--kv-budget", default=None, help="G1 KV bytes for every run (default: --budget-fraction of "
                   "the sessions' final contexts in fp16)")
    p.add_argument("--budget-fraction", type=positive, default=0.45)
    p.add_argument("--resume-lead", type=non_negative, default=0.25, help="resume this long before the next turn "
                   "(at most half the gap)")
    p.add_argument("--park-min-gap", type=non_negative, default=0.1, help="park only across gaps at least this long (s)")
    p.add_argument("--sample-interval", type=positive, default=0.25, help="G1 ledger sampling period (s)")
    p.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of " + ", ".join(RUNS))
    p.add_argument("--prefix-tokens", type=count, default=2048, help="prefix loaded vs recomputed in the tier test")
    p.add_argument("--no-tiers", action="store_true", help="skip the tier bandwidth / 2K-prefix measurements")
    p.add_argument("--tier-dir", default=None, help="directory for the G3 test (default: the temp dir)")
    p.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2-135M)")
    p.add_argument("--dtype", default="auto", help="weights/activations dtype (auto: bf16 where native, else fp32)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--run-marker", default="bench-memory")
    p.add_argument("--quick", action="store_true", help="a ~2-3 minute run: " +
                   ", ".join(f"{k}={v}" for k, v in QUICK.items()))
    p.add_argument("--json", default=None, help="write the JSON here too")
    p.add_argument("--out", default=None, help="directory for report.md, g1_bytes.png, g1_series.json, report.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            if getattr(args, k) == build_parser().get_default(k):
                setattr(args, k, v)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    if bad := [n for n in names if n not in RUNS]:
        print(f"{PROG}: unknown run(s) {', '.join(bad)}; choose from {', '.join(RUNS)}", file=sys.stderr)
        return 2
    from everybyte.engine.config import resolve_dtype
    from everybyte.engine.llm_engine import LLMEngine
    from everybyte.kv.data.pool import bytes_per_token, min_pool_bytes, parse_size
    from everybyte.models.loader import load_model

    trace = load_trace(args.trace or default_trace())
    scaling = Scaling(token_scale=args.token_scale, output_scale=args.output_scale, max_context=args.max_context,
                      max_output=args.max_output, gap_scale=args.gap_scale, max_gap_s=args.max_gap)
    space = TokenSpace()
    plans = plan_sessions(trace, scaling, space, args.run_marker, args.sessions, args.turns, args.min_context)
    dtype = resolve_dtype(args.dtype, args.device)
    loaded = load_model(args.model, dtype=dtype, device=args.device)
    mc, bs = loaded.config, 16
    layer_shapes = [(mc.num_key_value_heads, mc.head_dim)] * mc.num_hidden_layers
    fp16_tok = bytes_per_token(layer_shapes, "fp16")
    longest = max(sum(x) for p in plans for x in p.lengths)
    mml = -(-longest // bs) * bs
    finals = [sum(p.lengths[-1]) for p in plans]
    floor = min_pool_bytes(layer_shapes, "fp16", mml, bs)
    budget = parse_size(args.kv_budget) if args.kv_budget else \
        max(int(args.budget_fraction * sum(finals) * fp16_tok), floor)
    runs, series = [], {}
    for name in names:
        fmt, prefix, tiers, park = RUNS[name]
        eng = LLMEngine(loaded, kv_cache_dtype=fmt, kv_cache_bytes=budget, max_model_len=mml, block_size=bs,
                        enable_prefix_caching=prefix, kv_tiers=tiers, dtype=dtype, device=args.device, seed=0)
        rep = Replay(eng, plans, scaling, space, args.run_marker, trace.name, park, args.resume_lead,
                     args.park_min_gap, args.sample_interval)
        r = {"name": name, **rep.run()}
        eng.close()
        runs.append(r)
        series[name] = rep.series
        print(f"[{PROG}] {name}: prefill {r['prefill_tokens_computed']} (min {r['min_prefill_tokens']}), TTFT resumed "
              f"p50 {fmt_num(r['ttft_resumed_p50_s'])} s, {r['output_tok_s']:.2f} out tok/s, wall {r['wall_s']:.1f} s",
              file=sys.stderr, flush=True)
        del eng, rep
        gc.collect()
    tiers = None if args.no_tiers else measure_tiers(loaded, layer_shapes, RUNS["all"][0], args.prefix_tokens,
                                                     args.tier_dir, dtype, args.device, bs)
    by_name = {r["name"]: r for r in runs}
    result = {"runs": runs, "tiers": tiers, "goals": goals(by_name, tiers), "assumptions": {
        "model": mc.model_id, "dtype": str(dtype).removeprefix("torch."), "device": args.device,
        "trace": trace.name, "sessions": [p.session.id for p in plans], "turns_per_session": args.turns,
        "turn_lengths": {p.session.id: [f"{a}+{b}" for a, b in p.lengths] for p in plans},
        "gaps_s": {p.session.id: [round(g, 3) for g in p.gaps] for p in plans},
        "scaling": {**scaling.describe(), "selection": f"the first {args.sessions} sessions whose first {args.turns} "
                    f"main-agent turns form a chain with a last turn of {args.min_context}-{args.max_context} tokens"},
        "schedule": "all sessions start at t=0; a turn arrives its compressed gap after the previous turn's last "
                    "token (a real wall-clock wait; other sessions keep running); TTFT counts from that arrival",
        "kv_budget_bytes": budget, "kv_budget_rule": f"{args.budget_fraction} x sum of the sessions' final contexts "
        f"({sum(finals)} tokens) x {fp16_tok} B/token fp16, at least one max_model_len request" if not args.kv_budget
        else "--kv-budget", "max_model_len": mml, "block_size": bs,
        "runs": {n: dict(zip(("kv_cache_dtype", "prefix_caching", "kv_tiers", "park"), RUNS[n])) for n in names},
        "parking": f"park(expected_gap_s=gap) when a turn ends (gaps >= {args.park_min_gap} s), resume "
                   f"min({args.resume_lead} s, gap/2) before the next turn",
        "prefill_tokens_computed": "counted from the scheduler's output: every token computed except each "
                                   "decode step's newest sampled token (so recompute after preemption counts)",
        "min_prefill_tokens": "per turn, prompt tokens past the longest common prefix with any earlier prompt + "
                              "output of the replay (the first turn's whole prompt, later turns' appended input)",
        "output_tok_s": "output tokens / replay wall time (first arrival to last token); output_tok_s_busy "
                        "divides by the time spent inside engine.step() instead",
        "ttft_resumed": "turns after each session's first", "sampling": "greedy, ignore_eos, max_tokens per turn",
        "g1_ledger": f"stats()['memory']['g1'] (levers off/nvfp4: the same split computed from the block manager) "
                     f"sampled every {args.sample_interval} s; mean = sample mean",
        "environment": environment()}}
    emit(result, args.json)
    for k, g in result["goals"].items():
        print(f"[{PROG}] goal {k}: {fmt_num(g['value'])} (target {g['target']}): {'met' if g['met'] else 'NOT met'}",
              file=sys.stderr)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "report.md"), "w") as f:
            f.write(markdown(result))
        with open(os.path.join(args.out, "report.json"), "w") as f:
            json.dump(result, f, indent=2, default=float)
        with open(os.path.join(args.out, "g1_series.json"), "w") as f:
            json.dump(series, f)
        plot(series, os.path.join(args.out, "g1_bytes.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
