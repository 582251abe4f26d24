"""How the model's own output joins the next turn's context, and how often that was exact.

In order of preference: the ids the server generated (embedded engine; servers that stream
`token_ids`, e.g. vLLM with `return_token_ids`), else the generated text through the server's
/tokenize (a round trip: exact when it gives back as many tokens as were generated), else the
text itself (text prompts), else stand-in ids of the generated length (counted as `filler`).
"""
from __future__ import annotations

from collections import Counter

from everybyte.bench.replay.backend import GenResult


class Joiner:
    def __init__(self, backend):
        self.backend = backend
        self.methods: Counter = Counter()
        self.round_trips = Counter()

    async def output_ids(self, res: GenResult, prompts, k: int) -> tuple[list[int], str, bool | None]:
        n = res.completion_tokens
        if self.backend.prompt_mode == "text":
            method, ids, exact = "text", prompts.filler(k, n), None
            if self.backend.tokenize and res.output_text:
                toks = await self._tokenize(res.output_text)
                exact = None if toks is None else len(toks) == n
        elif res.output_ids is not None and len(res.output_ids) == n:
            method, ids, exact = "server_ids", list(res.output_ids), True
        elif self.backend.tokenize and res.output_text:
            ids = await self._tokenize(res.output_text)
            if ids:
                method, exact = "tokenize", len(ids) == n
            else:
                method, ids, exact = "filler", prompts.filler(k, n), None
        else:
            method, ids, exact = "filler", prompts.filler(k, n), None
        self.methods[method] += 1
        if exact is not None:
            self.round_trips["exact" if exact else "inexact"] += 1
        return ids, method, exact

    async def _tokenize(self, text: str) -> list[int] | None:
        try:
            return await self.backend.tokenize_text(text)
        except Exception:
            return None

    def describe(self) -> dict:
        checked = sum(self.round_trips.values())
        return {"methods": dict(self.methods),
                "round_trip_checked": checked,
                "round_trip_rate": (self.round_trips["exact"] / checked) if checked else None}
