"""Token sampling, vectorized over the batch: repetition penalty, greedy, temperature, top-k, top-p,
min-p, seeds.

Each row draws one uniform number per step from its request's torch.Generator (seeded requests)
or the sampler's own generator, then inverts the filtered distribution's CDF; so a seeded
request gives the same tokens whatever else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from everybyte.engine.sampling_params import SamplingParams


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor   # [B] float32, 0 = greedy
    top_ks: torch.Tensor         # [B] int64, vocab size when off
    top_ps: torch.Tensor         # [B] float32
    min_ps: torch.Tensor         # [B] float32
    all_greedy: bool
    needs_filter: bool
    max_logprobs: int            # -1 when no row asks for logprobs
    logprob_ns: list[int | None]
    penalties: torch.Tensor | None = None   # [B] float32 repetition penalties, None when all are 1
    seen: torch.Tensor | None = None        # [B, V] bool: the token is in the row's sequence

    @classmethod
    def from_params(cls, params: list[SamplingParams], vocab_size: int,
                    token_ids: list[list[int]] | None = None) -> "SamplingTensors":
        penalties = seen = None
        if token_ids is not None and any(p.repetition_penalty != 1 for p in params):
            penalties = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
            rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1]
            flat = torch.tensor([t for i in rows for t in token_ids[i]], dtype=torch.long)
            which = torch.repeat_interleave(torch.tensor(rows), torch.tensor([len(token_ids[i]) for i in rows]))
            seen = torch.zeros(len(params), vocab_size, dtype=torch.bool)
            seen[which, flat] = True
        return cls(
            temperatures=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_ks=torch.tensor([vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params]),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32),
            all_greedy=all(p.greedy for p in params),
            needs_filter=any(not p.greedy and (p.top_k != -1 or p.top_p < 1 or p.min_p > 0) for p in params),
            max_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
            logprob_ns=[p.logprobs for p in params],
            penalties=penalties, seen=seen,
        )


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]   # per row: {chosen: lp, top-N: lp} or None


class Sampler:
    def __init__(self, seed: int | None = None):
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, st: SamplingTensors,
                 generators: list[torch.Generator | None]) -> SamplerOutput:
        logits = logits.float()
        if st.penalties is not None:
            logits = self.penalize(logits, st)
        greedy = logits.argmax(dim=-1)
        if st.all_greedy:
            tokens = greedy
        else:
            u = torch.cat([torch.rand(1, generator=g or self.generator) for g in generators])
            tokens = torch.where(st.temperatures == 0, greedy, self._sample(logits, st, u))
        lps = self._logprobs(logits, tokens, st) if st.max_logprobs >= 0 else [None] * len(generators)
        return SamplerOutput(tokens.tolist(), lps)

    @staticmethod
    def penalize(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """The repetition penalty as in HF and vLLM: a token already in the sequence (prompt and
        output) has its logit divided by the penalty when positive, multiplied when negative."""
        pen = st.penalties[:, None]
        return torch.where(st.seen, torch.where(logits > 0, logits / pen, logits * pen), logits)

    @staticmethod
    def _sample(logits: torch.Tensor, st: SamplingTensors, u: torch.Tensor) -> torch.Tensor:
        temps = torch.where(st.temperatures == 0, torch.ones_like(st.temperatures), st.temperatures)
        scaled = logits / temps[:, None]
        cdf = scaled.softmax(dim=-1).cumsum(dim=-1)
        plain = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
        plain = plain.clamp(max=logits.shape[-1] - 1)
        if not st.needs_filter:
            return plain
        filtered = st.top_ks.lt(logits.shape[-1]) | st.top_ps.lt(1) | st.min_ps.gt(0)
        return torch.where(filtered, Sampler._sample_filtered(scaled, st, u), plain)

    @staticmethod
    def _sample_filtered(scaled: torch.Tensor, st: SamplingTensors, u: torch.Tensor) -> torch.Tensor:
        """Top-k, then top-p, then min-p over the sorted distribution; each keeps a prefix of it.
        The sort is a top-k over a few hundred candidates unless some row's kept prefix might reach
        past them, then a full sort: exact either way."""
        vocab = scaled.shape[-1]
        k = min(vocab, max(256, int(st.top_ks[st.top_ks < vocab].max()) if (st.top_ks < vocab).any() else 0))
        while True:
            sorted_logits, order = scaled.topk(k, dim=-1)
            probs = (sorted_logits - scaled.logsumexp(dim=-1, keepdim=True)).exp()
            ranks = torch.arange(k)[None]
            probs = probs.masked_fill(ranks >= st.top_ks[:, None], 0.0)
            covered = st.top_ks <= k
            total = torch.where(covered, probs.sum(dim=-1), torch.ones_like(st.top_ps))
            probs = probs / total[:, None]
            cum = probs.cumsum(dim=-1)
            drop = (cum - probs) >= st.top_ps[:, None]
            drop |= probs < st.min_ps[:, None] * probs[:, :1]
            drop[:, 0] = False
            inside = drop[:, -1] | covered
            if k == vocab or bool(inside.all()):
                break
            k = vocab
        probs = probs.masked_fill(drop, 0.0)
        kept = (probs > 0).sum(dim=-1).clamp(min=1)
        cdf = probs.cumsum(dim=-1)
        pos = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
        return order.gather(1, torch.minimum(pos, kept - 1)[:, None]).squeeze(1)

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, st: SamplingTensors) -> list:
        lp = logits.log_softmax(dim=-1)
        chosen = lp.gather(1, tokens[:, None]).squeeze(1).tolist()
        top_v, top_i = lp.topk(st.max_logprobs, dim=-1) if st.max_logprobs > 0 else (None, None)
        out = []
        for row, n in enumerate(st.logprob_ns):
            if n is None:
                out.append(None)
                continue
            d = {int(tokens[row]): chosen[row]}
            if n:
                for i, v in zip(top_i[row, :n].tolist(), top_v[row, :n].tolist()):
                    d.setdefault(i, v)
            out.append(d)
        return out
