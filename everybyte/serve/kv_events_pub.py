"""The KV-event feed: a worker's KV events, one batch per engine step, on a ZeroMQ PUB socket in
vLLM's format (kv/events_wire), with a ROUTER socket that replays buffered batches.

PUB frames: [topic, seq (8 bytes big-endian, from 0, +1 a batch), payload]. Replay: a DEALER or
REQ client sends start_seq (8 bytes); it gets [seq, payload] for every buffered batch from
start_seq on, then [-1, b""]. The first batch is AllBlocksCleared, so a subscriber that sees seq 0
again knows the worker restarted. The engine thread only appends to a queue; the sockets live on
the publisher's own thread, so the engine loop never blocks on the network.
"""
from __future__ import annotations

import logging
import queue
import re
import threading
from collections import deque

import zmq

from everybyte.kv.events import AllBlocksCleared, EventLog, KVEvent, coalesce
from everybyte.kv.events_wire import END_SEQ, encode_batch

log = logging.getLogger("everybyte.serve.kv_events")
_TCP = re.compile(r"^tcp://([^:/]+|\[[0-9a-fA-F:]+\]):(\d{1,5})$")


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """(host, port) of tcp://HOST:PORT; ValueError otherwise."""
    m = _TCP.match(endpoint)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"expected a ZeroMQ endpoint tcp://HOST:PORT, got {endpoint!r}")
    return m.group(1), int(m.group(2))


def default_replay_endpoint(endpoint: str) -> str:
    host, port = parse_endpoint(endpoint)
    if port >= 65535:
        raise ValueError(f"no default replay port after {port}; give --kv-events-replay")
    return f"tcp://{host}:{port + 1}"


class KVEventPublisher:
    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str,
                 buffer_batches: int = 10000, data_parallel_rank: int | None = None):
        parse_endpoint(endpoint)
        if replay_endpoint is not None:
            parse_endpoint(replay_endpoint)
        if buffer_batches < 1:
            raise ValueError(f"buffer_batches must be >= 1, got {buffer_batches}")
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic.encode()
        self.dp_rank = data_parallel_rank
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self.next_seq = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="everybyte-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:                 # e.g. the address is in use
            raise RuntimeError(f"KV events: cannot bind {endpoint}: {self._error}") from self._error
        self.publish([AllBlocksCleared()])

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one batch (never blocks); the publisher thread numbers, encodes and sends it."""
        if events:
            self._queue.put(list(events))

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        pub = ctx.socket(zmq.PUB)
        replay = ctx.socket(zmq.ROUTER) if self.replay_endpoint else None
        try:
            pub.setsockopt(zmq.LINGER, 0)
            pub.bind(self.endpoint)
            if replay is not None:
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._error = e
            self._ready.set()
            pub.close()
            if replay is not None:
                replay.close()
            return
        self._ready.set()
        try:
            while not self._stop.is_set() or not self._queue.empty():
                if replay is not None:
                    while replay.poll(0):
                        self._answer_replay(replay, replay.recv_multipart())
                try:
                    events = self._queue.get(timeout=0.01)
                except queue.Empty:
                    continue
                self._send(pub, events)
        except Exception:
            log.exception("KV event publisher stopped")
        finally:
            pub.close()
            if replay is not None:
                replay.close()

    def _send(self, pub: zmq.Socket, events: list[KVEvent]) -> None:
        payload = encode_batch(events, data_parallel_rank=self.dp_rank)
        seq = self.next_seq
        self.next_seq += 1
        self.buffer.append((seq, payload))
        pub.send_multipart([self.topic, seq.to_bytes(8, "big", signed=True), payload])

    def _answer_replay(self, replay: zmq.Socket, frames: list[bytes]) -> None:
        envelope, request = frames[:-1], frames[-1]
        if len(request) != 8:
            log.warning("KV events: ignoring a replay request of %d bytes (want 8)", len(request))
            replay.send_multipart([*envelope, END_SEQ, b""])
            return
        start = int.from_bytes(request, "big", signed=True)
        for seq, payload in list(self.buffer):
            if seq >= start:
                replay.send_multipart([*envelope, seq.to_bytes(8, "big", signed=True), payload])
        replay.send_multipart([*envelope, END_SEQ, b""])


class KVEventFeed:
    """Joins a worker's EventLog to a publisher: `flush()` (once per engine step, on the engine
    thread) sends what the log collected since the last one as one batch (runs of a chain's
    blocks merged into one BlockStored, as vLLM sends them)."""

    def __init__(self, log: EventLog, publisher: KVEventPublisher):
        self.log, self.publisher = log, publisher

    def flush(self) -> None:
        self.publisher.publish(coalesce(self.log.drain().events))

    def close(self) -> None:
        self.flush()
        self.publisher.close()
