"""Turns engine outputs into OpenAI responses: one JSON body, or server-sent event chunks."""
from __future__ import annotations

import asyncio
import json
import time

from everybyte.serve.async_engine import QueueFull, ShuttingDown
from everybyte.serve.protocol import APIError, now, usage
from everybyte.serve.tool_calls import parse_tool_calls, visible_prefix


class ResponseWriter:
    def __init__(self, state, object_: str, response_id: str, session_id: str | None, tools: bool = False,
                 cache_salt: str | None = None):
        self.state, self.object, self.id, self.session_id = state, object_, response_id, session_id
        self.tools, self.cache_salt = tools, cache_salt
        self.return_token_ids = False
        self.kv_transfer_params: dict | None = None
        self.chat = object_ == "chat.completion"
        self.model = state.config.model_name
        self.pending: list = []

    def admit(self, jobs) -> None:
        """Take every job's place in the engine queue before the response starts, so a full queue
        or a draining server is an HTTP status (429, 503), never an error inside a 200 stream."""
        try:
            self.pending = self.state.engine.submit(
                [(f"{self.id}-{i}", ids, params, self.session_id, self.cache_salt, self.kv_transfer_params)
                 for i, (ids, params) in enumerate(jobs)])
        except QueueFull as e:
            raise APIError(429, f"server busy: {e}; retry later", "rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"})
        except ShuttingDown as e:
            raise APIError(503, f"{e}; retry on another server", "server_error", code="shutting_down",
                           headers={"Retry-After": "1"})
        except ValueError as e:
            raise APIError(400, str(e), param="prompt")

    def release(self) -> None:
        """Abort whatever was admitted and did not finish (a response that never ran, a disconnect)."""
        for p in self.pending:
            self.state.engine.release(p)

    async def _outputs(self, ids, index: int):
        t0, last = time.monotonic(), None
        m = self.state.metrics
        m.prompt_tokens.inc(len(ids))
        try:
            async for out in self.state.engine.outputs(self.pending[index]):
                t = time.monotonic()
                n_new = len(out.token_ids) - (0 if last is None else len(last.token_ids))
                if last is None and out.token_ids:
                    m.ttft.observe(t - t0)
                elif n_new > 0:
                    m.itl.observe((t - self._t_last) / n_new)
                self._t_last = t
                m.generation_tokens.inc(max(n_new, 0))
                last = out
                yield out
        except ShuttingDown as e:
            raise APIError(503, str(e), "server_error", code="shutting_down")
        except ValueError as e:
            raise APIError(400, str(e))
        if last is not None and last.finished:
            m.e2e.observe(time.monotonic() - t0)
            m.finished.labels(finished_reason=last.finish_reason).inc()

    def _cached(self, out) -> int:
        return int(getattr(out, "num_cached_tokens", 0) or 0)

    def _logprobs(self, out, start: int = 0):
        if out.logprobs is None:
            return None
        tok = self.state.tokenizer
        entries = out.logprobs[start:]
        ids = out.token_ids[start:start + len(entries)]
        if self.chat:
            return {"content": [{"token": tok.decode([t], skip_special_tokens=False), "logprob": lp[t],
                                 "top_logprobs": [{"token": tok.decode([k], skip_special_tokens=False), "logprob": v}
                                                  for k, v in lp.items()]}
                                for t, lp in zip(ids, entries)]}
        return {"tokens": [tok.decode([t], skip_special_tokens=False) for t in ids],
                "token_logprobs": [lp[t] for t, lp in zip(ids, entries)],
                "top_logprobs": [{tok.decode([k], skip_special_tokens=False): v for k, v in lp.items()}
                                 for lp in entries]}

    async def complete(self, jobs, request):
        async def run(i, ids):
            last = None
            async for out in self._outputs(ids, i):
                last = out
            return last

        tasks = [asyncio.ensure_future(run(i, ids)) for i, (ids, _) in enumerate(jobs)]
        watcher = asyncio.ensure_future(_watch_disconnect(request, tasks))
        try:
            outs = await asyncio.gather(*tasks)
        finally:
            watcher.cancel()
            for t in tasks:
                t.cancel()
            self.release()
        choices, n_prompt, n_out, n_cached = [], 0, 0, 0
        for i, ((ids, _), out) in enumerate(zip(jobs, outs)):
            n_prompt, n_out, n_cached = n_prompt + len(ids), n_out + len(out.token_ids), n_cached + self._cached(out)
            if self.chat:
                content, calls = parse_tool_calls(out.text) if self.tools else (out.text, [])
                message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
                finish = "tool_calls" if calls else out.finish_reason
                self.state.after_turn(self.session_id, finish)
                choices.append({"index": i, "message": message, "logprobs": self._logprobs(out),
                                "finish_reason": finish})
            else:
                choices.append({"index": i, "text": out.text, "logprobs": self._logprobs(out),
                                "finish_reason": out.finish_reason})
            if self.return_token_ids:
                choices[-1]["token_ids"] = list(out.token_ids)
        body = {"id": self.id, "object": self.object, "created": now(), "model": self.model,
                "choices": choices, "usage": usage(n_prompt, n_out, n_cached)}
        if published := [o.kv_transfer_params for o in outs if getattr(o, "kv_transfer_params", None)]:
            body["kv_transfer_params"] = published[0]
        return body

    async def stream(self, job, stream_options, request):
        ids, _ = job
        include_usage = bool(stream_options and stream_options.include_usage)
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        created = now()

        def chunk(delta_or_text, finish_reason=None, logprobs=None, token_ids=None):
            if self.chat:
                choice = {"index": 0, "delta": delta_or_text, "logprobs": logprobs, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": delta_or_text, "logprobs": logprobs, "finish_reason": finish_reason}
            if self.return_token_ids and token_ids is not None:
                choice["token_ids"] = token_ids
            body = {"id": self.id, "object": obj, "created": created, "model": self.model, "choices": [choice]}
            if include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        sent_text, sent_tokens, last = "", 0, None
        try:
            if self.chat:
                yield chunk({"role": "assistant", "content": ""})
            async for out in self._outputs(ids, 0):
                last = out
                text = visible_prefix(out.text) if self.tools and not out.finished else out.text
                calls = []
                if self.tools and out.finished:
                    content, calls = parse_tool_calls(out.text)
                    text = (content or "") if calls else out.text
                delta = text[len(sent_text):] if text.startswith(sent_text) else ""
                if calls:
                    if delta:
                        yield chunk({"content": delta})
                    delta_calls = [{"index": k, **c} for k, c in enumerate(calls)]
                    self.state.after_turn(self.session_id, "tool_calls")
                    yield chunk({"tool_calls": delta_calls}, "tool_calls", None, out.token_ids[sent_tokens:])
                elif delta or out.finished:
                    lp = self._logprobs(out, sent_tokens)
                    if out.finished and self.chat:
                        self.state.after_turn(self.session_id, out.finish_reason)
                    yield chunk({"content": delta} if self.chat else delta, out.finish_reason, lp,
                                out.token_ids[sent_tokens:])
                    sent_text, sent_tokens = sent_text + delta, len(out.token_ids)
            if include_usage and last is not None:
                body = {"id": self.id, "object": obj, "created": created, "model": self.model, "choices": [],
                        "usage": usage(len(ids), len(last.token_ids), self._cached(last))}
                yield f"data: {json.dumps(body)}\n\n"
        except APIError as e:
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            self.release()
        yield "data: [DONE]\n\n"


async def _watch_disconnect(request, tasks):
    while True:
        await asyncio.sleep(0.25)
        if await request.is_disconnected():
            for t in tasks:
                t.cancel()
            return
