"""Forwarding a request to the chosen worker, with retries before the first byte.

A request whose worker fails before answering (connect error, a 5xx, a stream that breaks before
its first byte) or is full (429) goes to another worker; any other 4xx is the client's answer,
forwarded as is.
A stream cut in flight ends with an error event and `data: [DONE]`. Every failure is counted.
"""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable, Mapping

import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from everybyte.cluster.routing import NoWorker, Plan, Routing

FORWARD_HEADERS = ("authorization", "x-session-id", "content-type", "x-api-key")
MAX_ATTEMPTS = 3


def error(status: int, message: str, type_: str = "server_error", code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": code}},
                        status_code=status)


def forward_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() in FORWARD_HEADERS}


class Proxy:
    def __init__(self, routing: Routing, client: httpx.AsyncClient):
        self.routing, self.client = routing, client

    async def send(self, path: str, raw: bytes, body: dict[str, Any] | None, headers: dict[str, str],
                   plan_for: Callable[[set[str]], Plan], stream: bool) -> Response:
        """POST `raw` to the planned worker's `path`; on a failure before the first byte, replan
        without the workers that failed."""
        m, failed = self.routing.metrics, set[str]()
        last: Response | None = None
        reason = "every attempt failed"
        for _ in range(MAX_ATTEMPTS):
            try:
                plan = plan_for(failed)
            except NoWorker as e:
                reason = str(e)
                break
            self.routing.begin(plan)
            url = plan.worker.url + path
            try:
                req = self.client.build_request("POST", url, content=raw, headers=headers)
                resp = await self.client.send(req, stream=True)
            except httpx.TransportError as e:
                self._failed(plan, failed, f"connect: {type(e).__name__}")
                self.routing.workers.mark_down(plan.worker)
                continue
            if resp.status_code >= 500 or resp.status_code == 429:     # broken or full: try another
                content = await _read(resp)
                self._failed(plan, failed, f"http {resp.status_code}")
                last = Response(content, resp.status_code, media_type=resp.headers.get("content-type"))
                continue
            if not (stream and resp.status_code == 200):
                try:
                    content = await resp.aread()
                except httpx.TransportError:
                    await resp.aclose()
                    self._failed(plan, failed, "read")
                    continue
                await resp.aclose()
                self.routing.end(plan)
                m.requests.labels(path, str(resp.status_code)).inc()
                return Response(content, resp.status_code, media_type=resp.headers.get("content-type"))
            chunks = resp.aiter_raw()
            try:
                first = await chunks.__anext__()
            except (httpx.TransportError, StopAsyncIteration):
                await resp.aclose()
                self._failed(plan, failed, "stream broke before its first byte")
                continue
            m.requests.labels(path, "200").inc()
            if not path.endswith("/chat/completions"):      # a chat stream's first chunk is its role, sent at once
                self.routing.prefilled(plan)
            return StreamingResponse(self._relay(first, chunks, resp, plan), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        m.failed.labels("no_worker" if last is None else "worker_error").inc()
        m.requests.labels(path, str(last.status_code if last is not None else 503)).inc()
        return last if last is not None else error(503, reason, code="no_worker")

    def _failed(self, plan: Plan, failed: set[str], reason: str) -> None:
        self.routing.end(plan)
        failed.add(plan.worker.url)
        self.routing.metrics.retries.labels(reason.split(":")[0]).inc()

    async def _relay(self, first: bytes, chunks: AsyncIterator[bytes], resp: httpx.Response,
                     plan: Plan) -> AsyncIterator[bytes]:
        try:
            yield first
            async for chunk in chunks:
                if plan.prefill_blocks:
                    self.routing.prefilled(plan)
                yield chunk
        except httpx.HTTPError as e:
            self.routing.metrics.failed.labels("stream_cut").inc()
            err = {"error": {"message": f"the worker's stream broke: {type(e).__name__}", "type": "server_error",
                             "param": None, "code": "worker_failed"}}
            yield f"\n\ndata: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await resp.aclose()
            self.routing.end(plan)


async def _read(resp: httpx.Response) -> bytes:
    try:
        return await resp.aread()
    except httpx.HTTPError:
        return b""
    finally:
        await resp.aclose()
