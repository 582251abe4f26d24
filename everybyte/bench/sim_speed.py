"""`everybyte bench sim-speed`: simulated requests per wall-second of `everybyte sim run` on a
synthetic agent trace at 64 workers (one Python process: one core), against the issue's goal of
20,000; --profile adds the hottest functions (cProfile). --compiled runs it twice, each in its own
process: the control plane as Python, then compiled with mypyc (native/compiled), and prints both
with the ratio and whether they made the same decisions."""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys

from everybyte.bench.report import emit

GOAL = 20_000


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="everybyte bench sim-speed", description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=1000)
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--arrival-s", type=float, default=0.005,
                   help="mean seconds between session starts; smaller loads the workers (worker_busy_fraction)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--compiled", action="store_true", help="Python vs the compiled control plane, side by side")
    p.add_argument("sim_args", nargs="*", help="more `sim run` flags after --")
    args = p.parse_args(argv)
    if not args.arrival_s > 0:
        p.error(f"--arrival-s must be > 0, got {args.arrival_s}")
    if args.compiled:
        return side_by_side(args)
    from everybyte.sim.cli import config_from, run_parser, run_sim
    trace = f"synthetic:sessions={args.sessions},turns=6,arrival_s={args.arrival_s},seed=0"
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
           "simulated_seconds": s["simulated_seconds"], "worker_busy_fraction": s["worker_busy_fraction"],
           "workers": args.workers, "trace": trace,
           "prefix_cache": s.get("prefix_cache"), "compiled": s["compiled"], "interpreter": interpreter(),
           "note": "wall_s and cpu_s (its processor time) are the event loop only (trace generation and "
                   "worker construction excluded); one Python process, so one core"}
    if prof:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(15)
        out["profile_top_tottime"] = buf.getvalue().splitlines()[-22:]
    emit(out, args.json)
    return 0


def interpreter() -> dict:
    """Which Python ran it: half the loop's time is spent inside the interpreter, and a shared
    libpython built without PGO/LTO (pyenv's default) runs the same code ~1.1-1.2x slower than a
    statically linked PGO+LTO one (Debian's), so a figure names its interpreter."""
    try:
        with open("/proc/self/maps") as f:
            shared: bool | None = any("libpython" in line for line in f)
    except OSError:
        shared = None                          # not Linux: unknown
    return {"version": sys.version.split()[0], "executable": sys.executable, "libpython_shared": shared}


DECISIONS = ("requests", "steps", "events", "simulated_seconds")


def side_by_side(args: argparse.Namespace) -> int:
    """The same run as Python and compiled, each in a fresh process (a module, once imported, is
    one or the other)."""
    rest = ["--sessions", str(args.sessions), "--workers", str(args.workers), "--arrival-s", str(args.arrival_s),
            "--", *args.sim_args]
    runs = {}
    for name, flag in (("python", "0"), ("compiled", "1")):
        done = subprocess.run([sys.executable, "-m", "everybyte.cli", "bench", "sim-speed", *rest],
                              env={**os.environ, "EVERYBYTE_COMPILED": flag}, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"everybyte bench sim-speed ({name}): {done.stderr.strip()[-2000:]}", file=sys.stderr)
            return done.returncode
        runs[name] = json.loads(done.stdout)
    py, c = runs["python"], runs["compiled"]
    if not c["compiled"]:
        print("everybyte bench sim-speed: the compiled control plane did not load (pip install -e '.[compiled]')",
              file=sys.stderr)
        return 2
    out = {"benchmark": "sim-speed", "sessions": args.sessions, "workers": args.workers,
           "python": {k: py[k] for k in ("sim_requests_per_wall_s", "sim_requests_per_cpu_s", "wall_s", "cpu_s")},
           "compiled": {k: c[k] for k in ("sim_requests_per_wall_s", "sim_requests_per_cpu_s", "wall_s", "cpu_s")},
           "speedup_cpu": py["cpu_s"] / c["cpu_s"] if c["cpu_s"] > 0 else None,
           "speedup_wall": py["wall_s"] / c["wall_s"] if c["wall_s"] > 0 else None,
           "same_decisions": all(py[k] == c[k] for k in DECISIONS),
           "decisions": {k: py[k] for k in DECISIONS}, "goal": GOAL,
           "meets_goal": c["sim_requests_per_wall_s"] >= GOAL, "trace": py["trace"],
           "worker_busy_fraction": c["worker_busy_fraction"], "interpreter": c["interpreter"]}
    emit(out, args.json)
    return 0
