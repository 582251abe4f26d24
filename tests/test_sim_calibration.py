"""The simulator's step-time calibration: the fit (torch-free arithmetic), its file, the cost
model stepping on it and counting extrapolation, and the real engine's step profile (shapes only:
tests never assert timings)."""
import json

import pytest

from everybyte.engine.step_profile import profile_steps
from everybyte.sim.calibration import StepFit, StepSample, fit_steps
from everybyte.sim.cost_model import CostModel
from everybyte.sim.hardware import get_hardware
from everybyte.sim.models import get_model


def _linear(tokens, attended, seqs):
    return 0.002 + 1e-4 * tokens + 2e-7 * attended + 5e-4 * seqs


def test_fit_recovers_a_linear_step_time(tmp_path):
    shapes = [(t, a, s) for t in (1, 8, 64, 256) for a in (100, 5000) for s in (1, 4)]
    fit = fit_steps([StepSample(t, a, s, _linear(t, a, s)) for t, a, s in shapes], {"machine": "test"})
    assert fit.coefficients["overhead_s"] == pytest.approx(0.002, rel=1e-6)
    assert fit.coefficients["per_token_s"] == pytest.approx(1e-4, rel=1e-6)
    assert fit.coefficients["per_attended_s"] == pytest.approx(2e-7, rel=1e-6)
    assert fit.residuals["max"] < 1e-6 and fit.range()["tokens"] == [1, 256]
    path = tmp_path / "fit.json"
    fit.save(str(path))
    assert StepFit.load(str(path)).seconds(10, 1000, 2) == pytest.approx(_linear(10, 1000, 2))
    path.write_text(json.dumps({"coefficients": {"a": 1}}))
    with pytest.raises(ValueError, match="not a calibration file .*: no 'residuals' field"):
        StepFit.load(str(path))


def test_a_step_with_a_prompt_chunk_costs_its_own_term(tmp_path):
    """The real engine's prefill path costs a fixed amount over a decode step of as many tokens:
    with it in the measured times, the fit finds it and charges it only where tokens > seqs."""
    def measured(t, a, s):
        return _linear(t, a, s) + (0.03 if t > s else 0.0)
    shapes = [(t, a, s) for t in (1, 2, 8, 64, 256) for a in (100, 5000) for s in (1, 2)]
    fit = fit_steps([StepSample(t, a, s, measured(t, a, s)) for t, a, s in shapes])
    assert fit.coefficients["per_prefill_step_s"] == pytest.approx(0.03, rel=1e-6)
    assert fit.seconds(2, 100, 2) == pytest.approx(_linear(2, 100, 2))          # two decoding: no chunk
    assert fit.seconds(9, 100, 2) == pytest.approx(_linear(9, 100, 2) + 0.03)
    legacy = tmp_path / "old.json"                       # a fit saved before the term: it reads as 0
    legacy.write_text(json.dumps({"coefficients": {"overhead_s": 0.01, "per_token_s": 0.0, "per_attended_s": 0.0,
                                                   "per_seq_s": 0.0}, "residuals": {}, "samples": 5}))
    assert StepFit.load(str(legacy)).seconds(9, 100, 2) == pytest.approx(0.01)


def test_negative_terms_are_dropped():
    samples = [StepSample(t, 0, 1, 0.01 + 1e-3 * t) for t in (1, 2, 4, 8, 16)]
    samples += [StepSample(3, 10, 1, 1e-4)]                     # an outlier that pulls per_attended negative
    fit = fit_steps(samples)
    assert all(v >= 0 for v in fit.coefficients.values())


def test_cost_model_steps_on_the_fit_and_counts_extrapolation():
    fit = fit_steps([StepSample(t, a, s, _linear(t, a, s)) for t in (1, 16) for a in (10, 1000) for s in (1, 2)])
    cost = CostModel(get_hardware("H200"), get_model("smollm2"), calibration=fit)

    class Seq:
        num_computed_tokens = 4

    assert cost.batch_seconds([Seq()], [1]) == pytest.approx(_linear(1, 5, 1))
    assert cost.outside_range == 1                              # attended 5 < the fitted 10
    cost.batch_seconds([Seq(), Seq()], [8, 8])
    assert cost.outside_range == 1 and cost.describe()["step_time"].startswith("calibrated")


def test_calibrated_tier_loads_replace_the_catalog_link(tmp_path):
    fit = fit_steps([StepSample(t, a, s, _linear(t, a, s)) for t in (1, 16) for a in (10, 1000) for s in (1, 2)])
    fit.tiers = {"G2": {"bytes_per_s": 1e9, "latency_s": 1e-3}}
    path = tmp_path / "fit.json"
    fit.save(str(path))
    cost = CostModel(get_hardware("H200"), get_model("smollm2"), calibration=StepFit.load(str(path)))
    assert cost.transfer_seconds("G2", 10**9) == pytest.approx(1.001)          # not H200's PCIe 128 GB/s
    fit.tiers = {"G2": {"bytes_per_s": 0}}
    fit.save(str(path))
    with pytest.raises(ValueError, match="bytes_per_s"):
        StepFit.load(str(path))
    with pytest.raises(ValueError, match="seconds > 0"):
        fit_steps([StepSample(1, 1, 1, 0.0)] * 5)


def test_profile_records_every_step_shape():
    raw, info = profile_steps(None, [8], [1, 2], max_tokens=2, warmup_steps=0)
    assert info["steps_measured"] == len(raw) >= 4
    assert raw[0][:3] == (8, 8 * 9 // 2, 1)                     # the first prompt's prefill
    assert all(seconds > 0 and 1 <= seqs <= 2 for _, _, seqs, seconds in raw)
    assert (2, 9 + 9, 2) in [r[:3] for r in raw]               # the pair decoding at context 9
