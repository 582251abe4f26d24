"""`everybyte router`: an OpenAI-compatible front over N `everybyte serve` workers.

Generation requests are routed by the policy (cluster/policy) and forwarded with their bytes
untouched, so a malformed body gets exactly the 4xx a worker gives; streams pass through as
they come. Session calls go to the worker that holds the session (asked in turn when the router
does not know it, e.g. after a restart). Workers are polled on /v1/kv/info about once a second.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from everybyte.cluster.disagg import Disaggregation
from everybyte.cluster.proxy import Proxy, error, forward_headers
from everybyte.cluster.routing import NoWorker, Routing
from everybyte.serve.guard import tenant_of

log = logging.getLogger("everybyte.router")
POLL_INTERVAL_S = 1.0


def create_app(routing: Routing, *, disagg_threshold: int | None = None, request_timeout_s: float = 600.0,
               poll_interval_s: float = POLL_INTERVAL_S, cache_salt_from_api_key: bool = False) -> FastAPI:
    timeout = httpx.Timeout(connect=2.0, read=request_timeout_s, write=30.0, pool=10.0)
    client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1024))
    proxy = Proxy(routing, client)
    disagg = Disaggregation(routing, client, disagg_threshold) if disagg_threshold is not None else None

    async def poll_forever() -> None:
        while True:
            try:
                await routing.workers.poll(client)
            except Exception:                                # keep polling whatever one round did
                log.exception("worker poll failed")
            await asyncio.sleep(poll_interval_s)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await routing.workers.poll(client)
        task = asyncio.create_task(poll_forever())
        try:
            yield
        finally:
            task.cancel()
            routing.feed.stop_all()
            await client.aclose()

    app = FastAPI(title="everybyte router", version="0.1.0", lifespan=lifespan)
    app.state.routing = routing

    async def generate(request: Request, path: str) -> Response:
        raw = await request.body()
        body = _json_object(raw)
        session = ((body or {}).get("session_id") if isinstance((body or {}).get("session_id"), str) else None) \
            or request.headers.get("x-session-id")
        headers = forward_headers(request.headers)
        tenant = _tenant(request.headers.get("authorization")) if cache_salt_from_api_key else None
        digest = None
        if disagg is not None and body is not None:
            try:
                first = routing.plan(path, body, session, tenant=tenant)
            except NoWorker as e:
                return error(503, str(e), code="no_worker")
            if disagg.wanted(first) and (params := await disagg.prefill(first, body, headers, tenant)) is not None:
                body = {**body, "kv_transfer_params": params}
                raw = json.dumps(body).encode()
                digest = first.worker.digest
        stream = bool((body or {}).get("stream"))
        return await proxy.send(path, raw, body, headers,
                                lambda failed: routing.plan(path, body, session, failed, tenant=tenant, digest=digest),
                                stream)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(request, "/v1/chat/completions")

    async def any_worker(request: Request, method: str, path: str) -> Response:
        for w in routing.workers.healthy(("both", "decode", "prefill")):
            try:
                r = await client.request(method, w.url + path, content=await request.body(),
                                         headers=forward_headers(request.headers))
            except httpx.TransportError:
                continue
            if r.status_code < 500:
                return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        return error(503, "no healthy worker answered", code="no_worker")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await any_worker(request, "GET", "/v1/models")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await any_worker(request, "POST", "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await any_worker(request, "POST", "/detokenize")

    async def session_call(request: Request, method: str, session_id: str, suffix: str = "") -> Response:
        known = routing.sessions.get(session_id)
        workers = sorted(routing.workers.healthy(), key=lambda w: w.url != known)
        last: Response = error(404, f"session {session_id!r} does not exist", "invalid_request_error",
                               "session_not_found")
        for w in workers:
            try:
                r = await client.request(method, f"{w.url}/v1/sessions/{session_id}{suffix}",
                                         content=await request.body(), headers=forward_headers(request.headers))
            except httpx.TransportError:
                continue
            last = Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
            if r.status_code != 404:
                if r.status_code < 300 and method != "DELETE":
                    routing.remember_session(session_id, w.url)
                return last
        return last

    @app.post("/v1/sessions/{session_id}/park")
    async def park(request: Request, session_id: str) -> Response:
        return await session_call(request, "POST", session_id, "/park")

    @app.post("/v1/sessions/{session_id}/resume")
    async def resume(request: Request, session_id: str) -> Response:
        return await session_call(request, "POST", session_id, "/resume")

    @app.get("/v1/sessions/{session_id}")
    async def session_info(request: Request, session_id: str) -> Response:
        return await session_call(request, "GET", session_id)

    @app.delete("/v1/sessions/{session_id}")
    async def drop(request: Request, session_id: str) -> Response:
        routing.sessions.pop(session_id, None)
        return await session_call(request, "DELETE", session_id)

    @app.get("/health")
    async def health() -> Response:
        up = [w.url for w in routing.workers.workers.values() if w.healthy]
        return JSONResponse({"status": "ok" if up else "no_workers", "workers": up}, status_code=200 if up else 503)

    @app.get("/v1/workers")
    async def workers() -> Response:
        data = [{"url": w.url, "healthy": w.healthy, "role": w.role, "namespace_digest": w.digest,
                 "in_flight": w.in_flight, "failures": w.failures, "load": w.load}
                for w in routing.workers.workers.values()]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(routing.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _tenant(authorization: str | None) -> str | None:
    """The tenant a worker with --cache-salt-from-api-key derives from this request's key."""
    if not authorization or authorization[:7].lower() != "bearer ":
        return None
    return tenant_of(authorization[7:])


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) else None
