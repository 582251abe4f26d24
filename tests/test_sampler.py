"""Sampler (vectorized, seeded) and SamplingParams validation."""
import pytest
import torch

from everybyte.engine.sampler import Sampler, SamplingTensors
from everybyte.engine.sampling_params import SamplingParams

V = 6


def run(logits, params, gens=None, seed=0):
    st = SamplingTensors.from_params(params, logits.shape[-1])
    return Sampler(seed)(logits, st, gens or [None] * len(params))


@pytest.mark.parametrize("kwargs,field,limit", [
    ({"temperature": -0.1}, "temperature", ">= 0"),
    ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_k": 0}, "top_k", "-1 (off) or >= 1"),
    ({"top_k": -2}, "top_k", "-1 (off) or >= 1"),
    ({"min_p": -0.1}, "min_p", "[0, 1]"),
    ({"min_p": 1.1}, "min_p", "[0, 1]"),
    ({"max_tokens": 0}, "max_tokens", ">= 1"),
    ({"logprobs": -1}, "logprobs", ">= 0"),
    ({"stop": [""]}, "stop", "non-empty"),
])
def test_params_validation(kwargs, field, limit):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert field in str(e.value) and limit in str(e.value)


def test_params_normalize_stop():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams().stop == []


def test_greedy_and_degenerate_filters_are_argmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    want = logits.argmax(-1).tolist()
    assert run(logits, [SamplingParams(temperature=0)] * 5).token_ids == want
    for p in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6),
              SamplingParams(temperature=1.0, min_p=1.0), SamplingParams(temperature=1e-4)):
        assert run(logits, [p] * 5).token_ids == want


def test_temperature_sampling_matches_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, 0.3])
    n = 20000
    params = [SamplingParams(temperature=0.8)] * n
    toks = torch.tensor(run(logits.expand(n, V).clone(), params).token_ids)
    freq = torch.bincount(toks, minlength=V).float() / n
    assert torch.allclose(freq, (logits / 0.8).softmax(-1), atol=0.015)


def test_filters_restrict_support():
    logits = torch.tensor([3.0, 2.5, 2.0, 0.0, -1.0, -2.0])
    n = 4000
    big = logits.expand(n, V).clone()
    probs = logits.softmax(-1)
    assert set(run(big, [SamplingParams(top_k=2)] * n).token_ids) == {0, 1}
    # nucleus: smallest prefix whose mass reaches top_p
    top_p = float(probs[:2].sum()) + 0.01
    assert set(run(big, [SamplingParams(top_p=top_p)] * n).token_ids) == {0, 1, 2}
    min_p = float(probs[2] / probs[0]) + 1e-3       # token 2 just below the bar
    assert set(run(big, [SamplingParams(min_p=min_p)] * n).token_ids) == {0, 1}


def test_mixed_batch_rows_independent():
    torch.manual_seed(1)
    logits = torch.randn(4, 100)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=3), SamplingParams(temperature=0),
              SamplingParams(top_p=0.5, min_p=0.1)]
    out = run(logits, params).token_ids
    assert out[0] == logits[0].argmax() and out[2] == logits[2].argmax()
    assert out[1] in logits[1].topk(3).indices.tolist()


def test_seeded_generators_reproducible_and_batch_invariant():
    torch.manual_seed(2)
    logits = torch.randn(3, 1000)
    p = SamplingParams(temperature=1.0, seed=42)

    def draws(rows):
        g = torch.Generator().manual_seed(42)
        toks = []
        for _ in range(20):
            out = run(logits[rows], [p] * len(rows), [g] + [None] * (len(rows) - 1), seed=None)
            toks.append(out.token_ids[0])
        return toks

    alone = draws([0])
    assert draws([0]) == alone
    assert draws([0, 1, 2]) == alone          # other rows in the batch do not change row 0
    assert len(set(alone)) > 1


def test_logprobs_chosen_and_top_n():
    torch.manual_seed(3)
    logits = torch.randn(3, 30)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0),
              SamplingParams(temperature=0, logprobs=0)]
    out = run(logits, params)
    lp = logits.log_softmax(-1)
    d = out.logprobs[0]
    top = lp[0].topk(3)
    assert list(d) == top.indices.tolist()    # chosen (= top-1 when greedy) first, then the rest
    assert all(abs(d[i] - v) < 1e-6 for i, v in zip(top.indices.tolist(), top.values.tolist()))
    assert out.logprobs[1] is None
    assert out.logprobs[2] == {out.token_ids[2]: pytest.approx(float(lp[2, out.token_ids[2]]))}


def _reference(row: torch.Tensor, p: SamplingParams, u: float) -> int:
    """Plain per-row sampling: full sort, top-k, top-p, min-p, inverse CDF (vocab order when unfiltered)."""
    if p.top_k == -1 and p.top_p == 1 and p.min_p == 0:
        cdf = (row / p.temperature).softmax(-1).cumsum(0)
        return int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])]), right=True))
    probs, order = (row / p.temperature).softmax(-1).sort(descending=True)
    if p.top_k != -1:
        probs[p.top_k:] = 0
    probs = probs / probs.sum()
    keep = (probs.cumsum(0) - probs) < p.top_p
    keep &= probs >= p.min_p * probs[0]
    keep[0] = True
    probs = probs * keep
    cdf = probs.cumsum(0)
    i = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])]), right=True))
    return int(order[min(i, int(keep.sum()) - 1)])


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])
def test_vectorized_matches_per_row_reference(scale):
    torch.manual_seed(4)
    vocab = 3000
    logits = torch.randn(8, vocab) * scale
    params = [SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(top_k=5),
              SamplingParams(top_k=500, top_p=0.5), SamplingParams(min_p=0.2),
              SamplingParams(temperature=1.3), SamplingParams(top_p=0.99, min_p=0.01),
              SamplingParams(top_k=300), SamplingParams(temperature=0.9, top_k=2, min_p=0.5)]
    st = SamplingTensors.from_params(params, vocab)
    for trial in range(5):
        u = torch.rand(8)
        got = Sampler._sample(logits.clone(), st, u).tolist()
        want = [_reference(logits[i], p, float(u[i])) for i, p in enumerate(params)]
        assert got == want
