"""Expert-parallel imbalance (max / mean tokens per GPU) per EP degree, derived rather than one
cited figure for every degree. The cited figures are DeepSeek-R1 at EP32: 2.56 with the experts
split contiguously, 1.11 after EPLB (../shared/specs/nvfp4.md). A GPU holding 32 experts (EP8)
averages out more of the skew than one holding 4 (EP64), so one figure cannot hold for all.

The model (each part an assumption the output states):
- each MoE layer's expert popularity is log-normal (DeepSeek-V3's per-expert token counts are
  best fitted by a log-normal: deepseek-ai/DeepEP pull request #393), an expert's share capped
  at 1/top_k (a token picks an expert at most once), with sigma fitted so that the contiguous
  split at EP32 gives the cited 2.56;
- a step routes `tokens_per_gpu` tokens per GPU x top_k pairs, drawn multinomially;
- EPLB (models/eplb.place, the engine's own balancer) places experts plus `redundant_per_gpu`
  replicas per GPU from a window of past steps, and is judged on later steps (out of sample),
  whose popularity has drifted: each expert's share times a log-normal factor of sigma `drift`,
  fitted so that EPLB at EP32 gives the cited 1.11 (with no drift it gives 1.04: a stationary
  load is easy to balance);
- a layer's step waits for its most loaded GPU: the figure is the mean over layers and steps.
SIGMA and DRIFT below are that fit's result (`fit()` redoes it, about a minute; a test checks
that they still give the cited pair).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass

import numpy as np

from everybyte.models.eplb import place

CITED_EP, CITED_BEFORE, CITED_AFTER = 32, 2.56, 1.11      # ../shared/specs/nvfp4.md: DeepSeek-R1 at EP32
SIGMA, DRIFT = 1.075, 0.114       # fit() with the default model (2026-12-06)


@dataclass(frozen=True)
class ImbalanceModel:
    experts: int = 256                 # DeepSeek-R1's routed experts
    top_k: int = 8
    layers: int = 256                  # layer draws, each with its own popularity (R1 has 58 MoE
                                       # layers; more draws make the mean over layers steadier)
    tokens_per_gpu: int = 256          # tokens a GPU brings to a step (decode: its sequences)
    window_steps: int = 32             # the load history EPLB places from
    eval_steps: int = 8                # later steps it is judged on
    redundant_per_gpu: int = 1         # replica slots per GPU (DeepSeek's prefill EP32: 32 in all)
    seed: int = 0

    def check(self, ep: int) -> None:
        if ep < 1 or self.experts % ep:
            raise ValueError(f"EP{ep}: {self.experts} experts do not split evenly over {ep} GPUs")
        if self.top_k < 1 or self.top_k > self.experts or self.layers < 1 or self.tokens_per_gpu < 1:
            raise ValueError(f"bad expert imbalance model: {self}")


def _capped(weights: np.ndarray, top_k: int) -> np.ndarray:
    """Shares of token-expert pairs from weights, each at most 1 / top_k (water-filled: the excess
    of a clipped share goes to the others in proportion)."""
    p = weights / weights.sum()
    cap = 1.0 / top_k
    for _ in range(len(p)):
        over = p > cap
        if not over.any():
            break
        excess = float((p[over] - cap).sum())
        p[over] = cap
        free = p < cap
        p[free] += excess * p[free] / p[free].sum()
    return p


def _max_over_mean(per_gpu: np.ndarray) -> float:
    mean = per_gpu.mean()
    return float(per_gpu.max() / mean) if mean > 0 else 1.0


def _layers(m: ImbalanceModel, ep: int, sigma: float, drift: float) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer: (window counts per expert, eval counts [steps, experts], drawn after the drift);
    the same draws for every sigma and drift of one seed."""
    rng = np.random.default_rng(m.seed)
    pairs = ep * m.tokens_per_gpu * m.top_k
    out = []
    for _ in range(m.layers):
        z, d = rng.standard_normal(m.experts), rng.standard_normal(m.experts)
        p = _capped(np.exp(sigma * z), m.top_k)
        q = _capped(p * np.exp(drift * d), m.top_k)
        window = rng.multinomial(pairs, p, size=m.window_steps).sum(axis=0)
        out.append((window, rng.multinomial(pairs, q, size=m.eval_steps)))
    return out


def contiguous(m: ImbalanceModel, ep: int, sigma: float = SIGMA, drift: float = DRIFT) -> float:
    """Mean over layers and eval steps of max/mean tokens per GPU, experts split contiguously."""
    m.check(ep)
    got = [_max_over_mean(step.reshape(ep, -1).sum(axis=1)) for _, ev in _layers(m, ep, sigma, drift) for step in ev]
    return float(np.mean(got))


def with_eplb(m: ImbalanceModel, ep: int, sigma: float = SIGMA, drift: float = DRIFT) -> float:
    """The same after EPLB placed experts and replicas from the window (judged on later steps)."""
    m.check(ep)
    slots = m.experts + m.redundant_per_gpu * ep
    got = []
    for window, ev in _layers(m, ep, sigma, drift):
        phy2log = np.array(place(window.tolist(), slots, ep))
        replicas = np.bincount(phy2log, minlength=m.experts)
        for step in ev:
            per_slot = step[phy2log] / replicas[phy2log]     # an expert's load split over its replicas
            got.append(_max_over_mean(per_slot.reshape(ep, -1).sum(axis=1)))
    return float(np.mean(got))


def _bisect(f, target: float, lo: float, hi: float, iters: int) -> float:
    """x in [lo, hi] where the increasing f crosses target."""
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def fit(m: ImbalanceModel = ImbalanceModel(), rounds: int = 2) -> tuple[float, float]:
    """(sigma, drift) that give the cited EP32 pair: sigma for the contiguous split, then drift for
    EPLB, twice (drift skews the judged steps a little too)."""
    sigma, drift = 1.0, 0.0
    for _ in range(rounds):
        sigma = _bisect(lambda x: contiguous(m, CITED_EP, x, drift), CITED_BEFORE, 0.0, 3.0, 16)
        drift = _bisect(lambda x: with_eplb(m, CITED_EP, sigma, x), CITED_AFTER, 0.0, 2.0, 12)
    return sigma, drift


@functools.cache
def derived(ep: int, eplb: bool, m: ImbalanceModel = ImbalanceModel()) -> float:
    """max/mean tokens per GPU at EP `ep`, without or with EPLB, under the fitted model."""
    return with_eplb(m, ep) if eplb else contiguous(m, ep)


def table(degrees: tuple[int, ...] = (8, 16, 32, 64), m: ImbalanceModel = ImbalanceModel()) -> dict:
    """Every degree's figures, the fit and the cited EP32 pair it was fitted to."""
    return {"model": asdict(m), "sigma": SIGMA, "drift": DRIFT,
            "cited": {"ep": CITED_EP, "contiguous": CITED_BEFORE, "eplb": CITED_AFTER},
            "per_ep": {ep: {"contiguous": round(derived(ep, False, m), 3), "eplb": round(derived(ep, True, m), 3)}
                       for ep in degrees}}
