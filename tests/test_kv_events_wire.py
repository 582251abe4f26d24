"""KV events on the wire (serve/kv_events_wire, serve/kv_events_pub, cluster/kv_events_sub): vLLM's
own struct definitions decode our payloads, and a subscriber gets every batch in order over real
ZeroMQ sockets, catching up by replay, resyncing when the buffer lost what it missed, and
noticing a worker restart."""
from __future__ import annotations

import threading
import time
from typing import Any, Union

import msgspec
import pytest
import zmq
from serve_fixtures import free_port

from everybyte.cluster.kv_events_sub import Subscriber, decode_batch
from everybyte.kv import events as ev
from everybyte.kv.block_id import KVNamespace, chain_block_ids
from everybyte.kv.events_wire import encode_batch
from everybyte.serve.kv_events_pub import KVEventPublisher, parse_endpoint

# ---- vLLM's definitions, as examples/online_serving/kv_events_subscriber.py writes them ----------
ExternalBlockHash = Union[bytes, int]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Union[ExternalBlockHash, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: Union[str, None]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


NS = KVNamespace("m", block_size=4)
A = chain_block_ids(NS, list(range(12)))


def test_vllm_structs_decode_our_payload():
    events = [ev.AllBlocksCleared(), ev.BlockStored(A[1:], 4, A[0], "G1", list(range(4, 12))),
              ev.BlockRemoved([A[2]], "G1"), ev.BlockStored([A[2]], 4, medium="G2")]
    payload = encode_batch(events, ts=12.5, data_parallel_rank=None)
    raw = msgspec.msgpack.decode(payload)                 # the contract's array layout, literally
    assert raw[0] == 12.5 and raw[2] is None
    assert raw[1][1] == ["BlockStored", A[1:], A[0], list(range(4, 12)), 4, None, "G1"]
    assert raw[1][0] == ["AllBlocksCleared"] and raw[1][2] == ["BlockRemoved", [A[2]], "G1"]
    vb = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)
    assert vb.ts == 12.5
    assert vb.events == [AllBlocksCleared(), BlockStored(A[1:], A[0], list(range(4, 12)), 4, None, "G1"),
                         BlockRemoved([A[2]], "G1"), BlockStored([A[2]], None, [], 4, None, "G2")]
    assert decode_batch(payload).events == events        # and ours reads it back
    # ours reads what vLLM's encoder writes (its batch has no data_parallel_rank when unset)
    theirs = msgspec.msgpack.encode(KVEventBatch(1.0, [BlockStored([7, A[0]], 5, [1, 2], 2, None, None)]))
    (e,) = decode_batch(theirs).events
    assert e.block_hashes[1] == A[0] and e.parent_block_hash == (5).to_bytes(8, "big") and e.medium == "G1"
    with pytest.raises(msgspec.ValidationError):
        decode_batch(msgspec.msgpack.encode([1.0, [["Nonsense", 1]], None]))


def test_endpoint_parsing():
    assert parse_endpoint("tcp://127.0.0.1:5557") == ("127.0.0.1", 5557)
    for bad in ("127.0.0.1:5557", "tcp://127.0.0.1", "tcp://h:0", "ipc:///tmp/x"):
        with pytest.raises(ValueError, match="tcp://HOST:PORT"):
            parse_endpoint(bad)


class Recorder:
    def __init__(self):
        self.batches, self.resets, self.cv = [], 0, threading.Condition()

    def on_batch(self, b):
        with self.cv:
            self.batches.append(b)
            self.cv.notify_all()

    def on_reset(self):
        with self.cv:
            self.resets += 1
            self.batches.clear()

    def wait_for(self, pred, timeout=20.0):
        with self.cv:
            assert self.cv.wait_for(lambda: pred(self), timeout), (self.resets, [b.seq for b in self.batches])


def _endpoints():
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def test_late_subscriber_replays_from_zero_then_follows_live():
    ep, rep = _endpoints()
    pub = KVEventPublisher(ep, rep, "kv.test")
    try:
        for i in range(5):
            pub.publish([ev.BlockStored([A[i % 3]], 4)])
        time.sleep(0.2)                                   # published before anyone listened
        rec = Recorder()
        sub = Subscriber(ep, rep, rec.on_batch, rec.on_reset).start()
        time.sleep(0.3)                                   # the SUB connection settles
        pub.publish([ev.BlockRemoved([A[0]])])               # the first live batch shows the gap
        rec.wait_for(lambda r: len(r.batches) == 7)
        assert [b.seq for b in rec.batches] == list(range(7))
        assert isinstance(rec.batches[0].events[0], ev.AllBlocksCleared)
        assert rec.batches[-1].events == [ev.BlockRemoved([A[0]])]
        # the replay already held the live batch that showed the gap: it is not delivered twice
        assert rec.resets == 0 and sub.stats["gaps"] == 1 and sub.stats["replayed"] == 7
        sub.stop()
    finally:
        pub.close()


def test_resync_when_the_buffer_lost_the_gap():
    ep, rep = _endpoints()
    pub = KVEventPublisher(ep, rep, "kv.test", buffer_batches=3)
    try:
        for i in range(9):
            pub.publish([ev.BlockStored([A[i % 3]], 4)])
        time.sleep(0.2)
        rec = Recorder()
        sub = Subscriber(ep, rep, rec.on_batch, rec.on_reset).start()
        time.sleep(0.3)
        pub.publish([ev.BlockRemoved([A[1]])])               # seq 10; the buffer holds 8, 9, 10
        rec.wait_for(lambda r: r.batches and r.batches[-1].seq == 10)
        assert rec.resets == 1 and [b.seq for b in rec.batches] == [8, 9, 10]
        sub.stop()
    finally:
        pub.close()


def test_a_lost_message_is_replayed_and_a_restart_resets():
    """A hand-driven PUB (real sockets) that skips seq 2 on the wire; the ROUTER answers the replay."""
    ep, rep = _endpoints()
    ctx = zmq.Context.instance()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind(ep)
    router.bind(rep)
    payloads = {i: encode_batch([ev.BlockStored([A[i % 3]], 4, token_ids=[i] * 4)]) for i in range(4)}
    rec = Recorder()
    sub = Subscriber(ep, rep, rec.on_batch, rec.on_reset).start()
    try:
        time.sleep(0.3)
        for i in (0, 1, 3):
            pub.send_multipart([b"kv.x", i.to_bytes(8, "big"), payloads[i]])
        assert router.poll(10000)
        ident, start = router.recv_multipart()
        assert int.from_bytes(start, "big") == 2
        for i in (2, 3):
            router.send_multipart([ident, i.to_bytes(8, "big"), payloads[i]])
        router.send_multipart([ident, (-1).to_bytes(8, "big", signed=True), b""])
        rec.wait_for(lambda r: len(r.batches) == 4)
        assert [b.seq for b in rec.batches] == [0, 1, 2, 3] and [b.replayed for b in rec.batches][2]
        assert rec.batches[2].events[0].token_ids == [2] * 4
        pub.send_multipart([b"kv.x", (0).to_bytes(8, "big"), encode_batch([ev.AllBlocksCleared()])])  # restarted
        rec.wait_for(lambda r: r.resets == 1 and len(r.batches) == 1)
        assert sub.stats["restarts"] == 1
    finally:
        sub.stop()
        pub.close(0)
        router.close(0)
