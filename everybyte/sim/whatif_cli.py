"""`everybyte sim whatif`: the tokens-per-MW table (JSON on stdout; --out DIR adds whatif.json,
whatif.md and whatif.png)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from everybyte.cli_args import counts, numbers
from everybyte.json_output import check_writable, emit
from everybyte.sim import expert_imbalance
from everybyte.sim.expert_parallel import ExpertParallel
from everybyte.sim.fleet_links import POD_FLASH
from everybyte.sim.models import get_model
from everybyte.sim.row_pool import default_jobs
from everybyte.sim.storage_links import tier_bytes
from everybyte.sim.whatif import (
    DISAGG_PREFILL_WORKERS,
    DISAGG_THRESHOLD_TOKENS,
    EPLB_AFTER,
    EPLB_BEFORE,
    FLEET_WORKERS,
    HOST_BYTES_PER_GPU,
    IMBALANCE_SOURCES,
    LEVERS,
    SYSTEMS,
    WhatIfConfig,
    run_whatif,
    watts_per_gpu,
)
from everybyte.sim.whatif_report import claims, markdown, plot
from everybyte.traces import TraceError, load_trace
from everybyte.traces.locate import default_trace
from everybyte.traces.scaling import Scaling

PROG = "everybyte sim whatif"
ROW_BYTES = 5 << 29           # 2.5 GiB for a row's process: no process of the default run went past 2.1 GB


def _jobs(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"needs a whole number of processes, at least 1; got {text!r}")
    return n


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="output tok/s per MW at fixed tok/s/user for DeepSeek-R1 "
                                "on an agentic workload, per hardware and lever",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hardware", default=",".join(SYSTEMS))
    p.add_argument("--levers", default=",".join(LEVERS))
    p.add_argument("--sessions-per-gpu", default="1,4,16", help="the load sweep (concurrent agent sessions)")
    p.add_argument("--max-sessions-per-gpu", type=int, default=64, help="the sweep doubles its last load up to "
                   "this while every load is more interactive than --mark")
    p.add_argument("--turns", type=int, default=6, help="each session's first turns")
    p.add_argument("--interactivity", default="50,100,160,200", help="tok/s/user columns")
    p.add_argument("--mark", type=float, default=160.0)
    p.add_argument("--max-ttft", type=float, default=10.0, help="seconds of TTFT p50 above which a load is off "
                   "the frontier (its prompts queue)")
    p.add_argument("--trace", default=None, help="agent sessions (default: the shared ones)")
    p.add_argument("--token-scale", type=float, default=None, help="default: bench agentic's for the format")
    p.add_argument("--max-num-batched-tokens", type=int, default=32, help="trace tokens per step per GPU")
    p.add_argument("--max-num-seqs", type=int, default=128, help="sequences per step per GPU")
    p.add_argument("--pod-flash-bandwidth", default=None, metavar="BYTES_PER_S", help="the pod flash tier's "
                   "aggregate bandwidth each way, shared by every worker (default: no cap beyond each worker's NIC)")
    p.add_argument("--imbalance", choices=IMBALANCE_SOURCES, default="cited",
                   help="max/mean tokens per GPU under EP: cited (DeepSeek-R1's EP32 pair, 2.56 / 1.11 with EPLB, at "
                        "every degree) or derived (per EP degree from an expert-load model fitted to that pair: "
                        "sim/expert_imbalance)")
    p.add_argument("--jobs", type=_jobs, default=None, help="rows simulated at once, each in its own process "
                   "(default: the usable CPUs, at most one per row and one per 2.5 GB of free memory; 1: in "
                   "this process)")
    p.add_argument("--out", default=None, help="directory for whatif.json, whatif.md, whatif.png")
    p.add_argument("--json", default=None)
    return p


def imbalance_assumption(cfg: WhatIfConfig) -> str:
    if cfg.imbalance == "cited":
        return (f"EPLB: imbalance (max/mean tokens per GPU) {EPLB_BEFORE} without, {EPLB_AFTER} with "
                "(../shared/specs/nvfp4.md, DeepSeek-R1 at EP32), applied at every EP degree (--imbalance derived: "
                "per degree)")
    t = expert_imbalance.table((8, 32, 64))
    per = "; ".join(f"EP{ep} {v['contiguous']:g} without, {v['eplb']:g} with" for ep, v in t["per_ep"].items())
    return (f"EPLB: imbalance derived per EP degree (sim/expert_imbalance: log-normal expert popularity of sigma "
            f"{t['sigma']:g}, drift {t['drift']:g} between EPLB's window and the judged steps, "
            f"{t['model']['redundant_per_gpu']} replica slot per GPU, both fitted to DeepSeek-R1's EP32 pair "
            f"{EPLB_BEFORE} / {EPLB_AFTER}): {per}")


def assumptions(cfg: WhatIfConfig, trace, scaling: Scaling, path: str) -> list[str]:
    w = scaling.token_scale
    out = [
        f"workload: {path} ({len(trace.sessions)} agent sessions, {trace.format}) cycled to sessions-per-GPU x "
        f"EP-degree sessions, each its first {cfg.turns} turns, starting over {cfg.start_window_s:g} s, parked "
        "during tool gaps >= 0.5 s; scaled as `bench agentic` scales them: " + scaling.describe()["rule"],
        f"scaled down for speed: a trace token stands for {w:g} real tokens in the cost model (its KV bytes, "
        "attention over it, its prefill FLOPs; decode tokens are real), so KV room in sessions and attention "
        f"traffic are at full scale; a step's budget per GPU of the worker is {cfg.max_num_batched_tokens} "
        f"trace tokens (= {cfg.max_num_batched_tokens * w:,.0f} real prefill tokens) and {cfg.max_num_seqs} "
        "sequences (attention is data-parallel over the worker's GPUs)",
        "baseline: FP8 weights, FP8 KV, EP8 (one worker = 8 GPUs), imbalance 2.56, no host staging; a lever "
        "changes one of these; 'all' = NVFP4 weights + NVFP4 KV + EP64 + EPLB + host staging, less what the hardware "
        "lacks (its row's 'dropped': EP capped at the NVLink domain, no staging without a host link)",
        "ep_overlap / ep32_overlap: EP8 / EP32 with the all-to-all hidden behind compute (two micro-batches, "
        "as DeepSeek serves R1), ideally: a step costs max(compute, all-to-all) instead of their sum",
        imbalance_assumption(cfg),
        f"host staging: parked sessions' KV offloaded to a G2 tier of the catalog's host memory per GPU, or "
        f"{HOST_BYTES_PER_GPU >> 30} GiB per GPU where it has a host link but no size; loads at the host link",
        "local_nvme: host staging + a G3 tier of the catalog's NVMe drives per worker below it (sim/storage_links: "
        "drives per GPU x GPUs, each at a Gen5 drive's 14 GB/s and 60 us); what overflows G2 spills there",
        "per system: throughput per GPU x the GPUs of the system (H200 NVL8: 8, NVL72: 72); one worker is "
        "simulated per configuration, the others are copies",
        "interactivity = 1 / TPOT p50 over turns; throughput = output tokens over the run's span (ramp-up and "
        "tail included); a column value is interpolated between the sweep's loads that bracket it; loads: "
        f"{cfg.sessions_per_gpu} sessions per GPU, the last doubled up to {cfg.max_sessions_per_gpu} while every "
        f"load is more interactive than {cfg.mark:g} tok/s/user",
        "extrapolation: no figure here is inside a calibrated range; step costs are the catalog roofline "
        "(sim calibrate / bench sim-accuracy fit this CPU only), so every value extrapolates the cost model",
        f"fleet levers (fleet_round_robin, kv_routing, kv_routing_disagg, pod_flash): {FLEET_WORKERS} workers of "
        "the baseline's EP8 behind a router (sessions per GPU x all their GPUs); fleet_round_robin is their "
        "reference (a KV-unaware load balancer); kv_routing routes with the cluster router's policy on its KV "
        "index fed by the workers' KV events (sim/fleet_router); kv_routing_disagg adds conditional "
        f"disaggregation, {DISAGG_PREFILL_WORKERS} prefill + {FLEET_WORKERS - DISAGG_PREFILL_WORKERS} decode "
        f"workers, threshold {DISAGG_THRESHOLD_TOKENS} real tokens of uncached prefill, the KV moved at NVLink "
        "within one domain, the NIC otherwise; pod_flash = round-robin + a pod flash tier (G3.5) every worker "
        "writes new blocks through to and loads from at the NIC's bandwidth (sim/fleet_links: "
        + "; ".join(f"{k} {v:g} from {src}" for k, (v, src) in POD_FLASH.items()) + "); "
        "'all' stacks the per-worker levers on one worker (the fleet levers are not in it)",
        "tier links (sim/link_lanes): each worker's loads queue on its own link per tier and direction, writes "
        "(offloads, spills, write-through) hold the write lane and a read waits for its blocks' write; the pod "
        "flash tier's aggregate: " + (f"{cfg.pod_flash_bandwidth} per second each way, shared by every worker"
                                      if cfg.pod_flash_bandwidth else "not capped (no source gives it)"),
        f"queueing: a load whose TTFT p50 exceeds {cfg.max_ttft_s:g} s is off the frontier and ends the sweep "
        "(per-token speed alone would flatter a decode worker behind saturated prefill workers)",
    ]
    out += [f"power: {hw}: {watts_per_gpu(hw)[1]}" for hw in cfg.hardware]
    m = get_model("deepseek-r1")
    out.append(f"model: deepseek-r1 ({m.active_params() / 1e9:.1f}B active), step time roofline per GPU: "
               + "; ".join(ExpertParallel(8).describe()["assumptions"]))
    return out


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        cfg = WhatIfConfig(hardware=args.hardware.split(","), levers=args.levers.split(","),
                           sessions_per_gpu=counts("--sessions-per-gpu", args.sessions_per_gpu), turns=args.turns,
                           max_sessions_per_gpu=args.max_sessions_per_gpu,
                           interactivity=numbers("--interactivity", args.interactivity), mark=args.mark,
                           max_ttft_s=args.max_ttft,
                           max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                           pod_flash_bandwidth=args.pod_flash_bandwidth, imbalance=args.imbalance)
        cfg.check()
        check_writable(args.out, directory=True)         # before the rows run, not after
        check_writable(args.json)
        if cfg.mark not in cfg.interactivity:
            cfg.interactivity = sorted(cfg.interactivity + [cfg.mark])
        if cfg.pod_flash_bandwidth is not None:
            tier_bytes("--pod-flash-bandwidth", cfg.pod_flash_bandwidth, 0)      # bad input fails here, not per row
        path = args.trace or default_trace()
        trace = load_trace(path)
        scaling = Scaling.defaults(trace.format, get_model("deepseek-r1").max_len, token_scale=args.token_scale)

        def progress(row):
            print(f"{PROG}: {row['hardware']} {row['lever']} done", file=sys.stderr)

        jobs = args.jobs or default_jobs(len(cfg.hardware) * len(cfg.levers), ROW_BYTES)
        rows = run_whatif(cfg, trace, scaling, progress, jobs)
        result = {"benchmark": "sim-whatif", "config": asdict(cfg), "rows": rows,
                  "claims": claims(rows, cfg.mark), "assumptions": assumptions(cfg, trace, scaling, path)}
    except (ValueError, TraceError, OSError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:                   # a worker process died
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "whatif.md"), "w") as f:
            f.write(markdown(result))
        result["plot"] = plot(result, os.path.join(args.out, "whatif.png")) or "matplotlib not installed: no plot"
        with open(os.path.join(args.out, "whatif.json"), "w") as f:
            json.dump(result, f, indent=1)
    emit(result, args.json)
    return 0
