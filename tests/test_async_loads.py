"""Loads from lower tiers run beside compute (real default model): a slow tier never stalls
another request's decode, a load that fails part way or never ends costs only a recompute, an
aborted loading request gives its blocks back, and a turn arriving mid-prestage waits for it."""
from __future__ import annotations

import threading

import pytest
from test_memory_system import ENGINE, SYSTEM, loaded  # noqa: F401 (a fixture)

from everybyte import LLM, SamplingParams
from everybyte.engine.sequence import SequenceStatus

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# A gated tier holds its loads for as long as the test wants; the engine must not give up on them
# by the wall clock meanwhile (a busy machine makes the steps in between take any time).
NO_TIMEOUT = dict(kv_load_timeout_s=24 * 3600.0)
OTHER = "Once upon a time in a small village by the sea there lived an old fisherman and his cat."


@pytest.fixture(scope="module")
def reference(loaded):
    llm = LLM(loaded, enable_prefix_caching=False, **ENGINE)
    return lambda prompt, params=GREEDY: llm.generate([prompt], params)[0].token_ids


_GATES: list[threading.Event] = []


@pytest.fixture(autouse=True)
def open_gates():
    """A test that fails before opening its gate still lets the held tier read finish."""
    yield
    while _GATES:
        _GATES.pop().set()


def gate_tier(llm) -> threading.Event:
    """Hold every read of the engine's first tier until the returned event is set."""
    gate, tier = threading.Event(), llm.block_manager.tiers.first
    _GATES.append(gate)
    get_many = tier.get_many
    tier.get_many = lambda names: get_many(names) if gate.wait(NO_TIMEOUT["kv_load_timeout_s"]) else [None] * len(names)
    return gate


def in_g2_only(llm, prompt: str) -> None:
    llm.generate([prompt], GREEDY)
    assert llm.reset_prefix_cache() > 0


def test_slow_tier_does_not_block_another_requests_decode(loaded, reference):
    llm = LLM(loaded, kv_tiers="host:64MiB", **NO_TIMEOUT, **ENGINE)
    prompt = SYSTEM + "Task: the parser drops trailing commas; fix it."
    in_g2_only(llm, prompt)
    gate = gate_tier(llm)
    decode = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    a = llm.add_request(OTHER, decode)
    outs = {o.request_id: o for o in llm.step()}                # a's prefill and first token
    b = llm.add_request(prompt, GREEDY)
    decoded_while_loading = 0
    while not outs[a].finished:                                 # the tier holds b's blocks back meanwhile
        step = {o.request_id: o for o in llm.step()}
        outs.update(step)
        (seq_b,) = [s for s in llm.scheduler.loading if s.request_id == b]
        assert seq_b.status == SequenceStatus.LOADING and b not in step
        decoded_while_loading += a in step
    assert decoded_while_loading == 9 and outs[a].token_ids == reference(OTHER, decode)
    gate.set()
    while llm.has_unfinished_requests():
        outs.update({o.request_id: o for o in llm.step()})
    assert outs[b].num_cached_tokens > 0 and outs[b].token_ids == reference(prompt)
    assert llm.stats()["memory"]["prefill_tokens"]["reused"]["G2"] == outs[b].num_cached_tokens


def test_block_failing_mid_load_recomputes_from_there(loaded, reference, tmp_path):
    llm = LLM(loaded, kv_tiers=f"disk:{tmp_path}:64MiB", **ENGINE)
    prompt = SYSTEM + "Task: add a --verbose flag to the CLI and document it."
    in_g2_only(llm, prompt)
    from everybyte.kv.data.tiers.disk import read_pack_table
    (pack,) = tmp_path.rglob("*.kvp")
    names = llm.block_manager.names_of(llm.make_sequence(prompt, GREEDY))
    offset, size = read_pack_table(str(pack))[names[2]]
    data = bytearray(pack.read_bytes())
    data[offset + size // 2] ^= 0xFF                            # the third block of the prefix
    pack.write_bytes(bytes(data))
    out = llm.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 2 * 16 and out.token_ids == reference(prompt)
    mem = llm.stats()["memory"]
    assert mem["tiers"]["G3"]["corrupt"] == 1 and mem["prefill_tokens"]["reused"]["G3"] == 2 * 16

    lost = LLM(loaded, kv_tiers="host:64MiB", **NO_TIMEOUT, **ENGINE)         # a tier that loses a block mid-read
    in_g2_only(lost, prompt)
    tier = lost.block_manager.tiers.first
    get_many = tier.get_many
    tier.get_many = lambda ns: [None if i == 1 else b for i, b in enumerate(get_many(ns))]
    out = lost.generate([prompt], GREEDY)[0]
    # one block in: less than an exact-tail span (2 blocks), so it is computed again from token 0
    assert out.num_cached_tokens == 0 and out.token_ids == reference(prompt)
    assert lost.stats()["memory"]["prefill_tokens"]["reused"].get("G2", 0) == 0


def test_abort_of_a_loading_request_frees_its_blocks(loaded):
    llm = LLM(loaded, kv_tiers="host:64MiB", **NO_TIMEOUT, **ENGINE)
    prompt = SYSTEM + "Task: rename utils.py to helpers.py."
    in_g2_only(llm, prompt)
    bm = llm.block_manager
    free = bm.num_free_blocks
    gate = gate_tier(llm)
    rid = llm.add_request(prompt, GREEDY)
    assert llm.step() == [] and len(llm.scheduler.loading) == 1 and bm.num_free_blocks < free
    llm.abort(rid)
    assert not llm.scheduler.loading and not bm.loading and llm.has_pending_loads()
    gate.set()
    llm.step()                                                  # nothing to run: collects the load
    assert not llm.has_pending_loads() and bm.num_free_blocks == free
    assert bm.cache.counts()["running"] == 0 and bm.stats(0)["loads"]["blocks_in_flight"] == 0


def test_a_load_that_never_ends_times_out_into_a_recompute(loaded, reference):
    llm = LLM(loaded, kv_tiers="host:64MiB", kv_load_timeout_s=0.3, **ENGINE)
    prompt = SYSTEM + "Task: pin the numpy version."
    in_g2_only(llm, prompt)
    gate = gate_tier(llm)
    free = llm.block_manager.num_free_blocks
    out = llm.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == reference(prompt)
    job_blocks = [b for b in range(llm.pool.num_blocks) if llm.block_manager.cache.ref_count(b)]
    assert job_blocks == [] and llm.block_manager.num_free_blocks == free
    gate.set()                                                  # the worker wakes up and writes nothing


def test_turn_arriving_mid_prestage_waits_for_it(loaded, reference):
    llm = LLM(loaded, kv_tiers="host:64MiB", **NO_TIMEOUT, **ENGINE)
    turn1 = SYSTEM + "Task: make the logger thread-safe."
    out1 = llm.generate([turn1], GREEDY, session_id="s")[0]
    llm.park("s")
    gate = gate_tier(llm)
    n = llm.resume("s")
    assert n > 0 and llm.session_info("s")["blocks"]["loading"] == n
    turn2 = turn1 + out1.text + "\nTool result: done."
    rid = llm.add_request(turn2, GREEDY, session_id="s")
    llm.step()
    assert [s.request_id for s in llm.scheduler.loading] == [rid]   # shares the prestage's blocks
    gate.set()
    outs = {}
    while llm.has_unfinished_requests():
        outs.update({o.request_id: o for o in llm.step()})
    span = llm.block_manager.restart_blocks            # reuse restarts at an exact-tail span
    kept = n // span * span * 16
    assert outs[rid].num_cached_tokens == kept > 0 and outs[rid].token_ids == reference(turn2)
    mem = llm.stats()["memory"]
    assert mem["prefill_tokens"]["reused"]["G2"] == kept and mem["blocks"]["prestaged"] == n


def test_a_loads_deadline_passes_only_on_the_injected_clock(loaded, reference):
    """On a virtual clock a held load waits through any number of steps (however long they take
    on the wall clock) and times out into a recompute at the step after the clock passes its deadline."""
    from everybyte.kv.clock import VirtualClock
    clock = VirtualClock()
    llm = LLM(loaded, kv_tiers="host:64MiB", kv_load_timeout_s=1.0, clock=clock, **ENGINE)
    prompt = SYSTEM + "Task: add a retry to the HTTP client."
    in_g2_only(llm, prompt)
    gate_tier(llm)
    rid = llm.add_request(prompt, GREEDY)
    for _ in range(5):
        assert llm.step() == [] and llm.block_manager.has_pending_loads()
    clock.advance(1.5)
    outs = []
    while llm.has_unfinished_requests():
        outs += [o for o in llm.step() if o.request_id == rid]
    assert outs[-1].num_cached_tokens == 0 and outs[-1].token_ids == reference(prompt)
