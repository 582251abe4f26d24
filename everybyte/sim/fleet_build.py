"""A simulated fleet: the workers of `sim/build` with roles (`everybyte cluster`'s --prefill /
--decode rules), the routing (the runner's sticky / round-robin, or the cluster router's policies
through sim/fleet_router), conditional disaggregation (sim/fleet_disagg), the pod flash tier
(G3.5: one name-only tier every worker holds, write-through as the real shared tiers are) and the
shared storage (G4: one name-only tier at the end of every worker's spill chain, as the real
engine's `cold:` tier is)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from everybyte.cluster.policy import Policy
from everybyte.cluster.worker_state import plan_roles
from everybyte.kv.events import BlockRemoved
from everybyte.sim.build import SimConfig, build
from everybyte.sim.calibration import StepFit
from everybyte.sim.cost_model import CostModel
from everybyte.sim.fleet_disagg import Disaggregation
from everybyte.sim.fleet_links import POD_FLASH, pod_flash_link, remote_link
from everybyte.sim.fleet_links import describe as describe_links
from everybyte.sim.fleet_router import FleetRouter
from everybyte.sim.link_lanes import Lane, aggregate_lane, merge_stats
from everybyte.sim.metrics import TurnRecord
from everybyte.sim.routes import ROUTES
from everybyte.sim.storage_links import SHARED_STORAGE, describe_shared, shared_storage_link, tier_bytes
from everybyte.sim.tiers import NameTier
from everybyte.sim.worker import SimPool, SimWorker

FLEET_ROUTES = ("kv",)
# the cluster policy a runner route stands for when the cluster router must route (disaggregation)
AS_POLICY = {"sticky": "session", "round-robin": "round-robin", "kv": "kv"}


@dataclass
class FleetConfig:
    route: str = "sticky"                     # sticky | round-robin (sim/runner) | kv (the cluster router)
    workers: int | None = None                # as given (None: 1, or --prefill + --decode)
    prefill: int | None = None
    decode: int | None = None
    disagg_threshold: int | None = None       # tokens of uncached prefill above which a turn disaggregates
    pod_flash: str | None = None              # G3.5 bytes for the pod ("catalog": POD_FLASH); None: none
    shared_storage: str | None = None         # G4 bytes for the fleet ("catalog": SHARED_STORAGE); None: none
    pod_flash_bandwidth: str | None = None    # the pod flash tier's aggregate bytes/s, each way; None: no cap
    shared_storage_bandwidth: str | None = None   # the shared storage's aggregate bytes/s, each way; None: no cap
    overlap_weight: float = 1.0


@dataclass
class Fleet:
    cost: CostModel
    workers: list[SimWorker]
    info: dict[str, Any]
    roles: list[str]
    route: Callable
    router: FleetRouter | None = None
    disagg: Disaggregation | None = None
    pod_lanes: dict[tuple[str, str], Lane] = field(default_factory=dict)
    isolated: bool = False           # workers share nothing: no router reading them, no disaggregation,
                                     # no shared tier or lane (runner.Runner's `isolated`)


def roles_for(f: FleetConfig) -> list[str]:
    if f.route not in (*ROUTES, *FLEET_ROUTES):
        raise ValueError(f"unknown route {f.route!r}; choose from {', '.join((*ROUTES, *FLEET_ROUTES))}")
    roles = plan_roles(f.workers if f.workers is not None or f.prefill is not None else 1, f.prefill, f.decode)
    if f.prefill is not None and f.disagg_threshold is None:
        raise ValueError("--prefill/--decode need --disagg-threshold TOKENS (without it the router sends "
                         "nothing to prefill workers)")
    if f.disagg_threshold is not None and f.prefill is None:
        raise ValueError("--disagg-threshold needs prefill workers: --prefill P --decode D")
    if f.disagg_threshold is not None and f.disagg_threshold < 0:
        raise ValueError(f"--disagg-threshold must be >= 0 tokens, got {f.disagg_threshold}")
    return roles


def build_fleet(cfg: SimConfig, f: FleetConfig, calibration: StepFit | None = None) -> Fleet:
    roles = roles_for(f)
    pod_bytes = None if f.pod_flash is None else \
        tier_bytes("--pod-flash", f.pod_flash, int(POD_FLASH["capacity_bytes"][0]))
    g4_bytes = None if f.shared_storage is None else \
        tier_bytes("--shared-storage", f.shared_storage, int(SHARED_STORAGE["capacity_bytes"][0]))
    fleet_tiers: list[NameTier] = []

    def shared(pool: SimPool) -> list:
        for nbytes, level, kind in ((pod_bytes, "G3.5", "pod-flash"), (g4_bytes, "G4", "shared-storage")):
            if nbytes is not None:
                fleet_tiers.append(NameTier(nbytes, level, pool.bytes_per_block, kind=kind))
        return fleet_tiers
    pod_lanes, aggregate = _pod_lanes(f)
    cost, workers, info = build(replace(cfg, workers=len(roles)), calibration, shared, pod_lanes)
    links: dict[str, Any] = {}
    if f.disagg_threshold is not None:
        cost.tiers["remote"], links["remote"] = remote_link(cost, len(roles))
    for tier in fleet_tiers:
        if tier.level == "G3.5":
            cost.tiers["G3.5"] = pod_flash_link(cost)
            links["G3.5"] = {"capacity_bytes": pod_bytes, **describe_links()}
        else:
            link = cost.tiers.setdefault("G4", shared_storage_link(cost))   # a calibration's measured G4 wins
            links["G4"] = describe_shared(cost.hw.name, tier.capacity_bytes, link)
        links[tier.level]["aggregate_bytes_per_s"] = aggregate.get(tier.level)
        tier.on_evict_many = lambda names, datas, level=tier.level: _evicted_everywhere(workers, names, level)
    router = disagg = None
    if f.route in FLEET_ROUTES or f.disagg_threshold is not None:
        router = FleetRouter(workers, roles, Policy(AS_POLICY[f.route], f.overlap_weight))
        route: Callable = router
        if f.disagg_threshold is not None:
            disagg = Disaggregation(router, f.disagg_threshold)
    else:
        route = ROUTES[f.route](len(workers))
    info["fleet"] = {"roles": roles, "route": f.route, "router": None if router is None else "cluster/policy "
                     f"{router.decider.policy.name} over cluster/kv_index fed by the workers' KV events",
                     "disagg_threshold_tokens": f.disagg_threshold, "links": links}
    isolated = router is None and not fleet_tiers and not pod_lanes
    return Fleet(cost, workers, info, roles, route, router, disagg, pod_lanes, isolated)


def _pod_lanes(f: FleetConfig) -> tuple[dict[tuple[str, str], Lane], dict[str, int]]:
    """The pod-wide lanes (each way) of the shared tiers given an aggregate bandwidth, and those figures."""
    lanes: dict[tuple[str, str], Lane] = {}
    rates: dict[str, int] = {}
    for level, flag, value, tier, tier_flag in (
            ("G3.5", "--pod-flash-bandwidth", f.pod_flash_bandwidth, f.pod_flash, "--pod-flash"),
            ("G4", "--shared-storage-bandwidth", f.shared_storage_bandwidth, f.shared_storage, "--shared-storage")):
        if value is None:
            continue
        if tier is None:
            raise ValueError(f"{flag} needs the tier it caps: add {tier_flag}")
        rate = rates[level] = tier_bytes(flag, value, 0)          # refuses 0 and negatives
        lanes[(level, "read")], lanes[(level, "write")] = aggregate_lane(rate), aggregate_lane(rate)
    return lanes, rates


def link_stats(fleet: Fleet) -> dict[str, Any]:
    """What went over the tier links: transfers, bytes, seconds busy and seconds queued behind
    other transfers, per level and direction summed over the workers, then the pod-wide lanes."""
    return merge_stats([w.mover.lanes.stats() for w in fleet.workers], fleet.pod_lanes)


def _evicted_everywhere(workers: list[SimWorker], names, level: str) -> None:
    """A tier every worker holds dropped blocks: every worker reports it (each may have announced
    them), so the router's index forgets them for all."""
    for w in workers:
        if w.memory.tiers.on_event is not None:
            w.memory.tiers.on_event(BlockRemoved(list(names), medium=level))


def fleet_summary(fleet: Fleet, turns: list[TurnRecord], weights_bytes: int) -> dict[str, Any]:
    """Per worker its role and prompt tokens computed / reused; with disaggregation what moved and
    what the decode workers still computed of the turns that took that path."""
    per, turns_on = [], Counter(t.worker for t in turns)
    for w, role in zip(fleet.workers, fleet.roles):
        p = w.memory.stats(weights_bytes)["prefill_tokens"]
        per.append({"worker": w.index, "role": role, "prefill_computed": p["computed"], "reused": p["reused_total"],
                    "reused_by_tier": p["reused"],
                    "turns": turns_on[w.index]})
    out: dict[str, Any] = {"workers": per, "session_moves": session_moves(turns)}
    if fleet.router is not None:
        out["router"] = fleet.router.describe()
    if fleet.disagg is not None:
        dis = [t for t in turns if f"{t.session}-t{t.turn}" in fleet.disagg.disaggregated]
        out["disagg"] = {**fleet.disagg.describe(), "turns": len(dis),
                         "decode_prefill_tokens": sum(t.prompt_tokens - t.cached_tokens for t in dis),
                         "decode_prompt_tokens": sum(t.prompt_tokens for t in dis)}
    return out


def session_moves(turns: list[TurnRecord]) -> int:
    """Turns that ran on another worker than their session's previous turn (its KV stayed behind)."""
    last: dict[str, tuple[int, int]] = {}
    moves = 0
    for t in sorted(turns, key=lambda t: (t.session, t.turn)):
        prev = last.get(t.session)
        moves += prev is not None and prev[1] != t.worker
        last[t.session] = (t.turn, t.worker)
    return moves
