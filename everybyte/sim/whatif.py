"""`everybyte sim whatif` (issue #20 item 6): output tokens per second per MW at fixed per-user
interactivity for an agentic workload on DeepSeek-R1, per hardware, with each lever off and on
and all stacked. Every figure comes from simulated runs (sim/runner on one worker of EP-degree
GPUs at a sweep of loads); every assumption is listed with the output (ASSUMPTIONS, describe()).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

from everybyte.sim import expert_imbalance
from everybyte.sim.build import SimConfig
from everybyte.sim.fleet_build import FleetConfig, build_fleet
from everybyte.sim.hardware import get_hardware
from everybyte.sim.row_pool import run_rows
from everybyte.sim.runner import RunConfig, Runner
from everybyte.sim.storage_links import LOCAL_NVME
from everybyte.traces.model import Trace
from everybyte.traces.scaling import Scaling
from everybyte.traces.tokens import TokenSpace

EPLB_BEFORE, EPLB_AFTER = expert_imbalance.CITED_BEFORE, expert_imbalance.CITED_AFTER   # R1 at EP32, max/mean
HOST_BYTES_PER_GPU = 256 << 30                 # staging room where the catalog has a host link but no size
FLEET_WORKERS = 4                              # workers (of EP-degree GPUs each) in a fleet lever's pod
DISAGG_THRESHOLD_TOKENS = 2048                 # real tokens of uncached prefill above which a turn disaggregates
DISAGG_PREFILL_WORKERS = 3                     # of FLEET_WORKERS: the agentic workload is mostly prefill


@dataclass(frozen=True)
class Scenario:
    weights_format: str = "fp8"
    kv_format: str = "fp8"
    ep: int = 8
    eplb: bool = False                # experts placed by EPLB (with replicas), else split contiguously
    overlap: bool = False             # the all-to-all hidden behind compute (two-batch overlap)
    host_staging: bool = False
    workers: int = 1                  # a fleet of this many workers behind the router
    route: str = "sticky"             # sim run --route: sticky | round-robin | kv
    disagg: bool = False              # DISAGG_PREFILL_WORKERS of the workers prefill, the rest decode
    pod_flash: bool = False           # the pod flash tier (G3.5, CMX-like) shared by the workers
    local_nvme: bool = False          # a G3 tier of the catalog's NVMe drives per worker, below G2


ALL: dict[str, Any] = {"weights_format": "nvfp4", "kv_format": "nvfp4", "ep": 64, "eplb": True,
                       "host_staging": True, "local_nvme": True}
# `all_fleet`: ALL_FLEET_WORKERS workers of `all` behind the kv router sharing a pod flash tier
# (2, not FLEET_WORKERS: 4 x EP64 is 256 GPUs, whose sweep outlasts this host's patience)
ALL_FLEET_WORKERS = 2

# lever -> what it changes on the baseline (None: not simulated, with the reason)
LEVERS: dict[str, dict[str, Any] | str] = {
    "baseline": {},
    "nvfp4_weights": {"weights_format": "nvfp4"},
    "nvfp4_kv": {"kv_format": "nvfp4"},
    "ep32": {"ep": 32},
    "ep64": {"ep": 64},
    "ep_overlap": {"overlap": True},
    "ep32_overlap": {"ep": 32, "overlap": True},
    "eplb": {"eplb": True},
    "host_staging": {"host_staging": True},
    "local_nvme": {"host_staging": True, "local_nvme": True},
    "fleet_round_robin": {"workers": FLEET_WORKERS, "route": "round-robin"},
    "kv_routing": {"workers": FLEET_WORKERS, "route": "kv"},
    "kv_routing_disagg": {"workers": FLEET_WORKERS, "route": "kv", "disagg": True},
    "pod_flash": {"workers": FLEET_WORKERS, "route": "round-robin", "pod_flash": True},
    "all": ALL,
    "all_fleet": {**ALL, "workers": ALL_FLEET_WORKERS, "route": "kv", "pod_flash": True},
}
STACKED = ("all", "all_fleet")
SYSTEMS = {"H200": 8, "GB300-NVL72": 72, "VR-NVL72": 72}       # GPUs in one system (NVLink domain)


@dataclass
class WhatIfConfig:
    hardware: list[str] = field(default_factory=lambda: list(SYSTEMS))
    levers: list[str] = field(default_factory=lambda: list(LEVERS))
    sessions_per_gpu: list[int] = field(default_factory=lambda: [1, 4, 16])
    turns: int = 6                              # each session's first turns
    max_sessions_per_gpu: int = 64              # the sweep doubles its last load up to this until the mark is reached
    max_ttft_s: float = 10.0                    # a load whose TTFT p50 exceeds this is off the frontier (queueing)
    interactivity: list[float] = field(default_factory=lambda: [50.0, 100.0, 160.0, 200.0])
    mark: float = 160.0
    start_window_s: float = 1.0                 # sessions start spread over this
    # per GPU of the worker (attention is data-parallel: each GPU batches its own share)
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 32            # trace tokens per step (each token_scale real ones in prefill)
    memory_utilization: float = 0.9
    pod_flash_bandwidth: str | None = None      # the pod flash tier's aggregate bytes/s each way (None: no cap)
    imbalance: str = "cited"                    # cited: EP32's pair at every degree; derived: sim/expert_imbalance

    def check(self) -> None:
        """ValueError for a configuration no row could run (before any row starts)."""
        for hw_name in self.hardware:
            get_hardware(hw_name)                              # an unknown name lists the known ones
        for lever in self.levers:
            if lever not in LEVERS:
                raise ValueError(f"unknown lever {lever!r}; known: {', '.join(LEVERS)}")
        whole = {"--sessions-per-gpu": min(self.sessions_per_gpu, default=0), "--turns": self.turns,
                 "--max-sessions-per-gpu": self.max_sessions_per_gpu, "--max-num-seqs": self.max_num_seqs,
                 "--max-num-batched-tokens": self.max_num_batched_tokens}
        for flag, value in whole.items():
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        for flag, x in (("--interactivity", min(self.interactivity, default=0.0)), ("--mark", self.mark),
                        ("--max-ttft", self.max_ttft_s)):
            if not x > 0:
                raise ValueError(f"{flag} must be > 0, got {x:g}")
        if not self.start_window_s >= 0 or not 0 < self.memory_utilization <= 1:
            raise ValueError("the start window must be >= 0 s and memory utilization in (0, 1]")
        if self.imbalance not in IMBALANCE_SOURCES:
            raise ValueError(f"imbalance must be one of {', '.join(IMBALANCE_SOURCES)}, got {self.imbalance!r}")


def watts_per_gpu(hw_name: str) -> tuple[float, str]:
    hw = get_hardware(hw_name)
    if (w := hw.get("gpu_power_w")) is not None:
        return w, f"GPU TDP {w:g} W ({hw.figures['gpu_power_w'][1]})"
    rack = hw.need("rack_power_w")
    n = SYSTEMS.get(hw.name) or int(hw.need("nvlink_domain_gpus"))
    return rack / n, f"rack {rack:g} W / {n} GPUs, includes CPUs and switches ({hw.figures['rack_power_w'][1]})"


IMBALANCE_SOURCES = ("cited", "derived")


def imbalance_of(cfg: WhatIfConfig, s: Scenario) -> float:
    """max/mean tokens per GPU for the scenario: the cited EP32 figures at every degree, or the
    degree's own under the fitted expert-load model (sim/expert_imbalance)."""
    if cfg.imbalance == "derived":
        return expert_imbalance.derived(s.ep, s.eplb)
    if cfg.imbalance != "cited":
        raise ValueError(f"imbalance source {cfg.imbalance!r}: one of {', '.join(IMBALANCE_SOURCES)}")
    return EPLB_AFTER if s.eplb else EPLB_BEFORE


def scenario_for(lever: str) -> Scenario | str:
    change = LEVERS[lever]
    return change if isinstance(change, str) else replace(Scenario(), **change)


def fit_to(hw_name: str, s: Scenario) -> tuple[Scenario, list[str]]:
    """'all' (and 'all_fleet') on a hardware that lacks a lever: the widest EP its NVLink domain
    holds (EP across nodes is the ep32/ep64 rows' question: over the NIC, without overlap, it
    costs this prefill-heavy workload more than it saves), no host staging without a host link,
    no local NVMe without drive figures; what was dropped is said."""
    hw, dropped = get_hardware(hw_name), []
    domain = int(hw.need("nvlink_domain_gpus"))
    if s.ep > domain:
        dropped.append(f"EP{s.ep} (NVLink domain of {domain}: EP{domain}; across nodes see the ep32/ep64 rows)")
        s = replace(s, ep=domain)
    if s.host_staging and hw.get("host_bytes_per_s") is None:
        dropped.append("host staging (no sourced host link)")
        s = replace(s, host_staging=False)
    if s.local_nvme and hw.name not in LOCAL_NVME:
        dropped.append("local NVMe (no sourced drive figures)")
        s = replace(s, local_nvme=False)
    return s, dropped


def why_not(hw_name: str, s: Scenario) -> str | None:
    hw = get_hardware(hw_name)
    domain = int(hw.need("nvlink_domain_gpus"))
    if s.ep > domain and hw.get("nic_bytes_per_s") is None:
        return f"EP{s.ep} exceeds the NVLink domain of {domain} GPUs and the catalog has no NIC figure to cross it"
    if s.host_staging and hw.get("host_bytes_per_s") is None:
        return "no sourced host link (C2C/PCIe) bandwidth for this hardware in the catalog"
    if s.local_nvme and hw.name not in LOCAL_NVME:
        return "no sourced local NVMe figures (drives per GPU, drive capacity) for this hardware in the catalog"
    return None


def workload(trace: Trace, n_sessions: int, turns: int) -> Trace:
    """n_sessions sessions cycling through the trace's (copies get their own ids, so their tokens
    and blocks are their own), each cut to its first `turns` turns."""
    out = copy.copy(trace)
    out.sessions = []
    for i in range(n_sessions):
        s = copy.copy(trace.sessions[i % len(trace.sessions)])
        s.id = f"{s.id}-c{i // len(trace.sessions)}"
        s.turns = s.turns[:turns]
        out.sessions.append(s)
    return out


def run_point(cfg: WhatIfConfig, hw_name: str, s: Scenario, trace: Trace, scaling: Scaling,
              per_gpu: int) -> dict[str, Any]:
    host = None
    if s.host_staging:
        size = get_hardware(hw_name).get("host_bytes") or HOST_BYTES_PER_GPU
        host = str(int(size * s.ep))
    sim = SimConfig(hw_name, "deepseek-r1", s.workers, s.ep, s.weights_format, s.kv_format, None,
                    cfg.memory_utilization, host, 16, cfg.max_num_seqs * s.ep, cfg.max_num_batched_tokens * s.ep,
                    ep=True, expert_imbalance=imbalance_of(cfg, s), token_weight=scaling.token_scale, ep_overlap=s.overlap,
                    disk_tier="catalog" if s.local_nvme else None)
    threshold = max(int(DISAGG_THRESHOLD_TOKENS / scaling.token_scale), 0) if s.disagg else None
    prefill = min(DISAGG_PREFILL_WORKERS, s.workers - 1) if s.disagg else None
    fleet = build_fleet(sim, FleetConfig(s.route, s.workers, prefill, None if prefill is None else s.workers - prefill,
                                         threshold, "catalog" if s.pod_flash else None,
                                         pod_flash_bandwidth=cfg.pod_flash_bandwidth if s.pod_flash else None))
    cost, workers = fleet.cost, fleet.workers
    gpus = s.ep * s.workers
    n = per_gpu * gpus
    runner = Runner(workload(trace, n, cfg.turns), scaling, TokenSpace.compact(), workers,
                    RunConfig(park=True, rate=n / cfg.start_window_s), fleet.route, cost.weight_bytes(),
                    fleet.disagg, fleet.isolated)
    sm = runner.run()
    tpot = sm["tpot_s"]["p50"]
    watts, _ = watts_per_gpu(hw_name)
    per_gpu_tok_s = sm["output_tok_s"] / gpus
    return {"sessions_per_gpu": per_gpu, "sessions": n, "requests": sm["requests"],
            "tok_s_per_user": 1.0 / tpot if tpot else None, "tok_s_per_gpu": per_gpu_tok_s,
            "tok_s_per_mw": per_gpu_tok_s / (watts / 1e6), "ttft_p50_s": sm["ttft_s"]["p50"],
            "preemptions": sm["preemptions"], "reuse_fraction": sm["prefill_tokens"]["reuse_fraction"],
            "prefill_computed": sm["prefill_tokens"]["computed"], "reused_by_tier": sm["prefill_tokens"]["by_tier"],
            "kv_blocks_per_worker": workers[0].spec.pool.num_blocks, "skipped": sm["skipped_turns"],
            "wall_s": sm["wall_s"]}


def at_interactivity(points: list[dict], x: float, max_ttft_s: float = float("inf")) -> dict[str, Any]:
    """tok/s/MW at x tok/s/user on the sweep's frontier: interpolated between the loads that
    bracket x; every load faster than x: the most loaded point, a lower bound (the sweep did not
    load the system down to x); every load slower: unreachable. A load whose TTFT p50 exceeds
    max_ttft_s is left out (its prompts queue: per-token speed alone would flatter it, e.g. a
    decode worker behind saturated prefill workers)."""
    kept = [p for p in points if (p.get("ttft_p50_s") or 0.0) <= max_ttft_s]
    capped = f" ({len(points) - len(kept)} loads left out: TTFT p50 over {max_ttft_s:g} s)" if len(kept) < len(points) else ""
    pts = sorted((p for p in kept if p["tok_s_per_user"]), key=lambda p: p["tok_s_per_user"])
    if not pts or pts[-1]["tok_s_per_user"] < x:
        return {"tok_s_per_mw": None, "how": "unreachable: no load of the sweep is this interactive" + capped}
    if pts[0]["tok_s_per_user"] >= x:
        best = max(pts, key=lambda p: p["tok_s_per_mw"])
        return {"tok_s_per_mw": best["tok_s_per_mw"], "how": "lower bound: every load of the sweep is more "
                f"interactive (slowest {pts[0]['tok_s_per_user']:.0f} tok/s/user); more load would give more"}
    for lo, hi in zip(pts, pts[1:]):
        if lo["tok_s_per_user"] <= x <= hi["tok_s_per_user"]:
            f = (x - lo["tok_s_per_user"]) / max(hi["tok_s_per_user"] - lo["tok_s_per_user"], 1e-12)
            v = lo["tok_s_per_mw"] + f * (hi["tok_s_per_mw"] - lo["tok_s_per_mw"])
            return {"tok_s_per_mw": v, "how": "interpolated between the two loads that bracket it"}
    raise AssertionError("unreachable")


def sweep(cfg: WhatIfConfig, hw_name: str, s: Scenario, trace: Trace, scaling: Scaling) -> list[dict[str, Any]]:
    """The given loads, then the last one doubled (up to max_sessions_per_gpu) while every point
    is still more interactive than the mark."""
    loads = list(cfg.sessions_per_gpu)
    points = [run_point(cfg, hw_name, s, trace, scaling, n) for n in loads]
    while (min((p["tok_s_per_user"] for p in points if p["tok_s_per_user"]), default=0.0) > cfg.mark
           and loads[-1] * 2 <= cfg.max_sessions_per_gpu
           and all((p["ttft_p50_s"] or 0.0) <= cfg.max_ttft_s for p in points)):
        loads.append(loads[-1] * 2)
        points.append(run_point(cfg, hw_name, s, trace, scaling, loads[-1]))
    return points


def run_row(cfg: WhatIfConfig, trace: Trace, scaling: Scaling, hw_name: str, lever: str) -> dict[str, Any]:
    """One table row: the lever's sweep on the hardware, or why it is not simulated."""
    s = scenario_for(lever)
    row: dict[str, Any] = {"hardware": hw_name, "lever": lever}
    reason = s if isinstance(s, str) else None if lever in STACKED else why_not(hw_name, s)
    if reason is not None:
        return {**row, "simulated": False, "why_not": reason}
    assert isinstance(s, Scenario)
    if lever in STACKED:
        s, row["dropped"] = fit_to(hw_name, s)
    try:
        points = sweep(cfg, hw_name, s, trace, scaling)
    except ValueError as e:                            # e.g. the weights do not fit
        return {**row, "simulated": False, "why_not": str(e),
                "scenario": {**s.__dict__, "imbalance": imbalance_of(cfg, s)}}
    at = {f"{x:g}": at_interactivity(points, x, cfg.max_ttft_s) for x in cfg.interactivity}
    return {**row, "simulated": True, "scenario": {**s.__dict__, "imbalance": imbalance_of(cfg, s)},
            "points": points, "at": at}


def run_whatif(cfg: WhatIfConfig, trace: Trace, scaling: Scaling, progress=None, jobs: int = 1) -> list[dict[str, Any]]:
    """Every (hardware, lever) row, in that order; jobs > 1 runs rows in that many processes
    (sim/row_pool: the rows are independent and each is deterministic, so the table is the same)."""
    cfg.check()
    tasks = [(hw_name, lever) for hw_name in cfg.hardware for lever in cfg.levers]
    return run_rows(run_row, (cfg, trace, scaling), tasks, jobs, progress, [_gpus(lever) for _, lever in tasks])


def _gpus(lever: str) -> int:
    """GPUs a lever's row simulates: its sessions, and so its cost, grow with them."""
    s = scenario_for(lever)
    return 0 if isinstance(s, str) else s.ep * s.workers
