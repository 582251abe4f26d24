"""The OpenAI-compatible HTTP API: routes, input checks and error rendering."""
from __future__ import annotations

import logging
from typing import Optional

from fastapi import FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from everybyte.engine.sampling_params import SamplingParams
from everybyte.kv.connector import transfer_kind
from everybyte.serve.async_engine import ShuttingDown
from everybyte.serve.guard import Guard
from everybyte.serve.kv_info import kv_info
from everybyte.serve.protocol import (
    MAX_SESSION_ID,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ParkRequest,
    TokenizeRequest,
    new_id,
)
from everybyte.serve.state import ServerConfig, ServerState
from everybyte.serve.streams import ResponseWriter

log = logging.getLogger("everybyte.serve")
SessionPath = Path(min_length=1, max_length=MAX_SESSION_ID)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="everybyte", version="0.1.0")
    app.state.eb = state
    cfg = state.config

    app.add_middleware(Guard, state=state, routes=app.router.routes)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        if err.get("type") == "json_invalid":
            return _error(APIError(400, f"malformed JSON body: {err.get('msg', '')}", param=None,
                                   code="invalid_json"))
        loc = [str(x) for x in err.get("loc", ())][1:]     # past "body", "path", "query" or "header"
        param = ".".join(loc) or None
        return _error(APIError(400, f"invalid value for {param or 'body'}: {err.get('msg', 'invalid')}",
                               param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        return _error(APIError(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500
                               else "server_error"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.error("internal error on %s %s", request.method, request.url.path, exc_info=e)
        return _error(APIError(500, "internal server error (logged on the server)", "server_error"))

    @app.get("/health")
    async def health():
        if state.engine.error is not None:
            return JSONResponse({"status": "error", "error": repr(state.engine.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        try:
            stats = await state.engine.call(lambda e: e.stats()) if state.engine.error is None else {}
        except ShuttingDown:
            stats = {}
        return Response(state.metrics.render(stats), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/kv/info")
    async def kv_info_route():
        return kv_info(state)

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
        jobs = [(ids, _params(state, body, ids, body.logprobs, default_max=16)) for ids in prompts]
        writer = _writer(state, request, body, "text_completion", new_id("cmpl"))
        writer.admit(jobs)
        if body.stream:
            return _sse(writer, writer.stream(jobs[0], body.stream_options, request))
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
        job = (ids, _params(state, body, ids, n_lp, default_max=None))
        writer = _writer(state, request, body, "chat.completion", new_id("chatcmpl"), tools=bool(body.tools))
        writer.admit([job])
        if body.stream:
            return _sse(writer, writer.stream(job, body.stream_options, request))
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
    async def park(request: Request, body: Optional[ParkRequest] = None, session_id: str = SessionPath):
        gap = body.expected_gap_s if body is not None else None
        sid = _internal_session(state, request, session_id)
        return await _session_call(state, session_id, sid, lambda e: e.park(sid, expected_gap_s=gap))

    @app.post("/v1/sessions/{session_id}/resume")
    async def resume(request: Request, session_id: str = SessionPath):
        sid = _internal_session(state, request, session_id)
        return await _session_call(state, session_id, sid, lambda e: e.resume(sid))

    @app.delete("/v1/sessions/{session_id}")
    async def drop(request: Request, session_id: str = SessionPath):
        sid = _internal_session(state, request, session_id)
        return await _session_call(state, session_id, sid, lambda e: e.drop(sid), deleted=True)

    @app.get("/v1/sessions/{session_id}")
    async def session_info(request: Request, session_id: str = SessionPath):
        sid = _internal_session(state, request, session_id)
        return await _session_call(state, session_id, sid, lambda e: e.session_info(sid))

    return app


async def _session_call(state: ServerState, client_id: str, sid: str, fn, deleted: bool = False) -> dict:
    try:
        await state.engine.call(fn)
        info = {"deleted": True} if deleted else await state.engine.call(lambda e: e.session_info(sid))
    except KeyError:
        raise APIError(404, f"session {client_id!r} does not exist", param="session_id",
                       code="session_not_found")
    except ValueError as e:
        raise APIError(400, str(e), param=str(e).split()[0])
    except ShuttingDown as e:
        raise APIError(503, str(e), "server_error", code="shutting_down")
    return {"id": client_id, "object": "session", **info}


def _tenant(request: Request) -> str | None:
    return request.scope.get("state", {}).get("tenant")


def _internal_session(state: ServerState, request: Request, session_id: str | None) -> str | None:
    """The engine's name for a client's session: with --cache-salt-from-api-key, inside its
    tenant's namespace, so one tenant can neither reach nor collide with another's sessions."""
    tenant = _tenant(request) if state.config.cache_salt_from_api_key else None
    return session_id if session_id is None or tenant is None else f"{tenant}/{session_id}"


def _writer(state: ServerState, request: Request, body, object_: str, response_id: str,
            tools: bool = False) -> ResponseWriter:
    header = request.headers.get("x-session-id")
    if header is not None and not 1 <= len(header) <= MAX_SESSION_ID:
        raise APIError(400, f"X-Session-Id must be 1 to {MAX_SESSION_ID} characters, got {len(header)}",
                       param="X-Session-Id")
    session = _internal_session(state, request, body.session_id or header)
    salt = body.cache_salt
    tenant = _tenant(request) if state.config.cache_salt_from_api_key else None
    if tenant is not None:                    # a tenant's own salts live under its key's hash
        salt = tenant if salt is None else f"{tenant}/{salt}"
    writer = ResponseWriter(state, object_, response_id, session, tools=tools, cache_salt=salt)
    writer.return_token_ids = body.return_token_ids
    writer.kv_transfer_params = _transfer_params(state.config, body)
    return writer


def _transfer_params(cfg: ServerConfig, body) -> dict | None:
    """The body's kv_transfer_params if this worker can do what they ask (else a 400)."""
    params = body.kv_transfer_params
    try:
        kind = transfer_kind(params)
    except ValueError as e:
        raise APIError(400, str(e), param="kv_transfer_params")
    if kind == "decode":
        if cfg.kv_connector is None:
            raise APIError(400, f"do_remote_decode: this worker ({cfg.role}) serves no KV; start it with "
                                "--role prefill or --kv-connector", param="kv_transfer_params")
        if body.stream or (isinstance(getattr(body, "prompt", None), list) and body.prompt
                           and not isinstance(body.prompt[0], int) and len(body.prompt) > 1):
            raise APIError(400, "do_remote_decode takes one prompt and stream=false", param="kv_transfer_params")
    if kind == "prefill" and cfg.role == "prefill":
        raise APIError(400, "do_remote_prefill: this worker's role is prefill", param="kv_transfer_params")
    return params if kind else None


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def _sse(writer: ResponseWriter, gen) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", background=BackgroundTask(writer.release),
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
