"""kv/name_memo: a session's next turn takes the block names of its longest whole-block prefix
equal to the session's last context, and hashes only the rest; the names are always those of
chain_block_ids over the whole prompt (a diverging prompt, another tenant or another session
reuse nothing wrong)."""
from everybyte.engine.sampling_params import SamplingParams
from everybyte.engine.sequence import Sequence
from everybyte.kv.block_id import KVNamespace, chain_block_ids
from everybyte.sim.worker import SimPool, SimWorker, WorkerSpec

BS = 16
NS = KVNamespace("sim-model", kv_format="nvfp4", block_size=BS)


def _memory(memo_sessions: int):
    spec = WorkerSpec(SimPool(64, BS, 8), kv_format="nvfp4", name_memo_sessions=memo_sessions)
    return SimWorker(0, spec, lambda clock: None, lambda level, nbytes: 0.0).memory


def _seq(tokens, sid, salt=None):
    s = Sequence(tokens, SamplingParams(max_tokens=4, ignore_eos=True), arrival_time=0.0)
    s.session_id, s.cache_salt = sid, salt
    return s


def _turn(mm, tokens, sid, salt=None):
    seq = _seq(tokens, sid, salt)
    mm.allocate(seq)
    seq.num_computed_tokens = len(seq)
    names = list(mm.names_of(seq))
    mm.deallocate(seq)
    ns = mm.ns.with_tenant(salt) if salt else mm.ns         # the simulated worker's (mix128) names
    assert names == chain_block_ids(ns, tokens, BS)         # never a wrong name
    return names


def test_next_turn_names_only_its_new_blocks():
    mm = _memory(2)
    first = list(range(1000, 1000 + 5 * BS + 3))
    _turn(mm, first, "a")
    assert mm.names_memo.reused == 0
    _turn(mm, first + list(range(5000, 5000 + 2 * BS)), "a")             # extends: 5 blocks reused
    assert mm.names_memo.reused == 5
    diverged = first[:2 * BS + 5] + [9] * (3 * BS)                        # equal for 2 blocks, then not
    _turn(mm, diverged, "a")
    assert mm.names_memo.reused == 5 + 2
    _turn(mm, diverged, "a", salt="tenant-b")                              # another tenant: nothing reused
    _turn(mm, diverged, "other")                   # a new session: the last context is another tenant's
    assert mm.names_memo.reused == 7


def test_a_new_session_takes_the_blocks_it_shares_with_the_latest_context():
    """A session's first turn (or a request of no session) reuses the names of its leading blocks
    equal to the context kept last by any session: a system prompt that sessions share is
    hashed once, not once per session."""
    mm = _memory(4)
    system = list(range(1000, 1000 + 3 * BS))
    _turn(mm, system + list(range(5000, 5000 + 2 * BS)), "a")
    _turn(mm, system + list(range(7000, 7000 + BS + 3)), "b")             # the 3 system blocks reused
    assert mm.names_memo.reused == 3
    _turn(mm, system[:BS] + [5] * (2 * BS), None)                          # no session: 1 block
    assert mm.names_memo.reused == 4
    _turn(mm, [1] + system[1:], "c")                                        # differs at its first token
    assert mm.names_memo.reused == 4


def test_the_memo_is_bounded_and_off_when_not_asked():
    mm = _memory(2)
    for sid in ("a", "b", "c"):
        _turn(mm, list(range(100, 100 + 2 * BS)), sid)
    assert list(mm.names_memo.entries) == ["b", "c"]
    off = _memory(0)
    _turn(off, list(range(100, 100 + 2 * BS)), "a")
    _turn(off, list(range(100, 100 + 3 * BS)), "a")
    assert off.names_memo.reused == 0 and not off.names_memo.entries


def test_kept_context_is_a_reference_that_may_grow():
    """keep() stores the sequence's own lists (no copy); what a sequence appends after it (more
    tokens, more names) is neither reused as if kept nor able to change what was."""
    from everybyte.kv.name_memo import NameMemo
    memo = NameMemo(4)
    tokens = list(range(100, 100 + 3 * BS))
    names = chain_block_ids(NS, tokens, BS)
    memo.keep("s", None, tokens, names, BS)
    assert memo.entries["s"][1] is tokens and memo.entries["s"][2] is names
    more = list(range(900, 900 + 2 * BS))
    tokens += more                                  # the sequence decodes on (a preempted one)
    names += chain_block_ids(NS, tokens, BS, parent=names[-1], start_block=3)
    assert memo.prefix("s", None, tokens, BS) == names[:3]       # only the blocks kept
    assert memo.prefix("s", None, tokens[:2 * BS] + [1] * BS, BS) == names[:2]


def test_equal_blocks_native_and_python_agree(monkeypatch):
    """The memo's prefix check: block_names.common_prefix (identity, then value) counts the same
    whole blocks as the slice comparison it replaces, for shared, fresh and unequal ints."""
    import random

    from everybyte.kv import block_id, name_memo
    if block_id.compiled_names() is None:
        import pytest
        pytest.skip("the block_names C module did not build here (no compiler)")
    rng = random.Random(0)
    cases = []
    for _ in range(200):
        kept = [rng.randrange(2**40) for _ in range(rng.randrange(0, 6 * BS))]
        tokens = [int(str(t)) for t in kept]             # equal values, other objects
        if tokens and rng.random() < 0.7:
            tokens[rng.randrange(len(tokens))] += 1      # diverge somewhere
        tokens += [7] * rng.randrange(0, 2 * BS)
        cases.append((tokens, kept, min(len(kept), len(tokens)) // BS))
    native = [name_memo.equal_blocks(t, k, n, BS) for t, k, n in cases]
    monkeypatch.setattr(name_memo, "compiled_names", lambda: None)
    assert native == [name_memo.equal_blocks(t, k, n, BS) for t, k, n in cases]
    assert any(0 < x < n for x, (_, _, n) in zip(native, cases))      # partial prefixes were tried
