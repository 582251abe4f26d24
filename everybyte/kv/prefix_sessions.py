"""The session side of the G1 prefix cache: which sessions (owners) use each named block, which
are parked until when, and what parking, unparking and dropping a session does to its blocks'
eviction class. A mixin of PrefixCache, which provides the state declared here."""
from __future__ import annotations

from collections import deque
from typing import Callable, Hashable

from everybyte.kv.eviction import EvictionPolicy, park_rank

ANON = None   # owner of requests without a session


class _Shared:
    """Owner standing for "too many owners to track": such a block is never parked-only. An
    object, not a string, so no client session id can ever be it."""

    def __repr__(self) -> str:
        return "SHARED"


SHARED = _Shared()


class PrefixSessions:
    policy: EvictionPolicy
    max_owners: int
    ref: list[int]
    names: list[bytes | None]
    empty: deque[int]
    owners: dict[int, set[Hashable]]                 # named block -> sessions (or ANON) using it
    session_blocks: dict[Hashable, set[int]]
    parked: dict[Hashable, float | None]             # session -> expected return (None: unknown)
    _freed_at: list[int]                             # when each block was last freed (a tick)

    _forget: Callable[[int], bytes | None]   # the host class's

    def _own(self, block_id: int, owner: Hashable) -> None:
        owners = self.owners.get(block_id)    # (not setdefault: it builds a set on every call)
        if owners is None:
            owners = self.owners[block_id] = set()
        elif owner in owners or SHARED in owners:
            return
        if len(owners) >= self.max_owners:
            owner = SHARED
        owners.add(owner)
        if owner is not ANON and owner is not SHARED:
            blocks = self.session_blocks.get(owner)
            if blocks is None:
                blocks = self.session_blocks[owner] = set()
            blocks.add(block_id)
        if owner in self.parked:
            self._reclass(block_id)
        else:
            self.policy.unpark(block_id)

    def _rank(self, block_id: int) -> float | None:
        """Its parked rank (the earliest expected return of its owners) when every owner is a
        parked session, else None (ordinary class)."""
        owners, parked = self.owners.get(block_id, ()), self.parked
        if len(owners) == 1:                     # the common case, a private block: no generators
            (o,) = owners
            return park_rank(parked[o]) if o in parked else None
        if owners and all(o in parked for o in owners):
            return min(park_rank(parked[o]) for o in owners)
        return None

    def _reclass(self, block_id: int) -> None:
        """Parked class iff every owner is a parked session; rank = the earliest expected return."""
        rank = self._rank(block_id)
        if rank is None:
            self.policy.unpark(block_id)
        else:
            self.policy.set_parked(block_id, rank)

    def _session_order(self, session_id: Hashable) -> list[int]:
        """The session's blocks in the order they were freed (keeps tails ahead of prefixes); blocks
        with the same free tick (never freed) by id, so no set order decides."""
        freed_at = self._freed_at
        return sorted(self.session_blocks.get(session_id, ()), key=lambda b: (freed_at[b], b))

    def park(self, session_id: Hashable, expected_return: float | None = None) -> list[int]:
        """The session is idle (a tool call) until about `expected_return` (a clock time; None =
        unknown). Its private cached blocks become the first eviction candidates. Returns the
        session's device blocks (all named) in the order they were freed, e.g. to write them
        down to G2 right away."""
        if session_id is ANON or session_id is SHARED:
            raise ValueError(f"cannot park session id {session_id!r}")
        self.parked[session_id] = expected_return
        blocks = self._session_order(session_id)
        rank, owners = park_rank(expected_return), self.owners
        # a block with one owner has this session as it (its blocks are the ones it owns)
        self.policy.set_classes(blocks, [rank if len(owners[b]) == 1 else self._rank(b) for b in blocks])
        return blocks

    def unpark(self, session_id: Hashable) -> int:
        """The session is back; its blocks return to ordinary order. Returns how many device
        blocks it moved back: none when the session was not parked (then none of its blocks is
        parked on its account, and every admission of a session's turn calls this)."""
        if session_id not in self.parked:
            return 0
        del self.parked[session_id]
        blocks = self._session_order(session_id)
        self.policy.unpark_many(blocks)     # it owns them all and is not parked: none is parked-only
        return len(blocks)

    def drop(self, session_id: Hashable, keep: Callable[[bytes], bool] | None = None) -> list[bytes]:
        """Forget the session: blocks only it used, nobody holds and `keep(name)` does not claim
        are emptied now; returns their names (the caller deletes them from lower tiers too)."""
        self.parked.pop(session_id, None)
        freed: list[bytes] = []
        for b in sorted(self.session_blocks.pop(session_id, ())):
            owners = self.owners.get(b, set())
            owners.discard(session_id)
            name = self.names[b]
            if not owners and self.ref[b] == 0 and name is not None and not (keep is not None and keep(name)):
                self.policy.remove(b)
                self._forget(b)
                freed.append(name)
                self.empty.append(b)
            else:
                self._reclass(b)
        return freed
