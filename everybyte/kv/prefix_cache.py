"""G1 prefix cache: which device block holds which named block, and who uses it.

Pure bookkeeping over block ids 0..num_blocks-1 (no tensors). A block is either empty, in use
(ref count > 0: running requests), or cached (ref count 0, named, reusable until evicted). Cached
blocks are evicted in the policy's order; the default puts blocks owned only by parked sessions
first (latest expected return first), then LRU. Blocks in use are never evicted.

`on_evict(block_id, name)` fires before an evicted block is handed out again, so the data plane
can write it down a tier (its bytes are still intact when the callback runs). `on_event` (one
hook, kv/events) hears every block named (BlockStored), forgotten (BlockRemoved) and the cache
emptied of named blocks (AllBlocksCleared); a call's events come as it returns, coalesced
(kv/event_run: a run of blocks committed together is one BlockStored).
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Callable, Hashable, Iterable, Sequence

from everybyte.kv.event_run import PendingEvents, emits
from everybyte.kv.events import AllBlocksCleared, BlockRemoved, KVEvent
from everybyte.kv.eviction import EvictionPolicy, LRUPolicy, ParkedFirst
from everybyte.kv.prefix_sessions import ANON, SHARED, PrefixSessions

__all__ = ["ANON", "SHARED", "NoFreeBlocks", "PrefixCache"]
log = logging.getLogger(__name__)
class NoFreeBlocks(RuntimeError):
    pass


class PrefixCache(PrefixSessions):
    def __init__(self, num_blocks: int, policy: EvictionPolicy | None = None,
                 on_evict: Callable[[int, bytes], None] | None = None, max_owners: int = 32,
                 on_event: Callable[[KVEvent], None] | None = None, block_size: int = 16):
        if num_blocks < 1:
            raise ValueError(f"need num_blocks >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.policy = policy if policy is not None else ParkedFirst(LRUPolicy())
        self.on_evict = on_evict
        self.on_event, self.block_size = on_event, block_size
        self.events = PendingEvents()                     # the current call's, not handed over yet
        self.max_owners = max_owners
        self.ref = [0] * num_blocks
        self.names: list[bytes | None] = [None] * num_blocks
        self.by_name: dict[bytes, int] = {}
        self.empty: deque[int] = deque(range(num_blocks))
        self.owners: dict[int, set[Hashable]] = {}       # named block -> sessions (or ANON) using it
        self.session_blocks: dict[Hashable, set[int]] = {}
        self.parked: dict[Hashable, float | None] = {}   # session -> expected return (None: unknown)
        self._freed_at = [0] * num_blocks                 # when each block was last freed (a tick)
        self._tick = 0
        self.stats = {"lookups": 0, "lookup_blocks": 0, "hit_blocks": 0, "evictions": 0, "commits": 0,
                      "duplicate_commits": 0}

    # ---- counts -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get now: empty ones plus evictable cached ones."""
        return len(self.empty) + len(self.policy)

    @property
    def num_empty_blocks(self) -> int:
        return len(self.empty)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def counts(self) -> dict[str, int]:
        """Blocks by state: running (ref > 0), parked, cached (reusable), empty; they sum to num_blocks."""
        parked = self.policy.num_parked()
        return {"running": self.num_used_blocks, "parked": parked, "cached": len(self.policy) - parked,
                "empty": len(self.empty)}

    def ref_count(self, block_id: int) -> int:
        return self.ref[block_id]

    def count_unreferenced(self, block_ids: Sequence[int]) -> int:
        """How many of these blocks no sequence references (evictable now, pinned once reused)."""
        ref = self.ref
        return sum(1 for b in block_ids if ref[b] == 0)

    def name_of(self, block_id: int) -> bytes | None:
        return self.names[block_id]

    def block_of(self, name: bytes) -> int | None:
        return self.by_name.get(name)

    def evictable_order(self) -> list[int]:
        return self.policy.order()

    def _cached_name(self, block_id: int) -> bytes:
        """The name of a block that must have one (evictable, or held by a session)."""
        name = self.names[block_id]
        assert name is not None, f"block {block_id} has no name"
        return name

    # ---- lookup and sharing -------------------------------------------------------------------
    def lookup(self, names: Sequence[bytes]) -> list[int]:
        """Device blocks of the longest cached prefix of `names`; changes nothing."""
        hits: list[int | None] = list(map(self.by_name.get, names))   # in C; misses after the first are cut
        try:
            del hits[hits.index(None):]
        except ValueError:
            pass
        return hits  # type: ignore[return-value]

    def acquire(self, names: Sequence[bytes], owner: Hashable = ANON, limit: int | None = None) -> list[int]:
        """Take a reference on every block of the longest cached prefix of `names` (of its first
        `limit` names when given: the caller's list is not copied)."""
        hits, _ = self._claim(names if limit is None else names[:max(limit, 0)], owner)
        ref = self.ref
        for b in hits:
            ref[b] += 1
        return hits

    def refresh(self, names: Sequence[bytes], owner: Hashable = ANON) -> int:
        """acquire() and at once free() the hits: the same counts, owners and eviction order
        (each unreferenced hit goes back as just freed, the tail first), no references taken.
        Returns how many hits."""
        hits, idle = self._claim(names, owner)
        idle.reverse()
        self._evictable(idle)
        return len(hits)

    def count_hits(self, names: Sequence[bytes], limit: int) -> tuple[int, int]:
        """lookup(names[:limit]) counted, changing nothing: how many hits, and how many of those
        no sequence references (evictable now, pinned once reused)."""
        hits = self.lookup(names[:max(limit, 0)])
        return len(hits), self.count_unreferenced(hits)

    def _claim(self, names: Sequence[bytes], owner: Hashable) -> tuple[list[int], list[int]]:
        """The hits of acquire() and those of them unreferenced until now (out of the policy), with
        `owner` among the users of each; references are the caller's to take."""
        hits = self.lookup(names)
        self.stats["lookups"] += 1
        self.stats["lookup_blocks"] += len(names)
        self.stats["hit_blocks"] += len(hits)
        ref, owners_of, own = self.ref, self.owners, self._own
        idle = [b for b in hits if ref[b] == 0]
        self.policy.remove_many(idle)         # out of the policy before any _own reclasses them
        for b in hits:                        # every admission runs this per block
            owners = owners_of.get(b)
            if owners is None or (owner not in owners and SHARED not in owners):
                own(b, owner)
        return hits, idle

    def share(self, block_ids: Sequence[int]) -> None:
        """One more reference on blocks already in use (e.g. one that a load is filling)."""
        for b in block_ids:
            if self.ref[b] < 1:
                raise ValueError(f"block {b} is not in use")
            self.ref[b] += 1

    def _ref(self, block_id: int) -> None:
        if self.ref[block_id] == 0:
            self.policy.remove(block_id)
        self.ref[block_id] += 1

    # ---- allocation ---------------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    @emits
    def allocate(self, n: int = 1, ascending: bool = False) -> list[int]:
        """n fresh blocks (ref count 1, unnamed): empty blocks first, then evicted cached ones; in
        that order, or by id when ascending (a sequence's blocks then tend to be consecutive)."""
        if n > self.num_free_blocks:
            raise NoFreeBlocks(f"need {n} blocks, {self.num_free_blocks} free or evictable")
        out: list[int] = []
        for _ in range(n):
            b = self.empty.popleft() if self.empty else self._evict_one()[0]
            self.ref[b] = 1
            out.append(b)
        if ascending:
            out.sort()
        return out

    def _evict_one(self) -> tuple[int, bytes]:
        b = self.policy.pop()
        assert b is not None and self.ref[b] == 0, "policy returned a block in use"
        return b, self._evicted(b, self._cached_name(b))

    def _evicted(self, b: int, name: bytes) -> bytes:
        """A cached block leaves the policy: tell on_evict (its bytes are intact), then forget it."""
        if self.on_evict is not None:
            try:
                self.on_evict(b, name)
            except Exception:    # a failed write-down only costs a recompute later
                log.exception("on_evict failed for block %d; its content is dropped", b)
        self.stats["evictions"] += 1
        self._forget(b)
        return name

    @emits
    def evict(self, n: int = 1) -> list[tuple[int, bytes]]:
        """Evict up to n cached blocks now (policy order) and make them empty; returns (id, name)."""
        out: list[tuple[int, bytes]] = []
        while len(out) < n and len(self.policy):
            out.append(self._evict_one())
            self.empty.append(out[-1][0])
        return out

    @emits
    def evict_blocks(self, block_ids: Iterable[int]) -> list[tuple[int, bytes]]:
        """Evict these cached (unreferenced) blocks now, e.g. a parked session's; returns (id, name)."""
        out: list[tuple[int, bytes]] = []
        for b in block_ids:
            name = self.names[b]
            if self.ref[b] == 0 and name is not None:
                self.policy.remove(b)
                out.append((b, self._evicted(b, name)))
                self.empty.append(b)
        return out

    def _forget(self, block_id: int) -> bytes | None:
        name = self.names[block_id]
        self.names[block_id] = None
        if name is not None and self.by_name.get(name) == block_id:
            del self.by_name[name]
            if self.on_event is not None:
                self.events.removed(name)
        for s in self.owners.pop(block_id, ()):
            blocks = self.session_blocks.get(s)
            if blocks is not None:
                blocks.discard(block_id)
                if not blocks:
                    del self.session_blocks[s]
        self.policy.unpark(block_id)
        return name

    # ---- naming and freeing -------------------------------------------------------------------
    @emits
    def commit(self, block_id: int, name: bytes, owner: Hashable = ANON, parent: bytes | None = None,
               token_ids: Sequence[int] = ()) -> int:
        """Name a block that just became full (parent: the previous block's name, None for a first
        block; both only go into the BlockStored event). When the name is already cached in
        another block that one is returned (the caller may switch to it); this block then stays
        unnamed."""
        return self._commit(block_id, name, owner, parent, token_ids)

    def _commit(self, block_id: int, name: bytes, owner: Hashable, parent: bytes | None,
                token_ids: Sequence[int]) -> int:
        if self.ref[block_id] < 1:
            raise ValueError(f"block {block_id} is not in use")
        current = self.names[block_id]
        if current is not None:
            if current != name:
                raise ValueError(f"block {block_id} is already named {current.hex()}")
            self._own(block_id, owner)
            return block_id
        other = self.by_name.get(name)
        if other is not None:
            self.stats["duplicate_commits"] += 1
            return other
        self.names[block_id] = name
        self.by_name[name] = block_id
        self.stats["commits"] += 1
        if self.on_event is not None:
            self.events.stored(self.block_size, name, parent, token_ids)
        self._own(block_id, owner)
        return block_id

    @emits
    def commit_run(self, block_ids: Sequence[int], names: Sequence[bytes], start: int, end: int,
                   owner: Hashable = ANON, token_ids: Sequence[int] | None = None) -> list[int]:
        """commit() blocks start..end-1 of a table (parent: the previous name; tokens: each block's
        slice of token_ids, only when there is an on_event to hear them); returns the indices i
        whose block kept its name (commit returned block_ids[i])."""
        if start < 0 or end > len(block_ids) or end > len(names):
            raise IndexError("commit_run range outside block_ids or names")
        bs, kept = self.block_size, []
        tokens = token_ids if self.on_event is not None else None
        for i in range(start, end):
            b = block_ids[i]
            origin = tokens[i * bs:(i + 1) * bs] if tokens is not None else ()
            if self._commit(b, names[i], owner, names[i - 1] if i else None, origin) == b:
                kept.append(i)
        return kept

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block; pass a block table in order (its tail is freed first,
        so under LRU a sequence's last blocks go before its prefix)."""
        ref, names = self.ref, self.names
        evictable: list[int] = []             # into the policy in one call, in this order
        try:
            for b in reversed(block_ids):
                r = ref[b]
                if r < 1:
                    raise ValueError(f"block {b} freed more often than taken")
                ref[b] = r - 1
                if r == 1:
                    if names[b] is None:
                        self._forget(b)
                        self.empty.append(b)
                    else:
                        evictable.append(b)
        finally:
            self._evictable(evictable)

    @emits
    def drop(self, session_id: Hashable, keep: Callable[[bytes], bool] | None = None) -> list[bytes]:
        return super().drop(session_id, keep)

    def _evictable(self, blocks: list[int]) -> None:
        """Unreferenced named blocks become evictable, freed in this order (each a fresh tick)."""
        freed_at, tick = self._freed_at, self._tick
        for b in blocks:
            tick += 1
            freed_at[b] = tick
        self._tick = tick
        self.policy.insert_many(blocks)

    def touch(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            self.policy.touch(b)

    def clear(self) -> int:
        """Forget every cached (unreferenced) block without eviction callbacks; returns how many."""
        n, hook = 0, self.on_event
        self.on_event = None                  # one AllBlocksCleared (or the removals) instead of n events
        removed: list[bytes | None] = []
        try:
            while (b := self.policy.pop()) is not None:
                removed.append(self._forget(b))
                self.empty.append(b)
                n += 1
        finally:
            self.on_event = hook
        if hook is not None and removed:
            hook(AllBlocksCleared() if not self.by_name else BlockRemoved([r for r in removed if r is not None]))
        return n
