"""What the memory system knows about one sequence: the sequence as it reads it (KVSequence) and
its KV state (SeqKV: block names, how many are committed, a load it waits for)."""
from __future__ import annotations

from dataclasses import dataclass

from everybyte.kv.mover import LoadJob


class KVSequence:
    """A sequence as the memory manager reads it: engine.sequence.Sequence extends this class. A
    class, not a Protocol, so the compiled control plane reads these fields directly rather than
    by name (a generic attribute lookup runs ~190 instructions). The manager writes only
    block_table, num_computed_tokens, kv_stored_until and num_cached_tokens."""
    seq_id: int
    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int                    # tokens whose KV is in the pool
    kv_stored_until: int                        # positions below already stored in the pool
    num_cached_tokens: int                      # prompt tokens reused instead of computed
    session_id: str | None                      # agent session: its blocks park and prestage together
    cache_salt: str | None                      # tenant salt: blocks are shared only within it

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def first_admission(self) -> bool:
        """Not scheduled before (so not a preemption's readmission). A sequence that keeps no
        scheduling history counts each admission as its first; engine.sequence.Sequence reads its
        metrics."""
        return True


@dataclass(eq=False)
class PendingLoad:
    """Blocks of an admitted sequence that tier loads are bringing into G1."""
    jobs: set[LoadJob]
    ready: int                                  # leading blocks already in G1 (hits)
    levels: list[str]                           # tier each ready block came from
    first: bool                                 # first admission (not a preemption's)


@dataclass(eq=False)
class SeqKV:
    seq: KVSequence
    names: list[bytes]                  # names of its full blocks, computed lazily
    committed: int                      # leading blocks already named in the prefix cache
    holds_blocks: bool                  # allocated (not only looked up)
    load: PendingLoad | None            # set while it waits out of compute
    order: int                          # when its manager made it: loads finish in this order

    def __init__(self, seq: KVSequence, order: int = 0) -> None:   # compiled (see engine.scheduler.SchedulerOutput)
        self.seq, self.names, self.committed, self.holds_blocks, self.load = seq, [], 0, False, None
        self.order = order
