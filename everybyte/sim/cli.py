"""`everybyte sim run|hardware|models`: replay agent sessions on simulated workers (the engine's own
control plane on a virtual clock and a hardware cost model); print the catalog."""
from __future__ import annotations

import argparse
import json
import sys

from everybyte.cli_args import count, counts, non_negative, positive
from everybyte.formats.sizes import KV_CACHE_DTYPES, WEIGHT_FORMATS
from everybyte.json_output import check_writable, emit
from everybyte.native import compiled
from everybyte.sim.build import SimConfig
from everybyte.sim.calibration import StepFit, StepSample, fit_steps
from everybyte.sim.fleet_build import FLEET_ROUTES, FleetConfig, build_fleet, fleet_summary, link_stats
from everybyte.sim.hardware import get_hardware, names
from everybyte.sim.models import BUILTIN, get_model
from everybyte.sim.routes import ROUTES
from everybyte.sim.runner import RunConfig, Runner
from everybyte.sim.storage_links import describe_catalog
from everybyte.traces import FORMATS, TraceError, load_trace
from everybyte.traces.scaling import Scaling
from everybyte.traces.tokens import TokenSpace

PROG = "everybyte sim"


def add_config_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("machine and model")
    g.add_argument("--hardware", default="H200", help=f"one of {', '.join(names())}")
    g.add_argument("--model", default="smollm2", help=f"{', '.join(BUILTIN)}, or a config.json / HF directory")
    g.add_argument("--workers", type=int, default=None, help="engine instances (default 1, or --prefill + --decode)")
    g.add_argument("--gpus-per-worker", type=int, default=1)
    g.add_argument("--weights-format", choices=WEIGHT_FORMATS, default="bf16")
    g.add_argument("--kv-format", choices=KV_CACHE_DTYPES, default="bf16")
    g.add_argument("--kv-cache", default=None, help="KV bytes per worker (default: the device after the weights)")
    g.add_argument("--memory-utilization", type=float, default=0.9)
    g.add_argument("--host-tier", default=None, help="G2 host tier bytes per worker, e.g. 64GiB (default none)")
    g.add_argument("--disk-tier", nargs="?", const="catalog", default=None, metavar="BYTES",
                   help="G3 local NVMe tier per worker, below G2 (--kv-tiers disk:); BYTES or the catalog's "
                   "drives per GPU x the worker's GPUs (sim/storage_links)")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=8192)
    g.add_argument("--step-overhead-us", type=float, default=0.0, help="fixed cost per step (not calibrated)")
    g.add_argument("--ep", action="store_true", help="expert parallelism over --gpus-per-worker (all-to-all "
                   "over NVLink, experts spread) instead of ideal scaling")
    g.add_argument("--expert-imbalance", type=float, default=1.0, help="with --ep: max/mean tokens per GPU "
                   "(no EPLB ~2.56, EPLB ~1.11 for DeepSeek-R1 at EP32, ../shared/specs/nvfp4.md)")
    g.add_argument("--ep-overlap", action="store_true", help="with --ep: the all-to-all hidden behind compute "
                   "(two micro-batches, as DeepSeek serves R1): a step costs max(compute, all-to-all), ideally")


def config_from(args) -> SimConfig:
    return SimConfig(args.hardware, args.model, args.workers or 1, args.gpus_per_worker, args.weights_format,
                     args.kv_format, args.kv_cache, args.memory_utilization, args.host_tier, args.block_size,
                     args.max_num_seqs, args.max_num_batched_tokens, args.step_overhead_us * 1e-6, args.ep,
                     args.expert_imbalance, disk_tier=args.disk_tier, ep_overlap=args.ep_overlap)


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"{PROG} run", description="replay agent sessions on simulated workers",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_config_args(p)
    t = p.add_argument_group("trace (the importers and scaling of `bench agentic`)")
    t.add_argument("--trace", default="synthetic", help="session .json file or directory, Mooncake .jsonl, "
                   "Azure .csv, or synthetic[:sessions=8,...]")
    t.add_argument("--trace-format", choices=FORMATS, default=None)
    t.add_argument("--skip-bad", action="store_true")
    t.add_argument("--max-sessions", type=count, default=None)
    for flag, kind in (("--token-scale", float), ("--output-scale", float), ("--max-context", int),
                       ("--max-output", int), ("--gap-scale", float), ("--max-gap", float), ("--arrival-scale", float)):
        t.add_argument(flag, type=kind, default=None)
    t.add_argument("--vocab-range", default=None, metavar="LOW,HIGH",
                   help="token ids of the synthetic prompts (default 0,256: TokenSpace.compact)")
    r = p.add_argument_group("replay")
    r.add_argument("--route", choices=[*ROUTES, *FLEET_ROUTES], default="sticky",
                   help="kv: the cluster router's policy (cluster/policy) on its KV index fed by the workers' events")
    r.add_argument("--prefill", type=int, default=None, help="prefill workers (with --decode and --disagg-threshold)")
    r.add_argument("--decode", type=int, default=None, help="decode workers (with --prefill)")
    r.add_argument("--disagg-threshold", type=int, default=None, metavar="TOKENS",
                   help="a turn whose uncached prefill exceeds TOKENS prefills on a prefill worker first")
    r.add_argument("--pod-flash", nargs="?", const="catalog", default=None, metavar="BYTES",
                   help="a pod flash tier (G3.5, CMX-like) shared by every worker; BYTES or the catalog's 1 PB")
    r.add_argument("--shared-storage", nargs="?", const="catalog", default=None, metavar="BYTES",
                   help="shared storage (G4, a shared file system / object store over the network, --kv-tiers "
                   "cold:) at the end of every worker's spill chain; BYTES or the catalog's 10 PB")
    r.add_argument("--pod-flash-bandwidth", default=None, metavar="BYTES_PER_S",
                   help="the pod flash tier's aggregate bandwidth each way, e.g. 400GB: every worker's reads and "
                   "writes also queue on it (default: no cap beyond each worker's NIC)")
    r.add_argument("--shared-storage-bandwidth", default=None, metavar="BYTES_PER_S",
                   help="the shared storage's aggregate bandwidth each way (default: no cap beyond each worker's link)")
    r.add_argument("--no-park", action="store_true", help="do not park sessions during tool gaps")
    r.add_argument("--park-min-gap", type=non_negative, default=0.5)
    r.add_argument("--no-multi-step", action="store_true", help="step every decode token (the same decisions, "
                   "slower: for checking multi-step decode)")
    r.add_argument("--rate", type=positive, default=None, help="sessions/s (default: the recorded arrivals)")
    r.add_argument("--max-requests", type=count, default=None)
    r.add_argument("--calibration", default=None, help="step times from a `sim calibrate` fit instead of "
                   "the roofline (steps outside its range are counted)")
    r.add_argument("--json", default=None, help="write the JSON here too")
    return p


def calibrate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=f"{PROG} calibrate", description="fit the step time to the real engine "
                                "on this machine (runs it; needs torch)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="the real engine's model (default: the embedded one)")
    p.add_argument("--prompt-lens", default="16,64,256")
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--max-tokens", type=count, default=6)
    p.add_argument("--kv-cache-dtype", default="nvfp4")
    p.add_argument("--out", default="sim-calibration.json", help="where the fit is saved")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    lens, batches = counts("--prompt-lens", args.prompt_lens), counts("--batches", args.batches)
    check_writable(args.out, args.json)          # before minutes of profiling, not after
    from everybyte.engine.step_profile import profile_steps  # the real engine: imports torch
    raw, info = profile_steps(args.model, lens, batches, args.max_tokens, kv_cache_dtype=args.kv_cache_dtype)
    fit = fit_steps([StepSample(*r) for r in raw], {**info, "machine": "this machine (cpu-this-machine)"})
    fit.save(args.out)
    emit({"benchmark": "sim-calibrate", "saved": args.out, "coefficients": fit.coefficients,
          "residuals": fit.residuals, "samples": fit.samples, "source": fit.source}, args.json)
    return 0


def token_space(vocab_range: str | None) -> TokenSpace:
    """--vocab-range LOW,HIGH, or the simulator's compact ids."""
    return TokenSpace.parse(vocab_range) if vocab_range else TokenSpace.compact()


def run_sim(args, cfg: SimConfig) -> dict:
    fleet_cfg = FleetConfig(args.route, args.workers, args.prefill, args.decode, args.disagg_threshold,
                            args.pod_flash, args.shared_storage, args.pod_flash_bandwidth,
                            args.shared_storage_bandwidth)
    fleet = build_fleet(cfg, fleet_cfg, StepFit.load(args.calibration) if args.calibration else None)
    cost, workers, info = fleet.cost, fleet.workers, fleet.info
    trace = load_trace(args.trace, skip_bad=args.skip_bad, fmt=args.trace_format)
    if args.max_sessions:
        trace.sessions = trace.sessions[:args.max_sessions]
    scaling = Scaling.defaults(trace.format, cost.model.max_len, token_scale=args.token_scale,
                               output_scale=args.output_scale, max_context=args.max_context,
                               max_output=args.max_output, gap_scale=args.gap_scale, max_gap_s=args.max_gap,
                               arrival_scale=args.arrival_scale)
    space = token_space(args.vocab_range)
    runner = Runner(trace, scaling, space, workers,
                    RunConfig(park=not args.no_park, park_min_gap_s=args.park_min_gap,
                              max_requests=args.max_requests, rate=args.rate,
                              multi_step=not args.no_multi_step),
                    fleet.route, cost.weight_bytes(), fleet.disagg, fleet.isolated)
    summary = runner.run()
    summary["fleet"] = fleet_summary(fleet, runner.turns, cost.weight_bytes())
    summary["links"] = link_stats(fleet)
    summary["compiled"] = compiled.active()      # the control plane built with mypyc (native/compiled)
    if cost.calibration is not None:
        summary["steps_outside_calibrated_range"] = cost.outside_range
    return {"benchmark": "sim", "summary": summary,
            "assumptions": {**info, "trace": {"path": args.trace, **trace.describe()},
                            "scaling": scaling.describe(), "token_ids": [space.low, space.high],
                            "route": args.route, "park": not args.no_park,
                            "park_min_gap_s": args.park_min_gap,
                            "arrivals": f"{args.rate} sessions/s" if args.rate else "recorded x arrival_scale"}}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = (f"usage: {PROG} COMMAND [args]\n\ncommands:\n  run          replay agent sessions on simulated "
             f"workers\n  calibrate    fit step times to the real engine on this machine\n  whatif       tok/s per MW at fixed tok/s/user per hardware and lever (DeepSeek-R1)\n  hardware     the hardware catalog with its sources [NAME]\n  models       the model "
             f"catalog [NAME|PATH]")
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd == "hardware":
            hws = [get_hardware(rest[0])] if rest else [get_hardware(n) for n in names()]
            print(json.dumps([{**h.describe(), "storage_tiers": describe_catalog(h.name)} for h in hws], indent=1))
            return 0
        if cmd == "models":
            models = [get_model(rest[0])] if rest else [get_model(n) for n in BUILTIN]
            print(json.dumps([{f: m.describe(f, "bf16" if f == "bf16" else f) for f in ("bf16", "fp8", "nvfp4")}
                              for m in models], indent=1))
            return 0
        if cmd == "calibrate":
            return calibrate(rest)
        if cmd == "whatif":
            from everybyte.sim.whatif_cli import main as whatif
            return whatif(rest)
        if cmd != "run":
            print(f"{PROG}: unknown command {cmd!r}; choose from run, calibrate, whatif, hardware, models", file=sys.stderr)
            return 2
        args = run_parser().parse_args(rest)
        check_writable(args.json)
        result = run_sim(args, config_from(args))
    except (ValueError, TraceError, OSError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    emit(result, args.json)
    return 0
