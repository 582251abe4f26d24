"""The server's one input boundary, as plain ASGI middleware (no per-chunk cost on responses).

Before any route runs: the API key (every path but /health, /metrics and /v1/kv/info), the body read and
counted as it arrives (413 past --max-body-bytes, however it is framed: Content-Length or
chunked), and the body checked as JSON: well-formed UTF-8, nested at most MAX_DEPTH deep, no
string (or key) holding a lone UTF-16 surrogate. Each failure is a 4xx naming what was wrong; a
route only ever sees a body that passed. Requests are counted by route template (a fixed
"unmatched" for anything else), never by a client-chosen path.
"""
from __future__ import annotations

import hashlib
import hmac
import json

from starlette.responses import JSONResponse
from starlette.routing import Match

from everybyte.serve.protocol import APIError

MAX_DEPTH = 64
OPEN_PATHS = ("/health", "/metrics", "/v1/kv/info")
UNMATCHED = "unmatched"


def tenant_of(api_key: str) -> str:
    """A tenant's name derived from its API key: a hash, never the key itself."""
    return hashlib.sha256(b"everybyte-tenant\0" + api_key.encode()).hexdigest()[:32]


class Guard:
    def __init__(self, app, state, routes: list):
        self.app, self.state, self.routes = app, state, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = self._route(scope)
        try:
            tenant = self._authorize(scope)
            body = await self._read_body(scope, receive)
            if body:
                check_json(body)
        except APIError as e:
            self._count(route, e.status)
            return await _render(e)(scope, receive, send)
        scope.setdefault("state", {})["tenant"] = tenant
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()          # then http.disconnect, as the server reports it

        async def send_counted(message):
            if message["type"] == "http.response.start":
                self._count(route, message["status"])
            await send(message)

        await self.app(scope, replay, send_counted)

    def _route(self, scope) -> str:
        for r in self.routes:
            match, _ = r.matches(scope)
            if match != Match.NONE:
                return getattr(r, "path", UNMATCHED)
        return UNMATCHED

    def _authorize(self, scope) -> str | None:
        """The caller's tenant (a hash of its key) when keys are set; 401 for a wrong key."""
        keys = self.state.config.api_keys
        if not keys or scope["path"] in OPEN_PATHS:
            return None
        auth = dict(scope["headers"]).get(b"authorization", b"")
        given = auth[7:] if auth[:7].lower() == b"bearer " else b""
        for key in keys:
            if hmac.compare_digest(given, key.encode()):
                return tenant_of(key)
        raise APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")

    async def _read_body(self, scope, receive) -> bytes:
        limit = self.state.config.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            raise _too_large(int(length), limit)
        parts, n, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise APIError(400, "client disconnected while sending the body")
            chunk = message.get("body", b"")
            n += len(chunk)
            if n > limit:
                raise _too_large(n, limit, partial=True)
            parts.append(chunk)
            more = message.get("more_body", False)
        return b"".join(parts)

    def _count(self, route: str, status: int) -> None:
        self.state.metrics.requests.labels(endpoint=route, status=str(status)).inc()


def check_json(body: bytes) -> None:
    """400 unless body is UTF-8 JSON with every string encodable as UTF-8, at most MAX_DEPTH deep."""
    try:
        doc = json.loads(body)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as e:            # JSONDecodeError and UnicodeDecodeError alike
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    stack = [(doc, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise _too_deep()
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for k, v in value.items():
                key = k.encode("utf-8", "backslashreplace").decode()     # printable in an error
                _check_text(k, path + (key,))
                stack.append((v, path + (key,), depth + 1))
        elif isinstance(value, list):
            stack.extend((v, path + (str(i),), depth + 1) for i, v in enumerate(value))


def _check_text(s: str, path: tuple) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        field = ".".join(path) or None
        raise APIError(400, f"invalid value for {field or 'body'}: a lone UTF-16 surrogate "
                            f"{s[e.start]!r} at character {e.start} is not valid Unicode text",
                       param=field, code="invalid_value") from None


def _too_deep() -> APIError:
    return APIError(400, f"JSON body is nested more than {MAX_DEPTH} levels deep", code="invalid_json")


def _too_large(n: int, limit: int, partial: bool = False) -> APIError:
    size = f"more than {limit}" if partial else str(n)
    return APIError(413, f"request body of {size} bytes is over the limit of {limit} bytes",
                    code="request_too_large")


def _render(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)
