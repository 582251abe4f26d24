"""Trace importers, scaling, deterministic token content and the synthetic generator."""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import pytest

from everybyte.traces import TraceError, detect_format, load_trace
from everybyte.traces.scaling import Scaling
from everybyte.traces.synthetic import SyntheticSpec, generate
from everybyte.traces.tokens import MARKER_LEN, SessionPrompts, TokenSpace

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces"
AGENT = SHARED / "agent_sessions"
MOONCAKE = SHARED / "mooncake_synthetic_trace.jsonl"
AZURE = SHARED / "AzureLLMInferenceTrace_code_2023.csv"
needs_shared = pytest.mark.skipif(not AGENT.is_dir() and not os.environ.get("CI"),
                                  reason="../shared traces not beside the checkout (CI always has them)")


def build(session, scaling, marker="run-a", name="t", instance=0, upto=None):
    """Prompts of every turn with stand-in outputs of the scaled output length."""
    sp = SessionPrompts(session, scaling, TokenSpace(), marker, name, instance)
    outs, prompts = {}, []
    for k, turn in enumerate(session.turns[:upto]):
        prompts.append(sp.prompt(k, outs))
        outs[k] = sp.filler(k, scaling.output_len(turn))
    return prompts, outs


@needs_shared
def test_agent_sessions_counts_match_the_files():
    trace = load_trace(str(AGENT))
    files = sorted(glob.glob(str(AGENT / "*.json")))
    assert trace.format == "agent_sessions" and len(trace.sessions) == len(files) == 51
    for f, s in zip(files, trace.sessions):
        doc = json.load(open(f))
        assert s.id == doc["id"] and len(s.turns) == len(doc["requests"])
        assert [t.input_tokens for t in s.turns] == [r["in"] for r in doc["requests"]]
        assert sum(t.agent > 0 for t in s.turns) == sum(r["type"] == "s" for r in doc["requests"])
    assert trace.num_turns == 1219
    assert sum(t.extends for s in trace.sessions for t in s.turns) > 1000


@needs_shared
def test_agent_session_prefix_structure_survives_scaling():
    session = load_trace(str(AGENT / "trace_0038.json")).sessions[0]
    sc = Scaling.defaults("agent_sessions", 8192)
    prompts, outs = build(session, sc, upto=22)
    for k, turn in enumerate(session.turns[:22]):
        if turn.parent is None:
            continue
        p = turn.parent
        if turn.extends:        # the model's own output joins the context
            assert prompts[k][:len(prompts[p]) + len(outs[p])] == prompts[p] + outs[p]
        else:                   # shared blocks stay shared, the rest differs
            cut = sc.scaled_pos(turn.shared_blocks * session.block_size)
            assert prompts[k][:cut] == prompts[p][:cut]
            assert prompts[k][cut:cut + 8] != prompts[p][cut:cut + 8]
    assert not session.turns[16].extends and session.turns[16].shared_blocks == 197
    # contexts keep about their scaled recorded length
    assert abs(len(prompts[0]) - session.turns[0].input_tokens // 64) <= 1


@needs_shared
def test_equal_hash_ids_give_equal_tokens_and_scopes_apart():
    sc = Scaling.defaults("agent_sessions")
    trace = load_trace(str(AGENT))
    a, b = trace.sessions[0], trace.sessions[1]
    sa = SessionPrompts(a, sc, TokenSpace(), "m", trace.name)
    sa2 = SessionPrompts(a, sc, TokenSpace(), "m", trace.name)
    sb = SessionPrompts(b, sc, TokenSpace(), "m", trace.name)
    assert a.turns[0].hash_ids[:3] == b.turns[0].hash_ids[:3]          # local ids collide across files ...
    assert sa.content(0, 0, 640) == sa2.content(0, 0, 640)               # deterministic
    assert sa.content(0, 0, 640) != sb.content(0, 0, 640)                # ... but are not the same content
    # within a session, equal ids at equal positions in two turns give equal tokens
    assert sa.content(0, 0, 64 * 50) == sa.content(1, 0, 64 * 50)


@needs_shared
def test_run_markers_separate_first_blocks_only():
    session = load_trace(str(AGENT / "trace_0165.json")).sessions[0]
    sc = Scaling.defaults("agent_sessions")
    p1, _ = build(session, sc, marker="run-1", upto=3)
    p2, _ = build(session, sc, marker="run-2", upto=3)
    p3, _ = build(session, sc, marker="run-1", instance=1, upto=3)     # a recycled session
    assert p1[0][:MARKER_LEN] != p2[0][:MARKER_LEN] and p1[0][:MARKER_LEN] != p3[0][:MARKER_LEN]
    assert p1[0][MARKER_LEN:] == p2[0][MARKER_LEN:]
    for k in range(3):                                                  # every turn opens with the marker
        assert p1[k][:MARKER_LEN] == p1[0][:MARKER_LEN]


@needs_shared
def test_mooncake_global_hash_ids_share_tokens_across_requests():
    trace = load_trace(str(MOONCAKE))
    assert trace.format == "mooncake" and len(trace.sessions) == 3993 and trace.num_turns == 3993
    assert trace.sessions[0].block_size == 512 and trace.sessions[-1].arrival_s > 1000
    sc = Scaling.defaults("mooncake")
    by_first: dict[int, list] = {}
    for s in trace.sessions[:400]:
        by_first.setdefault(s.turns[0].hash_ids[0], []).append(s)
    x, y = next(v for v in by_first.values() if len(v) >= 2)[:2]
    shared = 0
    while x.turns[0].hash_ids[shared] == y.turns[0].hash_ids[shared]:
        shared += 1
    px = SessionPrompts(x, sc, TokenSpace(), "m", trace.name).prompt(0, {})
    py = SessionPrompts(y, sc, TokenSpace(), "m", trace.name).prompt(0, {})
    n = sc.scaled_pos(shared * 512)
    assert n > MARKER_LEN and px[:n] == py[:n] and px[n:n + 4] != py[n:n + 4]


@needs_shared
def test_azure_has_no_reuse():
    trace = load_trace(str(AZURE))
    assert trace.format == "azure" and len(trace.sessions) == 8819
    assert all(not s.turns[0].hash_ids for s in trace.sessions)
    sc = Scaling.defaults("azure")
    a, b = (SessionPrompts(s, sc, TokenSpace(), "m", trace.name).prompt(0, {}) for s in trace.sessions[:2])
    assert a[MARKER_LEN:MARKER_LEN + 8] != b[MARKER_LEN:MARKER_LEN + 8]
    assert len(a) == max(1, trace.sessions[0].turns[0].input_tokens // 4)


def test_detection_and_bad_records(tmp_path):
    good = {"timestamp": 0, "input_length": 700, "output_length": 3, "hash_ids": [1, 2]}
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n{not json\n" +
                 json.dumps({**good, "input_length": -1}) + "\n")
    assert detect_format(str(p)) == "mooncake"
    with pytest.raises(TraceError, match=rf"{p}:3"):
        load_trace(str(p))
    trace = load_trace(str(p), skip_bad=True)
    assert len(trace.sessions) == 2 and len(trace.skipped) == 2 and trace.skipped[1].startswith(f"{p}:4")

    sess = {"id": "x", "block_size": 64, "requests": [
        {"t": 0, "type": "n", "in": 100, "out": 5, "hash_ids": [7]},
        {"t": 1, "type": "n", "in": "many", "out": 5, "hash_ids": [7, 8]}]}
    j = tmp_path / "x.json"
    j.write_text(json.dumps(sess))
    with pytest.raises(TraceError, match=r"x\.json.*requests\[1\].*'in'"):
        load_trace(str(j))
    assert load_trace(str(tmp_path / "x.json"), skip_bad=True).num_turns == 1
    assert load_trace(str(tmp_path), skip_bad=True).format == "agent_sessions"     # a directory

    c = tmp_path / "a.csv"
    c.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,48,10\n"
                 "2023-11-16 18:17:04.0319600,x,8\n")
    with pytest.raises(TraceError, match=rf"{c}:3"):
        load_trace(str(c))
    (tmp_path / "u.txt").write_text("hello\n")
    with pytest.raises(TraceError, match="cannot tell its format"):
        load_trace(str(tmp_path / "u.txt"))
    with pytest.raises(TraceError, match="no such file"):
        load_trace(str(tmp_path / "missing.json"))


def test_scaling_rules():
    sc = Scaling.defaults("agent_sessions", model_window=2048)
    assert (sc.token_scale, sc.output_scale, sc.max_context) == (64.0, 16.0, 2048)
    assert Scaling.defaults("mooncake").token_scale == 16.0 and Scaling.defaults("synthetic").token_scale == 1.0
    from everybyte.traces.model import Turn
    t = Turn(index=1, t=0, input_tokens=6400, output_tokens=4000, gap_s=100.0)
    assert sc.output_len(t) == 64 and sc.gap(t) == 3.0
    t.output_tokens, t.gap_s = 3, 12.0
    assert sc.output_len(t) == 1 and sc.gap(t) == pytest.approx(1.2)
    assert Scaling.defaults("azure", token_scale=2.0).token_scale == 2.0
    with pytest.raises(ValueError):
        Scaling(token_scale=0)


def test_synthetic_is_seeded_and_shares_the_system_prompt():
    a = generate(SyntheticSpec(sessions=5, seed=3))
    b = load_trace("synthetic:sessions=5,seed=3")
    c = generate(SyntheticSpec(sessions=5, seed=4))
    key = lambda tr: [(t.input_tokens, t.output_tokens, t.gap_s, tuple(t.hash_ids)) for s in tr.sessions for t in s.turns]
    assert key(a) == key(b) and key(a) != key(c)
    sys_blocks = 512 // 64
    assert len({tuple(s.turns[0].hash_ids[:sys_blocks]) for s in a.sessions}) == 1
    assert all(t.extends for s in a.sessions for t in s.turns[1:])
    with pytest.raises(ValueError, match="bogus"):
        SyntheticSpec.parse("bogus=1")
    sc = Scaling.defaults("synthetic")
    p0 = SessionPrompts(a.sessions[0], sc, TokenSpace(), "m", a.name).prompt(0, {})
    p1 = SessionPrompts(a.sessions[1], sc, TokenSpace(), "m", a.name).prompt(0, {})
    assert p0[:512] == p1[:512] and p0[512:520] != p1[512:520]          # shared across sessions in a run


@pytest.mark.parametrize("adopt", [False, True])
def test_a_last_child_takes_its_parents_prompt_over_with_the_same_tokens(adopt):
    """prompt(last_child=True) (the simulator's: no copy of the parent's list) builds the same
    prompts as copying and drops the parent's list; a parent with more children is copied; and a
    caller appending each turn's output to the list it got (a Sequence adopting it) changes none."""
    sessions = list(generate(SyntheticSpec(sessions=3, turns=5, seed=2)).sessions)
    if AGENT.is_dir():                      # branches and sub-agents: parents with several children
        sessions.append(load_trace(str(AGENT / "trace_0038.json")).sessions[0])
    for session in sessions:
        sc = Scaling.defaults(session.source if session.source == "synthetic" else "agent_sessions", 8192)
        want, outs = build(session, sc, upto=22)
        last = {t.parent: k for k, t in enumerate(session.turns[:22]) if t.parent is not None}
        sp = SessionPrompts(session, sc, TokenSpace(), "run-a", "t")
        for k, turn in enumerate(session.turns[:22]):
            took = turn.parent is not None and last[turn.parent] == k
            ids = sp.prompt(k, {j: o for j, o in outs.items() if j < k}, last_child=took)
            assert ids == want[k], (session.id, k)
            if took and turn.extends:
                assert turn.parent not in sp.prompts          # taken over, not copied
            if adopt:
                ids += outs[k]
        assert sum(t.extends for t in session.turns[1:22]) > 0


def test_vectorized_content_is_token_space_token_at_every_position():
    """SessionPrompts.content (numpy, the simulator's hot loop) gives TokenSpace.token of the
    module docstring at every scaled position: hashed blocks by (namespace, hash id, position),
    the unhashed tail by (session, turn), for scales that split blocks unevenly and huge ids."""
    trace = generate(SyntheticSpec(sessions=2, turns=3, seed=4, block_size=16))
    session = trace.sessions[1]
    session.turns[0].hash_ids[0] = (1 << 70) + 5              # ids beyond 64 bits wrap like the reference
    space = TokenSpace(1000, 30000)
    for token_scale in (1.0, 3.0, 7.5):
        sc = Scaling.defaults(trace.format, 1 << 20, token_scale=token_scale)
        sp = SessionPrompts(session, sc, space, "m", trace.name)
        for k, turn in enumerate(session.turns):
            h, bs = turn.hash_ids, session.block_size
            for rec_a, rec_b, n in ((0, turn.input_tokens, None), (3, turn.input_tokens + 200, 50)):
                first, end = sc.scaled_pos(rec_a), sc.scaled_pos(rec_b)
                want = []
                for s in range(first if n is None else max(first, end - n), end):
                    block = max(rec_a, int(s * token_scale)) // bs
                    want.append(space.token(sp.ns_blocks, h[block], s) if block < len(h)
                                else space.token(sp.ns_unique, -1 - k, s))
                assert sp.content(k, rec_a, rec_b, n) == want


@pytest.mark.parametrize("token_scale", [1.0, 2.5, 4.0, 16.0, 64.0])
def test_compiled_prompt_tokens_equal_the_numpy_reference(token_scale):
    """native/csrc/prompt_tokens.c against SessionPrompts.content_numpy on random turns: hash ids
    negative, past 2**64 or short of the input (an unhashed tail), any window [rec_a, rec_b), last n."""
    import random

    from everybyte.traces import tokens
    from everybyte.traces.model import Session, Turn
    if tokens._compiled() is None:
        pytest.skip("the compiled prompt tokens do not build here")
    rng = random.Random(int(token_scale * 10))
    sc = Scaling(token_scale=token_scale)
    for case in range(60):
        bs = rng.choice([16, 64, 128])
        n_in = rng.randint(1, 40 * bs)
        ids = [rng.choice([rng.getrandbits(64), -rng.getrandbits(40), rng.getrandbits(80), 0])
               for _ in range(rng.randint(0, -(-n_in // bs)))]
        turns = [Turn(0, 0.0, n_in, 10, ids), Turn(1, 1.0, n_in + 5, 10, ids[:3])]
        sp = SessionPrompts(Session(f"s{case}", turns, block_size=bs), sc, TokenSpace(100, 50_000 + case), "m", "t")
        for _ in range(5):
            k = rng.randint(0, 1)
            rec_a = rng.randint(0, n_in)
            rec_b = rng.randint(rec_a, n_in + 3 * bs)
            n = rng.choice([None, 0, 1, rng.randint(1, 500)])
            first, end = sc.scaled_pos(rec_a), sc.scaled_pos(rec_b)
            start = first if n is None else max(first, end - n)
            want = sp.content_numpy(k, rec_a, start, end) if end > start else []
            assert sp.content(k, rec_a, rec_b, n) == want
    with pytest.raises(TypeError):
        tokens._compiled().content(["x"], 0, 4, 1.0, 0, 16, 0, 0, 0, 0, 10)
    with pytest.raises(ValueError, match="bad range"):
        tokens._compiled().content([], 5, 4, 1.0, 0, 16, 0, 0, 0, 0, 10)


def test_compiled_prompt_tokens_share_one_object_per_value():
    """A vocabulary up to 2**20 values hands out one shared int per value (no allocation per token);
    a wider one allocates, with the same values either way."""
    from everybyte.traces import tokens
    from everybyte.traces.model import Session, Turn
    if tokens._compiled() is None:
        pytest.skip("the compiled prompt tokens do not build here")
    turns = [Turn(0, 0.0, 4096, 10, list(range(64)))]
    for space, shared in ((TokenSpace(), True), (TokenSpace(0, 1 << 22), False), (TokenSpace(7, 9), True)):
        sp = SessionPrompts(Session("s", turns, block_size=64), Scaling(token_scale=1.0), space, "m", "t")
        a, b = sp.content(0, 0, 4096), sp.content(0, 0, 4096)
        assert a == b == sp.content_numpy(0, 0, 0, 4096)
        assert all(x is y for x, y in zip(a, b)) is shared
        assert all(space.low <= x < space.high for x in a)


def test_prompt_tokens_fall_back_to_numpy(monkeypatch):
    from everybyte.traces import tokens
    monkeypatch.setenv("EVERYBYTE_NATIVE_TOKENS", "0")
    tokens._compiled.cache_clear()
    try:
        assert tokens._compiled() is None
        trace = load_trace("synthetic:sessions=2,turns=2,seed=3")
        sp = SessionPrompts(trace.sessions[0], Scaling.defaults("synthetic"), TokenSpace(), "m", trace.name)
        assert len(sp.prompt(0, {})) > MARKER_LEN
    finally:
        tokens._compiled.cache_clear()


def test_token_space_parse_takes_low_high_and_names_the_option_when_bad():
    space = TokenSpace.parse("1000,30000")
    assert (space.low, space.high) == (1000, 30000)
    for bad, why in (("0-256", "two integers"), ("5", "two integers"), ("1,2,3", "two integers"),
                     ("a,b", "two integers"), ("9,9", "'9,9': needs 0 <= LOW < HIGH"), ("-1,5", "needs 0 <= LOW")):
        with pytest.raises(ValueError, match=f"--vocab-range.*{why}"):
            TokenSpace.parse(bad)
    with pytest.raises(ValueError, match="--tokens must be"):
        TokenSpace.parse("x", option="--tokens")


def test_bench_agentic_and_sim_accuracy_refuse_a_bad_vocab_range(capsys):
    from everybyte.cli import main as cli_main
    assert cli_main(["bench", "agentic", "--vocab-range", "30000,1000"]) == 2
    assert "--vocab-range '30000,1000': needs 0 <= LOW < HIGH" in capsys.readouterr().err
    assert cli_main(["bench", "sim-accuracy", "--vocab-range", "1000;30000"]) == 2
    assert "--vocab-range must be LOW,HIGH" in capsys.readouterr().err
