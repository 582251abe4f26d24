"""The router's event feed (cluster/event_feed) on real ZeroMQ sockets: the test publishes KV
event batches in the cluster contract's wire format (PUB [topic, seq, msgpack KVEventBatch] and a
ROUTER replay socket) and the feed fills a KVIndex, replays a gap and resets when it cannot."""
import threading
import time

import msgspec
import pytest
import zmq
from serve_fixtures import free_port

from everybyte.cluster.event_feed import EventFeed, decode_events
from everybyte.cluster.kv_index import KVIndex
from everybyte.kv.block_id import KVNamespace, chain_block_ids
from everybyte.kv.events import BlockStored

NS = KVNamespace("m", block_size=4)
A = chain_block_ids(NS, list(range(32)))
END = (-1).to_bytes(8, "big", signed=True)


def stored(names, medium="G1", parent=None):
    return ["BlockStored", list(names), parent, list(range(4 * len(names))), 4, None, medium]


class Publisher:
    """A worker's event sockets as the contract states them, with a replay buffer the test controls."""

    def __init__(self):
        self.ctx = zmq.Context.instance()
        self.port, self.replay_port = free_port(), free_port()
        self.pub = self.ctx.socket(zmq.XPUB)            # a PUB that also hears subscriptions
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.buffer: dict[int, bytes] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve_replay, daemon=True)
        self.thread.start()

    def batch(self, seq, events, send=True):
        payload = msgspec.msgpack.encode([time.time(), events, None])
        self.buffer[seq] = payload
        if send:
            self.pub.send_multipart([b"kv.abc", seq.to_bytes(8, "big", signed=True), payload])

    def _serve_replay(self):
        sock = self.ctx.socket(zmq.ROUTER)
        sock.bind(f"tcp://127.0.0.1:{self.replay_port}")
        while not self.stop.is_set():
            if not sock.poll(50):
                continue
            ident, start = sock.recv_multipart()
            first = int.from_bytes(start, "big", signed=True)
            for seq in sorted(s for s in self.buffer if s >= first):
                sock.send_multipart([ident, seq.to_bytes(8, "big", signed=True), self.buffer[seq]])
            sock.send_multipart([ident, END, b""])
        sock.close(0)

    def wait_subscribed(self):
        assert self.pub.poll(20000), "no subscriber joined"
        assert self.pub.recv()[0] == 1

    def close(self):
        self.stop.set()
        self.thread.join()
        self.pub.close(0)


def wait_for(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached")


@pytest.fixture
def setup():
    ix, resets = KVIndex(), []
    feed = EventFeed(lambda w, events, ts: ix.apply(w, events), lambda w: (resets.append(w), ix.drop_worker(w)))
    pub = Publisher()
    feed.start("w", f"tcp://127.0.0.1:{pub.port}", f"tcp://127.0.0.1:{pub.replay_port}")
    pub.wait_subscribed()
    pub.batch(0, [["AllBlocksCleared"]])
    wait_for(lambda: feed.stats["batches"] == 1)
    yield ix, feed, pub, resets
    feed.stop_all()
    pub.close()


def test_batches_fill_the_index_and_a_gap_is_replayed(setup):
    ix, feed, pub, resets = setup
    pub.buffer.clear()
    pub.batch(1, [stored(A[:2])])
    wait_for(lambda: ix.overlap(A).get("w") and ix.overlap(A)["w"].total == 2)
    pub.batch(2, [stored(A[2:4]), stored(A[4:5], medium="G2")], send=False)     # lost on the wire
    pub.batch(3, [["BlockRemoved", [A[0]], "G1"], stored(A[:1], medium="G2")])
    wait_for(lambda: ix.counts("w")["G2"] == 2)
    assert ix.overlap(A)["w"].g1 == 0 and ix.overlap(A)["w"].g12 == 5
    assert feed.stats["gaps"] == 1 and not resets


def test_a_gap_the_buffer_cannot_fill_resets_the_worker(setup):
    ix, feed, pub, resets = setup
    pub.batch(1, [stored(A[:3])])
    wait_for(lambda: ix.counts("w").get("G1") == 3)
    pub.buffer.clear()                                   # the worker's buffer no longer holds seq 2
    pub.batch(4, [stored(A[5:6])])
    wait_for(lambda: resets == ["w"])
    wait_for(lambda: ix.counts("w").get("G1") == 1)       # what it knew is gone; the new batch applies


def test_a_late_subscriber_replays_the_buffer_then_follows_live():
    ix = KVIndex()
    pub = Publisher()
    pub.batch(0, [["AllBlocksCleared"]], send=False)
    pub.batch(1, [stored(A[:2])], send=False)                 # before the router started
    pub.batch(2, [stored(A[2:3], medium="G3")], send=False)
    feed = EventFeed(lambda w, events, ts: ix.apply(w, events), lambda w: ix.drop_worker(w))
    try:
        feed.start("w", f"tcp://127.0.0.1:{pub.port}", f"tcp://127.0.0.1:{pub.replay_port}")
        pub.wait_subscribed()
        wait_for(lambda: feed.stats["batches"] == 3)
        pub.batch(2, [stored(A[2:3], medium="G3")])            # a live copy of a replayed batch: skipped
        pub.batch(3, [stored(A[3:4])])
        wait_for(lambda: ix.counts("w").get("G1") == 3)
        assert ix.counts("w")["G3"] == 1 and feed.stats["batches"] == 4 and feed.stats["gaps"] == 0
        pub.batch(0, [["AllBlocksCleared"]])                  # the worker restarted
        wait_for(lambda: ix.counts("w").get("G1") == 0)
        assert feed.stats["resets"] == 1
    finally:
        feed.stop_all()
        pub.close()


def test_decode_rejects_what_is_not_a_batch():
    ts, events = decode_events(msgspec.msgpack.encode([1.5, [stored(A[:1])], None]))
    assert ts == 1.5 and events == [BlockStored(A[:1], 4, None, "G1")]
    for bad in (b"\x00junk", msgspec.msgpack.encode([1.0, [["Nope"]], None]), msgspec.msgpack.encode(3)):
        with pytest.raises(ValueError, match="not a KVEventBatch"):
            decode_events(bad)
