"""Measure the real engine's step time against its batch shape, for the simulator's calibration
(`everybyte sim calibrate`): batches of B distinct prompts of P tokens decoding a few tokens, every
step recorded through EngineCore.observers as (tokens computed, context attended, sequences,
seconds of the whole step). Prompts are distinct, so no step reuses a prefix."""
from __future__ import annotations

import random
import time
from typing import Any

from everybyte.engine.llm_engine import LLMEngine
from everybyte.engine.sampling_params import SamplingParams


def profile_steps(model: str | None, prompt_lens: list[int], batches: list[int], max_tokens: int = 6,
                  warmup_steps: int = 4, seed: int = 0, **engine_kwargs: Any) -> tuple[list[tuple], dict]:
    """[(tokens, attended, seqs, seconds)] for every step after the first warmup_steps, and the
    engine's description (model, formats, pool)."""
    kw = {"kv_cache_bytes": "64MiB", "kv_tiers": "none", "max_num_seqs": max(batches),
          "max_num_batched_tokens": 512, "max_model_len": max(prompt_lens) + max_tokens + 16, **engine_kwargs}
    llm = LLMEngine(model, **kw)
    shapes: list[tuple[int, int, int]] = []

    def observe(sched, res) -> None:
        if res is not None:
            attended = sum(n * s.num_computed_tokens + n * (n + 1) // 2 for s, n in zip(sched.seqs, sched.num_new_tokens))
            shapes.append((sched.num_batched_tokens, attended, len(sched.seqs)))

    llm.core.observers.append(observe)
    rng = random.Random(seed)
    vocab = llm.model_config.vocab_size
    samples: list[tuple] = []
    n_steps = 0
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for p in prompt_lens:
        for b in batches:
            for _ in range(b):
                llm.add_request([rng.randrange(100, vocab) for _ in range(p)], params)
            while llm.has_unfinished_requests():
                t0 = time.perf_counter()
                llm.step()
                dt = time.perf_counter() - t0
                n_steps += 1
                if shapes and n_steps > warmup_steps:
                    samples.append((*shapes[-1], dt))
                shapes.clear()
    info = {"model": llm.model_config.model_id, "kv_cache_dtype": llm.config.kv_cache_dtype,
            "weights_format": llm.loaded.weights_format, "device": llm.config.device,
            "prompt_lens": prompt_lens, "batches": batches, "max_tokens": max_tokens,
            "max_num_batched_tokens": kw["max_num_batched_tokens"], "steps_measured": len(samples)}
    return samples, info
