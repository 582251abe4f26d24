"""Prometheus metrics for the server, under the `everybyte:` prefix (vLLM-style names)."""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    """`render(engine_stats)` takes a stats snapshot made on the engine thread (the engine is
    not thread-safe), so scrapes never read half-updated bookkeeping."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.snapshot: dict = {}
        r = self.registry
        self.requests = Counter("everybyte:requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.finished = Counter("everybyte:request_success", "finished requests by finish reason",
                                ["finished_reason"], registry=r)
        self.ttft = Histogram("everybyte:time_to_first_token_seconds", "time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("everybyte:inter_token_latency_seconds", "time between output tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("everybyte:e2e_request_latency_seconds", "end-to-end request latency",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("everybyte:prompt_tokens", "prompt tokens received", registry=r)
        self.generation_tokens = Counter("everybyte:generation_tokens", "tokens generated", registry=r)
        r.register(_EngineCollector(lambda: self.snapshot))

    def render(self, engine_stats: dict) -> bytes:
        self.snapshot = engine_stats
        return generate_latest(self.registry)


class _EngineCollector:
    """Reads the engine's stats() at scrape time: queue depths, prefix cache, byte ledger, tiers."""

    def __init__(self, engine_stats: Callable[[], dict]):
        self.engine_stats = engine_stats

    def collect(self):
        s = self.engine_stats() or {}
        for key, name, doc in (("num_running", "num_requests_running", "requests running on the engine"),
                               ("num_waiting", "num_requests_waiting", "requests waiting to be scheduled")):
            if key in s:
                yield GaugeMetricFamily(f"everybyte:{name}", doc, value=s[key])
        for key, name, doc in (("kv_blocks_free", "kv_blocks_free", "free KV blocks in the device pool"),
                               ("kv_blocks_total", "kv_blocks_total", "KV blocks in the device pool"),
                               ("kv_usage", "kv_cache_usage_perc", "fraction of KV blocks in use")):
            if key in s:
                yield GaugeMetricFamily(f"everybyte:{name}", doc, value=s[key])
        for key, name, doc in (("prefix_cache_queries", "prefix_cache_queries", "prompt tokens looked up in the prefix cache"),
                               ("prefix_cache_hits", "prefix_cache_hits", "prompt tokens found in the prefix cache")):
            if key in s:
                yield CounterMetricFamily(f"everybyte:{name}", doc, value=s[key])
        pool = s.get("kv_pool", {})
        if pool:
            yield GaugeMetricFamily("everybyte:kv_cache_budget_bytes", "device KV cache budget", value=pool["budget_bytes"])
        mem = s.get("memory", {})
        ledger = mem.get("g1", {})
        if ledger:
            g = GaugeMetricFamily("everybyte:g1_bytes", "device bytes by ledger category", labels=["category"])
            for cat, v in ledger.items():
                if cat != "total":
                    g.add_metric([cat], v)
            yield g
        prefill = mem.get("prefill_tokens", {})
        if prefill:
            c = CounterMetricFamily("everybyte:prefill_tokens", "prompt tokens computed or reused, by tier",
                                    labels=["source"])
            c.add_metric(["computed"], prefill.get("computed", 0))
            for tier, v in prefill.get("reused", {}).items():
                c.add_metric([tier], v)
            yield c
        blocks = mem.get("blocks", {})
        if blocks:
            c = CounterMetricFamily("everybyte:kv_block_events", "KV block events (evicted, parked, prestaged, "
                                    "loaded, corrupt, dropped)", labels=["event"])
            for event, v in blocks.items():
                c.add_metric([event], v)
            yield c
        tiers = mem.get("tiers", {})
        if tiers:
            used = GaugeMetricFamily("everybyte:tier_bytes_used", "bytes held per KV tier", labels=["tier"])
            cap = GaugeMetricFamily("everybyte:tier_bytes_capacity", "capacity per KV tier", labels=["tier"])
            for tier, t in tiers.items():
                used.add_metric([tier], t.get("used_bytes", 0))
                cap.add_metric([tier], t.get("capacity_bytes", 0))
            yield used
            yield cap
        yield from _transfer_metrics(s.get("kv_transfer", {}))
        moved = mem.get("bytes_moved", {})
        if moved:
            c = CounterMetricFamily("everybyte:kv_bytes_moved", "KV bytes moved per tier and direction",
                                    labels=["tier", "direction"])
            for tier, directions in moved.items():
                for direction, v in directions.items():
                    c.add_metric([tier, direction], v)
            yield c


def _transfer_metrics(t: dict):
    """Disaggregated prefill/decode: bytes and blocks received per connector path, and served."""
    paths = t.get("paths", {})
    if paths:
        nbytes = CounterMetricFamily("everybyte:kv_transfer_bytes_received", "KV bytes received from other "
                                     "workers per connector path (zmq: direct; redis: the pod-shared tier)",
                                     labels=["path"])
        blocks = CounterMetricFamily("everybyte:kv_transfer_blocks", "remote KV blocks by path and outcome",
                                     labels=["path", "outcome"])
        for path, d in paths.items():
            nbytes.add_metric([path], d.get("bytes_received", 0))
            for outcome in ("blocks_received", "missing", "corrupt", "failed", "refused"):
                if outcome in d:
                    blocks.add_metric([path, outcome.removeprefix("blocks_")], d[outcome])
        yield nbytes
        yield blocks
    if "refused" in t:
        yield CounterMetricFamily("everybyte:kv_transfer_refused", "transfers refused: the peer's namespace "
                                  "digest differs", value=t["refused"])
    served = t.get("served")
    if served:
        c = CounterMetricFamily("everybyte:kv_transfer_served", "KV blocks this worker staged and sent",
                                labels=["what"])
        for key, v in served.items():
            c.add_metric([key], v)
        yield c
