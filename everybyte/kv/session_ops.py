"""The memory manager's agent-session operations: park a session during a tool call (its blocks
go first, or leave the device now), prestage it back before the next turn, drop it, expire idle
ones, and report where its blocks are; and taking fresh G1 blocks after writing down the ones
evicted for them, which these and the host's allocations share. KVMemoryManager's base (one
line of bases, so mypyc compiles it as a native class), which provides the state declared here."""
from __future__ import annotations

import logging
from typing import Any

from everybyte.kv.block_manager import BlockManager
from everybyte.kv.ledger import ByteLedger
from everybyte.kv.mover import KVMover, PoolGeometry
from everybyte.kv.prefix_core import G1Cache
from everybyte.kv.seq_state import KVSequence, SeqKV
from everybyte.kv.sessions import SessionTable
from everybyte.kv.tier_movement import TierSet

log = logging.getLogger(__name__)


class SessionOps(BlockManager[KVSequence]):
    pool: PoolGeometry
    cache: G1Cache
    sessions: SessionTable
    tiers: TierSet
    ledger: ByteLedger
    mover: KVMover
    seqs: dict[int, SeqKV]
    offload_on_park: bool

    _evicting: list[tuple[int, bytes]]

    def _fresh(self, n: int) -> list[int]:
        """n fresh G1 blocks (ascending, so a sequence's blocks tend to be consecutive), after the
        blocks evicted for them are written down."""
        blocks = self.cache.allocate(n, True) if n > 0 else []
        self._flush()
        return blocks

    def _flush(self) -> None:
        if not self._evicting:
            return
        batch, self._evicting = sorted(self._evicting), []
        names = [n for _, n in batch]
        pin = getattr(self.tiers.first, "pin_memory", False)
        self.tiers.put_down(names, self.mover.store([b for b, _ in batch], names, pin_memory=pin))

    def park(self, session_id: str, expected_gap_s: float | None = None) -> int:
        """The agent is in a tool call: its blocks go first when G1 needs room, and leave the
        device now (written down to G2) when a lower tier exists. Returns blocks offloaded."""
        s = self.sessions.park(session_id, expected_gap_s)     # checks both before changing anything
        blocks = self.cache.park(session_id, s.expected_return)
        self.ledger.count("parked", len(blocks))
        if not (self.offload_on_park and self.tiers.first is not None):
            return 0
        evictable = [b for b in blocks if self.cache.ref_count(b) == 0]
        n = len(self.cache.evict_blocks(evictable))
        self._flush()
        return n

    def resume(self, session_id: str) -> int:
        """Start prestaging the session's context back into G1 ahead of its next turn; returns at
        once with the number of blocks being loaded (session_info shows them as "loading")."""
        self.sessions.get(session_id)                        # an unknown session is a KeyError
        s = self.sessions.touch(session_id)
        self.cache.unpark(session_id)
        self.expire_sessions(keep=session_id)
        if not self.tiers.tiers:              # nothing to load (no tier): the hits need no pin
            self.cache.refresh(s.names, session_id)
            self._flush()
            return 0
        hits = self.cache.acquire(s.names, session_id)     # pinned while blocks for the rest are taken
        start = len(hits) + len(self.mover.in_flight(s.names[len(hits):]))
        missing = s.names[start:]
        n = min(self.tiers.may_hold(missing), self.cache.num_free_blocks)   # may evict idle blocks
        blocks = self._fresh(n)
        self.cache.free(hits)
        if n:
            self.mover.start(missing[:n], blocks, session_id, prestage=True)
        return n

    def drop(self, session_id: str) -> None:
        """Forget the session and free the blocks only it needed, in every tier. A block that
        another session's context, a running request or a load in flight still references
        stays (a common system prompt outlives any one session)."""
        s = self.sessions.pop(session_id)
        in_use = set(self.mover.inflight)
        for st in self.seqs.values():
            in_use.update(st.names)

        def needed(name: bytes) -> bool:
            return name in in_use or self.sessions.held(name)

        names = set(self.cache.drop(session_id, keep=needed)) | {n for n in s.names if not needed(n)}
        self.tiers.delete_everywhere(names)
        self.ledger.count("dropped", len(names))

    def expire_sessions(self, keep: str | None = None) -> None:
        """Drop sessions idle past the timeout or beyond the count limit (least recently active first)."""
        for sid in self.sessions.over_limits(keep):
            log.info("session %r expired", sid)
            self.drop(sid)

    def session_info(self, session_id: str) -> dict[str, Any]:
        s = self.sessions.get(session_id)
        g1 = sum(self.cache.block_of(n) is not None for n in s.names)
        loading = sum(n in self.mover.inflight for n in s.names)
        blocks = {"G1": g1, "loading": loading, **self.tiers.count_present(s.names)}
        return {"state": s.state, "tokens": s.num_tokens, "blocks": blocks,
                "bytes": {k: v * self.pool.bytes_per_block for k, v in blocks.items()},
                "expected_return": s.expected_return}
