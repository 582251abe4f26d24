"""Which sampling settings a request gets for the fields it leaves unset: one rule for the
in-process LLM, `everybyte generate` and the server (vLLM's `--generation-config auto`).

1. A value the request sets always wins (`--temperature 0` is greedy).
2. Otherwise the checkpoint's own defaults, when it carries any: generation_config.json of a
   Hugging Face directory (temperature, top_p, top_k, min_p, repetition_penalty), or a GGUF's
   `general.sampling.*` metadata (temp, top_p, top_k, min_p, penalty_repeat).
3. A checkpoint with none gets FALLBACK: temperature 0.7, top_p 0.9 and a light repetition
   penalty, 1.1; plain greedy or temperature-1 sampling of a small model loops.
A greedy request takes no default repetition penalty (SamplingParams.with_defaults).
"""
from __future__ import annotations

from everybyte.models.config import ModelConfig

FALLBACK = {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1}


def sampling_defaults(config: ModelConfig) -> dict:
    return dict(config.sampling_defaults) if config.sampling_defaults else dict(FALLBACK)
