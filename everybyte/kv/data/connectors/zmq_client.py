"""The requesting side of the direct path: one DEALER socket per fetch, a deadline on the answer."""
from __future__ import annotations

import threading

import zmq

from everybyte.kv.connector import TransferFailed, TransferRefused
from everybyte.kv.data.connectors.wire import NAMESPACE, OK, PROTOCOL


class ZmqConnector:
    path = "zmq"

    def __init__(self, timeout_s: float = 5.0):
        if not timeout_s > 0:
            raise ValueError(f"KV transfer timeout must be > 0 s, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self._ctx: zmq.Context | None = None
        self._lock = threading.Lock()

    def _context(self) -> zmq.Context:
        with self._lock:
            if self._ctx is None:
                self._ctx = zmq.Context()
            return self._ctx

    def fetch(self, endpoint: str, digest: bytes, names: list[bytes]) -> list:
        sock = self._context().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send_multipart([PROTOCOL, digest, b"".join(names)])
            if not sock.poll(int(self.timeout_s * 1000), zmq.POLLIN):
                raise TransferFailed(f"no answer from {endpoint} in {self.timeout_s:g} s")
            frames = sock.recv_multipart(copy=False)
        except zmq.ZMQError as e:
            raise TransferFailed(f"{endpoint}: {e}") from None
        finally:
            sock.close()
        if len(frames) < 3 or frames[0].bytes != PROTOCOL:
            raise TransferFailed(f"{endpoint} answered something other than {PROTOCOL.decode()}")
        status, theirs = frames[1].bytes, frames[2].bytes
        if status == NAMESPACE or theirs != digest:
            raise TransferRefused(f"{endpoint} holds namespace {theirs.hex()[:12]}, this worker is {digest.hex()[:12]}")
        if status != OK or len(frames) - 3 != len(names):
            raise TransferFailed(f"{endpoint} answered {status.decode(errors='replace')} with "
                                 f"{len(frames) - 3} blocks for {len(names)} names")
        return [f.buffer if len(f) else None for f in frames[3:]]

    def close(self) -> None:
        if self._ctx is not None:
            self._ctx.term()
