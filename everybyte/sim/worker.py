"""One simulated worker: the real EngineCore, Scheduler and KVMemoryManager (prefix cache,
sessions, tier bookkeeping) over a pool geometry, name-only tiers, the simulated mover and an
executor, all on the worker's own virtual clock."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, cast

from everybyte.engine.core import EngineCore, Executor
from everybyte.engine.scheduler import Scheduler
from everybyte.engine.sequence import Sequence
from everybyte.kv.block_id import KVNamespace
from everybyte.kv.block_manager import BlockManager
from everybyte.kv.clock import VirtualClock
from everybyte.kv.memory_manager import KVMemoryManager
from everybyte.kv.tiers.base import TierBackend
from everybyte.sim.link_lanes import Lane, Lanes, Seconds
from everybyte.sim.mover import SimMover
from everybyte.sim.tiers import NameTier, SyncTierSet


@dataclass
class SimPool:
    """The KV pool as the control plane sees it (kv.mover.PoolGeometry): counts and sizes only."""
    num_blocks: int
    block_size: int
    bytes_per_token: int

    @classmethod
    def from_budget(cls, budget_bytes: int, block_size: int, bytes_per_token: int) -> "SimPool":
        n = budget_bytes // (block_size * bytes_per_token)
        if n < 1:
            raise ValueError(f"KV budget of {budget_bytes} bytes holds no block of {block_size} tokens "
                             f"({block_size * bytes_per_token} bytes)")
        return cls(n, block_size, bytes_per_token)

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def budget_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def nbytes(self) -> int:
        return self.budget_bytes


@dataclass
class WorkerSpec:
    pool: SimPool
    model_id: str = "sim-model"
    kv_format: str = "nvfp4"
    host_tier_bytes: int = 0                 # 0: no G2 tier
    disk_tier_bytes: int = 0                 # 0: no G3 tier (local NVMe, below G2 in the spill chain)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    offload_on_park: bool = True
    restart_blocks: int = 1                  # the real engine's exact-tail span in blocks (nvfp4/fp8 KV)
    name_memo_sessions: int = 128            # sessions whose last context's block names a next turn reuses


class SimWorker:
    index: int
    spec: WorkerSpec
    clock: VirtualClock
    mover: SimMover
    memory: KVMemoryManager
    executor: Executor
    core: EngineCore
    scheduled: bool

    def __init__(self, index: int, spec: WorkerSpec, executor_for: Callable[[VirtualClock], Executor],
                 transfer_seconds: Seconds, eos: Iterable[int] = (), shared_tiers: Iterable[TierBackend] = (),
                 write_seconds: Seconds | None = None, pod_lanes: dict[tuple[str, str], Lane] | None = None) -> None:
        """executor_for(clock) -> Executor; transfer_seconds(level, nbytes) -> seconds of a read;
        write_seconds(level, nbytes): of a write (None: writes are free); shared_tiers: tiers every
        worker of the pod holds (the pod flash tier G3.5, shared storage G4: sim/fleet_build), after
        the local ones as the real engine's --kv-tiers orders them; pod_lanes: their pod-wide lanes."""
        self.index, self.spec = index, spec
        self.clock = VirtualClock(0.0)
        pool = spec.pool
        local: list[TierBackend] = [NameTier(n, level, pool.bytes_per_block, kind) for n, level, kind in
                 ((spec.host_tier_bytes, "G2", "host"), (spec.disk_tier_bytes, "G3", "disk")) if n]
        tiers = SyncTierSet(local + list(shared_tiers))
        self.mover = SimMover(tiers, self.clock, pool.bytes_per_block, Lanes(transfer_seconds, write_seconds, pod_lanes))
        tiers.on_write = self.mover.wrote
        # mix128 names: a tenth of BLAKE2b's work and collision-free on token streams; nothing
        # in a simulation is adversarial, and every simulated worker names blocks alike
        ns = KVNamespace(spec.model_id, kv_format=spec.kv_format, block_size=pool.block_size, name_hash="mix128")
        self.memory = KVMemoryManager(pool, ns, tiers, offload_on_park=spec.offload_on_park, clock=self.clock,
                                      restart_blocks=spec.restart_blocks,
                                      mover=self.mover, name_memo_sessions=spec.name_memo_sessions)
        self.executor = executor_for(self.clock)
        sched = Scheduler(cast(BlockManager[Sequence], self.memory), spec.max_num_seqs, spec.max_num_batched_tokens,
                          spec.max_model_len, self.clock)
        self.core = EngineCore(sched, self.executor, self.clock, tuple(eos), spec.max_model_len)
        self.core.final_only = True          # the runner reads finished outputs only
        self.core.prompt_in_outputs = False  # it knows each prompt's length from its request
        self.scheduled = False               # a step event for this worker is in the runner's queue
