"""Scaling a recorded trace to the model and machine at hand, always stated in the report.

Input token counts are divided by `token_scale` (the hash-block structure is kept: a block of the
trace becomes block_size / token_scale tokens at the same scaled position), outputs by
`output_scale` and capped at `max_output`, a prompt + its output must fit `max_context` (the
session stops at the first turn that does not), gaps are multiplied by `gap_scale` and capped.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from everybyte.traces.model import Turn

# Defaults for the embedded SmolLM2-135M (8K window) on a 2-core CPU: contexts of ~1-3K tokens,
# outputs of a few to 64 tokens, gaps of ~0.5-3 s.
FORMAT_DEFAULTS: dict[str, dict[str, Any]] = {
    "agent_sessions": {"token_scale": 64.0, "output_scale": 16.0},   # p50 input 61K -> ~950 tokens
    "mooncake": {"token_scale": 16.0, "output_scale": 4.0},          # p50 input 11.6K -> ~720 tokens
    "azure": {"token_scale": 4.0, "output_scale": 2.0},              # p50 input 1.5K -> ~370 tokens
    "synthetic": {"token_scale": 1.0, "output_scale": 1.0},          # generated at model scale
}


@dataclass
class Scaling:
    token_scale: float = 64.0
    output_scale: float = 16.0
    max_context: int = 4096          # prompt + output tokens of one turn
    max_output: int = 64
    gap_scale: float = 0.1
    max_gap_s: float = 3.0
    arrival_scale: float = 1.0       # open loop with recorded arrivals: seconds multiplied by this

    def __post_init__(self) -> None:
        for name in ("token_scale", "output_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.max_context < 2 or self.max_output < 1:
            raise ValueError("max_context must be >= 2 and max_output >= 1")
        if self.gap_scale < 0 or self.max_gap_s < 0 or self.arrival_scale < 0:
            raise ValueError("gap_scale, max_gap_s and arrival_scale must be >= 0")

    @classmethod
    def defaults(cls, fmt: str, model_window: int | None = None, **overrides: Any) -> "Scaling":
        s = cls(**FORMAT_DEFAULTS.get(fmt, {}))
        if model_window:
            s = replace(s, max_context=min(s.max_context, model_window))
        return replace(s, **{k: v for k, v in overrides.items() if v is not None})

    def scaled_pos(self, recorded_pos: int) -> int:
        return int(recorded_pos // self.token_scale)

    def output_len(self, turn: Turn) -> int:
        return max(1, min(self.max_output, round(turn.output_tokens / self.output_scale)))

    def gap(self, turn: Turn) -> float:
        return min(self.max_gap_s, turn.gap_s * self.gap_scale)

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        d["rule"] = (f"input tokens / {self.token_scale:g} (by hash block position), output tokens / "
                     f"{self.output_scale:g} capped at {self.max_output} (at least 1), prompt + output <= "
                     f"{self.max_context} tokens (a session stops at its first turn over it), gaps x "
                     f"{self.gap_scale:g} capped at {self.max_gap_s:g} s")
        return d
