"""`everybyte bench sim-accuracy` on a tiny synthetic trace: one session calibrates, another is
replayed on the real engine and on the simulator; the JSON holds both runs' figures and the
relative errors computed from them."""
import json

import pytest

from everybyte.bench import sim_accuracy

TRACE = ("synthetic:sessions=2,turns=3,system_tokens=32,first_tokens=24,append_tokens=16,output_tokens=6,"
         "gap_s=0.1,arrival_s=0.1,seed=0")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("acc")
    rc = sim_accuracy.main(["--trace", TRACE, "--calibration-sessions", "1", "--held-out-sessions", "1",
                            "--turns-per-session", "2", "--max-output", "4", "--max-context", "256",
                            "--kv-cache", "16MiB", "--max-num-seqs", "4", "--json", str(out / "acc.json"),
                            "--calibration-out", str(out / "fit.json")])
    assert rc == 0
    return json.loads((out / "acc.json").read_text()), out


def test_both_runs_happened_and_the_errors_come_from_them(result):
    r, _ = result
    real, sim = r["real"], r["sim"]
    assert real["requests"] == sim["requests"] == 2                  # the held-out session's two turns
    assert r["steps"]["real"] > 0 and r["steps"]["sim"] > 0
    assert r["real_wall_split_s"]["stepping"] > 0                    # the real engine ran on the wall clock
    assert real["prefill_tokens_computed"] > 0 and sim["prefill_tokens_computed"] > 0
    for k in sim_accuracy.METRICS:
        assert r["relative_error"][k] == pytest.approx(abs(sim[k] - real[k]) / real[k])
        assert r["within_target"][k] == (r["relative_error"][k] <= r["target"])
    assert r["calibration"]["samples"] >= 4 and r["calibration"]["coefficients"]
    assert r["held_out_sessions"] != r["calibration"]["sessions"]


def test_the_calibration_brackets_the_held_out_run(result):
    r, _ = result
    assert r["calibration"]["runs"] == 2                              # replayed before and after
    assert set(r["host"]["load_average_1m_after"]) == {"calibration", "held_out", "calibration_after"}
    drift = r["host"]["drift"]
    assert drift["calibration_after_vs_before"] > -1 and drift["held_out_steps_measured_vs_fit"] > -1
    moved = drift["calibration_after_vs_before"]
    assert ("warning" in r["host"]) == (abs(moved) > r["target"])


def test_host_drift_compares_each_calibration_on_the_held_out_shapes():
    from everybyte.sim.calibration import StepSample, fit_steps
    shapes = [(t, 100 * t, s) for t in (1, 4, 16, 64, 128) for s in (1, 2, 4)]
    slow = [StepSample(t, a, s, 0.01 + 0.002 * t + 1e-6 * a + 0.001 * s) for t, a, s in shapes]
    fast = [StepSample(x.tokens, x.attended, x.seqs, x.seconds / 2) for x in slow]
    held = fast[:6]
    fit = fit_steps(slow + fast)
    d = sim_accuracy.host_drift(slow, fast, held, fit)
    assert d["calibration_after_vs_before"] == pytest.approx(-0.5, rel=1e-6)
    assert d["held_out_steps_measured_vs_fit"] < 0                  # the held-out steps ran at the fast speed


def test_the_fit_is_a_sim_calibration_file(result):
    from everybyte.sim.calibration import StepFit
    r, out = result
    fit = StepFit.load(str(out / "fit.json"))
    assert fit.coefficients == r["calibration"]["coefficients"]
    assert set(fit.tiers) <= {"G2"}


def test_a_trace_too_short_for_the_split_is_a_clear_error(capsys):
    rc = sim_accuracy.main(["--trace", "synthetic:sessions=1", "--calibration-sessions", "1"])
    assert rc == 2
    assert "sessions" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--json", "--calibration-out"])
def test_an_unwritable_output_fails_before_both_runs(flag, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    ran: list[object] = []
    monkeypatch.setattr(sim_accuracy, "run", ran.append)
    rc = sim_accuracy.main(["--trace", TRACE, flag, str(blocker / "x.json")])
    assert rc == 2 and ran == []
    assert f"cannot write '{blocker}/x.json'" in capsys.readouterr().err
