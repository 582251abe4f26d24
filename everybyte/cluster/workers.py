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
from typing import Callable

import httpx

from everybyte.cluster.request_blocks import namespace_from_info
from everybyte.cluster.worker_state import DEFAULT_LOAD_FRACTION, Worker  # noqa: F401 (re-exported)
from everybyte.kv.block_id import KVNamespace

POLL_TIMEOUT_S = 1.0


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
