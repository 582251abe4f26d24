"""The real executor behind EngineCore: one forward of the model over the paged KV pool and
sampling, with a seeded generator per request that asks for one."""
from __future__ import annotations

import time

import torch

from everybyte.engine.core import StepResult
from everybyte.engine.model_runner import ModelRunner
from everybyte.engine.sequence import Sequence


class ModelExecutor:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.generators: dict[str, torch.Generator] = {}

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        seed = seq.params.seed
        if seed is None:
            return None
        gen = self.generators.get(seq.request_id)
        if gen is None:
            gen = self.generators[seq.request_id] = torch.Generator().manual_seed(seed)
        return gen

    def execute(self, seqs: list[Sequence], num_new_tokens: list[int]) -> StepResult:
        gens = [self._generator(s) for s in seqs]
        t0 = time.perf_counter()
        rows, out = self.runner.run(seqs, num_new_tokens, gens)
        seconds = time.perf_counter() - t0
        if out is None:
            return StepResult(rows, [], [], seconds)
        return StepResult(rows, list(out.token_ids), list(out.logprobs), seconds)

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
