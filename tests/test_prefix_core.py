"""The compiled prefix cache against the Python reference: the same random operations on both,
every return value, exception, eviction order, count, name, owner, stat, callback and event
compared after each one."""
import random

import pytest

from everybyte.kv.block_id import KVNamespace, chain_block_ids
from everybyte.kv.prefix_cache import NoFreeBlocks, PrefixCache
from everybyte.kv.prefix_core import native_prefix_cache_class, native_unavailable_reason, new_prefix_cache
from everybyte.kv.prefix_sessions import SHARED

Native = native_prefix_cache_class()
pytestmark = pytest.mark.skipif(Native is None, reason=f"compiled prefix cache: {native_unavailable_reason()}")
NS = KVNamespace("m", block_size=4)


class Recorder:
    def __init__(self):
        self.log = []

    def evict(self, b, name):
        self.log.append(("evict", b, name))
        if name[-1] % 17 == 0:              # a write-down that fails: logged, the eviction goes on
            raise OSError("disk full")

    def event(self, ev):
        self.log.append((type(ev).__name__, repr(ev)))


def pair(num_blocks, max_owners):
    made = []
    for cls in (PrefixCache, Native):
        rec = Recorder()
        made.append((cls(num_blocks, on_evict=rec.evict, max_owners=max_owners, on_event=rec.event,
                         block_size=4), rec))
    return made


def outcome(fn):
    try:
        return "ok", fn()
    except (NoFreeBlocks, ValueError, IndexError, KeyError) as e:
        return type(e).__name__, None


def state(c):
    return {"order": c.evictable_order(), "counts": c.counts(), "names": list(c.names),
            "ref": [c.ref_count(b) for b in range(c.num_blocks)], "ref_view": list(c.ref), "stats": dict(c.stats),
            "unreferenced": c.count_unreferenced([b for b in range(c.num_blocks) if b % 3]),
            "owners": {b: set(o) for b, o in c.owners.items()},
            "sessions": {s: set(v) for s, v in c.session_blocks.items()}, "parked": dict(c.parked),
            "free": c.num_free_blocks, "used": c.num_used_blocks, "empty": c.num_empty_blocks}


def random_op(rng, chains, held, sessions):
    """One operation as (label, fn(cache, held_table) -> result)."""
    k = rng.random()
    s = rng.choice(sessions)
    chain = rng.choice(chains)[: rng.randint(1, 6)]
    if k < 0.24:
        by_run = rng.random() < 0.5
        tokens = list(range(4 * len(chain)))
        run_tokens = rng.choice([tokens, tokens, None, tokens[:rng.randrange(4 * len(chain))]])  # short: blocks without
        limit = rng.choice([None, None, rng.randint(-1, len(chain) + 1)])    # a hit may cover only a prefix

        def fill(c, h):
            hits = c.acquire(chain, s, limit)
            try:
                new = c.allocate(len(chain) - len(hits), ascending=by_run)   # the engine's way when by_run
            except NoFreeBlocks:
                c.free(hits)
                raise
            table = hits + new
            if by_run:                       # the memory manager's path: a run of blocks at once
                kept = set(c.commit_run(table, chain, len(hits), len(chain), s, run_tokens))
                dups = [i for i in range(len(hits), len(chain)) if i not in kept]
            else:
                dups = []
                for i in range(len(hits), len(chain)):
                    parent = chain[i - 1] if i else None
                    if c.commit(table[i], chain[i], s, parent, tokens[4 * i:4 * i + 4]) != table[i]:
                        dups.append(i)
            for i in dups:                   # duplicate: switch to the cached block
                got = c.block_of(chain[i])
                c.share([got]) if c.ref_count(got) else c.acquire([chain[i]], s)
                c.free([table[i]])
                table[i] = got
            h.append(table)
            return table
        return "fill", fill
    if k < 0.45:
        def free(c, h):
            if not h:
                return None
            c.free(h.pop(i % len(h)))
        i = rng.randrange(1 << 30)
        return "free", free
    if k < 0.52:
        return "refresh", lambda c, h: c.refresh(chain, s)
    if k < 0.54:
        return "lookup", lambda c, h: c.lookup(chain)
    if k < 0.56:
        limit = rng.randint(-1, 7)

        def count_hits(c, h):                 # lookup(chain[:limit]) counted, on both classes
            hits, idle = c.count_hits(chain, limit)
            found = c.lookup(chain[:max(limit, 0)])
            assert (hits, idle) == (len(found), c.count_unreferenced(found))
            return hits, idle
        return "count_hits", count_hits
    if k < 0.64:
        ret = rng.choice([None, 5.0, 1.0, 9.0, float(rng.randint(0, 20))])
        return "park", lambda c, h: c.park(s, ret)
    if k < 0.72:
        return "unpark", lambda c, h: c.unpark(s)
    if k < 0.76:
        mod = rng.randint(2, 5)
        keep = (lambda name: name[0] % mod == 0) if rng.random() < 0.5 else None
        return "drop", lambda c, h: c.drop(s, keep)
    if k < 0.81:
        n = rng.randint(0, 4)
        return "evict", lambda c, h: c.evict(n)
    if k < 0.85:
        picks = [rng.randrange(16) for _ in range(rng.randint(0, 4))]
        return "evict_blocks", lambda c, h: c.evict_blocks(picks)
    if k < 0.90:
        picks = [rng.randrange(16) for _ in range(rng.randint(0, 3))]
        return "touch", lambda c, h: c.touch(picks)
    if k < 0.94:
        def share(c, h):
            if h:
                c.share(h[-1][:1])
                h.append(h[-1][:1])
        return "share", share
    if k < 0.96:
        n, ascending = rng.randint(0, 20), rng.random() < 0.5
        return "allocate_free", lambda c, h: c.allocate(n, ascending)
    if k < 0.98:
        return "clear", lambda c, h: c.clear()
    bad = rng.choice([("free_bad", lambda c, h: c.free([rng_b])), ("share_bad", lambda c, h: c.share([rng_b])),
                      ("commit_bad", lambda c, h: c.commit(rng_b, b"x" * 8))])
    rng_b = rng.randrange(16)
    return bad


@pytest.mark.parametrize("seed", range(30))
def test_native_matches_reference(seed):
    rng = random.Random(seed)
    max_owners = rng.choice([1, 2, 3, 32])
    (ref, ref_rec), (nat, nat_rec) = pair(16, max_owners)
    chains = [chain_block_ids(NS, [t % 3] * 4 + [t] * 20) for t in range(6)]
    sessions = [None, "a", "b", "c", 7]
    held = {id(ref): [], id(nat): []}
    for step in range(1000):
        label, op = random_op(rng, chains, held, sessions)
        r = outcome(lambda: op(ref, held[id(ref)]))
        n = outcome(lambda: op(nat, held[id(nat)]))
        where = f"seed {seed} step {step} {label}"
        assert n == r, where
        assert state(nat) == state(ref), where
        assert nat_rec.log == ref_rec.log, where
        assert held[id(nat)] == held[id(ref)], where
        if label == "allocate_free" and r[0] == "ok":
            ref.free(r[1]), nat.free(n[1])


@pytest.mark.parametrize("how", ["one_by_one", "tables", "partly_held"])
@pytest.mark.parametrize("seed", range(5))
def test_park_order_of_long_sessions(seed, how):
    """Sessions of more than 16 blocks (the merge sort, not the insertion sort, orders them): park and
    unpark return, and evict in, the order of the Python reference. Blocks freed one by one in a
    random order (short runs), whole tables freed tail first and some freed again after a
    re-acquire (long falling and rising runs), or two in every few still held (never freed: equal
    keys within and between the runs, so finding runs and merging them must be stable)."""
    rng = random.Random(seed)
    (ref, _), (nat, _) = pair(128, 32)
    chains = {s: chain_block_ids(NS, [s] * 4 + [rng.randrange(1000) for _ in range(4 * 40)]) for s in (1, 2, 3)}
    for c in (ref, nat):
        order_rng = random.Random(seed)
        tables = {s: c.allocate(len(names)) for s, names in chains.items()}
        for s, names in chains.items():
            for b, name in zip(tables[s], names):
                c.commit(b, name, f"s{s}")
        if how == "one_by_one":
            order = [(s, i) for s in chains for i in range(len(chains[s]))]
            order_rng.shuffle(order)
            for s, i in order:                # freed one by one in a random order: the keys differ
                c.free([tables[s][i]])
            continue
        for s in order_rng.sample(sorted(chains), 3):
            keep = order_rng.randrange(3, 6) if how == "partly_held" and s != 1 else 0
            c.free([b for i, b in enumerate(tables[s]) if not keep or i % keep > 1])   # tail first
            if how == "tables":
                b = order_rng.randrange(2, len(chains[s]))
                a = order_rng.randrange(1, b)
                again = c.acquire(chains[s][:b], f"s{s}")
                c.free(again[a:])             # freed again, later: a second falling run
                c.free(again[:a])
    for s in (1, 2, 3):
        assert nat.park(f"s{s}", float(s)) == ref.park(f"s{s}", float(s))
        assert nat.evictable_order() == ref.evictable_order()
    assert nat.unpark("s2") == ref.unpark("s2")
    assert nat.evictable_order() == ref.evictable_order()
    assert nat.evict(50) == ref.evict(50)


def test_shared_owner_and_errors():
    c = Native(4, max_owners=1)
    (b,) = c.allocate(1)
    c.commit(b, b"n1", "a")
    c.commit(b, b"n1", "b")
    assert c.owners[b] == {"a"} or SHARED in c.owners[b]
    with pytest.raises(ValueError, match="cannot park"):
        c.park(None)
    with pytest.raises(ValueError, match="already named"):
        c.commit(b, b"n2")
    with pytest.raises(NoFreeBlocks):
        c.allocate(5)
    with pytest.raises(ValueError, match="num_blocks"):
        Native(0)
    with pytest.raises(IndexError):
        c.ref_count(99)
    for bad in (lambda: c.evict_blocks([7]), lambda: c.free([-1]), lambda: c.touch([4]), lambda: c.share([9])):
        with pytest.raises(IndexError, match="out of range 0..3"):   # stricter than list indexing
            bad()
    with pytest.raises(TypeError):
        c.free(["a"])
    with pytest.raises(IndexError, match="commit_run range"):
        c.commit_run([b], [b"n1"], 0, 2)


def test_switch_off(monkeypatch):
    monkeypatch.setenv("EVERYBYTE_NATIVE_KV", "0")
    assert type(new_prefix_cache(4)) is PrefixCache
    monkeypatch.setenv("EVERYBYTE_NATIVE_KV", "1")
    assert type(new_prefix_cache(4)) is Native


@pytest.mark.parametrize("cls", [PrefixCache, Native], ids=["python", "native"])
def test_events_of_a_call_are_coalesced(cls):
    """A call's events come as it returns, merged as kv/events.coalesce merges them: a run of
    blocks committed together is one BlockStored (the first block's parent, the tokens joined), a
    block whose parent is not the last one named (a duplicate in between) or that has no tokens
    where the others have some starts another, and the blocks one allocation evicts are one
    BlockRemoved."""
    from everybyte.kv.events import BlockRemoved, BlockStored, coalesce
    got = []
    c = cls(8, on_event=got.append, block_size=4)
    names = chain_block_ids(NS, list(range(24)))          # 6 blocks
    tokens = list(range(24))
    first = c.allocate(2)
    c.commit_run(first, names, 0, 2, "a", tokens)
    assert got == [BlockStored(names[:2], 4, None, token_ids=tokens[:8])]
    got.clear()
    table = c.acquire(names[:2], "b") + c.allocate(4)
    dup = c.allocate(1)[0]
    c.commit(dup, names[3], "x", names[2], tokens[12:16])  # block 3's name is taken before the run
    got.clear()
    kept = c.commit_run(table, names, 2, 6, "b", tokens[:20])      # block 5 without tokens
    assert kept == [2, 4, 5]
    assert got == [BlockStored([names[2]], 4, names[1], token_ids=tokens[8:12]),
                   BlockStored([names[4]], 4, names[3], token_ids=tokens[16:20]),
                   BlockStored([names[5]], 4, names[4])]
    assert coalesce(got) == got                           # nothing left to merge
    c.free(table), c.free(first), c.free([dup])
    got.clear()
    c.allocate(8)                                          # every cached block evicted: one removal
    assert len(got) == 1 and isinstance(got[0], BlockRemoved) and sorted(got[0].block_hashes) == sorted(names)
