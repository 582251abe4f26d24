"""Per-request sampling and stopping options (vLLM-compatible names).

The sampling fields (temperature, top_p, top_k, min_p, repetition_penalty) left unset (None) take
the model's defaults when the engine accepts the request (`with_defaults`, engine.sampling_defaults);
a value the request sets always wins. Until then an unset field reads as its neutral value (1.0,
1.0, -1, 0.0, 1.0: plain sampling), so a SamplingParams is usable on its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1   # a 64-bit signed seed, as vLLM takes
MAX_STOP_STRINGS = 64          # stop strings per request
MAX_STOP_LEN = 256             # characters of one stop string
MAX_STOP_TOKEN_IDS = 1024


@dataclass
class SamplingParams:
    temperature: float | None = None  # 0 = greedy; None: the model's default
    top_p: float | None = None        # in (0, 1]
    top_k: int | None = None          # -1 = off, else >= 1
    min_p: float | None = None        # in [0, 1]
    repetition_penalty: float | None = None   # > 0; 1 = off; > 1 discourages tokens already in the sequence
    seed: int | None = None           # per-request generator: same seed, same tokens
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None       # N: the chosen token's logprob and the top N
    skip_special_tokens: bool = True

    unset: frozenset = field(init=False, repr=False, compare=False, default=frozenset())

    def __post_init__(self):
        unset = frozenset(n for n in NEUTRAL if getattr(self, n) is None)
        for n in unset:
            setattr(self, n, NEUTRAL[n])
        self.unset = unset
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def __setattr__(self, name, value):
        if name in NEUTRAL and self.__dict__.get("unset"):       # assigned after construction: now set
            object.__setattr__(self, "unset", self.unset - {name})
        object.__setattr__(self, name, value)

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
        if not self.repetition_penalty > 0:
            bad("repetition_penalty", "> 0")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", ">= 1")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            bad("logprobs", ">= 0 (or None)")
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX):
            bad("seed", f"an int in [{SEED_MIN}, {SEED_MAX}] (or None)")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must be at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_LEN for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings of at most {MAX_STOP_LEN} characters each")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "a list of token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def with_defaults(self, defaults: dict) -> "SamplingParams":
        """These params with each unset sampling field taken from `defaults` (where it has one);
        a greedy request (temperature 0) takes no default repetition penalty."""
        taken = {n: defaults[n] for n in self.unset if defaults.get(n) is not None}
        if taken.get("temperature", self.temperature) == 0:
            taken.pop("repetition_penalty", None)     # greedy stays plain greedy unless a penalty is asked for
        return replace(self, **taken, **{n: None for n in self.unset - taken.keys()}) if taken else self
