"""The simulated fleet (sim/fleet_*): KV-aware routing with the cluster router's own policy and
index fed by the simulated workers' KV events, disaggregated prefill/decode over the real
RemoteBlocks tier, the pod flash tier (G3.5) shared by all workers, and bad fleet input."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from everybyte.sim.cli import main as sim_main

SESSIONS = "synthetic:sessions=16,turns=4,gap_s=1,arrival_s=0.2,seed=5,first_tokens=256,append_tokens=64,block_size=16"
OWN_PREFIXES = SESSIONS + ",system_tokens=0"            # each session's turns share only its own prefix
SHARED = SESSIONS + ",system_tokens=256"                # plus one system prompt every session shares
BASE = ["--hardware", "H200", "--kv-cache", "48MiB"]


def sim(capsys, *args) -> dict:
    assert sim_main(["run", *BASE, *args]) == 0
    return json.loads(capsys.readouterr().out)["summary"]


@pytest.fixture(scope="module")
def runs():
    out = {}
    for name, args in {
        "rr": ["--workers", "3", "--trace", OWN_PREFIXES, "--route", "round-robin"],
        "kv": ["--workers", "3", "--trace", OWN_PREFIXES, "--route", "kv"],
        "rr_shared": ["--workers", "3", "--trace", SHARED, "--route", "round-robin"],
        "kv_shared": ["--workers", "3", "--trace", SHARED, "--route", "kv"],
        "disagg": ["--prefill", "1", "--decode", "2", "--trace", SHARED, "--route", "kv", "--disagg-threshold", "64"],
    }.items():
        done = subprocess.run([sys.executable, "-m", "everybyte.cli", "sim", "run", *BASE, *args],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        out[name] = json.loads(done.stdout)["summary"]
    return out


def test_kv_routing_keeps_sessions_on_their_prefix_and_computes_less(runs):
    rr, kv = runs["rr"], runs["kv"]
    assert rr["requests"] == kv["requests"] > 40 and not kv["rejected"] and kv["unfinished_requests"] == 0
    assert kv["fleet"]["router"]["kv_events_applied"] > 0              # the index was fed by the workers' events
    assert sum(w["turns"] > 0 for w in kv["fleet"]["workers"]) == 3     # new sessions spread over the workers
    assert kv["fleet"]["session_moves"] == 0 < rr["fleet"]["session_moves"]
    assert kv["prefill_tokens"]["computed"] < 0.6 * rr["prefill_tokens"]["computed"]
    assert runs["kv_shared"]["prefill_tokens"]["computed"] < runs["rr_shared"]["prefill_tokens"]["computed"]
    # a system prompt every session shares is no magnet: new sessions still spread over the workers
    assert sum(w["turns"] > 0 for w in runs["kv_shared"]["fleet"]["workers"]) == 3


def test_disaggregation_moves_the_kv_and_decode_computes_only_the_tail(runs):
    d = runs["disagg"]
    assert d["unfinished_requests"] == 0
    dis, workers = d["fleet"]["disagg"], d["fleet"]["workers"]
    assert dis["remote_prefills"] >= dis["turns"] > 10
    assert d["prefill_tokens"]["by_tier"].get("remote", 0) > 0           # decode loaded the prefill's blocks
    assert workers[0]["role"] == "prefill" and workers[0]["turns"] == 0 and workers[0]["prefill_computed"] > 0
    # a disaggregated turn's decode computes at most its prompt's last partial block (16 tokens)
    assert dis["decode_prefill_tokens"] <= 16 * dis["turns"]
    assert dis["decode_prefill_tokens"] < 0.05 * dis["decode_prompt_tokens"]


def test_pod_flash_tier_serves_a_prefix_the_worker_never_computed(capsys):
    trace = "synthetic:sessions=2,turns=1,arrival_s=1,seed=1,system_tokens=512,first_tokens=32,block_size=16"
    base = ["--workers", "2", "--trace", trace, "--route", "round-robin"]
    without, pod = sim(capsys, *base), sim(capsys, *base, "--pod-flash", "1GiB")
    w1 = pod["fleet"]["workers"][1]                  # its one turn is the second session's first
    assert w1["turns"] == 1 and w1["reused_by_tier"].get("G3.5", 0) >= 512
    assert without["fleet"]["workers"][1]["reused"] == 0
    assert pod["prefill_tokens"]["computed"] < without["prefill_tokens"]["computed"]


def test_the_fleet_runs_without_torch():
    script = Path(__file__).with_name("sim_torch_free.py")
    done = subprocess.run([sys.executable, str(script), *BASE, "--prefill", "1", "--decode", "1", "--trace",
                           "synthetic:sessions=3,turns=2,seed=2,block_size=16", "--route", "kv",
                           "--disagg-threshold", "32", "--pod-flash"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "torch_loaded=False" in done.stderr
    assert json.loads(done.stdout)["summary"]["fleet"]["disagg"]["turns"] > 0


@pytest.mark.parametrize("args, message", [
    (["--route", "nearest"], "invalid choice: 'nearest'"),
    (["--prefill", "2", "--decode", "0", "--disagg-threshold", "8"], "--prefill and --decode must be >= 1"),
    (["--workers", "3", "--prefill", "2", "--decode", "2", "--disagg-threshold", "8"], "differs from --prefill 2"),
    (["--prefill", "1"], "give both --prefill and --decode"),
    (["--prefill", "1", "--decode", "1"], "need --disagg-threshold"),
    (["--workers", "2", "--disagg-threshold", "8"], "needs prefill workers"),
    (["--prefill", "1", "--decode", "1", "--disagg-threshold", "-1"], "must be >= 0 tokens"),
    (["--workers", "2", "--pod-flash", "lots"], "cannot parse size 'lots'"),
    (["--hardware", "GB200-NVL72", "--workers", "2", "--pod-flash"], "no scale-out network figure"),
    (["--hardware", "GB200-NVL72", "--gpus-per-worker", "64", "--prefill", "1", "--decode", "1",
      "--disagg-threshold", "8"], "exceed its NVLink domain"),
])
def test_bad_fleet_input_says_what_is_wrong(capsys, args, message):
    with pytest.raises(SystemExit) if args[0] == "--route" else _no_exit():
        rc = sim_main(["run", *BASE, "--trace", "synthetic:sessions=1,turns=1", *args])
        assert rc == 2
    assert message in capsys.readouterr().err


class _no_exit:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_fleet_makes_the_same_decisions_with_multi_step_decode(capsys):
    """Routing, disaggregation hand-offs (`later` calls) and the shared pod tier are outside events
    for the workers' planned decode runs: jumping over decode steps changes nothing."""
    args = ["--prefill", "1", "--decode", "2", "--trace", SHARED, "--route", "kv", "--disagg-threshold", "64",
            "--pod-flash", "1GiB"]
    on, off = sim(capsys, *args), sim(capsys, *args, "--no-multi-step")
    assert on["events"] < off["events"] and off["fleet"]["disagg"]["turns"] > 10
    for d in (on, off):
        for key in ("wall_s", "sim_requests_per_wall_s", "cpu_s", "events"):
            d.pop(key)
    assert on == off


@pytest.mark.parametrize("route, extra, isolated", [
    ("sticky", {}, True), ("round-robin", {}, True), ("kv", {}, False),
    ("sticky", {"pod_flash": "1GiB"}, False), ("sticky", {"shared_storage": "1GiB"}, False),
    ("kv", {"prefill": 1, "decode": 2, "disagg_threshold": 64}, False)])
def test_only_workers_that_share_nothing_are_isolated(route, extra, isolated):
    """Runner(isolated=True) lets an arrival leave other workers' decode runs uncaught: only when
    nothing of theirs is read by another worker's event (a state-free route, no disaggregation,
    no shared tier or lane)."""
    from everybyte.sim.build import SimConfig
    from everybyte.sim.fleet_build import FleetConfig, build_fleet
    workers = None if "prefill" in extra else 3
    fleet = build_fleet(SimConfig(kv_cache="8MiB"), FleetConfig(route, workers, **extra))
    assert fleet.isolated is isolated
