"""The OpenAI-compatible HTTP API: routes, input checks and error rendering."""
from __future__ import annotations


from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from everybyte.engine.sampling_params import SamplingParams
from everybyte.serve.async_engine import QueueFull
from everybyte.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      TokenizeRequest, new_id)
from everybyte.serve.streams import ResponseWriter
from everybyte.serve.state import ServerConfig, ServerState


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="everybyte", version="0.1.0")
    app.state.eb = state
    cfg = state.config

    app.add_middleware(Guard, state=state)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        if err.get("type") == "json_invalid":
            return _error(APIError(400, f"malformed JSON body: {err.get('msg', '')}", param=None,
                                   code="invalid_json"))
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        return _error(APIError(400, f"invalid value for {param or 'body'}: {err.get('msg', 'invalid')}",
                               param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        return _error(APIError(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500
                               else "server_error"))

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception):
        return _error(APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))

    @app.get("/health")
    async def health():
        if state.engine.error is not None:
            return JSONResponse({"status": "error", "error": repr(state.engine.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        stats = await state.engine.call(lambda e: e.stats()) if state.engine.error is None else {}
        return Response(state.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": state.started,
                                            "owned_by": "everybyte", "max_model_len": cfg.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        _check_model(cfg, body.model)
        prompts = _completion_prompts(state, body.prompt)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if len(prompts) > 1 and body.stream:
            raise APIError(400, "streaming supports a single prompt", param="prompt")
        session = body.session_id or request.headers.get("x-session-id")
        jobs = [(ids, _params(state, body, ids, body.logprobs, default_max=16)) for ids in prompts]
        writer = ResponseWriter(state, "text_completion", new_id("cmpl"), session)
        writer.return_token_ids = body.return_token_ids
        if body.stream:
            return _sse(state, writer.stream(jobs[0], body.stream_options, request))
        return await writer.complete(jobs, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        _check_model(cfg, body.model)
        messages = [{"role": m.role, "content": m.text(), **({"tool_calls": m.tool_calls} if m.tool_calls else {})}
                    for m in body.messages]
        try:
            text = state.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:
            raise APIError(400, f"could not apply the chat template: {e}", param="messages")
        ids = state.tokenizer.encode(text, add_special_tokens=False)
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        n_lp = (body.top_logprobs or 0) if body.logprobs else None
        session = body.session_id or request.headers.get("x-session-id")
        job = (ids, _params(state, body, ids, n_lp, default_max=None))
        writer = ResponseWriter(state, "chat.completion", new_id("chatcmpl"), session, tools=bool(body.tools))
        writer.return_token_ids = body.return_token_ids
        if body.stream:
            return _sse(state, writer.stream(job, body.stream_options, request))
        return await writer.complete([job], request)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        _check_model(cfg, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            text = state.tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages])
            ids = state.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": cfg.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _check_model(cfg, body.model)
        bad = [t for t in body.tokens if not 0 <= t < cfg.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})", param="tokens")
        return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @app.post("/v1/sessions/{session_id}/park")
    async def park(session_id: str, request: Request):
        gap = None
        if await request.body():
            try:
                gap = (await request.json()).get("expected_gap_s")
            except (ValueError, AttributeError):
                raise APIError(400, "body must be a JSON object like {\"expected_gap_s\": 30}", param=None)
            if gap is not None and (not isinstance(gap, (int, float)) or gap < 0):
                raise APIError(400, f"expected_gap_s must be a number >= 0, got {gap!r}", param="expected_gap_s")
        return await _session_call(state, session_id, lambda e: e.park(session_id, expected_gap_s=gap))

    @app.post("/v1/sessions/{session_id}/resume")
    async def resume(session_id: str):
        return await _session_call(state, session_id, lambda e: e.resume(session_id))

    @app.delete("/v1/sessions/{session_id}")
    async def drop(session_id: str):
        return await _session_call(state, session_id, lambda e: e.drop(session_id), deleted=True)

    @app.get("/v1/sessions/{session_id}")
    async def session_info(session_id: str):
        return await _session_call(state, session_id, lambda e: e.session_info(session_id))

    return app


async def _session_call(state: ServerState, session_id: str, fn, deleted: bool = False) -> dict:
    try:
        await state.engine.call(fn)
        info = {"deleted": True} if deleted else await state.engine.call(lambda e: e.session_info(session_id))
    except KeyError:
        raise APIError(404, f"session {session_id!r} does not exist", param="session_id",
                       code="session_not_found")
    return {"id": session_id, "object": "session", **info}


class Guard:
    """Plain ASGI middleware (no per-chunk cost on streams): API key, body size limit, and the
    request counter by endpoint and status."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cfg, path = self.state.config, scope["path"]
        headers = dict(scope["headers"])
        error = None
        if cfg.api_key and path.startswith("/v1/") and \
                headers.get(b"authorization", b"") != f"Bearer {cfg.api_key}".encode():
            error = APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
        length = headers.get(b"content-length", b"")
        if error is None and length.isdigit() and int(length) > cfg.max_body_bytes:
            error = APIError(413, f"request body of {int(length)} bytes is over the limit of "
                                  f"{cfg.max_body_bytes} bytes", code="request_too_large")
        if error is not None:
            _count(self.state, path, error.status)
            return await _error(error)(scope, receive, send)

        async def send_counted(message):
            if message["type"] == "http.response.start":
                _count(self.state, path, message["status"])
            await send(message)

        await self.app(scope, receive, send_counted)


def _count(state: ServerState, endpoint: str, status: int) -> None:
    if endpoint.startswith("/v1/"):
        state.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _sse(state: ServerState, gen) -> StreamingResponse:
    try:
        state.engine.check_capacity()
    except QueueFull as e:
        raise APIError(429, f"server busy: {e}; retry later", "rate_limit_error", code="queue_full",
                       headers={"Retry-After": "1"})
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _check_model(cfg: ServerConfig, model: str | None) -> None:
    if model is not None and model not in (cfg.model_name, "default"):
        raise APIError(404, f"model {model!r} does not exist; this server serves {cfg.model_name!r}",
                       param="model", code="model_not_found")


def _completion_prompts(state: ServerState, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    out = []
    vocab = state.config.vocab_size
    for p in prompt:
        ids = state.tokenizer.encode(p) if isinstance(p, str) else list(p)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
        out.append(ids)
    if not out or any(not ids for ids in out):
        raise APIError(400, "prompt must not be empty", param="prompt")
    return out


def _params(state: ServerState, body, ids: list[int], logprobs, default_max) -> SamplingParams:
    limit = state.config.max_model_len
    if len(ids) >= limit:
        raise APIError(400, f"prompt has {len(ids)} tokens; this model's context is {limit} tokens "
                            f"(at least one must remain for the output)", param="prompt",
                       code="context_length_exceeded")
    remaining = limit - len(ids)
    max_tokens = body.max_tokens if body.max_tokens is not None else min(default_max or remaining, remaining)
    if max_tokens > remaining:
        raise APIError(400, f"max_tokens={max_tokens} is over the remaining context: the prompt has "
                            f"{len(ids)} tokens and the context is {limit} tokens, so at most {remaining}",
                       param="max_tokens", code="context_length_exceeded")
    try:
        return SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                              min_p=body.min_p, repetition_penalty=body.repetition_penalty, seed=body.seed, max_tokens=max_tokens, stop=body.stop,
                              stop_token_ids=body.stop_token_ids or [], ignore_eos=body.ignore_eos,
                              logprobs=logprobs)
    except ValueError as e:
        raise APIError(400, str(e), param=str(e).split()[0])
