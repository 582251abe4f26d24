"""Prometheus metrics of the router, under `everybyte:router_` (vLLM-style names)."""
from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)


class RouterMetrics:
    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("everybyte:router_requests", "requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.decisions = Counter("everybyte:router_decisions", "routing decisions by policy and worker",
                                 ["policy", "worker"], registry=r)
        self.overlap_blocks = Counter("everybyte:router_overlap_blocks",
                                      "prefix blocks the chosen worker held, by tier", ["tier"], registry=r)
        self.prompt_blocks = Counter("everybyte:router_prompt_blocks", "full prompt blocks routed", registry=r)
        self.retries = Counter("everybyte:router_retries", "requests retried on another worker", ["reason"],
                               registry=r)
        self.failed = Counter("everybyte:router_failed_requests",
                              "requests that failed or were cut (none is lost silently)", ["reason"], registry=r)
        self.disagg = Counter("everybyte:router_disagg_requests", "disaggregated requests by outcome",
                              ["outcome"], registry=r)
        self.decision_seconds = Histogram("everybyte:router_decision_seconds",
                                          "time to tokenize, hash and choose a worker",
                                          buckets=_DECISION_BUCKETS, registry=r)
        r.register(_Snapshot(snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Snapshot:
    """Per-worker gauges read at scrape time: health, load, in-flight, indexed blocks, event lag."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.snapshot()
        up = GaugeMetricFamily("everybyte:router_worker_up", "1 when the worker answers its health check",
                               labels=["worker"])
        load = GaugeMetricFamily("everybyte:router_worker_load", "the worker's load as it states it",
                                 labels=["worker", "kind"])
        blocks = GaugeMetricFamily("everybyte:router_indexed_blocks", "blocks indexed per worker and tier",
                                   labels=["worker", "tier"])
        lag = GaugeMetricFamily("everybyte:router_event_lag_seconds", "age of the last KV event batch on arrival",
                                labels=["worker"])
        events = CounterMetricFamily("everybyte:router_kv_events", "KV event feed counts", labels=["kind"])
        for url, w in s["workers"].items():
            up.add_metric([url], 1.0 if w["healthy"] else 0.0)
            for kind, v in w["load"].items():
                load.add_metric([url, kind], float(v))
            for tier, n in w["blocks"].items():
                blocks.add_metric([url, tier], float(n))
            if w.get("event_lag_s") is not None:
                lag.add_metric([url], w["event_lag_s"])
        for kind, n in s["events"].items():
            events.add_metric([kind], float(n))
        yield from (up, load, blocks, lag, events)
