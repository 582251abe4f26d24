"""The serving side of the direct path: a ROUTER socket on each prefill worker's thread.

The engine thread stages a finished prompt's blocks (encoded from G1 in their stored format and
framed, so they no longer depend on the pool) with `offer`; a decode worker's fetch takes them.
A staged block stays until it is fetched or `ttl_s` passes; past `max_bytes` staged, the oldest go
first (counted as dropped). Thread-safe: offer() runs on the engine thread, the socket on this
server's own thread.
"""
from __future__ import annotations

import logging
import threading
import time

import zmq

from everybyte.kv.data.connectors.wire import BAD_REQUEST, NAMESPACE, OK, PROTOCOL

log = logging.getLogger(__name__)
NAME = 16


class BlockServer:
    def __init__(self, digest: bytes, bind: str = "tcp://127.0.0.1:0", ttl_s: float = 60.0,
                 max_bytes: int = 1 << 30):
        self.digest, self.ttl_s, self.max_bytes = digest, ttl_s, max_bytes
        self._bytes = 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        host, _, port = bind.rpartition(":")
        if not bind.startswith("tcp://") or not port.isdigit():
            raise ValueError(f"--kv-connector must be tcp://HOST:PORT (PORT 0: a free one), got {bind!r}")
        try:
            if int(port) == 0:
                self._sock.bind_to_random_port(host)
            else:
                self._sock.bind(bind)
        except zmq.ZMQError as e:
            self._sock.close()
            raise ValueError(f"cannot bind the KV connector at {bind}: {e}") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._lock = threading.Lock()
        self._blocks: dict[bytes, tuple[bytes, float]] = {}       # name -> (framed block, expiry)
        self.stats = dict.fromkeys(("staged", "requests", "blocks_sent", "bytes_sent", "missing", "expired",
                                    "dropped", "refused"), 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="everybyte-kv-connector", daemon=True)
        self._thread.start()

    def offer(self, names: list[bytes], frames: list[bytes]) -> None:
        until = time.monotonic() + self.ttl_s
        with self._lock:
            for name, frame in zip(names, frames):
                self._pop(name)
                self._blocks[name] = (frame, until)
                self._bytes += len(frame)
            self.stats["staged"] += len(names)
            while self._bytes > self.max_bytes and self._blocks:
                self._pop(next(iter(self._blocks)))
                self.stats["dropped"] += 1

    def _pop(self, name: bytes) -> bytes:
        frame = self._blocks.pop(name, (b"", 0.0))[0]
        self._bytes -= len(frame)
        return frame

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            for name in [n for n, (_, t) in self._blocks.items() if t < now]:
                self._pop(name)
                self.stats["expired"] += 1

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    def _take(self, names: list[bytes]) -> list[bytes]:
        self._expire()
        out = []
        with self._lock:
            for name in names:
                frame = self._pop(name)
                self.stats["blocks_sent" if frame else "missing"] += 1
                self.stats["bytes_sent"] += len(frame)
                out.append(frame)
        return out

    def _answer(self, msg: list[bytes]) -> list[bytes]:
        if len(msg) != 3 or msg[0] != PROTOCOL or len(msg[1]) != NAME or len(msg[2]) % NAME:
            return [PROTOCOL, BAD_REQUEST, self.digest]
        self.stats["requests"] += 1
        if msg[1] != self.digest:
            self.stats["refused"] += 1
            return [PROTOCOL, NAMESPACE, self.digest]
        names = [msg[2][i:i + NAME] for i in range(0, len(msg[2]), NAME)]
        return [PROTOCOL, OK, self.digest, *self._take(names)]

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(100):
                    self._expire()
                    continue
                ident, *msg = self._sock.recv_multipart()
                self._sock.send_multipart([ident, *self._answer(msg)], copy=False)
            except zmq.ZMQError as e:
                if self._stop.is_set():
                    break
                log.warning("KV connector: %s", e)
        self._sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._ctx.term()
