"""What the memory system knows about one sequence: the sequence as it reads it (KVSequence) and
its KV state (SeqKV: block names, how many are committed, a load it waits for)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from everybyte.kv.block_manager import SeqLike
from everybyte.kv.mover import LoadJob


class AdmissionTimes(Protocol):
    @property
    def first_scheduled_time(self) -> float | None: ...     # None until the sequence is first scheduled


class KVSequence(SeqLike, Protocol):
    """A sequence as the memory manager reads it (engine.sequence.Sequence is one); it writes
    only the SeqLike fields and num_cached_tokens."""
    num_cached_tokens: int                      # prompt tokens reused instead of computed

    @property
    def seq_id(self) -> int: ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def session_id(self) -> str | None: ...     # agent session: its blocks park and prestage together

    @property
    def cache_salt(self) -> str | None: ...     # tenant salt: blocks are shared only within it

    @property
    def metrics(self) -> AdmissionTimes: ...


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
    names: list[bytes] = field(default_factory=list)   # names of its full blocks, computed lazily
    committed: int = 0                                 # leading blocks already named in the prefix cache
    holds_blocks: bool = False                         # allocated (not only looked up)
    load: PendingLoad | None = None                    # set while it waits out of compute

    def __init__(self, seq: KVSequence) -> None:       # compiled (see engine.scheduler.SchedulerOutput)
        self.seq, self.names, self.committed, self.holds_blocks, self.load = seq, [], 0, False, None
