"""What the replay driver asks of a target, and what one turn gives back."""
from __future__ import annotations

import re
from dataclasses import dataclass, field


class EndpointError(RuntimeError):
    """The target cannot be used at all (unreachable, no model): reported before the run."""


@dataclass
class GenRequest:
    session_id: str
    request_id: str
    prompt_ids: list[int] | None
    prompt_text: str | None
    max_tokens: int
    extra: dict | None = None


@dataclass
class GenResult:
    ok: bool = False
    error: str | None = None
    status: int | None = None
    t_send: float = 0.0               # time.perf_counter()
    t_end: float = 0.0
    token_times: list[float] = field(default_factory=list)    # arrival of each chunk that had output
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    cached_tokens: int | None = None
    output_ids: list[int] | None = None
    output_text: str = ""
    finish_reason: str | None = None

    @property
    def t_first(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    def fail(self, error: str, t: float) -> "GenResult":
        self.ok, self.error, self.t_end = False, error, t
        return self


_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[str, dict[tuple, float]]:
    """{metric name: {((label, value), ...): value}} from the Prometheus text format."""
    out: dict[str, dict[tuple, float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = tuple(sorted(_LABEL.findall(m.group(2) or "")))
        out.setdefault(m.group(1), {})[labels] = value
    return out


def _one(metrics: dict, name: str, **labels) -> float | None:
    series = metrics.get(name)
    if not series:
        return None
    want = set(labels.items())
    for key, v in series.items():
        if want <= set(key):
            return v
    return None


def _first(*values):
    return next((v for v in values if v is not None), None)


def sample_from(metrics: dict) -> dict:
    """The server-side gauges the report uses, from a parsed /metrics page."""
    g1 = {dict(k).get("category", "?"): v for k, v in (metrics.get("everybyte:g1_bytes") or {}).items()}
    s = {"everybyte": any(name.startswith("everybyte:") for name in metrics),
         "g1_bytes": g1,
         "kv_usage": _one(metrics, "everybyte:kv_cache_usage_perc"),
         "running": _one(metrics, "everybyte:num_requests_running"),
         "waiting": _one(metrics, "everybyte:num_requests_waiting"),
         "prefix_cache_queries": _first(_one(metrics, "everybyte:prefix_cache_queries_total"),
                                        _one(metrics, "everybyte:prefix_cache_queries")),
         "prefix_cache_hits": _first(_one(metrics, "everybyte:prefix_cache_hits_total"),
                                     _one(metrics, "everybyte:prefix_cache_hits")),
         "kv_budget_bytes": _first(_one(metrics, "everybyte:kv_cache_budget_bytes"),
                                   _one(metrics, "everybyte:tier_bytes_capacity", tier="g1"))}
    if s["kv_usage"] is None:                       # vLLM's name
        s["kv_usage"] = _first(_one(metrics, "vllm:kv_cache_usage_perc"), _one(metrics, "vllm:gpu_cache_usage_perc"))
    return s
