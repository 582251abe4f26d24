"""The router's KV event feed: one ZeroMQ SUB thread per worker (cluster contract §2).

Frames are [topic, seq (8 bytes, big-endian), payload], the payload vLLM's KVEventBatch msgpack
([ts, events, data_parallel_rank], events tagged arrays). Batches reach `on_batch(worker, events,
ts)` in order as kv/events dataclasses. A gap is filled by a replay from the worker's ROUTER
socket (request: start seq as 8 bytes; answer: [seq, payload] frames, then seq -1); when the
replay cannot fill it, or seq goes backwards (a restart), `on_reset(worker)` drops what the router
knew and the feed goes on. The events helper's cluster/kv_events_sub.Subscriber speaks the same
wire; this interface (start/stop per worker) lets it replace this one.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import msgspec
import zmq

from everybyte.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger("everybyte.cluster.events")
END_SEQ = -1
BatchCallback = Callable[[str, list[KVEvent], float], None]


def decode_events(payload: bytes) -> tuple[float, list[KVEvent]]:
    """(ts, events) of one KVEventBatch payload; ValueError when it is not one."""
    try:
        ts, raw, *_ = msgspec.msgpack.decode(payload)
        events: list[KVEvent] = []
        for e in raw:
            tag = e[0]
            if tag == "BlockStored":
                events.append(BlockStored([_name(h) for h in e[1]], e[4], None if e[2] is None else _name(e[2]),
                                          e[6] or "G1"))
            elif tag == "BlockRemoved":
                events.append(BlockRemoved([_name(h) for h in e[1]], e[2] or "G1"))
            elif tag == "AllBlocksCleared":
                events.append(AllBlocksCleared())
            else:
                raise ValueError(f"unknown event {tag!r}")
        return float(ts), events
    except (msgspec.DecodeError, TypeError, IndexError, ValueError) as e:
        raise ValueError(f"not a KVEventBatch: {e}") from e


def _name(h: bytes | int) -> bytes:
    return h if isinstance(h, bytes) else h.to_bytes(8, "big", signed=h < 0)


class EventFeed:
    def __init__(self, on_batch: BatchCallback, on_reset: Callable[[str], None], replay_timeout_s: float = 1.0):
        self.on_batch, self.on_reset, self.replay_timeout_s = on_batch, on_reset, replay_timeout_s
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._threads: dict[str, tuple[threading.Event, threading.Thread]] = {}
        self.stats = {"batches": 0, "events": 0, "gaps": 0, "resets": 0, "bad": 0}
        self.lag_s: dict[str, float] = {}

    def start(self, worker: str, endpoint: str, replay_endpoint: str | None = None) -> None:
        self.stop(worker)
        stop = threading.Event()
        t = threading.Thread(target=self._run, args=(worker, endpoint, replay_endpoint, stop),
                             name=f"everybyte-router-events-{worker}", daemon=True)
        self._threads[worker] = (stop, t)
        t.start()

    def stop(self, worker: str, timeout: float = 2.0) -> None:
        entry = self._threads.pop(worker, None)
        if entry is not None:
            entry[0].set()
            entry[1].join(timeout)

    def stop_all(self) -> None:
        for w in list(self._threads):
            self.stop(w)

    def _run(self, worker: str, endpoint: str, replay: str | None, stop: threading.Event) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        expected = self._replay(worker, replay, 0)      # what the worker did before we joined
        last_live: int | None = None
        try:
            while not stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.stats["bad"] += 1
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                restarted = last_live is not None and seq <= last_live
                last_live = seq
                if expected is not None and seq < expected and not restarted:
                    continue                             # already delivered by the replay
                if expected is not None and seq != expected:
                    self.stats["gaps"] += 1
                    if restarted or (self._replay(worker, replay, expected, seq) or -1) < seq:
                        self.stats["resets"] += 1
                        self.on_reset(worker)
                self._deliver(worker, frames[2])
                expected = seq + 1
        except zmq.ZMQError as e:
            log.warning("event feed of %s stopped: %s", worker, e)
        finally:
            sub.close(0)

    def _replay(self, worker: str, endpoint: str | None, start: int, upto: int | None = None) -> int | None:
        """Deliver the worker's buffered batches from `start` (up to `upto`, exclusive, when given:
        filling a gap, which must then start exactly at `start`); the next seq, or None when the
        buffer cannot (or has nothing)."""
        if endpoint is None:
            return None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        want: int | None = None
        try:
            sock.connect(endpoint)
            sock.send(start.to_bytes(8, "big", signed=True))
            deadline = time.monotonic() + self.replay_timeout_s
            while sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                frames = sock.recv_multipart()
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == END_SEQ:
                    return want
                if upto is not None and seq != (start if want is None else want):
                    return None                   # the buffer no longer holds what was lost
                if upto is None or seq < upto:
                    self._deliver(worker, frames[-1])
                want = seq + 1
            return None
        finally:
            sock.close(0)

    def _deliver(self, worker: str, payload: bytes) -> None:
        try:
            ts, events = decode_events(payload)
        except ValueError as e:
            self.stats["bad"] += 1
            log.warning("bad KV event batch from %s: %s", worker, e)
            return
        self.stats["batches"] += 1
        self.stats["events"] += len(events)
        self.lag_s[worker] = max(0.0, time.time() - ts)
        try:
            self.on_batch(worker, events, ts)
        except Exception:                         # one bad callback must not end the worker's feed
            log.exception("applying a KV event batch of %s failed", worker)
