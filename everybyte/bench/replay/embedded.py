"""Replay target: the everybyte engine in this process (no HTTP), stepped on its own thread.

Turns go in through a queue; the engine thread adds them, steps while anything is unfinished, and
hands each request's tokens back to the event loop with the time they appeared. The generated
token ids are exact, so the model's own output joins the next turn's context without a round trip.
"""
from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time

from everybyte.bench.replay.backend import EndpointError, GenRequest, GenResult


class EmbeddedBackend:
    kind = "embedded"

    def __init__(self, model: str | None = None, temperature: float = 0.0, **engine_kwargs):
        self.model_arg, self.temperature, self.engine_kwargs = model, temperature, engine_kwargs
        self.engine = None
        self.inbox: queue.Queue = queue.Queue()
        self.pending: dict[str, tuple] = {}       # request id -> (loop, future, GenResult)
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.prompt_mode, self.server_ids, self.tokenize, self.session_api = "ids", True, False, False
        self.takes_session = False
        self.vocab_size: int | None = None
        self.info: dict = {}

    async def start(self) -> dict:
        from everybyte import LLM

        try:
            self.engine = await asyncio.to_thread(LLM, self.model_arg, **self.engine_kwargs)
        except (ValueError, RuntimeError, OSError) as e:
            raise EndpointError(f"cannot start the embedded engine: {e}") from e
        e = self.engine
        self.vocab_size = e.model_config.vocab_size
        self.takes_session = "session_id" in inspect.signature(e.add_request).parameters
        self.session_api = hasattr(e, "park") and hasattr(e, "resume")
        self.thread = threading.Thread(target=self._loop, name="everybyte-bench-engine", daemon=True)
        self.thread.start()
        self.info = {"target": "embedded", "model": e.model_config.model_id, "max_model_len": e.max_model_len,
                     "vocab_size": self.vocab_size, "prompt_mode": "ids", "server_returns_token_ids": True,
                     "kv_budget_bytes": int(e.config.kv_cache_bytes),
                     "engine_config": {k: str(v) for k, v in vars(e.config).items()}}
        return self.info

    # ---- engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        from everybyte import SamplingParams

        e = self.engine
        while True:
            try:
                item = self.inbox.get(timeout=0.05) if not e.has_unfinished_requests() else self.inbox.get_nowait()
            except queue.Empty:
                item = False
            if item is None:
                return
            if item and item[0] == "call":
                _, fn, loop, fut = item
                try:
                    result = ("ok", fn(e))
                except Exception as ex:
                    result = ("error", f"{type(ex).__name__}: {ex}")
                loop.call_soon_threadsafe(_resolve, fut, result)
                continue
            if item:
                req, loop, fut = item
                res = GenResult(t_send=time.perf_counter())
                try:
                    params = SamplingParams(max_tokens=req.max_tokens, ignore_eos=True, temperature=self.temperature)
                    extra = {"session_id": req.session_id} if self.takes_session else {}
                    e.add_request(req.prompt_ids, params, request_id=req.request_id, **extra)
                    self.pending[req.request_id] = (loop, fut, res)
                except Exception as ex:       # a bad prompt: an error of this turn only
                    loop.call_soon_threadsafe(_resolve, fut, res.fail(f"{type(ex).__name__}: {ex}", time.perf_counter()))
                continue
            if not e.has_unfinished_requests():
                continue
            try:
                outputs = e.step()
            except Exception as ex:           # the engine broke: every request in flight fails
                self.error = ex
                now = time.perf_counter()
                for rid, (loop, fut, res) in list(self.pending.items()):
                    e.abort(rid)
                    loop.call_soon_threadsafe(_resolve, fut, res.fail(f"engine error: {type(ex).__name__}: {ex}", now))
                self.pending.clear()
                continue
            now = time.perf_counter()
            for out in outputs:
                entry = self.pending.get(out.request_id)
                if entry is None:
                    continue
                loop, fut, res = entry
                n_new = len(out.token_ids) - len(res.output_ids or [])
                res.token_times.extend([now] * max(0, n_new))
                res.output_ids = list(out.token_ids)
                if out.finished:
                    del self.pending[out.request_id]
                    res.t_end, res.ok = now, out.finish_reason != "abort"
                    res.output_text, res.finish_reason = out.text, out.finish_reason
                    res.prompt_tokens, res.completion_tokens = len(out.prompt_token_ids), len(out.token_ids)
                    cached = getattr(out, "num_cached_tokens", None)
                    res.cached_tokens = int(cached) if cached is not None else None
                    if not res.ok:
                        res.error = "aborted by the engine"
                    loop.call_soon_threadsafe(_resolve, fut, res)

    # ---- the driver's side --------------------------------------------------------------------
    async def generate(self, req: GenRequest) -> GenResult:
        if self.error is not None:
            return GenResult(t_send=time.perf_counter()).fail(f"engine error: {self.error!r}", time.perf_counter())
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.inbox.put((req, loop, fut))
        return await fut

    async def session_call(self, session_id: str, action: str, body: dict | None = None) -> str:
        """engine.park(id) / engine.resume(id) on the engine thread, where the engine has them."""
        if not self.session_api:
            return "unsupported"
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.inbox.put(("call", lambda e: getattr(e, action)(session_id, **(body or {})), loop, fut))
        status, detail = await fut
        return "ok" if status == "ok" else f"error: {detail}"

    async def tokenize_text(self, text: str) -> list[int] | None:
        return self.engine.tokenizer.encode(text) if self.engine else None

    async def sample(self) -> dict | None:
        if self.engine is None:
            return None
        try:
            s = dict(self.engine.stats())
        except Exception:                     # read while the engine thread steps: skip this sample
            return None
        hits, queries = s.get("prefix_cache_hits"), s.get("prefix_cache_queries")
        return {"everybyte": True, "g1_bytes": dict((s.get("memory") or {}).get("g1") or {}),
                "kv_usage": s.get("kv_usage"), "running": s.get("num_running"), "waiting": s.get("num_waiting"),
                "prefix_cache_queries": queries, "prefix_cache_hits": hits,
                "kv_budget_bytes": self.info.get("kv_budget_bytes")}

    async def close(self) -> None:
        if self.thread is not None:
            self.inbox.put(None)
            await asyncio.to_thread(self.thread.join, 10.0)


def _resolve(fut: asyncio.Future, res: GenResult) -> None:
    if not fut.done():
        fut.set_result(res)
