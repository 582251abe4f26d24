"""Subscribing to one worker's KV events (serve/kv_events_pub): in order, without gaps, or told so.

A Subscriber runs a thread with a ZeroMQ SUB socket on the worker's events and a DEALER on its
replay socket. Batches reach `on_batch(WorkerBatch)` in sequence order. A gap (a lost or late
message) is filled by a replay from the last delivered seq + 1; when the worker's buffer no
longer holds those batches, or the replay fails, `on_reset()` tells the caller to drop what it
knows of that worker and it goes on from the oldest batch it can get. A sequence number that goes
backwards means the worker restarted: `on_reset()`, then its batches from 0 (the first is an
AllBlocksCleared). Callbacks run on the subscriber's thread.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

import msgspec
import zmq

from everybyte.kv.events import KVEvent
from everybyte.kv.events_wire import END_SEQ, WireBatch
from everybyte.kv.events_wire import decode_batch as _decode

log = logging.getLogger("everybyte.cluster.kv_events")


@dataclass
class WorkerBatch:
    seq: int
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None
    replayed: bool = False


def decode_batch(payload: bytes) -> WireBatch:
    """One PUB payload (vLLM's KVEventBatch msgpack) as kv/events dataclasses; raises
    msgspec.DecodeError / ValidationError on anything else."""
    return _decode(payload)


class Subscriber:
    def __init__(self, endpoint: str, replay_endpoint: str | None, on_batch: Callable[[WorkerBatch], None],
                 on_reset: Callable[[], None] = lambda: None, topic: bytes = b"kv.",
                 replay_timeout_s: float = 2.0):
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.on_batch, self.on_reset, self.replay_timeout_s = on_batch, on_reset, replay_timeout_s
        self.last_seq: int | None = None          # last delivered
        self._last_live: int | None = None        # last received on the SUB socket
        self.stats = {"batches": 0, "replayed": 0, "gaps": 0, "resets": 0, "restarts": 0, "bad": 0}
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self._thread = threading.Thread(target=self._run, name="everybyte-kv-sub", daemon=True)

    def start(self) -> "Subscriber":
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    # ---- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self._bad(f"a message of {len(frames)} frames")
                    continue
                self._live(int.from_bytes(frames[1], "big", signed=True), frames[2])
        except Exception:
            log.exception("KV event subscriber for %s stopped", self.endpoint)
        finally:
            sub.close()

    def _live(self, seq: int, payload: bytes) -> None:
        if self._last_live is not None and seq <= self._last_live:     # the worker restarted
            self.stats["restarts"] += 1
            self._reset()
            self.last_seq = None
        self._last_live = seq
        expected = 0 if self.last_seq is None else self.last_seq + 1
        if seq < expected:
            return                                  # already delivered by a replay
        if seq > expected:
            self.stats["gaps"] += 1
            self._catch_up(expected, seq)
            if self.last_seq is not None and seq <= self.last_seq:
                return
        self._deliver(seq, payload, replayed=False)

    def _catch_up(self, start: int, live_seq: int) -> None:
        got = self._replay(start)
        if got is None or not got or got[0][0] != start:
            if got:
                log.warning("KV events from %s: batches %d.. are gone from the worker's buffer; "
                            "resyncing", self.endpoint, start)
            self._reset()
            self.last_seq = (got[0][0] - 1) if got else live_seq - 1
        for seq, payload in got or []:
            if self.last_seq is None or seq == self.last_seq + 1:
                self._deliver(seq, payload, replayed=True)

    def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The worker's buffered batches from `start` on, None when there is no answer."""
        if not self.replay_endpoint:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        out: list[tuple[int, bytes]] = []
        try:
            dealer.send(start.to_bytes(8, "big", signed=True))
            while dealer.poll(int(self.replay_timeout_s * 1000)):
                frames = dealer.recv_multipart()
                if len(frames) < 2 or frames[-2] == END_SEQ:
                    return out
                out.append((int.from_bytes(frames[-2], "big", signed=True), frames[-1]))
            log.warning("KV events: no replay answer from %s", self.replay_endpoint)
            return None
        finally:
            dealer.close()

    def _deliver(self, seq: int, payload: bytes, replayed: bool) -> None:
        self.last_seq = seq
        try:
            b = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._bad(f"batch {seq}: {e}")          # its events are unknown: start over
            self._reset()
            return
        self.stats["batches"] += 1
        self.stats["replayed"] += replayed
        try:
            self.on_batch(WorkerBatch(seq, b.ts, b.events, b.data_parallel_rank, replayed))
        except Exception:
            log.exception("on_batch failed for batch %d from %s", seq, self.endpoint)

    def _reset(self) -> None:
        self.stats["resets"] += 1
        try:
            self.on_reset()
        except Exception:
            log.exception("on_reset failed")

    def _bad(self, what: str) -> None:
        self.stats["bad"] += 1
        log.warning("KV events from %s: ignoring %s", self.endpoint, what)
