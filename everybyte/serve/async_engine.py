"""Runs the engine loop in a background thread and hands results to asyncio streams.

The HTTP event loop never blocks on a model step: requests and aborts cross into the
engine thread through a lock-protected inbox, and each step's outputs come back to the
request's asyncio queue with call_soon_threadsafe.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from everybyte.engine.outputs import RequestOutput
from everybyte.engine.sampling_params import SamplingParams

log = logging.getLogger("everybyte.serve")


class QueueFull(Exception):
    pass


class ShuttingDown(Exception):
    """The server is draining: no new requests, and at the deadline the rest are cut."""


@dataclass
class _Pending:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    session_id: str | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict | None = None
    done: bool = False


class AsyncEngine:
    WRITE_WAIT_S = 2.0

    def __init__(self, engine, max_queue: int = 256):
        self.engine = engine
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[_Pending] = []
        self._aborts: list[str] = []
        self._calls: list[tuple] = []
        self._streams: dict[str, _Pending] = {}
        self._stopping = False
        self._exited = False
        self.deadline: float | None = None     # monotonic time at which draining cuts what is left
        self.error: BaseException | None = None
        self.on_step: Callable[[], None] | None = None    # after each loop turn, on the engine thread
        self._thread = threading.Thread(target=self._run, name="everybyte-engine", daemon=True)
        self._thread.start()

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._streams) + len(self._inbox)

    def submit(self, jobs: list[tuple]) -> list[_Pending]:
        """Admit requests (request_id, prompt_token_ids, params, session_id, cache_salt[,
        kv_transfer_params]), all or none, before any response starts: QueueFull past max_queue,
        ShuttingDown while draining."""
        if self.error is not None:
            raise RuntimeError(f"engine loop stopped: {self.error!r}")
        if len(jobs) > self.max_queue:
            raise ValueError(f"{len(jobs)} prompts in one request; at most {self.max_queue} (--max-queue)")
        loop = asyncio.get_running_loop()
        ps = [_Pending(rid, ids, params, asyncio.Queue(), loop, sid, salt, *kv) for rid, ids, params, sid, salt, *kv in jobs]
        with self._lock:
            if self._stopping or self.deadline is not None:
                raise ShuttingDown("server is shutting down")
            if len(self._streams) + len(self._inbox) + len(ps) > self.max_queue:
                raise QueueFull(f"{self.max_queue} requests already in flight")
            self._inbox.extend(ps)
        self._wake.set()
        return ps

    async def outputs(self, p: _Pending):
        """Yields an admitted request's cumulative RequestOutputs; the last has finish_reason set.
        Leaving early (a disconnect, an error) aborts it."""
        try:
            while True:
                item = await p.queue.get()
                while not isinstance(item, BaseException) and not item.finished and not p.queue.empty():
                    item = p.queue.get_nowait()    # behind: outputs are cumulative, the newest covers all
                if isinstance(item, BaseException):
                    p.done = True
                    raise item
                if item.finished:
                    await self._shared_writes()
                yield item
                if item.finished:
                    p.done = True
                    return
        finally:
            self.release(p)

    async def _shared_writes(self) -> None:
        """A request's last output waits (bounded) for the write-through of its blocks to the
        pod-shared tier, so once a worker answered, any worker of the pod can reuse its prefix."""
        futures = getattr(self.engine, "pending_writes", list)()
        if futures:
            done, _ = await asyncio.wait([asyncio.wrap_future(f) for f in futures], timeout=self.WRITE_WAIT_S)
            for f in done:
                f.exception()              # a failed put is logged by the tier; retrieved here

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       session_id: str | None = None, cache_salt: str | None = None):
        (p,) = self.submit([(request_id, prompt_token_ids, params, session_id, cache_salt)])
        async for out in self.outputs(p):
            yield out

    def release(self, p: _Pending) -> None:
        """Abort an admitted request unless it finished (idempotent)."""
        if not p.done:
            p.done = True
            self.abort(p.request_id)

    async def call(self, fn):
        """Run fn(engine) on the engine thread between steps; returns its result or raises."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            if self._exited:
                raise ShuttingDown("the engine loop has stopped")
            self._calls.append((fn, fut, loop))
        self._wake.set()
        return await fut

    def call_soon(self, fn) -> None:
        """Fire-and-forget fn(engine) on the engine thread (errors are logged)."""
        with self._lock:
            self._calls.append((fn, None, None))
        self._wake.set()

    def park(self, session_id: str) -> None:
        self.call_soon(lambda e: e.park(session_id))

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    def begin_shutdown(self, timeout: float) -> None:
        """Start draining: refuse new requests; what is still running `timeout` s from now is cut.
        Safe to call from a signal handler (it takes no lock); the first call sets the deadline."""
        if self.deadline is None:
            self.deadline = time.monotonic() + timeout

    def shutdown(self, timeout: float = 30.0) -> None:
        """Drains (see begin_shutdown; an earlier deadline stands) and stops the loop."""
        self.begin_shutdown(timeout)
        self._wake.set()
        self._thread.join(max(self.deadline - time.monotonic(), 0.0) + 5.0)

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            calls, self._calls = self._calls, []
        for fn, fut, loop in calls:
            try:
                result, error = fn(self.engine), None
            except Exception as e:
                result, error = None, e
                if fut is None:
                    log.warning("engine call failed: %r", e)
            if fut is not None:
                loop.call_soon_threadsafe(_settle, fut, result, error)
        for p in inbox:
            try:
                self.engine.add_request(p.prompt_token_ids, p.params, request_id=p.request_id,
                                        session_id=p.session_id, cache_salt=p.cache_salt,
                                        **({"kv_transfer_params": p.kv_transfer_params} if p.kv_transfer_params else {}))
                self._streams[p.request_id] = p
            except Exception as e:  # bad input that slipped past the API checks
                p.loop.call_soon_threadsafe(p.queue.put_nowait, e)
        for rid in aborts:
            if rid in self._streams:
                self.engine.abort(rid)
                self._streams.pop(rid, None)

    def _deliver(self, out: RequestOutput) -> None:
        p = self._streams.get(out.request_id)
        if p is None:
            return
        if out.finished:
            self._streams.pop(out.request_id, None)
        p.loop.call_soon_threadsafe(p.queue.put_nowait, out)

    def _exit(self) -> None:
        """The loop stops: calls that can no longer run are answered ShuttingDown."""
        with self._lock:
            self._exited = True
            calls, self._calls = self._calls, []
        for _, fut, loop in calls:
            if fut is not None:
                loop.call_soon_threadsafe(_settle, fut, None, ShuttingDown("the engine loop has stopped"))

    def _cut_at_deadline(self) -> None:
        """Past the drain deadline: abort every request left and tell its client so."""
        with self._lock:
            cut = list(self._streams.values()) + self._inbox
            self._streams, self._inbox = {}, []
        for p in cut:
            if p.request_id in self.engine.requests:
                self.engine.abort(p.request_id)
            p.loop.call_soon_threadsafe(p.queue.put_nowait, ShuttingDown(
                "server shut down: the request was cut at the drain deadline"))
        if cut:
            log.warning("drain deadline passed: cut %d requests", len(cut))

    def _after_step(self) -> None:
        if self.on_step is not None:
            try:
                self.on_step()
            except Exception:         # a feed that fails must not stop serving
                log.exception("after-step hook failed")

    def _run(self) -> None:
        try:
            while True:
                if self.deadline is not None:
                    self._stopping = True
                    if time.monotonic() >= self.deadline:
                        self._cut_at_deadline()
                self._drain_inbox()
                self._after_step()
                if not self.engine.has_unfinished_requests() and not self.engine.has_pending_loads():
                    if self._stopping and not self._inbox:
                        return self._exit()
                    self._wake.wait(0.1)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out)
        except BaseException as e:  # surface to every waiting client instead of hanging them
            log.exception("engine loop failed")
            self.error = e
            with self._lock:
                streams = list(self._streams.values()) + self._inbox
            for p in streams:
                p.loop.call_soon_threadsafe(p.queue.put_nowait, RuntimeError(f"engine failed: {e!r}"))


def _settle(fut: asyncio.Future, result, error) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
