"""The seam between KV control and KV data: what the memory manager asks of whatever moves
block bytes (the real pool's BlockLoader, or a simulator's cost model that moves none).

The memory manager decides which blocks go where; a KVMover does it: `store` encodes G1 blocks
for a tier (one buffer for the batch), `start` loads named blocks from the tiers into G1 blocks
in the background, `finished` / `wait` collect those loads. Nothing here imports torch.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Hashable, Protocol


class PoolGeometry(Protocol):
    """The G1 pool's shape as the control plane sees it: counts and byte sizes, never bytes. The
    byte sizes are read-only, so a pool that computes them (sim.worker.SimPool) fits too."""
    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def bytes_per_block(self) -> int: ...
    @property
    def budget_bytes(self) -> int: ...
    @property
    def nbytes(self) -> int: ...


@dataclass(eq=False)
class LoadJob:
    names: list[bytes]
    blocks: list[int]
    owner: Hashable
    prestage: bool
    deadline: float
    future: Any = None                                      # a concurrent.futures.Future, or None
    lock: threading.Lock = field(default_factory=threading.Lock)
    cancelled: bool = False
    finished: bool = False                                  # collected by KVMover.finished()
    loaded: list[str] = field(default_factory=list)         # tier level of each loaded block, in order
    corrupt: list[str] = field(default_factory=list)        # tier levels that returned a bad block


class KVMover(Protocol):
    jobs: list[LoadJob]                               # loads not yet collected
    inflight: dict[bytes, tuple[LoadJob, int]]        # name -> (job, index in the job)
    nbytes: int                                       # bytes of one stored block

    def store(self, block_ids: list[int], names: list[bytes], pin_memory: bool = False) -> Any:
        """One buffer holding the encoded blocks, for TierBackend.put_many / write-through."""

    def start(self, names: list[bytes], blocks: list[int], owner: Hashable = None,
              prestage: bool = False) -> LoadJob:
        """Load `names` into G1 `blocks` in the background (the job holds one reference on each)."""

    def in_flight(self, names: list[bytes]) -> list[tuple[LoadJob, int]]:
        """(job, index) for the leading names that some job is loading now."""

    def finished(self) -> list[LoadJob]:
        """Jobs done or past their deadline; each is returned once."""

    def wait(self, timeout: float) -> bool:
        """Block (or, on a virtual clock, advance) until a job finishes, at most timeout s."""


def pool_mover(pool: Any, tiers: Any, timeout_s: float, clock: Any) -> KVMover:
    """The real data plane for a KVPool: codec + background loader (imports torch)."""
    from everybyte.kv.data.block_loader import BlockLoader
    return BlockLoader(pool, tiers, timeout_s, clock)
