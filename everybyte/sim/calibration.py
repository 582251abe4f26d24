"""A step-time model fitted to the real engine (issue #20 item 4, first part): least squares of
measured step seconds on the batch shape, seconds = a + b * tokens + c * attended + d * seqs + e *
[a prompt chunk in the step] (tokens computed, the context they attend to, sequences in the
batch, and whether any sequence computes more than one token: the real engine's prefill path costs
a fixed amount more than a decode step of as many tokens), with its residuals.
`everybyte sim calibrate` measures the samples (engine/step_profile) and saves the fit;
`sim run --calibration FILE` steps on it instead of the roofline. No torch here."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

TERMS = ("overhead_s", "per_token_s", "per_attended_s", "per_seq_s", "per_prefill_step_s")
LEGACY_TERMS = TERMS[:4]                         # fits saved before the prefill term: it is 0 there


@dataclass
class StepSample:
    tokens: int
    attended: int
    seqs: int
    seconds: float


@dataclass
class StepFit:
    coefficients: dict[str, float]
    residuals: dict[str, float]                 # relative error |fit - measured| / measured
    samples: int
    source: dict[str, Any] = field(default_factory=dict)
    # measured tier loads, level -> {"bytes_per_s", "latency_s"}: replace the catalog's links
    tiers: dict[str, dict[str, float]] = field(default_factory=dict)

    def seconds(self, tokens: int, attended: int, seqs: int) -> float:
        c = self.coefficients
        t = c["overhead_s"] + c["per_token_s"] * tokens + c["per_attended_s"] * attended + c["per_seq_s"] * seqs
        if tokens > seqs:
            t += c["per_prefill_step_s"]
        return max(t, 0.0)

    def total_seconds(self, samples: list[StepSample]) -> float:
        """What the fit says these steps take together."""
        return sum(self.seconds(s.tokens, s.attended, s.seqs) for s in samples)

    def range(self) -> dict[str, list[int]]:
        rng: dict[str, list[int]] = self.source.get("range", {})
        return rng

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    @classmethod
    def load(cls, path: str) -> "StepFit":
        try:
            with open(path) as f:
                d = json.load(f)
            fit = cls(d["coefficients"], d["residuals"], d["samples"], d.get("source", {}), d.get("tiers", {}))
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            why = f"no {e} field" if isinstance(e, KeyError) else str(e)
            raise ValueError(f"{path}: not a calibration file written by `everybyte sim calibrate`: {why}") from None
        if set(fit.coefficients) == set(LEGACY_TERMS):
            fit.coefficients["per_prefill_step_s"] = 0.0
        if set(fit.coefficients) != set(TERMS):
            raise ValueError(f"{path}: calibration coefficients must be {', '.join(TERMS)}")
        if any(not isinstance(t, dict) or not t.get("bytes_per_s", 0) > 0 for t in fit.tiers.values()):
            raise ValueError(f"{path}: each calibrated tier needs bytes_per_s > 0")
        return fit


def fit_steps(samples: list[StepSample], source: dict[str, Any] | None = None) -> StepFit:
    """Least squares of the relative error (each sample weighted by 1 / its seconds: the many short
    decode steps count as much as the few long prefills, and the residuals reported are what is
    minimised); non-negative terms: a negative one is dropped and the rest refitted."""
    import numpy as np
    if len(samples) < len(TERMS):
        raise ValueError(f"need at least {len(TERMS)} step samples to fit, got {len(samples)}")
    if any(not s.seconds > 0 for s in samples):
        raise ValueError("every step sample needs seconds > 0")
    w = np.array([1.0 / s.seconds for s in samples])
    x = np.array([[1.0, s.tokens, s.attended, s.seqs, float(s.tokens > s.seqs)] for s in samples]) * w[:, None]
    y = np.ones(len(samples))
    keep = list(range(len(TERMS)))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, keep], y, rcond=None)
        if (coef >= 0).all() or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    full = dict.fromkeys(TERMS, 0.0)
    for i, c in zip(keep, coef):
        full[TERMS[i]] = float(max(c, 0.0))
    fit = StepFit(full, {}, len(samples), dict(source or {}))
    rel = sorted(abs(fit.seconds(s.tokens, s.attended, s.seqs) - s.seconds) / s.seconds for s in samples)
    fit.residuals = {"p50": rel[len(rel) // 2], "p90": rel[int(0.9 * (len(rel) - 1))], "max": rel[-1]} if rel else {}
    fit.source.setdefault("fitted_at", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    fit.source["range"] = {"tokens": [min(s.tokens for s in samples), max(s.tokens for s in samples)],
                           "attended": [min(s.attended for s in samples), max(s.attended for s in samples)],
                           "seqs": [min(s.seqs for s in samples), max(s.seqs for s in samples)]}
    return fit
