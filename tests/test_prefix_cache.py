import random

import pytest

from everybyte.kv.block_id import KVNamespace, chain_block_ids
from everybyte.kv.eviction import FIFOPolicy, LRUPolicy, ParkedFirst
from everybyte.kv.prefix_cache import NoFreeBlocks, PrefixCache

NS = KVNamespace("m", block_size=4)


def names(tag: int, n: int) -> list[bytes]:
    return chain_block_ids(NS, [tag] * (4 * n))


def fill(cache: PrefixCache, chain: list[bytes], owner=None) -> list[int]:
    """What a block manager does for a new sequence: reuse the cached prefix, compute the rest."""
    hits = cache.acquire(chain, owner)
    new = cache.allocate(len(chain) - len(hits))
    for b, name in zip(new, chain[len(hits):]):
        cache.commit(b, name, owner)
    return hits + new


def check_invariants(c: PrefixCache):
    counts = c.counts()
    assert sum(counts.values()) == c.num_blocks
    assert len(set(c.empty)) == len(c.empty)
    for b in c.empty:
        assert c.ref[b] == 0 and c.names[b] is None and b not in c.policy
    for name, b in c.by_name.items():
        assert c.names[b] == name
    for b in range(c.num_blocks):
        assert (b in c.policy) == (c.ref[b] == 0 and c.names[b] is not None)


def test_refcounts_and_reuse():
    c = PrefixCache(8)
    a = fill(c, names(1, 3))
    assert c.num_free_blocks == 5 and all(c.ref_count(b) == 1 for b in a)
    b = fill(c, names(1, 3))      # same prefix: shares all three blocks
    assert b == a and all(c.ref_count(x) == 2 for x in a) and c.num_free_blocks == 5
    c.free(a)
    assert c.num_free_blocks == 5
    c.free(b)
    assert c.num_free_blocks == 8 and c.counts() == {"running": 0, "parked": 0, "cached": 3, "empty": 5}
    assert c.lookup(names(1, 3) + names(2, 1)) == a      # reusable after the requests finished
    with pytest.raises(ValueError):
        c.free([a[0]])
    check_invariants(c)


def test_unnamed_blocks_return_empty_and_refcounted_never_evicted():
    c = PrefixCache(4)
    a = fill(c, names(1, 2))
    partial = c.allocate(1)
    assert c.num_free_blocks == 1
    c.free(partial)
    assert c.num_empty_blocks == 2
    c.allocate(2)
    with pytest.raises(NoFreeBlocks):
        c.allocate(1)                 # the two in-use blocks of `a` are never evicted
    assert all(c.ref_count(x) == 1 for x in a) and c.lookup(names(1, 2)) == a
    check_invariants(c)


def test_lru_order_eviction_callback_and_tail_first():
    evicted = []
    c = PrefixCache(6, on_evict=lambda b, n: evicted.append((b, n, c.name_of(b))))
    a, b = fill(c, names(1, 3)), fill(c, names(2, 3))
    c.free(a)
    c.free(b)
    assert c.evictable_order() == [a[2], a[1], a[0], b[2], b[1], b[0]]   # tails first, oldest first
    c.free(c.acquire(names(1, 3)))                                        # reuse refreshes a
    assert c.evictable_order()[:3] == [b[2], b[1], b[0]]
    got = c.allocate(2)
    assert got == [b[2], b[1]]
    assert [(x, n) for x, n, _ in evicted] == [(b[2], names(2, 3)[2]), (b[1], names(2, 3)[1])]
    assert all(name == still for _, name, still in evicted)               # bytes intact during callback
    assert c.lookup(names(2, 3)) == [b[0]]                                # its prefix still reusable
    assert c.stats["evictions"] == 2
    check_invariants(c)


def test_duplicate_commit_returns_canonical_block():
    c = PrefixCache(4)
    chain = names(5, 1)
    x, y = c.allocate(2)
    assert c.commit(x, chain[0]) == x
    assert c.commit(y, chain[0]) == x and c.name_of(y) is None
    c.free([y])
    assert c.num_empty_blocks == 3
    with pytest.raises(ValueError):
        c.commit(x, names(6, 1)[0])


def test_parked_sessions_first_latest_return_first():
    c = PrefixCache(16)
    shared = names(9, 1)                                     # e.g. a system prompt
    sa = fill(c, shared + chain_block_ids(NS, [9] * 4 + [1] * 8)[1:], "A")
    sb = fill(c, shared + chain_block_ids(NS, [9] * 4 + [2] * 8)[1:], "B")
    sc = fill(c, chain_block_ids(NS, [3] * 8), "C")
    anon = fill(c, names(4, 2))
    for t in (sa, sb, sc, anon):
        c.free(t)
    assert c.counts()["parked"] == 0
    c.park("A", expected_return=100.0)
    c.park("B", expected_return=50.0)
    c.park("C")                                             # unknown return: treated as latest
    order = c.evictable_order()
    assert order[:2] == [sc[1], sc[0]]
    assert order[2:4] == [sa[2], sa[1]]
    assert order[4:6] == [sb[2], sb[1]]
    assert order[6] == sa[0]           # shared by A and B, both parked: goes with the earliest return
    assert set(order[7:]) == set(anon)
    assert c.counts()["parked"] == 7
    c.free(c.acquire(names(9, 1)))                          # an anonymous request uses the shared block
    assert c.counts()["parked"] == 6 and c.evictable_order()[-1] == sa[0]   # now ordinary, most recent
    got = c.allocate(c.num_empty_blocks + 3)
    assert set(got[-3:]) == {sc[1], sc[0], sa[2]}
    c.unpark("A")
    assert c.evictable_order()[0] == sb[2] and sa[1] not in c.evictable_order()[:2]
    check_invariants(c)


def test_parked_block_in_use_is_not_evicted():
    c = PrefixCache(3)
    a = fill(c, names(1, 2), "A")
    c.free(a)
    c.park("A", 10.0)
    hold = c.acquire(names(1, 1), "B")                      # another session reads A's first block
    assert hold == [a[0]] and c.evictable_order() == [a[1]]
    got = c.allocate(2)
    assert a[0] not in got and c.ref_count(a[0]) == 1
    check_invariants(c)


def test_drop_frees_private_blocks_only():
    c = PrefixCache(8)
    a = fill(c, names(1, 3), "A")
    c.free(a)
    b = fill(c, names(1, 1), "B")                           # B shares A's first block
    c.free(b)
    freed = c.drop("A")
    assert freed == [names(1, 3)[i] for i in sorted(range(1, 3), key=lambda i: a[i])]
    assert c.lookup(names(1, 3)) == [a[0]] and c.num_empty_blocks == 7
    assert "A" not in c.session_blocks and "A" not in c.parked
    check_invariants(c)


def test_policies_direct():
    lru, fifo = LRUPolicy(), FIFOPolicy()
    for p in (lru, fifo):
        for b in (1, 2, 3):
            p.insert(b)
        p.touch(1)
    assert lru.order() == [2, 3, 1] and fifo.order() == [1, 2, 3]
    pf = ParkedFirst()
    for b in range(5):
        pf.insert(b)
    pf.set_parked(3, 5.0)
    pf.set_parked(1, None)
    pf.set_parked(4, 7.0)       # parked before it is evictable
    pf.remove(4)
    assert pf.order() == [1, 3, 0, 2] and pf.num_parked() == 2
    pf.insert(4)
    assert pf.order() == [1, 4, 3, 0, 2]
    assert [pf.pop() for _ in range(5)] == [1, 4, 3, 0, 2] and pf.pop() is None
    pf.insert(3)                # id reused after eviction: no stale parking
    assert pf.num_parked() == 0


def test_random_workload_keeps_invariants():
    rng = random.Random(0)
    c = PrefixCache(32)
    live = []
    for step in range(400):
        if live and (rng.random() < 0.4 or c.num_free_blocks < 6):
            c.free(live.pop(rng.randrange(len(live))))
        else:
            chain = chain_block_ids(NS, [rng.randrange(3)] * 4 + [rng.randrange(4)] * rng.randrange(4, 20))
            if len(chain) <= c.num_free_blocks:
                live.append(fill(c, chain, rng.choice([None, "s1", "s2"])))
        if step % 50 == 0:
            c.park("s1", float(step))
        if step % 70 == 0:
            c.unpark("s1")
        check_invariants(c)
    for t in live:
        c.free(t)
    assert c.counts()["running"] == 0


def test_widely_shared_block_is_never_parked_only():
    c = PrefixCache(4, max_owners=3)
    chain = names(1, 1)
    for s in ("a", "b", "c", "d", "e"):
        c.free(c.acquire(chain, s) or fill(c, chain, s))
    for s in ("a", "b", "c", "d", "e"):
        c.park(s, 1.0)
    assert c.counts()["parked"] == 0
    assert c.drop("a") == [] and c.lookup(chain) != []
    check_invariants(c)


# ---- the integration the engine's BlockManager is meant to do (reference, driven by the real
# Scheduler with a fake forward pass) ---------------------------------------------------------
from everybyte.engine.sampling_params import SamplingParams  # noqa: E402
from everybyte.engine.scheduler import Scheduler  # noqa: E402
from everybyte.engine.sequence import Sequence  # noqa: E402
from everybyte.kv.block_manager import BlockManager  # noqa: E402


class PrefixBlockManager(BlockManager):
    """E's BlockManager interface on top of PrefixCache: names come from block_id, full computed
    blocks are committed lazily (may_append / deallocate), a full-prompt hit keeps its last block
    to recompute so the last prompt token still produces logits."""

    def __init__(self, num_blocks, block_size, namespace):
        super().__init__(num_blocks, block_size)
        self.ns, self.cache, self.names = namespace, PrefixCache(num_blocks), {}

    @property
    def num_free_blocks(self):
        return self.cache.num_free_blocks

    @property
    def num_used_blocks(self):
        return self.cache.num_used_blocks

    def _names(self, seq):
        known = self.names.setdefault(seq.seq_id, [])
        known += chain_block_ids(self.ns, seq.token_ids, parent=known[-1] if known else None,
                                 start_block=len(known))
        return known

    def _commit(self, seq):
        names = self._names(seq)
        for i in range(min(seq.num_computed_tokens // self.block_size, len(names))):
            self.cache.commit(seq.block_table[i], names[i], getattr(seq, "session_id", None))

    def can_allocate(self, seq):
        hits = self.cache.lookup(self._names(seq)[:(len(seq) - 1) // self.block_size])
        cached = sum(self.cache.ref_count(b) == 0 for b in hits)     # evictable now, not once reused
        return self.blocks_for(len(seq)) - len(hits) <= self.num_free_blocks - cached

    def allocate(self, seq):
        names = self._names(seq)[:(len(seq) - 1) // self.block_size]
        hits = self.cache.acquire(names, getattr(seq, "session_id", None))
        seq.block_table = hits + self.cache.allocate(self.blocks_for(len(seq)) - len(hits))
        seq.num_computed_tokens = len(hits) * self.block_size

    def deallocate(self, seq):
        self._commit(seq)
        self.cache.free(seq.block_table)
        self.names.pop(seq.seq_id, None)
        seq.block_table, seq.num_computed_tokens = [], 0

    def may_append(self, seq):
        self._commit(seq)
        seq.block_table += self.cache.allocate(self.blocks_for(len(seq)) - len(seq.block_table))


def run_to_end(sched, computed):
    while not sched.is_finished():
        out = sched.schedule()
        for seq, n in zip(out.seqs, out.num_new_tokens):
            computed[seq.request_id] = computed.get(seq.request_id, 0) + n
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == len(seq):
                seq.append_token(7)
                if seq.num_completion_tokens >= seq.params.max_tokens:
                    sched.finish(seq, "length")


def test_reference_block_manager_with_real_scheduler():
    bm = PrefixBlockManager(32, 4, NS)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
    prompt = list(range(100, 130))                           # 30 tokens = 7 full blocks + 2
    computed = {}
    sched.add(Sequence(prompt, SamplingParams(max_tokens=3), request_id="a"))
    run_to_end(sched, computed)
    sched.add(Sequence(prompt + [5, 6, 7, 8, 9], SamplingParams(max_tokens=3), request_id="b"))
    sched.add(Sequence(prompt[:28], SamplingParams(max_tokens=2), request_id="c"))   # full-prompt hit
    run_to_end(sched, computed)
    assert computed["a"] == 30 + 2
    assert computed["b"] == 35 - 28 + 2                      # reused a's 7 full blocks (a's 3 outputs too)
    assert computed["c"] == 4 + 1                            # recomputes its last block only
    assert bm.cache.counts()["running"] == 0 and bm.num_free_blocks == 32
    check_invariants(bm.cache)
