"""The memory system behind the BlockManager interface: content-named blocks shared through a
G1 prefix cache, written down to lower tiers on eviction, loaded back instead of recomputed,
and agent sessions parked off the device while they run a tool.

The scheduler only sees the BlockManager calls; a hit (G1, or a lower tier loaded into fresh
G1 blocks at admission) just starts the sequence with num_computed_tokens past the hit, so
chunked prefill computes only the misses. Names cover everything that changes a block's bytes
(KVNamespace), so a hit can never be wrong; a block that fails its checksum is a miss.
"""
from __future__ import annotations

import logging
import time

from everybyte.kv.block_id import KVNamespace, chain_block_ids
from everybyte.kv.block_manager import BlockManager
from everybyte.kv.ledger import ByteLedger, waste_bytes
from everybyte.kv.prefix_cache import PrefixCache
from everybyte.kv.sessions import SessionTable
from everybyte.kv.tiers.codec import CorruptBlock, encode_pool_block, load_pool_block
from everybyte.kv.tier_movement import TierSet

log = logging.getLogger(__name__)


class KVMemoryManager(BlockManager):
    def __init__(self, pool, namespace: KVNamespace, tiers: TierSet | None = None,
                 ledger: ByteLedger | None = None, offload_on_park: bool = True):
        super().__init__(pool.num_blocks, pool.block_size)
        self.pool, self.ns = pool, namespace
        self.tiers = tiers or TierSet([])
        self.tiers.bytes_per_token = pool.bytes_per_token
        self.ledger = ledger or ByteLedger(pool.bytes_per_block)
        for t in self.tiers.tiers:
            self.ledger.add_tier(t)
        self.cache = PrefixCache(pool.num_blocks, on_evict=self._write_down)
        self.sessions = SessionTable()
        self.offload_on_park = offload_on_park
        self._names: dict[int, list[bytes]] = {}      # seq_id -> names of its full blocks
        self._committed: dict[int, int] = {}          # seq_id -> blocks already committed
        self.running: dict[int, object] = {}          # seq_id -> sequence holding blocks
        self.query_tokens = self.hit_tokens = 0       # prompt tokens looked up / found in any tier
        self._prestaged_from: dict[int, str] = {}     # G1 block -> tier resume() loaded it from

    # ---- BlockManager interface ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.cache.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.cache.num_used_blocks

    def names_of(self, seq) -> list[bytes]:
        known = self._names.setdefault(seq.seq_id, [])
        if (len(seq) // self.block_size) > len(known):
            ns = self.ns.with_tenant(seq.cache_salt) if getattr(seq, "cache_salt", None) else self.ns
            known += chain_block_ids(ns, seq.token_ids, self.block_size, parent=known[-1] if known else None,
                                     start_block=len(known))
        return known

    def _reusable(self, seq) -> list[bytes]:
        # a full-prompt hit keeps its last block to recompute, so the last token yields logits
        return self.names_of(seq)[:(len(seq) - 1) // self.block_size]

    def can_allocate(self, seq) -> bool:
        hits = self.cache.lookup(self._reusable(seq))
        held = sum(self.cache.ref_count(b) == 0 for b in hits)   # evictable now, pinned once reused
        return self.blocks_for(len(seq)) - len(hits) <= self.num_free_blocks - held

    def allocate(self, seq) -> None:
        assert not seq.block_table, "sequence already holds blocks"
        sid = getattr(seq, "session_id", None)
        if sid is not None:
            self.sessions.touch(sid)
            self.cache.unpark(sid)
        names = self._reusable(seq)
        hits = self.cache.acquire(names, sid)
        fresh = self.cache.allocate(self.blocks_for(len(seq)) - len(hits))
        seq.block_table = hits + fresh
        reused: dict[str, int] = {}
        for b in hits:    # a block prestaged by resume() counts as reuse from the tier it came from
            level = self._prestaged_from.pop(b, "G1")
            reused[level] = reused.get(level, 0) + self.block_size
        loaded = self._load(names[len(hits):], fresh, sid, reused)
        seq.num_computed_tokens = (len(hits) + loaded) * self.block_size
        if seq.metrics.first_scheduled_time is None:    # first admission, not a preemption's
            seq.num_cached_tokens = seq.num_computed_tokens
        self.query_tokens += len(seq)
        self.hit_tokens += seq.num_computed_tokens
        self._committed[seq.seq_id] = len(hits) + loaded
        self.running[seq.seq_id] = seq
        self.ledger.record_prefill(0, reused)

    def may_append(self, seq) -> None:
        self._commit(seq)
        need = self.blocks_for(len(seq)) - len(seq.block_table)
        if need > 0:
            seq.block_table += self.cache.allocate(need)

    def can_append(self, seq) -> bool:
        return self.blocks_for(len(seq)) - len(seq.block_table) <= self.num_free_blocks

    def deallocate(self, seq) -> None:
        self._commit(seq)
        sid = getattr(seq, "session_id", None)
        if sid is not None and sid in self.sessions:
            n = seq.num_computed_tokens // self.block_size
            self.sessions.record_context(sid, seq.num_computed_tokens, self.names_of(seq)[:n])
        self.cache.free(seq.block_table)
        self._names.pop(seq.seq_id, None)
        self._committed.pop(seq.seq_id, None)
        self.running.pop(seq.seq_id, None)
        seq.block_table, seq.num_computed_tokens = [], 0

    def _commit(self, seq) -> None:
        """Name every full block whose KV is computed; new names are written through to the
        shared tiers so other nodes can reuse them."""
        done = self._committed.get(seq.seq_id, 0)
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= done:
            return
        names = self.names_of(seq)
        sid = getattr(seq, "session_id", None)
        for i in range(done, full):
            b = seq.block_table[i]
            if self.cache.commit(b, names[i], sid) == b and self.tiers.write_through:
                self.tiers.write_through_block(names[i], encode_pool_block(self.pool, b, names[i]))
        self._committed[seq.seq_id] = full

    # ---- tiers -------------------------------------------------------------------------------
    def _write_down(self, block_id: int, name: bytes) -> None:
        self._prestaged_from.pop(block_id, None)
        if name is not None and self.tiers.first is not None and not self.tiers.first.contains(name):
            data = encode_pool_block(self.pool, block_id, name)
            self.tiers.first.put(name, data)
        self.ledger.count("evicted")

    def _load(self, names: list[bytes], blocks: list[int], owner, reused: dict, prestage: bool = False) -> int:
        """Load the longest run of `names` found in lower tiers into `blocks`; returns how many."""
        found = self.tiers.locate(names)
        loaded = 0
        for (tier, buf), name, b in zip(self.tiers.fetch(found, names), names, blocks):
            if buf is None:
                break
            try:
                load_pool_block(self.pool, b, buf, verify=False)
            except CorruptBlock as e:
                log.warning("block %s from %s is corrupt (%s): recomputing", name.hex()[:12], tier.level, e)
                self.ledger.count("corrupt", tier=tier.level)
                tier.delete(name)
                break
            self.cache.commit(b, name, owner)
            if prestage:
                self._prestaged_from[b] = tier.level
            reused[tier.level] = reused.get(tier.level, 0) + self.block_size
            loaded += 1
        if loaded:
            self.ledger.count("loaded", loaded)
        return loaded

    def evict_all(self) -> int:
        """Evict every unreferenced G1 block now (written down to the first tier); returns how many."""
        return len(self.cache.evict(self.cache.num_blocks))

    # ---- sessions ----------------------------------------------------------------------------
    def park(self, session_id: str, expected_gap_s: float | None = None) -> int:
        """The agent is in a tool call: its blocks go first when G1 needs room, and leave the
        device now (written down to G2) when a lower tier exists. Returns blocks offloaded."""
        s = self.sessions.get(session_id)
        s.state = "parked"
        s.expected_return = None if expected_gap_s is None else time.time() + expected_gap_s
        blocks = self.cache.park(session_id, s.expected_return)
        self.ledger.count("parked", len(blocks))
        if not (self.offload_on_park and self.tiers.first is not None):
            return 0
        evictable = [b for b, _ in blocks if self.cache.ref_count(b) == 0]
        return len(self.cache.evict_blocks(evictable))

    def resume(self, session_id: str) -> int:
        """Prestage the session's context back into G1 ahead of its next turn; returns blocks loaded."""
        s = self.sessions.touch(session_id)
        self.cache.unpark(session_id)
        hits = self.cache.acquire(s.names, session_id)     # pinned while the rest loads
        missing = s.names[len(hits):]
        n = min(len(missing), self.cache.num_free_blocks)  # may evict idle cached blocks, never running ones
        blocks = self.cache.allocate(n) if n else []
        loaded = self._load(missing[:n], blocks, session_id, {}, prestage=True)
        self.cache.free(hits + blocks)
        self.ledger.count("prestaged", loaded)
        return loaded

    def drop(self, session_id: str) -> None:
        s = self.sessions.pop(session_id)
        names = set(self.cache.drop(session_id)) | set(s.names)
        self.tiers.delete_everywhere(names)
        self.ledger.count("dropped", len(names))

    def session_info(self, session_id: str) -> dict:
        s = self.sessions.get(session_id)
        g1 = sum(self.cache.block_of(n) is not None for n in s.names)
        blocks = {"G1": g1, **self.tiers.count_present(s.names)}
        return {"state": s.state, "tokens": s.num_tokens, "blocks": blocks,
                "bytes": {k: v * self.pool.bytes_per_block for k, v in blocks.items()},
                "expected_return": s.expected_return}

    # ---- reporting ---------------------------------------------------------------------------
    def stats(self, weights_bytes: int) -> dict:
        self.ledger.weights_bytes = weights_bytes
        waste = waste_bytes(self.running.values(), self.block_size, self.pool.bytes_per_token)
        padding = max(self.pool.budget_bytes - self.pool.nbytes, 0)
        self.ledger.update_g1_from_cache(self.cache, waste, padding)
        self.ledger.sample()
        d = self.ledger.to_dict()
        d["sessions"] = self.sessions.counts()
        d["prefix_cache"] = {**self.cache.stats, "query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens}
        return d
