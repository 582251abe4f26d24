"""Record a MoE model's routing on a replay of agent sessions: for every engine step, the tokens
each MoE layer sent to each logical expert (through MoEBlock.load_counter), so that placements
can be evaluated on real routing afterwards without running the model again.

The replay runs the sessions' turns in order, `concurrency` sessions at a time batched in one
engine (a turn that extends an earlier one carries that turn's prompt and the model's own output),
with the trace scaled as `bench agentic` scales it. Prefix caching stays on: reused tokens are
not computed, so they are not routed either, as in serving.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from everybyte.models.expert_load import ExpertLoad, moe_blocks
from everybyte.traces import Trace
from everybyte.traces.scaling import Scaling
from everybyte.traces.tokens import SessionPrompts, TokenSpace


@dataclass
class Routing:
    moe_layers: list[int]
    num_experts: int
    top_k: int
    steps: list[torch.Tensor]          # [L, E] tokens per logical expert, one tensor per engine step
    requests: int
    prompt_tokens: int
    generated_tokens: int
    scaling: dict[str, Any]

    @property
    def routed_tokens(self) -> int:
        """Tokens routed per layer (each counted once, not k times)."""
        return int(sum(int(s[0].sum()) for s in self.steps)) // max(self.top_k, 1)

    def total(self) -> torch.Tensor:
        return torch.stack(self.steps).sum(0) if self.steps else torch.zeros(len(self.moe_layers), self.num_experts)

    def save(self, path: str) -> None:
        torch.save({**asdict(self), "steps": torch.stack(self.steps)}, path)

    @classmethod
    def load(cls, path: str) -> "Routing":
        d = torch.load(path, weights_only=True)
        if not isinstance(d, dict) or "steps" not in d:
            raise ValueError(f"{path}: not a routing record written by `bench moe --save-routing`")
        return cls(**{**d, "steps": list(d["steps"].unbind(0))})


def moe_layer_indices(config: Any) -> list[int]:
    if not config.is_moe:
        raise ValueError(f"{config.model_id} is a dense {config.architecture} model; bench moe needs a "
                         f"mixture-of-experts model")
    return [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]


def record_routing(llm: Any, trace: Trace, scaling: Scaling, max_sessions: int, concurrency: int,
                   max_turns: int | None = None) -> Routing:
    """Replay up to `max_sessions` sessions (at most `max_turns` turns each) on `llm` (an LLMEngine
    of a MoE model) and return the routing of every step."""
    from everybyte.engine.sampling_params import SamplingParams

    mc = llm.model_config
    layers = moe_layer_indices(mc)
    blocks = moe_blocks(llm.loaded.model)
    if not blocks:
        raise ValueError(f"{mc.model_id}: no MoE block with a load_counter in the model")
    load = ExpertLoad(layers, mc.num_experts, window=1)
    steps: list[torch.Tensor] = []

    def observe(sched: Any, res: Any) -> None:
        if res is not None:
            steps.append(load.end_step())

    for b in blocks:
        b.load_counter = load.count
    llm.core.observers.append(observe)
    space = TokenSpace(min(1000, mc.vocab_size // 4), min(30000, mc.vocab_size))
    sessions = trace.sessions[:max_sessions]
    requests = prompt_tokens = generated = 0
    try:
        for start in range(0, len(sessions), concurrency):
            wave = [(s, SessionPrompts(s, scaling, space, "bench-moe", trace.name), {})
                    for s in sessions[start:start + concurrency]]
            live = list(wave)
            for k in range(max(len(s.turns) for s, _, _ in wave)):
                if max_turns is not None and k >= max_turns:
                    break
                batch, params, owners = [], [], []
                for item in list(live):
                    session, prompts, outputs = item
                    if k >= len(session.turns):
                        live.remove(item)
                        continue
                    ids, n_out = prompts.prompt(k, outputs), scaling.output_len(session.turns[k])
                    if len(ids) + n_out > scaling.max_context:
                        live.remove(item)          # a session stops at its first turn over the cap
                        continue
                    batch.append(ids)
                    params.append(SamplingParams(temperature=0.0, max_tokens=n_out, ignore_eos=True))
                    owners.append(outputs)
                if not batch:
                    continue
                for outputs, out, ids in zip(owners, llm.generate(batch, params), batch):
                    outputs[k] = list(out.token_ids)
                    requests, prompt_tokens, generated = requests + 1, prompt_tokens + len(ids), generated + len(out.token_ids)
    finally:
        llm.core.observers.remove(observe)
        for b in blocks:
            b.load_counter = None
    return Routing(moe_layers=layers, num_experts=mc.num_experts, top_k=mc.num_experts_per_tok, steps=steps,
                   requests=requests, prompt_tokens=prompt_tokens, generated_tokens=generated,
                   scaling=scaling.describe())
