"""From a configuration (hardware, model, formats, workers, budgets) to the cost model and the
simulated workers; shared by `everybyte sim run` and `everybyte bench sim-speed`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from everybyte.formats.sizes import parse_size
from everybyte.sim.calibration import StepFit
from everybyte.sim.cost_model import CostModel
from everybyte.sim.executor import CostExecutor
from everybyte.sim.expert_parallel import ExpertParallel
from everybyte.sim.hardware import get_hardware
from everybyte.sim.models import get_model
from everybyte.sim.storage_links import describe_nvme, local_nvme, tier_bytes
from everybyte.sim.worker import SimPool, SimWorker, WorkerSpec


@dataclass
class SimConfig:
    hardware: str = "H200"
    model: str = "smollm2"
    workers: int = 1
    gpus_per_worker: int = 1
    weights_format: str = "bf16"
    kv_format: str = "bf16"
    kv_cache: str | None = None              # per worker; None: what the device holds after the weights
    memory_utilization: float = 0.9
    host_tier: str | None = None             # G2 bytes per worker; None: no G2
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    step_overhead_s: float = 0.0
    ep: bool = False                         # expert parallelism over the worker's GPUs (else ideal scaling)
    expert_imbalance: float = 1.0            # max / mean tokens per GPU under EP
    ep_overlap: bool = False                 # the all-to-all hidden behind compute (two-batch overlap)
    token_weight: float = 1.0                # a trace token stands for this many real ones (CostModel)
    disk_tier: str | None = None             # G3 local NVMe bytes per worker ("catalog": its drives); None: none


def build(cfg: SimConfig, calibration: StepFit | None = None,
          shared_tiers: Callable[[SimPool], list] | None = None,
          pod_lanes: dict | None = None) -> tuple[CostModel, list[SimWorker], dict]:
    """shared_tiers(pool): tiers every worker holds (the pod flash tier, sim/fleet_build); pod_lanes:
    their pod-wide links (sim/link_lanes), which every worker's transfers also queue on."""
    if cfg.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {cfg.workers}")
    if cfg.block_size < 1:
        raise ValueError(f"--block-size must be >= 1 token, got {cfg.block_size}")
    if not 0 < cfg.memory_utilization <= 1:
        raise ValueError(f"--memory-utilization must be in (0, 1], got {cfg.memory_utilization}")
    if not cfg.step_overhead_s >= 0:
        raise ValueError(f"--step-overhead-us must be >= 0, got {cfg.step_overhead_s * 1e6:g}")
    if not cfg.expert_imbalance >= 1:
        raise ValueError(f"--expert-imbalance is max/mean tokens per GPU, so >= 1; got {cfg.expert_imbalance}")
    hw, model = get_hardware(cfg.hardware), get_model(cfg.model)
    if cfg.ep_overlap and not cfg.ep:
        raise ValueError("--ep-overlap needs --ep (it overlaps expert parallelism's all-to-all)")
    ep = ExpertParallel(cfg.gpus_per_worker, cfg.expert_imbalance, cfg.ep_overlap) if cfg.ep else None
    cost = CostModel(hw, model, cfg.weights_format, cfg.kv_format, cfg.gpus_per_worker, cfg.step_overhead_s,
                     calibration, ep, cfg.token_weight)
    room = cost.kv_budget(cfg.memory_utilization)             # also: do the weights fit at all
    budget = room if cfg.kv_cache is None else parse_size(cfg.kv_cache)
    if budget > room:
        raise ValueError(f"--kv-cache {cfg.kv_cache} is more than the {room} bytes left after the weights")
    pool = SimPool.from_budget(budget, cfg.block_size, cost.kv_token_bytes)
    host = parse_size(cfg.host_tier) if cfg.host_tier else 0
    if host:
        cost.transfer_seconds("G2", 1)                         # the hardware must have a host link
    disk, disk_info = _disk_tier(cfg, cost)
    spec = WorkerSpec(pool, model_id=model.name, kv_format=cfg.kv_format, host_tier_bytes=host, disk_tier_bytes=disk,
                      max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                      max_model_len=model.max_len)
    shared = shared_tiers(pool) if shared_tiers else []
    workers = [SimWorker(i, spec, lambda clock: CostExecutor(clock, cost.batch_seconds, decode=cost),
                         cost.transfer_seconds, shared_tiers=shared, write_seconds=cost.write_seconds,
                         pod_lanes=pod_lanes) for i in range(cfg.workers)]
    info = {"cost_model": cost.describe(), "model": model.describe(cfg.weights_format, cfg.kv_format),
            "hardware": hw.describe(), "workers": cfg.workers,
            "kv_pool_per_worker": {"budget_bytes": pool.budget_bytes, "num_blocks": pool.num_blocks,
                                   "block_size": pool.block_size, "bytes_per_token": pool.bytes_per_token},
            "host_tier_bytes_per_worker": host, "disk_tier": disk_info, "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens}
    return cost, workers, info


def _disk_tier(cfg: SimConfig, cost: CostModel) -> tuple[int, dict | None]:
    """G3 bytes per worker and what the output says of it; the link joins the cost model's tiers."""
    if cfg.disk_tier is None:
        return 0, None
    link, drives = local_nvme(cost)
    link = cost.tiers.setdefault("G3", link)                  # a calibration's measured G3 load wins
    disk = tier_bytes("--disk-tier", cfg.disk_tier, drives)
    return disk, describe_nvme(cost.hw.name, disk, link)
