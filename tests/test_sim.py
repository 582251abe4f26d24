"""The simulator (everybyte/sim): catalogs, cost model, the event-driven runner over the bench's
trace importers, and `everybyte sim` errors. The decision-equivalence check against the real
engine is tests/test_sim_equivalence.py."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from everybyte.cli import main as cli_main
from everybyte.sim.build import SimConfig, build
from everybyte.sim.cost_model import CostModel
from everybyte.sim.hardware import CATALOG, get_hardware
from everybyte.sim.models import get_model

TRACE = "synthetic:sessions=12,turns=4,gap_s=2,arrival_s=0.5,seed=3,system_tokens=256,first_tokens=128,append_tokens=64"


def _run(*args) -> dict:
    script = Path(__file__).with_name("sim_torch_free.py")
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "torch_loaded=False" in done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def parked():
    return _run("--hardware", "H200", "--workers", "3", "--kv-cache", "12MiB", "--kv-format", "nvfp4", "--host-tier", "1GiB",
                "--trace", TRACE, "--max-gap", "5", "--gap-scale", "1")


def test_every_turn_is_replayed_and_finishes(parked):
    s = parked["summary"]
    assert s["unfinished_requests"] == 0 and not s["rejected"]
    assert s["requests"] + sum(s["skipped_turns"].values()) == parked["assumptions"]["trace"]["turns"]
    assert s["ttft_s"]["p50"] > 0 and s["tpot_s"]["p50"] > 0 and s["output_tok_s"] > 0
    assert s["sim_requests_per_wall_s"] > 0


def test_shared_prefixes_and_parked_sessions_are_reused(parked):
    s = parked["summary"]
    assert s["prefill_tokens"]["computed"] > 0 and s["prefill_tokens"]["reused"] > 0
    assert s["blocks"]["parked"] > 0 and s["blocks"]["loaded"] > 0        # gaps park; resumes load from G2
    assert "G2" in s["prefill_tokens"]["by_tier"]


def test_ledger_balances_over_workers(parked):
    g1 = parked["summary"]["g1_ledger_bytes"]
    assert sum(v for k, v in g1.items() if k != "total") == g1["total"]
    assert g1["weights"] == 3 * parked["assumptions"]["cost_model"]["weight_bytes"]


def test_time_jumps_instead_of_ticking(parked):
    s = parked["summary"]
    # events are steps, arrivals and load wake-ups only: no idle ticks across the tool gaps
    assert s["events"] <= s["steps"] + 3 * (s["requests"] + sum(s["skipped_turns"].values()))
    assert s["worker_busy_fraction"] < 0.5


def test_round_robin_spreads_turns_sticky_keeps_sessions(tmp_path):
    out = tmp_path / "r.json"
    rc = cli_main(["sim", "run", "--workers", "4", "--kv-cache", "16MiB", "--kv-format", "nvfp4", "--route", "round-robin",
                   "--trace", TRACE, "--json", str(out)])
    assert rc == 0
    rr = json.loads(out.read_text())["summary"]
    sticky = _run("--workers", "4", "--kv-cache", "16MiB", "--kv-format", "nvfp4", "--trace", TRACE)["summary"]
    assert rr["requests"] == sticky["requests"]
    # sticky keeps a session's context on one worker: more of each prompt is reused
    assert sticky["prefill_tokens"]["reused"] > rr["prefill_tokens"]["reused"]


def test_catalog_figures_all_have_sources():
    for hw in CATALOG.values():
        assert hw.figures
        for key, (value, source) in hw.figures.items():
            assert value > 0 and source.strip(), (hw.name, key)
    cpu = get_hardware("cpu-this-machine")
    assert cpu.get("flops_fp32") > 0 and "measured at" in cpu.figures["flops_fp32"][1]


def test_model_bytes_follow_the_engine_formats():
    m = get_model("smollm2")
    assert m.kv_bytes_per_token("bf16") == 30 * 2 * 3 * 64 * 2
    assert m.kv_bytes_per_token("nvfp4") == 30 * 2 * (3 * 64 // 2 + 3 * 64 // 16)
    r1 = get_model("deepseek-r1")
    assert 660e9 < r1.total_weight_bytes("fp8") < 690e9                   # 671B parameters
    assert 36e9 < r1.active_params() < 39e9                               # ~37B active
    assert r1.weight_bytes("nvfp4")["expert"] == 3 * (7168 * 2048 // 2 + 7168 * 2048 // 16 + 4)


def test_cost_model_is_a_roofline():
    hw, m = get_hardware("H200"), get_model("smollm2")
    c = CostModel(hw, m, "bf16", "bf16")
    one = c.step_seconds(1, 100)
    assert one == pytest.approx((c.weight_bytes() + 101 * c.kv_token_bytes) / 4.8e12, rel=0.05)
    assert c.step_seconds(8192, 8192 * 4096) > 50 * one                     # a big prefill is compute-bound
    assert CostModel(hw, m, "nvfp4", "bf16").compute_format == "fp8"        # Hopper has no FP4 figure
    assert c.transfer_seconds("G2", 128_000_000) == pytest.approx(1e-3)


def test_bad_configurations_say_what_is_wrong(capsys, tmp_path):
    assert cli_main(["sim", "run", "--hardware", "TPU9"]) == 2
    assert "known: H200" in capsys.readouterr().err
    assert cli_main(["sim", "run", "--model", "nope"]) == 2
    assert "smollm2, deepseek-r1" in capsys.readouterr().err
    assert cli_main(["sim", "run", "--model", "deepseek-r1"]) == 2
    assert "bytes missing" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [1, 2]}\n')
    assert cli_main(["sim", "run", "--trace", str(bad)]) == 2
    assert f"{bad}:1" in capsys.readouterr().err
    assert cli_main(["sim", "run", "--vocab-range", "0-256"]) == 2
    assert "--vocab-range must be LOW,HIGH" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no sourced bandwidth for tier G2"):
        build(SimConfig(hardware="B200", kv_cache="16MiB", host_tier="1GiB"))


@pytest.mark.parametrize("args, message", [
    (["--block-size", "0"], "--block-size must be >= 1 token, got 0"),           # was a ZeroDivisionError
    (["--memory-utilization", "2"], "--memory-utilization must be in (0, 1], got 2.0"),
    (["--step-overhead-us", "-5"], "--step-overhead-us must be >= 0, got -5"),
    (["--ep", "--expert-imbalance", "0.5"], "so >= 1; got 0.5"),
    (["--trace", "synthetic:sessions=abc"], "option 'sessions=abc': expected a whole number >= 0"),
    (["--trace", "synthetic:arrival_s=-1"], "option 'arrival_s=-1': expected a number >= 0"),
    (["--trace", "synthetic:gap_s=nan"], "option 'gap_s=nan': expected a number >= 0"),
    (["--trace", "synthetic:output_tokens=0"], "block_size and output_tokens must be >= 1"),
])
def test_out_of_range_settings_are_refused_before_the_run(capsys, args, message):
    assert cli_main(["sim", "run", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--max-sessions", "-3"], "argument --max-sessions: must be >= 1, got '-3'"),   # sliced 3 off the end
    (["--rate", "-1"], "argument --rate: must be > 0, got '-1'"),
    (["--rate", "nan"], "argument --rate: expected a finite number, got 'nan'"),
    (["--max-requests", "0"], "argument --max-requests: must be >= 1, got '0'"),
    (["--park-min-gap", "-1"], "argument --park-min-gap: must be >= 0, got '-1'"),
])
def test_out_of_range_flags_are_usage_errors(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        cli_main(["sim", "run", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_an_unwritable_output_fails_before_the_run(capsys, tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr("everybyte.sim.cli.run_sim", lambda *a: ran.append(a))
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli_main(["sim", "run", "--json", str(blocker / "out.json")]) == 2      # under a file
    assert f"cannot write '{blocker / 'out.json'}'" in capsys.readouterr().err
    assert cli_main(["sim", "run", "--json", str(tmp_path)]) == 2
    assert "it is a directory" in capsys.readouterr().err
    assert cli_main(["sim", "calibrate", "--out", str(blocker / "fit.json")]) == 2  # before minutes of profiling
    assert "cannot write" in capsys.readouterr().err
    assert ran == []


def test_deepseek_r1_fits_an_h200_nvl8():
    cost, workers, info = build(SimConfig(hardware="H200", model="deepseek-r1", gpus_per_worker=8,
                                          weights_format="fp8", kv_format="fp8", kv_cache="1GiB"))
    assert info["kv_pool_per_worker"]["bytes_per_token"] == 61 * 576
    assert cost.kv_budget() > 300e9


def test_a_run_is_deterministic():
    a = _run("--workers", "2", "--kv-cache", "8MiB", "--kv-format", "nvfp4", "--trace", TRACE)["summary"]
    b = _run("--workers", "2", "--kv-cache", "8MiB", "--kv-format", "nvfp4", "--trace", TRACE)["summary"]
    for key in ("wall_s", "sim_requests_per_wall_s", "cpu_s"):
        a.pop(key), b.pop(key)
    assert a == b


def test_compact_token_ids_decide_as_the_model_vocabulary(parked):
    """The simulator's default ids (TokenSpace.compact, [0, 256)) name other blocks than ids from
    the model's range, but only equality of names decides: the whole summary is the same."""
    wide = _run("--hardware", "H200", "--workers", "3", "--kv-cache", "12MiB", "--kv-format", "nvfp4", "--host-tier", "1GiB",
                "--trace", TRACE, "--max-gap", "5", "--gap-scale", "1", "--vocab-range", "1000,30000")["summary"]
    compact = dict(parked["summary"])
    for key in ("wall_s", "sim_requests_per_wall_s", "cpu_s"):
        wide.pop(key), compact.pop(key)
    assert compact == wide
    assert parked["assumptions"]["token_ids"] == [0, 256]
    assert compact["prefill_tokens"]["reused"] > 0 and compact["blocks"]["loaded"] > 0
