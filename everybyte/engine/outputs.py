"""What a request gives back: text, token ids, why it stopped, logprobs and timings."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    token_times: list[float]                    # wall time each output token appeared
    num_preemptions: int

    def __init__(self, arrival_time: float, first_scheduled_time: float | None = None,
                 first_token_time: float | None = None, finished_time: float | None = None,
                 token_times: list[float] | None = None, num_preemptions: int = 0) -> None:
        # written out: mypyc compiles it; the one @dataclass generates runs interpreted, ~5x slower
        self.arrival_time, self.first_scheduled_time = arrival_time, first_scheduled_time
        self.first_token_time, self.finished_time = first_token_time, finished_time
        self.token_times = [] if token_times is None else token_times
        self.num_preemptions = num_preemptions

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None                   # "stop", "length", "abort" or None while running
    logprobs: list[dict[int, float]] | None     # per output token: {chosen: lp, top-N...: lp}
    metrics: RequestMetrics
    stop_reason: str | int | None               # the stop string or stop token id that matched
    num_cached_tokens: int                      # prompt tokens reused from any KV tier
    session_id: str | None
    kv_transfer_params: dict | None             # a prefill for a remote decode: where its KV waits

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], text: str,
                 token_ids: list[int], finish_reason: str | None, logprobs: list[dict[int, float]] | None,
                 metrics: RequestMetrics, stop_reason: str | int | None = None, num_cached_tokens: int = 0,
                 session_id: str | None = None, kv_transfer_params: dict | None = None) -> None:
        self.request_id, self.prompt, self.prompt_token_ids, self.text = request_id, prompt, prompt_token_ids, text
        self.token_ids, self.finish_reason, self.logprobs, self.metrics = token_ids, finish_reason, logprobs, metrics
        self.stop_reason, self.num_cached_tokens = stop_reason, num_cached_tokens
        self.session_id, self.kv_transfer_params = session_id, kv_transfer_params

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
