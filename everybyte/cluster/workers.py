"""The router's view of its workers: what each one said in /v1/kv/info, whether it answers, and
what the router itself has in flight there.

`WorkerSet.poll` asks every worker's /v1/kv/info (cluster contract §1) with a short timeout; a
worker without that endpoint (an older `serve`) is checked on /health and routed without events.
A worker that stops answering goes down (on_down: its index is dropped, its event feed stopped)
and comes back up when it answers again (on_up), as does one whose namespace changed.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from everybyte.cluster.request_blocks import namespace_from_info
from everybyte.kv.block_id import KVNamespace

POLL_TIMEOUT_S = 1.0
# Load time of a block relative to recomputing it, per tier, when a worker states no speeds.
DEFAULT_LOAD_FRACTION = {"G2": 0.05, "G3": 0.2, "G3.5": 0.3}


@dataclass
class Worker:
    url: str
    healthy: bool = False
    info: dict[str, Any] | None = None              # the last /v1/kv/info (None: the worker has none)
    namespace: KVNamespace | None = None
    in_flight: int = 0                    # requests the router has open there
    active_blocks: int = 0                # their blocks (Dynamo's decode blocks)
    queued_prefill_blocks: float = 0.0    # their blocks this worker computes (uncached when routed)
    failures: int = 0

    @property
    def role(self) -> str:
        return (self.info or {}).get("role") or "both"

    @property
    def digest(self) -> str:
        return (self.info or {}).get("namespace_digest") or ""

    @property
    def events(self) -> dict[str, Any] | None:
        return (self.info or {}).get("kv_events")

    @property
    def load(self) -> dict[str, Any]:
        return (self.info or {}).get("load") or {}

    def queue_depth(self) -> int:
        load = self.load
        return max(self.in_flight, int(load.get("num_running") or 0) + int(load.get("num_waiting") or 0))

    def full(self) -> bool:
        """The worker said (last poll) that requests wait for a slot: a session should not queue there."""
        return int(self.load.get("num_waiting") or 0) > 0

    def load_fraction(self, tier: str) -> float:
        """Seconds to load one token from `tier` over seconds to prefill one, clamped to [0, 1]."""
        speeds = (self.info or {}).get("speeds") or {}
        prefill, load = speeds.get("prefill_tok_s"), (speeds.get("load_tok_s") or {}).get(tier)
        if prefill and load:
            return min(1.0, max(0.0, float(prefill) / float(load)))
        return DEFAULT_LOAD_FRACTION.get(tier, 1.0)


@dataclass
class WorkerSet:
    urls: list[str]
    fallback_namespace: KVNamespace
    on_up: Callable[[Worker], None] = lambda w: None
    on_down: Callable[[Worker], None] = lambda w: None
    workers: dict[str, Worker] = field(init=False)

    def __post_init__(self) -> None:
        self.workers = {u: Worker(u) for u in self.urls}

    def healthy(self, roles: tuple[str, ...] = ("both", "decode")) -> list[Worker]:
        return [w for w in self.workers.values() if w.healthy and w.role in roles]

    async def poll(self, client: httpx.AsyncClient) -> None:
        await asyncio.gather(*(self._poll_one(client, w) for w in self.workers.values()))

    async def _poll_one(self, client: httpx.AsyncClient, w: Worker) -> None:
        try:
            r = await client.get(w.url + "/v1/kv/info", timeout=POLL_TIMEOUT_S)
            if r.status_code == 404:
                r = await client.get(w.url + "/health", timeout=POLL_TIMEOUT_S)
                info = None
            else:
                info = r.json() if r.status_code == 200 else None
            ok = r.status_code == 200
        except (httpx.HTTPError, ValueError):
            ok, info = False, None
        if not ok:
            self.mark_down(w)
            return
        old_digest, was_up = w.digest, w.healthy
        w.info = info
        ns = (info or {}).get("namespace")
        w.namespace = namespace_from_info(ns) if ns else self.fallback_namespace
        if was_up and w.digest != old_digest:        # restarted with another model or KV format
            self.mark_down(w)
        if not w.healthy:
            w.healthy, w.failures = True, 0
            self.on_up(w)

    def mark_down(self, w: Worker) -> None:
        if w.healthy:
            w.healthy = False
            w.failures += 1
            self.on_down(w)
