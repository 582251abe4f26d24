"""Per-request sampling and stopping options (vLLM-compatible names)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0                # in (0, 1]
    top_k: int = -1                   # -1 = off, else >= 1
    min_p: float = 0.0                # in [0, 1]
    seed: int | None = None           # per-request generator: same seed, same tokens
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None       # N: the chosen token's logprob and the top N
    skip_special_tokens: bool = True

    def __post_init__(self):
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        def bad(name, limit):
            raise ValueError(f"{name} must be {limit}, got {getattr(self, name)!r}")
        if not self.temperature >= 0:
            bad("temperature", ">= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or not (self.top_k == -1 or self.top_k >= 1):
            bad("top_k", "-1 (off) or >= 1")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", ">= 1")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad("logprobs", ">= 0 (or None)")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "an int (or None)")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "a list of token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
