"""Replay target: any OpenAI-compatible server, over HTTP with streaming /v1/completions."""
from __future__ import annotations

import json
import time

import httpx

from everybyte.bench.replay.backend import EndpointError, GenRequest, GenResult, parse_prometheus, sample_from


class HttpBackend:
    kind = "endpoint"

    def __init__(self, url: str, model: str | None = None, api_key: str | None = None,
                 prompt_mode: str = "auto", timeout_s: float = 300.0, max_connections: int = 64,
                 temperature: float = 0.0):
        self.url = url.rstrip("/")
        if self.url.endswith("/v1"):
            self.url = self.url[:-3]
        self.model, self.prompt_mode, self.temperature = model, prompt_mode, temperature
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0),
                                        limits=httpx.Limits(max_connections=max_connections))
        self.info: dict = {"target": self.url}
        self.server_ids = False          # the server streams the generated ids (vLLM return_token_ids)
        self.tokenize = False            # the server offers /tokenize
        self.session_api: bool | None = None    # park/resume answered (None: not tried yet)
        self.everybyte = False
        self.vocab_size: int | None = None

    # ---- before the run -----------------------------------------------------------------------
    async def start(self) -> dict:
        try:
            r = await self.client.get(self.url + "/v1/models", headers=self.headers, timeout=10.0)
        except httpx.HTTPError as e:
            raise EndpointError(f"cannot reach endpoint {self.url}: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise EndpointError(f"endpoint {self.url}/v1/models answered HTTP {r.status_code}: {r.text[:300]}")
        models = r.json().get("data") or []
        if not self.model:
            if not models:
                raise EndpointError(f"endpoint {self.url} lists no models; pass --model")
            self.model = models[0]["id"]
        entry = next((m for m in models if m.get("id") == self.model), {})
        self.info.update(model=self.model, max_model_len=entry.get("max_model_len"),
                         owned_by=entry.get("owned_by"))
        sample = await self.sample()
        self.everybyte = bool(sample and sample.get("everybyte"))
        if self.prompt_mode in ("auto", "ids"):
            ok = await self._probe_ids()
            if not ok and self.prompt_mode == "ids":
                raise EndpointError(f"endpoint {self.url} does not accept token-id prompts on /v1/completions")
            self.prompt_mode = "ids" if ok else "text"
        self.tokenize = await self._probe_tokenize()
        self.info.update(prompt_mode=self.prompt_mode, server_returns_token_ids=self.server_ids,
                         tokenize_endpoint=self.tokenize, everybyte_metrics=self.everybyte)
        return self.info

    async def _probe_ids(self) -> bool:
        for extra in ({"return_token_ids": True}, {}):
            res = await self.generate(GenRequest("probe", "probe", [1000, 1001, 1002], None, 2, extra))
            if res.ok:
                self.server_ids = res.output_ids is not None and len(res.output_ids) == res.completion_tokens
                self.extra = extra if self.server_ids else {}
                return True
        return False

    async def _probe_tokenize(self) -> bool:
        try:
            return (await self.tokenize_text("hello world")) is not None
        except httpx.HTTPError:
            return False

    async def tokenize_text(self, text: str) -> list[int] | None:
        body = {"model": self.model, "prompt": text, "content": text, "add_special_tokens": False,
                "add_special": False}
        r = await self.client.post(self.url + "/tokenize", json=body, headers=self.headers)
        if r.status_code != 200:
            return None
        toks = r.json().get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
            return None
        return toks

    # ---- one turn -----------------------------------------------------------------------------
    async def generate(self, req: GenRequest) -> GenResult:
        body = {"model": self.model, "prompt": req.prompt_ids if req.prompt_ids is not None else req.prompt_text,
                "max_tokens": req.max_tokens, "ignore_eos": True, "temperature": self.temperature,
                "stream": True, "stream_options": {"include_usage": True}, "session_id": req.session_id,
                **getattr(self, "extra", {}), **(req.extra or {})}
        headers = {**self.headers, "X-Session-Id": req.session_id}
        res = GenResult(t_send=time.perf_counter())
        text, ids = [], []
        try:
            async with self.client.stream("POST", self.url + "/v1/completions", json=body, headers=headers) as r:
                res.status = r.status_code
                if r.status_code != 200:
                    raw = (await r.aread()).decode(errors="replace")
                    return res.fail(f"HTTP {r.status_code}: {_message(raw)}", time.perf_counter())
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if "error" in chunk:
                        return res.fail(f"stream error: {_message(json.dumps(chunk))}", now)
                    for choice in chunk.get("choices") or []:
                        piece, tids = choice.get("text") or "", choice.get("token_ids")
                        if piece or tids:
                            res.token_times.append(now)
                        text.append(piece)
                        if isinstance(tids, list):
                            ids.extend(tids)
                        res.finish_reason = choice.get("finish_reason") or res.finish_reason
                    usage = chunk.get("usage")
                    if usage:
                        res.prompt_tokens = usage.get("prompt_tokens")
                        res.completion_tokens = usage.get("completion_tokens") or 0
                        details = usage.get("prompt_tokens_details") or {}
                        res.cached_tokens = details.get("cached_tokens")
        except (httpx.HTTPError, json.JSONDecodeError, ValueError) as e:
            return res.fail(f"{type(e).__name__}: {e}", time.perf_counter())
        res.t_end = time.perf_counter()
        res.output_text = "".join(text)
        res.output_ids = ids if ids else None
        if not res.completion_tokens:
            res.completion_tokens = len(ids) if ids else len(res.token_times)
        if not res.token_times:
            return res.fail("the stream ended without any output", res.t_end)
        res.ok = True
        return res

    # ---- sessions and metrics -----------------------------------------------------------------
    async def session_call(self, session_id: str, action: str, body: dict | None = None) -> str:
        """POST /v1/sessions/{id}/park|resume: 'ok', 'unsupported' (no such route) or 'error: ...'."""
        if self.session_api is False:
            return "unsupported"
        try:
            r = await self.client.post(f"{self.url}/v1/sessions/{session_id}/{action}", headers=self.headers,
                                       json=body or {})
        except httpx.HTTPError as e:
            return f"error: {type(e).__name__}: {e}"
        no_route = r.status_code in (405, 501) or (r.status_code == 404 and "session" not in _message(r.text).lower())
        if no_route and not self.session_api:
            self.session_api = False
            return "unsupported"
        if r.status_code >= 400:
            return f"error: HTTP {r.status_code}: {_message(r.text)}"
        self.session_api = True
        return "ok"

    async def sample(self) -> dict | None:
        try:
            r = await self.client.get(self.url + "/metrics", headers=self.headers, timeout=5.0)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        return sample_from(parse_prometheus(r.text))

    async def close(self) -> None:
        await self.client.aclose()


def _message(raw: str) -> str:
    try:
        doc = json.loads(raw)
        err = doc.get("error") or doc.get("detail")
        if isinstance(err, dict):
            return str(err.get("message"))[:300]
        if err:
            return str(err)[:300]
    except (ValueError, AttributeError):
        pass
    return raw.strip()[:300]
