"""Which KV blocks of the pool each sequence owns.

The interface (can_allocate / allocate / can_append / may_append / deallocate / num_free_blocks)
is what the scheduler relies on; prefix caching and tiers extend it by giving blocks content
names and sharing them through ref counts, and by loading blocks in the background (is_loading /
poll_loads: the scheduler keeps such a sequence out of compute until its blocks are in). A sequence here is
anything with `len(seq)`, a `block_table` list and `num_computed_tokens` / `kv_stored_until` ints (`SeqLike`);
a BlockManager[S] hands back the sequences it was given as S.
"""
from __future__ import annotations

from collections import deque
from typing import Generic, Protocol, TypeVar


class SeqLike(Protocol):
    block_table: list[int]
    num_computed_tokens: int
    kv_stored_until: int

    def __len__(self) -> int: ...


S = TypeVar("S", bound=SeqLike)


class BlockManager(Generic[S]):
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks        # ints, not objects: a simulated pool has millions
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        block_id = self.free_block_ids.popleft()
        assert self.ref_counts[block_id] == 0
        self.ref_counts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_block_ids.append(block_id)

    def can_allocate(self, seq: S) -> bool:
        return self.blocks_for(len(seq)) <= self.num_free_blocks

    def allocate(self, seq: S) -> None:
        """Give a waiting sequence blocks for all its current tokens."""
        assert not seq.block_table, "sequence already holds blocks"
        seq.block_table = [self._take() for _ in range(self.blocks_for(len(seq)))]
        seq.num_computed_tokens = 0
        seq.kv_stored_until = 0

    def deallocate(self, seq: S) -> None:
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.kv_stored_until = 0

    def can_append(self, seq: S) -> bool:
        return self.blocks_for(len(seq)) - len(seq.block_table) <= self.num_free_blocks

    def may_append(self, seq: S) -> None:
        """Grow a running sequence's table to cover all its tokens (the one just sampled)."""
        for _ in range(self.blocks_for(len(seq)) - len(seq.block_table)):
            seq.block_table.append(self._take())

    # ---- asynchronous loads (a block manager with tiers fills some blocks in the background) ----
    def is_loading(self, seq: S) -> bool:
        """Whether an allocated sequence must wait (out of compute) for its blocks to load."""
        return False

    def poll_loads(self) -> list[S]:
        """Sequences whose loads finished since the last call; they may be scheduled now."""
        return []

    def has_pending_loads(self) -> bool:
        return False

    def wait_loads(self, timeout: float) -> bool:
        """Block until a load finishes, at most timeout seconds; True if one did."""
        return False

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """A step computed `tokens` prompt tokens in `seconds` (a memory system weighs loads by it)."""
