"""The memory system behind the BlockManager interface: content-named blocks shared through a
G1 prefix cache, written down to lower tiers on eviction, loaded back instead of recomputed,
and agent sessions parked off the device while they run a tool.

The scheduler only sees the BlockManager calls; a hit just starts the sequence with
num_computed_tokens past it, so chunked prefill computes only the misses. A G1 hit is immediate;
blocks found in a lower tier are loaded into the sequence's fresh G1 blocks by a background job
(block_loader) while other requests keep running, and the sequence stays out of compute
(is_loading) until poll_loads() collects the job. Names cover everything that changes a block's
bytes (KVNamespace), so a hit can never be wrong; a block that fails its checks is a miss.
Blocks leave G1 in batches: everything evicted by one allocation is encoded at once and put to
the first tier as one buffer.
"""
from __future__ import annotations

from typing import Any, Callable

from everybyte.kv.block_id import KVNamespace, chain_block_ids
from everybyte.kv.clock import SYSTEM, Clock
from everybyte.kv.events import EventLog, KVEvent
from everybyte.kv.ledger import ByteLedger, waste_bytes
from everybyte.kv.mover import KVMover, LoadJob, PoolGeometry, pool_mover
from everybyte.kv.name_memo import NameMemo
from everybyte.kv.prefix_core import new_prefix_cache
from everybyte.kv.seq_state import KVSequence, PendingLoad, SeqKV
from everybyte.kv.session_ops import SessionOps
from everybyte.kv.sessions import SessionTable
from everybyte.kv.tier_movement import TierSet


class KVMemoryManager(SessionOps):
    def __init__(self, pool: PoolGeometry, namespace: KVNamespace, tiers: TierSet | None = None,
                 ledger: ByteLedger | None = None, offload_on_park: bool = True, load_timeout_s: float = 10.0,
                 restart_blocks: int = 1, max_sessions: int = 10000, session_idle_s: float = 3600.0,
                 clock: Clock = SYSTEM, mover: KVMover | None = None, name_memo_sessions: int = 0) -> None:
        """mover: the KV data plane (default the real one for a KVPool: codec + block loader).
        name_memo_sessions: keep the tokens and block names of this many sessions' last contexts,
        so a session's next turn names only its new blocks (names are a pure function of the
        tokens: a memo entry is checked token by token, never trusted)."""
        super().__init__(pool.num_blocks, pool.block_size)
        self.restart_blocks = restart_blocks      # a reusing sequence computes from a multiple of this
        self.pool, self.ns = pool, namespace
        self.tiers = tiers if tiers is not None else TierSet([])      # an empty TierSet is falsy: keep it
        self.tiers.bytes_per_token = pool.bytes_per_token
        self.ledger = ledger or ByteLedger(pool.bytes_per_block)
        for t in self.tiers.tiers:
            self.ledger.add_tier(t)
        # with no tier below G1 an evicted block has nowhere to go: no callback per eviction
        self.cache = new_prefix_cache(pool.num_blocks, on_evict=self._write_down if self.tiers.first is not None else None,
                                      block_size=pool.block_size)
        self.sessions = SessionTable(max_sessions, session_idle_s, clock.time)
        self.offload_on_park = offload_on_park
        self.seqs: dict[int, SeqKV] = {}              # seq_id -> its KV state (from its first lookup)
        self._made = 0                                # states made (SeqKV.order)
        self._loads: dict[int, SeqKV] = {}            # seq_id -> the state of each sequence waiting for loads
        self._last_state: SeqKV | None = None         # the last one _state gave (while in seqs)
        self.query_tokens = self.hit_tokens = 0       # prompt tokens looked up / found in any tier
        self.mover = mover or pool_mover(pool, self.tiers, load_timeout_s, clock)
        self._loaded_from: dict[int, str] = {}        # G1 block -> tier a job loaded it from, until reused
        self._evicting: list[tuple[int, bytes]] = []  # evicted blocks to write down in one batch
        self.names_memo = NameMemo(name_memo_sessions)

    # ---- BlockManager interface ---------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.cache.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.cache.num_used_blocks

    @property
    def loading(self) -> dict[int, SeqKV]:
        """The sequences waiting (out of compute) for tier loads, in the order their states were made."""
        return dict(sorted(self._loads.items(), key=lambda kv: kv[1].order))

    def _state(self, seq: KVSequence) -> SeqKV:
        st = self._last_state                   # a step asks for the same sequence's several times
        if st is not None and st.seq is seq:
            return st
        st = self.seqs.get(seq.seq_id)
        if st is None:
            st = self.seqs[seq.seq_id] = SeqKV(seq, self._made)
            self._made += 1
        self._last_state = st
        return st

    def names_of(self, seq: KVSequence) -> list[bytes]:
        return self._names(self._state(seq))

    def _names(self, st: SeqKV) -> list[bytes]:
        """The names of the sequence's full blocks (its state's list, extended as it grows)."""
        seq, known = st.seq, st.names
        if not known:                           # the memo's answer is a new list: it becomes ours
            st.names = known = self.names_memo.prefix(seq.session_id, seq.cache_salt, seq.token_ids,
                                                      self.block_size)
        if (len(seq) // self.block_size) > len(known):
            ns = self.ns.with_tenant(seq.cache_salt) if seq.cache_salt else self.ns
            known += chain_block_ids(ns, seq.token_ids, self.block_size, parent=known[-1] if known else None,
                                     start_block=len(known))
        return known

    def _usable(self, seq: KVSequence) -> int:
        # a full-prompt hit keeps its last block to recompute, so the last token yields logits
        return (len(seq) - 1) // self.block_size

    def _reusable(self, seq: KVSequence, st: SeqKV | None = None) -> list[bytes]:
        """The names of the blocks a hit may cover."""
        return self._names(st or self._state(seq))[:self._usable(seq)]

    def can_allocate(self, seq: KVSequence) -> bool:
        names, usable = self.names_of(seq), self._usable(seq)
        hits, held = self.cache.count_hits(names, usable)       # held: evictable now, pinned once reused
        loading = len(self.mover.in_flight(names[hits:usable])) if self.mover.inflight else 0
        return self.blocks_for(len(seq)) - hits - loading <= self.num_free_blocks - held

    def allocate(self, seq: KVSequence) -> None:
        assert not seq.block_table, "sequence already holds blocks"
        sid = seq.session_id
        if sid is not None:
            self.sessions.touch(sid)
            self.cache.unpark(sid)
        self.expire_sessions(keep=sid)
        st = self._state(seq)
        names, usable = self._names(st), self._usable(seq)      # the first `usable` names: what a hit may cover
        hits = self.cache.acquire(names, sid, usable)
        n_hits = len(hits)
        adopted = self.mover.in_flight(names[n_hits:usable]) if self.mover.inflight else []   # blocks a job is loading
        shared = [job.blocks[i] for job, i in adopted]
        if shared:
            self.cache.share(shared)
        known = n_hits + len(shared)
        # a block loaded by an earlier job counts as reuse from the tier it came from (None: all G1)
        loaded = self._loaded_from
        levels = [loaded.pop(b, "G1") for b in hits] if loaded else None
        table = hits                                # the cache's new list: the table is built in it
        table += shared
        table += self._fresh(self.blocks_for(len(seq)) - known)
        seq.block_table = table
        jobs = {job for job, _ in adopted}
        if self.tiers.tiers and (n := self.tiers.may_hold(names[known:usable])):     # (TierSet's len is Python)
            fresh = table[known:known + n]
            self.cache.share(fresh)
            jobs.add(self.mover.start(names[known:known + n], fresh, sid))
        first = seq.first_admission
        st.holds_blocks = True
        if jobs:
            seq.num_computed_tokens, seq.kv_stored_until = n_hits * self.block_size, 0
            st.committed = n_hits
            st.load = PendingLoad(jobs, n_hits, ["G1"] * n_hits if levels is None else levels, first)
            self._loads[seq.seq_id] = st
        else:
            self._admit(st, n_hits, levels, first)

    def _admit(self, st: SeqKV, ready: int, levels: list[str] | None, first: bool) -> None:
        """The first `ready` blocks of the sequence hold its KV (levels: the tier each came from;
        None: G1 for all): compute from the last multiple of restart_blocks at or below it. The
        blocks in between are recomputed for the exact tail only; their pool bytes stay
        (kv_stored_until)."""
        seq = st.seq
        keep = ready - ready % self.restart_blocks
        seq.kv_stored_until = ready * self.block_size
        seq.num_computed_tokens = keep * self.block_size
        if first:
            seq.num_cached_tokens = seq.num_computed_tokens
        self.query_tokens += len(seq)
        self.hit_tokens += seq.num_computed_tokens
        st.committed = ready
        reused: dict[str, int] = {}                # tokens reused per tier, in first-seen order
        if levels is None:                         # the common case: every hit was in G1
            if keep:
                reused["G1"] = keep * self.block_size
        else:
            for level in levels[:keep]:
                reused[level] = reused.get(level, 0) + self.block_size
        self.ledger.record_prefill(0, reused)

    # ---- loads in flight ---------------------------------------------------------------------
    def is_loading(self, seq: KVSequence) -> bool:
        st = self.seqs.get(seq.seq_id)
        return st is not None and st.load is not None

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """Prompt tokens computed (vs reused), and the prefill speed that decides whether loading
        a block from a tier beats recomputing it."""
        self.ledger.record_prefill(tokens)
        if tokens >= 64 and seconds > 0:
            speed, old = tokens / seconds, self.tiers.prefill_tok_s
            self.tiers.prefill_tok_s = speed if old is None else 0.7 * old + 0.3 * speed

    def has_pending_loads(self) -> bool:
        return bool(self.mover.jobs)

    def wait_loads(self, timeout: float) -> bool:
        return self.mover.wait(timeout)

    def poll_loads(self) -> list[KVSequence]:
        """Collect finished loads (name their blocks); returns the sequences now ready to compute."""
        where: dict[int, tuple[KVSequence, int]] | None = None    # block -> (loading sequence, index)
        for job in self.mover.finished():
            if job.loaded and where is None:     # once per poll: the loading sequences do not change in it
                where = {b: (st.seq, i) for st in self.loading.values() for i, b in enumerate(st.seq.block_table)}
            if job.loaded:
                self._name_loaded(job, where)
            for level in job.corrupt:
                self.ledger.count("corrupt", tier=level)
            if job.loaded:
                self.ledger.count("loaded", len(job.loaded))
                if job.prestage:
                    self.ledger.count("prestaged", len(job.loaded))
            self.cache.free(job.blocks)                       # the job's own references
        if not self._loads:
            return []
        ready = []
        done = [st for st in self.loading.values() if st.load is not None and all(job.finished for job in st.load.jobs)]
        for st in done:                         # (not a scan of every sequence: many wait in a deep queue)
            load = st.load
            assert load is not None
            st.load = None
            del self._loads[st.seq.seq_id]
            n, levels = load.ready, load.levels
            names, table = self._reusable(st.seq, st), st.seq.block_table
            while n < len(names) and self.cache.name_of(table[n]) == names[n]:
                levels.append(self._loaded_from.pop(table[n], "G1"))
                n += 1
            self._admit(st, n, levels, load.first)
            ready.append(st.seq)
        return ready

    def _name_loaded(self, job: LoadJob, where: dict[int, tuple[KVSequence, int]] | None) -> None:
        """Name the blocks a load filled: in one commit_run when they are a stretch of a loading
        sequence's table (a load's usual shape), else one by one."""
        m, loaded = len(job.loaded), job.loaded
        seq, i0 = where.get(job.blocks[0], (None, 0)) if where else (None, 0)
        if seq is not None:
            table, names = seq.block_table, self.names_of(seq)
            if table[i0:i0 + m] == job.blocks[:m] and names[i0:i0 + m] == job.names[:m]:
                for i in self.cache.commit_run(table, names, i0, i0 + m, job.owner, seq.token_ids):
                    self._loaded_from[table[i]] = loaded[i - i0]
                return
        for i, level in enumerate(loaded):
            b = job.blocks[i]
            origin = self._origin(*where[b]) if where and b in where else {"parent": job.names[i - 1] if i else None}
            if self.cache.commit(b, job.names[i], job.owner, **origin) == b:
                self._loaded_from[b] = level

    def may_append(self, seq: KVSequence) -> None:
        self._commit(seq)
        need = self.blocks_for(len(seq)) - len(seq.block_table)
        if need > 0:
            seq.block_table += self._fresh(need)

    def can_append(self, seq: KVSequence) -> bool:
        return self.blocks_for(len(seq)) - len(seq.block_table) <= self.num_free_blocks

    def deallocate(self, seq: KVSequence) -> None:
        st = self._state(seq)
        st.load = None                          # its jobs run on; they hold their own references
        self._loads.pop(seq.seq_id, None)
        self._commit(seq, st)
        sid = seq.session_id
        if sid is not None:
            self.names_memo.keep(sid, seq.cache_salt, seq.token_ids, st.names, self.block_size)
        if sid is not None and sid in self.sessions:
            n = seq.num_computed_tokens // self.block_size
            names = self._names(st)             # unchanged from now on: the session may keep it
            self.sessions.record_context(sid, seq.num_computed_tokens, names if n == len(names) else names[:n])
        self.cache.free(seq.block_table)
        self.seqs.pop(seq.seq_id, None)
        self._last_state = None
        seq.block_table, seq.num_computed_tokens, seq.kv_stored_until = [], 0, 0

    def _commit(self, seq: KVSequence, st: SeqKV | None = None) -> None:
        """Name every full block whose KV is computed; new names are written through to the
        shared tiers so other nodes can reuse them."""
        st = st or self._state(seq)
        done = st.committed
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= done:
            return
        names, table = self._names(st), seq.block_table
        new = self.cache.commit_run(table, names, done, full, seq.session_id, seq.token_ids)
        if new and self.tiers.write_through:
            ids, new_names = [seq.block_table[i] for i in new], [names[i] for i in new]
            self.tiers.write_through_blocks(new_names, self.mover.store(ids, new_names))
        st.committed = full

    def _origin(self, seq: KVSequence, i: int) -> dict[str, Any]:
        """Block i's parent name and tokens, for its BlockStored event."""
        names, bs = self.names_of(seq), self.block_size
        return {"parent": names[i - 1] if i else None, "token_ids": seq.token_ids[i * bs:(i + 1) * bs]}

    # ---- tiers -------------------------------------------------------------------------------
    def _write_down(self, block_id: int, name: bytes | None) -> None:
        """PrefixCache.on_evict: the block's bytes are intact until _flush() stores the batch."""
        self._loaded_from.pop(block_id, None)
        if name is not None and self.tiers.first is not None and not self.tiers.first.contains(name):
            self._evicting.append((block_id, name))

    def evict_all(self) -> int:
        """Evict every unreferenced G1 block now (written down to the first tier); returns how many."""
        n = len(self.cache.evict(self.cache.num_blocks))
        self._flush()
        return n

    # ---- reporting ---------------------------------------------------------------------------
    def kv_events(self, listener: Callable[[KVEvent], None] | None = None) -> EventLog:
        """Start recording the KV events (kv/events) of the G1 prefix cache and of every tier,
        stamped with this worker's namespace digest; a publisher drains the returned log (or
        passes a listener)."""
        log = EventLog(self.ns.digest, listener)
        self.cache.on_event = self.tiers.on_event = log
        self.tiers.block_size = self.block_size
        return log

    def stats(self, weights_bytes: int) -> dict[str, Any]:
        self.ledger.weights_bytes = weights_bytes
        holding = [st.seq for st in self.seqs.values() if st.holds_blocks]
        waste = waste_bytes(holding, self.block_size, self.pool.bytes_per_token)
        padding = max(self.pool.budget_bytes - self.pool.nbytes, 0)
        self.ledger.update_g1_from_cache(self.cache, waste, padding)
        self.ledger.set_count("evicted", self.cache.stats["evictions"])   # one count per on_evict
        self.ledger.sample()
        d: dict[str, Any] = dict(self.ledger.to_dict())
        d["sessions"] = self.sessions.counts()
        d["prefix_cache"] = {**self.cache.stats, "query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens}
        d["kv_namespace"] = self.ns.digest.hex()       # equal digests: the same bytes for the same tokens
        d["loads"] = {"jobs": len(self.mover.jobs), "requests_waiting": len(self.loading),
                      "blocks_in_flight": len(self.mover.inflight)}
        return d
