"""Conditional disaggregation at the router (cluster contract §4, Dynamo's conditional disagg).

A request whose uncached prefill (prompt tokens minus the deepest prefix any decode worker holds)
exceeds the threshold is first sent to a prefill-role worker as a completion of its prompt token
ids with max_tokens=1 and `kv_transfer_params: {"do_remote_decode": true}`; the prefill worker's
answer names its blocks (`kv_transfer_params`), which go with the original request to the decode
worker (`do_remote_prefill: true`). A prefill step that fails leaves the request aggregated: the
decode worker computes the prompt itself (counted, never lost).
"""
from __future__ import annotations

from typing import Any

import httpx

from everybyte.cluster.decide import disagg_wanted
from everybyte.cluster.routing import NoWorker, Plan, Routing

PREFILL_TIMEOUT_S = 120.0


class Disaggregation:
    def __init__(self, routing: Routing, client: httpx.AsyncClient, threshold_tokens: int):
        if threshold_tokens < 0:
            raise ValueError(f"--disagg-threshold must be >= 0 tokens, got {threshold_tokens}")
        self.routing, self.client, self.threshold = routing, client, threshold_tokens

    def wanted(self, plan: Plan) -> bool:
        return disagg_wanted(plan, self.threshold, bool(self.routing.workers.healthy(("prefill",))))

    async def prefill(self, plan: Plan, body: dict[str, Any], headers: dict[str, str],
                      tenant: str | None = None) -> dict[str, Any] | None:
        """Run the prompt on a prefill worker; its kv_transfer_params, or None (recompute on decode)."""
        m = self.routing.metrics
        prefill_body = {"prompt": plan.tokens, "max_tokens": 1, "stream": False,
                        "kv_transfer_params": {"do_remote_decode": True}}
        for key in ("model", "cache_salt"):
            if body.get(key) is not None:
                prefill_body[key] = body[key]
        try:
            pplan = self.routing.plan("/v1/completions", prefill_body, None, roles=("prefill",), tenant=tenant,
                                      digest=plan.worker.digest)     # never a transfer the decoder would misread
        except NoWorker:
            m.disagg.labels("no_prefill_worker").inc()
            return None
        self.routing.begin(pplan)
        try:
            r = await self.client.post(pplan.worker.url + "/v1/completions", json=prefill_body, headers=headers,
                                       timeout=PREFILL_TIMEOUT_S)
            params = r.json().get("kv_transfer_params") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            params = None
        finally:
            self.routing.end(pplan)
        if not isinstance(params, dict):
            m.disagg.labels("prefill_failed").inc()
            return None
        m.disagg.labels("remote_prefill").inc()
        return {**params, "do_remote_prefill": True}
