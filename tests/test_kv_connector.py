"""The KV connector's parts over real ZeroMQ sockets (the block server, the client, the remote
source's checks), and the in-process flow: LLM(kv_role="prefill") -> LLM(kv_role="decode"), with
the pod-shared Redis tier as the second path when the direct one is gone."""
from __future__ import annotations

import time

import pytest
import torch
import zmq

from everybyte import LLM, SamplingParams
from everybyte.kv.connector import RemoteBlocks, TransferFailed, TransferParams, TransferRefused, transfer_kind
from everybyte.kv.data.connectors.wire import BAD_REQUEST, PROTOCOL
from everybyte.kv.data.connectors.zmq_client import ZmqConnector
from everybyte.kv.data.connectors.zmq_server import BlockServer
from everybyte.kv.tiers.frame import frame_header
from everybyte.models.loader import load_model

DIGEST, OTHER = bytes(range(16)), bytes(16)
NAMES = [bytes([i]) * 16 for i in range(3)]


def _frames(n: int = 3) -> list[bytes]:
    return [frame_header(memoryview(b"block%d" % i * 50)) + b"block%d" % i * 50 for i in range(n)]


@pytest.fixture
def server():
    s = BlockServer(DIGEST)
    yield s
    s.close()


def test_a_staged_block_is_served_once(server):
    server.offer(NAMES, _frames())
    conn = ZmqConnector(timeout_s=5)
    got = conn.fetch(server.endpoint, DIGEST, NAMES[::-1] + [b"x" * 16])
    assert [bytes(g) for g in got[:3]] == _frames()[::-1] and got[3] is None
    assert conn.fetch(server.endpoint, DIGEST, NAMES) == [None] * 3      # fetched: no longer held
    assert server.stats["blocks_sent"] == 3 and server.stats["missing"] == 4
    assert server.stats["bytes_sent"] == sum(map(len, _frames()))


def test_the_server_refuses_another_namespace_and_bad_requests(server):
    server.offer(NAMES, _frames())
    with pytest.raises(TransferRefused):
        ZmqConnector(timeout_s=5).fetch(server.endpoint, OTHER, NAMES)
    assert server.stats["refused"] == 1 and len(server) == 3
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(server.endpoint)
    sock.send_multipart([PROTOCOL, DIGEST, b"12345"])                    # not a whole name
    assert sock.poll(5000) and sock.recv_multipart()[:2] == [PROTOCOL, BAD_REQUEST]
    sock.close(0)


def test_staged_blocks_expire_and_are_bounded():
    s = BlockServer(DIGEST, ttl_s=0.05)
    try:
        s.offer(NAMES, _frames())
        time.sleep(0.3)
        assert len(s) == 0 and s.stats["expired"] == 3         # expired with no fetch asking
        assert ZmqConnector(timeout_s=5).fetch(s.endpoint, DIGEST, NAMES) == [None] * 3
    finally:
        s.close()
    s = BlockServer(DIGEST, max_bytes=2 * len(_frames()[0]))
    try:
        s.offer(NAMES, _frames())
        assert s.stats["dropped"] == 1
        assert ZmqConnector(timeout_s=5).fetch(s.endpoint, DIGEST, NAMES)[0] is None      # the oldest went
    finally:
        s.close()


def test_no_peer_is_a_failed_transfer_and_a_bad_bind_a_clear_error(server):
    with zmq.Context.instance().socket(zmq.ROUTER) as silent:             # a peer that never answers
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        with pytest.raises(TransferFailed, match="no answer"):
            ZmqConnector(timeout_s=0.3).fetch(f"tcp://127.0.0.1:{port}", DIGEST, NAMES)
    with pytest.raises(ValueError, match="cannot bind"):
        BlockServer(DIGEST, server.endpoint)                               # the port is taken
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        BlockServer(DIGEST, "ipc:///tmp/x")


def test_remote_blocks_check_every_frame_and_the_namespace(server):
    frames = _frames()
    bad = bytearray(frames[1])
    bad[-3] ^= 1
    server.offer(NAMES, [frames[0], bytes(bad), frames[2]])
    remote = RemoteBlocks({"tcp": ZmqConnector(timeout_s=5)}, DIGEST)
    with pytest.raises(TransferRefused):
        remote.expect(TransferParams(server.endpoint, OTHER, tuple(NAMES), 48))
    assert remote.refused == 1 and not remote.contains(NAMES[0])
    assert remote.expect(TransferParams(server.endpoint, DIGEST, tuple(NAMES), 48)) == 3
    assert remote.contains_many(NAMES) == [True] * 3
    (batch,) = remote.get_stream(NAMES)
    assert [None if b is None else bytes(b) for _, b in batch] == [frames[0][24:], None, frames[2][24:]]
    paths = remote.describe()["paths"]["zmq"]
    assert paths["corrupt"] == 1 and paths["blocks_received"] == 2 and remote.stats["corrupt"] == 1
    assert paths["bytes_received"] == sum(map(len, frames))
    assert not remote.contains(NAMES[0])                 # asked for once, then forgotten


def test_expected_blocks_expire_in_order_when_one_is_expected_again():
    now = [0.0]
    remote = RemoteBlocks({"tcp": ZmqConnector(timeout_s=5)}, DIGEST, clock=lambda: now[0])
    a, b, c = NAMES
    remote.expect(TransferParams("tcp://127.0.0.1:5", DIGEST, (a, b), 32))         # until 120
    now[0] = 100.0
    remote.expect(TransferParams("tcp://127.0.0.1:6", DIGEST, (a,), 16))           # a again: until 220
    now[0] = 130.0
    remote.expect(TransferParams("tcp://127.0.0.1:5", DIGEST, (c,), 16))           # b has expired: dropped
    assert len(remote) == 2 and remote.contains_many([a, b, c]) == [True, False, True]
    now[0] = 221.0
    remote.expect(TransferParams("tcp://127.0.0.1:5", DIGEST, (), 0))
    assert len(remote) == 1 and remote.contains_many([a, b, c]) == [False, False, True]


def test_transfer_params_are_checked():
    assert transfer_kind(None) is None and transfer_kind({"do_remote_decode": True}) == "decode"
    good = TransferParams("tcp://127.0.0.1:5", DIGEST, tuple(NAMES), 48).to_json()
    assert transfer_kind({"do_remote_prefill": True, **good}) == "prefill"
    assert TransferParams.from_json(good) == TransferParams("tcp://127.0.0.1:5", DIGEST, tuple(NAMES), 48)
    for bad, msg in [({**good, "remote_endpoint": "nowhere"}, "URL"), ({**good, "block_hashes": ["zz"]}, "hex"),
                     ({**good, "num_tokens": -1}, "num_tokens"), ({**good, "namespace_digest": "00"}, "16-byte"),
                     ({"remote_endpoint": "tcp://x:1"}, "namespace_digest")]:
        with pytest.raises(ValueError, match=msg):
            transfer_kind({"do_remote_prefill": True, **bad})
    with pytest.raises(ValueError, match="exclusive"):
        transfer_kind({"do_remote_prefill": True, "do_remote_decode": True})


# ---- in process, on the real model ----------------------------------------------------------
ENGINE = dict(kv_cache_bytes="8MiB", max_model_len=512, dtype="float32")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PREFILL = SamplingParams(temperature=0, max_tokens=1)
SYSTEM = ("You are a coding agent working in a Python repository. You can call the tools read_file, "
          "write_file, run_tests and search. Keep edits small. ")


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, dtype=torch.float32)


def test_in_process_prefill_then_decode(loaded):
    prefill = LLM(loaded, kv_role="prefill", kv_tiers="none", **ENGINE)
    decode = LLM(loaded, kv_role="decode", kv_tiers="none", **ENGINE)
    reference = LLM(loaded, enable_prefix_caching=False, **ENGINE)
    prompt = SYSTEM + "Task: make the slow test faster."
    params = prefill.generate(prompt, PREFILL, kv_transfer_params={"do_remote_decode": True})[0].kv_transfer_params
    out = decode.generate(prompt, GREEDY, kv_transfer_params={"do_remote_prefill": True, **params})[0]
    assert out.token_ids == reference.generate(prompt, GREEDY)[0].token_ids
    assert out.num_cached_tokens >= (len(params["block_hashes"]) - 1) * 16 > 0
    assert decode.stats()["memory"]["prefill_tokens"]["reused"]["remote"] == out.num_cached_tokens
    with pytest.raises(ValueError, match="role is decode"):
        decode.generate(prompt, PREFILL, kv_transfer_params={"do_remote_decode": True})
    with pytest.raises(ValueError, match="role is prefill"):
        prefill.generate(prompt, PREFILL, kv_transfer_params={"do_remote_prefill": True, **params})
    prefill.close()


def test_the_pod_shared_tier_is_the_second_path(loaded, redis_server):
    tiers = f"{redis_server.url}:64MiB"
    prefill = LLM(loaded, kv_role="prefill", kv_tiers=tiers, **ENGINE)
    decode = LLM(loaded, kv_role="decode", kv_tiers=tiers, kv_transfer_timeout_s=1.0, **ENGINE)
    reference = LLM(loaded, enable_prefix_caching=False, **ENGINE)
    shared = decode.block_manager.tiers.write_through[0]

    def flow(prompt: str, prefill_alive: bool):
        params = prefill.generate(prompt, PREFILL, kv_transfer_params={"do_remote_decode": True})[0]
        params = params.kv_transfer_params
        # the write-through landed before the answer: Redis already holds every block
        assert all(shared.contains_many([bytes.fromhex(h) for h in params["block_hashes"]]))
        if not prefill_alive:
            prefill.kv_transfer.close()                  # the direct path is gone
        out = decode.generate(prompt, GREEDY, kv_transfer_params={"do_remote_prefill": True, **params})[0]
        assert out.token_ids == reference.generate(prompt, GREEDY)[0].token_ids
        assert out.num_cached_tokens >= (len(params["block_hashes"]) - 1) * 16 > 0
        return decode.stats()["kv_transfer"]["paths"]

    paths = flow("Task: rename load_cfg. " + SYSTEM, prefill_alive=True)   # no block in common
    assert paths["zmq"]["blocks_received"] > 0 and paths["redis"]["bytes_received"] == 0   # connector first
    paths = flow("Task: fix the flaky test. " + SYSTEM, prefill_alive=False)
    assert paths["zmq"]["failed"] == 1 and paths["redis"]["bytes_received"] > 0           # Redis second
