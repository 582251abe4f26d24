"""The router's state of one worker (what it said in /v1/kv/info, what the router has in flight
there) and the worker roles of a cluster: pure data, no HTTP, so the simulator's fleet
(sim/fleet_router) routes with the same objects the HTTP router keeps."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from everybyte.kv.block_id import KVNamespace

# Load time of a block relative to recomputing it, per tier, when a worker states no speeds.
DEFAULT_LOAD_FRACTION = {"G2": 0.05, "G3": 0.2, "G3.5": 0.3}


@dataclass
class Worker:
    url: str
    healthy: bool = False
    info: dict[str, Any] | None = None              # the last /v1/kv/info (None: the worker has none)
    namespace: KVNamespace | None = None
    in_flight: int = 0                    # requests the router has open there
    active_blocks: int = 0                # their blocks (Dynamo's decode blocks)
    queued_prefill_blocks: float = 0.0    # their blocks this worker computes (uncached when routed)
    cached_blocks: int = 0                # G1 blocks its KV events say it holds (set when routing)
    failures: int = 0

    @property
    def role(self) -> str:
        return (self.info or {}).get("role") or "both"

    @property
    def digest(self) -> str:
        return (self.info or {}).get("namespace_digest") or ""

    @property
    def events(self) -> dict[str, Any] | None:
        return (self.info or {}).get("kv_events")

    @property
    def load(self) -> dict[str, Any]:
        return (self.info or {}).get("load") or {}

    def queue_depth(self) -> int:
        load = self.load
        return max(self.in_flight, int(load.get("num_running") or 0) + int(load.get("num_waiting") or 0))

    def full(self) -> bool:
        """Every sequence slot was taken at the last poll (num_running >= max_num_seqs): a request
        routed there waits for one to finish, however much of its prefix is cached. Requests
        waiting only for prefill are the router's queued_prefill_blocks, not this."""
        load = self.load
        cap = load.get("max_num_seqs")
        return cap is not None and int(load.get("num_running") or 0) >= int(cap)

    @property
    def speeds(self) -> dict[str, Any]:
        return (self.info or {}).get("speeds") or {}

    def load_fraction(self, tier: str) -> float:
        """Seconds to load one token from `tier` over seconds to prefill one, clamped to [0, 1]."""
        speeds = self.speeds
        prefill, load = speeds.get("prefill_tok_s"), (speeds.get("load_tok_s") or {}).get(tier)
        if prefill and load:
            return min(1.0, max(0.0, float(prefill) / float(load)))
        return DEFAULT_LOAD_FRACTION.get(tier, 1.0)


def plan_roles(workers: int | None, prefill: int | None, decode: int | None) -> list[str]:
    """The role of each worker: --prefill P --decode D makes P prefill then D decode workers, else
    --workers N `both` (`everybyte cluster`'s rules; a clear ValueError otherwise)."""
    if (prefill is None) != (decode is None):
        raise ValueError("give both --prefill and --decode, or neither")
    if prefill is not None and decode is not None:
        if prefill < 1 or decode < 1:
            raise ValueError(f"--prefill and --decode must be >= 1, got {prefill} and {decode}")
        if workers is not None and workers != prefill + decode:
            raise ValueError(f"--workers {workers} differs from --prefill {prefill} + --decode {decode}")
        return ["prefill"] * prefill + ["decode"] * decode
    if workers is None or workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    return ["both"] * workers
