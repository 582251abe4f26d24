"""`everybyte bench sim-speed`: simulated requests per wall-second of `everybyte sim run` on a
synthetic agent trace at 64 workers (one Python process: one core), against the issue's goal of
20,000; --profile adds the hottest functions (cProfile)."""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys

from everybyte.bench.report import emit
from everybyte.sim.cli import config_from, run_parser, run_sim

GOAL = 20_000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="everybyte bench sim-speed", description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=1000)
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("sim_args", nargs="*", help="more `sim run` flags after --")
    args = p.parse_args(argv)
    trace = f"synthetic:sessions={args.sessions},turns=6,arrival_s=0.005,seed=0"
    run_args = run_parser().parse_args(["--workers", str(args.workers), "--kv-cache", "64MiB", "--kv-format",
                                        "nvfp4", "--trace", trace, *args.sim_args])
    prof = cProfile.Profile() if args.profile else None
    try:
        if prof:
            prof.enable()
        result = run_sim(run_args, config_from(run_args))
    except ValueError as e:
        print(f"everybyte bench sim-speed: {e}", file=sys.stderr)
        return 2
    finally:
        if prof:
            prof.disable()
    s = result["summary"]
    out = {"benchmark": "sim-speed", "sim_requests_per_wall_s": s["sim_requests_per_wall_s"], "goal": GOAL,
           "meets_goal": (s["sim_requests_per_wall_s"] or 0) >= GOAL, "requests": s["requests"],
           "sim_requests_per_cpu_s": s["requests"] / s["cpu_s"] if s["cpu_s"] > 0 else None,
           "steps": s["steps"], "events": s["events"], "wall_s": s["wall_s"], "cpu_s": s["cpu_s"],
           "simulated_seconds": s["simulated_seconds"], "workers": args.workers, "trace": trace,
           "prefix_cache": s.get("prefix_cache"),
           "note": "wall_s and cpu_s (its processor time) are the event loop only (trace generation and "
                   "worker construction excluded); one Python process, so one core"}
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
        out["profile_top_tottime"] = buf.getvalue().splitlines()[-22:]
    emit(out, args.json)
    return 0
