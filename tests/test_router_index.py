"""The router's KV index, policies and approximate mode (cluster/kv_index, policy, approx): prefix
depths per tier over many workers, the tier-priced KV cost, sessions, TTL expiry; and the router
imports without torch."""
import subprocess
import sys

import pytest

from everybyte.cluster.approx import ApproxTracker
from everybyte.cluster.kv_index import KVIndex, Overlap
from everybyte.cluster.policy import Policy, Request, kv_cost
from everybyte.cluster.workers import Worker
from everybyte.kv.block_id import KVNamespace, chain_block_ids
from everybyte.kv.events import AllBlocksCleared, BlockRemoved, BlockStored

NS = KVNamespace("m", block_size=4)
A = chain_block_ids(NS, list(range(40)))          # 10 chained blocks


def test_overlap_is_the_longest_prefix_per_cumulative_tier():
    ix = KVIndex()
    ix.apply("w1", [BlockStored(A[:3], 4), BlockStored(A[3:5], 4, medium="G2"), BlockStored(A[5:6], 4, medium="G3")])
    ix.apply("w2", [BlockStored(A[:1], 4), BlockStored(A[2:8], 4)])       # a hole at block 1: prefix stops
    ix.apply("w3", [BlockStored(A[:2], 4)])
    o = ix.overlap(A)
    assert o["w1"] == Overlap(3, 5, 6, 6)
    assert o["w1"].by_tier() == {"G1": 3, "G2": 2, "G3": 1, "G3.5": 0}
    assert o["w2"] == Overlap(1, 1, 1, 1)
    assert o["w3"] == Overlap(2, 2, 2, 2)
    assert ix.overlap(A, ["w3"]) == {"w3": Overlap(2, 2, 2, 2)}
    assert ix.counts("w1") == {"G1": 3, "G2": 2, "G3": 1, "G3.5": 0}


def test_remove_clear_and_drop():
    ix = KVIndex()
    ix.apply("w1", [BlockStored(A[:4], 4)])
    ix.apply("w2", [BlockStored(A[:4], 4)])
    ix.apply("w1", [BlockRemoved(A[2:3])])
    assert ix.overlap(A)["w1"].total == 2 and ix.overlap(A)["w2"].total == 4
    ix.apply("w1", [BlockRemoved(A[2:3]), BlockRemoved([b"\x01" * 16])])              # unknown: no-op
    ix.apply("w2", [AllBlocksCleared()])
    assert ix.overlap(A)["w2"].total == 0 and ix.counts("w2")["G1"] == 0
    ix.drop_worker("w1")
    assert ix.workers == ["w2"] and ix.overlap(A) == {"w2": Overlap()}
    ix.apply("w3", [BlockStored(A[:1], 4)])                 # reuses w1's freed slot: nothing of w1 leaks
    assert ix.overlap(A)["w3"].total == 1


def test_pod_shared_tier_reaches_every_worker_of_the_namespace():
    ix = KVIndex()
    ix.add_worker("a", "ns1")
    ix.add_worker("b", "ns1")
    ix.add_worker("c", "ns2")
    ix.apply("a", [BlockStored(A[:2], 4), BlockStored(A[:6], 4, medium="G3.5")])
    o = ix.overlap(A)
    assert o["a"] == Overlap(2, 2, 2, 6)
    assert o["b"] == Overlap(0, 0, 0, 6)           # same digest: can load it from the pod tier
    assert o["c"] == Overlap(0, 0, 0, 0)           # another namespace never loads a's blocks


def _worker(url, info=None, active=0):
    w = Worker(url, healthy=True, info=info)
    w.active_blocks = active
    return w


def test_kv_cost_prices_lower_tiers_by_load_time():
    w = _worker("w", {"speeds": {"prefill_tok_s": 1000.0, "load_tok_s": {"G2": 4000.0}}})
    req = Request(40, 4, {"w": Overlap(2, 6, 6, 6)})
    # 4 blocks to prefill, 4 blocks from G2 at 1000/4000 of a prefill each, 10 decode blocks
    assert kv_cost(req, w, 1.0) == pytest.approx(4 + 4 * 0.25 + 10)
    slow = _worker("s", {"speeds": {"prefill_tok_s": None, "load_tok_s": {}}})
    assert slow.load_fraction("G3") == 0.2 and slow.load_fraction("G4") == 1.0


def test_kv_policy_prefers_overlap_then_load_and_keeps_sessions():
    a, b = _worker("a"), _worker("b", active=3)
    pol = Policy("kv")
    assert pol.choose(Request(40, 4, {"a": Overlap(0, 0, 0, 0), "b": Overlap(8, 8, 8, 8)}), [a, b]).worker is b
    assert pol.choose(Request(40, 4, {"a": Overlap(1, 1, 1, 1), "b": Overlap(1, 1, 1, 1)}), [a, b]).worker is a
    # equal cost: the session's worker wins; a cheaper worker elsewhere beats the session
    b.active_blocks = 0
    assert pol.choose(Request(40, 4, {}, session_worker="b"), [a, b]).worker is b
    assert pol.choose(Request(40, 4, {"a": Overlap(9, 9, 9, 9)}, session_worker="b"), [a, b]).worker is a


def test_a_new_session_leaves_a_worker_holding_far_more_kv():
    pol = Policy("kv")
    first, other = _worker("first"), _worker("other")
    # 10 of 45 blocks (a system prompt) cached on the first worker: cost prefers it
    req = Request(180, 4, {"first": Overlap(10, 10, 10, 10)}, new_session=True)
    first.cached_blocks = 30                        # not far more than the other's plus a prompt
    assert pol.choose(req, [first, other]).worker is first
    first.cached_blocks = 100                       # every earlier session went there: spread
    assert pol.choose(req, [first, other]).worker is other
    other.cached_blocks = 60                        # balanced enough again
    assert pol.choose(req, [first, other]).worker is first
    # a turn of a known session is not moved by the balance rule
    first.cached_blocks, other.cached_blocks = 100, 0
    assert pol.choose(Request(180, 4, {"first": Overlap(40, 40, 40, 40)}, session_worker="first"),
                      [first, other]).worker is first


def test_kv_session_stays_where_its_kv_is_ready_first():
    pol = Policy("kv")
    home, idle = _worker("home", active=85), _worker("idle")
    # 44 of 45 blocks cached at home, whose load is another request's decode: Dynamo's cost alone moves it
    req = Request(180, 4, {"home": Overlap(44, 44, 44, 44)}, session_worker="home")
    assert kv_cost(req, idle, 1.0) < kv_cost(req, home, 1.0)
    d = pol.choose(req, [home, idle])
    assert d.worker is home and d.prefill_blocks == 1
    # prefill queued at home: the other worker has the KV sooner (60 + 1 against 45 blocks), but
    # by less than the 44 blocks of recompute leaving adds, so the session stays
    home.queued_prefill_blocks = 60
    assert pol.choose(req, [home, idle]).worker is home
    home.queued_prefill_blocks = 89                 # saves 45 blocks of wait for 44 of work: leave
    assert pol.choose(req, [home, idle]).worker is idle
    # requests waiting for prefill are the queue above, not a full home
    home.queued_prefill_blocks, home.info = 0, {"load": {"num_waiting": 2, "num_running": 1, "max_num_seqs": 4}}
    assert pol.choose(req, [home, idle]).worker is home
    # every slot at home taken: a worker with a free slot gets it; when all are full it stays home
    home.info = {"load": {"num_waiting": 2, "num_running": 4, "max_num_seqs": 4}}
    assert pol.choose(req, [home, idle]).worker is idle
    idle.info = {"load": {"num_running": 4, "max_num_seqs": 4}}
    assert pol.choose(req, [home, idle]).worker is home
    idle.info = None
    # no session: the one worker with the deepest prefix is the home (a sub-agent forked from a session)
    home.info = None
    fork = Request(180, 4, {"home": Overlap(30, 30, 30, 30), "idle": Overlap(2, 2, 2, 2)})
    assert pol.choose(fork, [home, idle]).worker is home
    # a prefix covering half the prompt or less (a system prompt an earlier session left) makes no home
    prompt = Request(180, 4, {"home": Overlap(22, 22, 22, 22)})
    assert pol.choose(prompt, [home, idle]).worker is idle
    # a prefix every worker holds equally has no home: Dynamo's cost spreads it
    shared = Request(180, 4, {"home": Overlap(30, 30, 30, 30), "idle": Overlap(30, 30, 30, 30)})
    assert pol.choose(shared, [home, idle]).worker is idle


def test_other_policies():
    ws = [_worker("a"), _worker("b"), _worker("c")]
    rr = Policy("round-robin")
    assert [rr.choose(Request(8, 4), ws).worker.url for _ in range(4)] == ["a", "b", "c", "a"]
    ws[0].in_flight, ws[1].in_flight = 5, 1
    assert Policy("least-loaded").choose(Request(8, 4), ws).worker.url == "c"
    sess = Policy("session")
    assert sess.choose(Request(8, 4, session_worker="b"), ws).worker.url == "b"
    assert {Policy("random", seed=s).choose(Request(8, 4), ws).worker.url for s in range(20)} == {"a", "b", "c"}
    with pytest.raises(ValueError, match="unknown policy"):
        Policy("fastest")
    with pytest.raises(ValueError, match="no worker"):
        rr.choose(Request(8, 4), [])


def test_approximate_mode_expires_after_ttl_unless_renewed():
    now = [0.0]
    ix = KVIndex()
    tr = ApproxTracker(ix, ttl_s=10, clock=lambda: now[0])
    tr.record("w", A[:4], 4)
    now[0] = 5
    tr.record("w", A[:2], 4)                   # renews the first two blocks
    now[0] = 11
    tr.expire()
    assert ix.overlap(A)["w"].total == 2
    now[0] = 16
    tr.expire()
    assert ix.overlap(A)["w"].total == 0
    with pytest.raises(ValueError):
        ApproxTracker(ix, ttl_s=0)


def test_router_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None; "
            "import everybyte.cluster.router_cli, everybyte.cluster.router, everybyte.cluster.routing")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("args, msg", [(["--worker", "127.0.0.1:8001"], "not an http(s) URL"),
                                       (["--worker", "http://a", "--worker", "http://a/"], "given twice"),
                                       (["--worker", "http://a", "--disagg-threshold", "-1"], ">= 0"),
                                       (["--worker", "http://a", "--approx-ttl", "0"], "> 0"),
                                       (["--worker", "http://a", "--request-timeout", "0"],
                                        "--request-timeout must be > 0 seconds"),
                                       (["--worker", "http://a", "--overlap-weight", "-1"],
                                        "--overlap-weight must be >= 0"),
                                       (["--worker", "http://a", "--policy", "fastest"], "invalid choice"),
                                       ([], "--worker")])
def test_router_cli_rejects_bad_arguments(args, msg):
    out = subprocess.run([sys.executable, "-m", "everybyte.cli", "router", *args], capture_output=True, text=True)
    assert out.returncode != 0 and msg in out.stderr
