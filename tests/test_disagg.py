"""Disaggregated prefill/decode over HTTP between real `everybyte serve` processes: a prefill
worker answers with kv_transfer_params, a decode worker fetches the prompt's blocks over the
ZeroMQ connector and gives the tokens a single worker gives; a dead peer, a corrupted block and
a peer of another KV namespace each cost a recompute, counted, never a wrong token."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading

import httpx
import pytest
import zmq
from serve_fixtures import Server, start_servers

from everybyte.kv.tiers.frame import FRAME

ENGINE = ["--kv-cache", "16MiB", "--max-model-len", "512", "--max-num-seqs", "4", "--kv-tiers", "none"]
BLOCK = 16
# SmolLM2-135M: 30 layers x 3 KV heads x 64 dims, K and V, 16 tokens a block
VALUES_PER_BLOCK = 30 * 3 * 64 * 2 * BLOCK
PROMPT = ("You are a coding agent working in a Python repository. You can call the tools read_file, "
          "write_file, run_tests and search. Think step by step, keep edits small, and run the tests after "
          "every change. Task: the test test_parse_dates fails with a KeyError; find out why and fix it.")


@pytest.fixture(scope="module")
def workers():
    prefill, decode, both = start_servers((*ENGINE, "--role", "prefill"),
                                          (*ENGINE, "--role", "decode", "--kv-transfer-timeout", "2"), ENGINE)
    yield prefill, decode, both
    for s in (prefill, decode, both):
        s.stop()


@pytest.fixture(scope="module")
def prompt_ids(workers):
    ids = httpx.post(workers[2].url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    ids = ids[:4 * BLOCK + 3]                   # 4 full blocks and a partial one
    assert len(ids) == 4 * BLOCK + 3
    return ids


def _complete(server: Server, ids: list[int], max_tokens: int = 8, **extra) -> dict:
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                         "return_token_ids": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _prefill(server: Server, ids: list[int]) -> dict:
    body = _complete(server, ids, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    return body["kv_transfer_params"]


def _decode(server: Server, ids: list[int], params: dict) -> dict:
    return _complete(server, ids, kv_transfer_params={"do_remote_prefill": True, **params})


def _tokens(body: dict) -> list[int]:
    return body["choices"][0]["token_ids"]


def _cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _metric(server: Server, name: str) -> float:
    try:
        return server.metric(name)
    except KeyError:
        return 0.0


def test_decode_worker_continues_from_the_prefill_workers_blocks(workers, prompt_ids):
    prefill, decode, both = workers
    reference = _complete(both, prompt_ids)
    params = _prefill(prefill, prompt_ids)
    assert params["remote_endpoint"].startswith("tcp://127.0.0.1:")
    assert len(params["block_hashes"]) == 4 and params["num_tokens"] == 4 * BLOCK
    before = _metric(decode, 'everybyte:kv_transfer_bytes_received_total{path="zmq"}')
    out = _decode(decode, prompt_ids, params)
    assert _tokens(out) == _tokens(reference)
    assert _cached(out) == 4 * BLOCK and _cached(reference) == 0
    moved = _metric(decode, 'everybyte:kv_transfer_bytes_received_total{path="zmq"}') - before
    block = moved / 4 - FRAME.size                # the block in its stored format, without the wire frame
    assert moved % 4 == 0 and 0 < block - VALUES_PER_BLOCK * 4.5 / 8 <= 1024     # NVFP4: 4.5 bits + header
    assert _metric(prefill, 'everybyte:kv_transfer_served_total{what="bytes_sent"}') >= moved
    assert _metric(decode, 'everybyte:prefill_tokens_total{source="remote"}') >= 4 * BLOCK


def test_chat_completions_carry_the_transfer_too(workers):
    prefill, decode, both = workers
    messages = [{"role": "system", "content": PROMPT}, {"role": "user", "content": "What do you check first?"}]
    req = {"messages": messages, "temperature": 0, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}
    first = httpx.post(prefill.url + "/v1/chat/completions", timeout=120,
                       json={**req, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
    params = first["kv_transfer_params"]
    out = httpx.post(decode.url + "/v1/chat/completions", timeout=120,
                     json={**req, "kv_transfer_params": {"do_remote_prefill": True, **params}}).json()
    ref = httpx.post(both.url + "/v1/chat/completions", timeout=120, json=req).json()
    assert out["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert _cached(out) >= (len(params["block_hashes"]) - 1) * BLOCK > 0


def _corrupting_proxy(target: str, which: int, stop: threading.Event) -> tuple[str, threading.Thread]:
    """A ROUTER in front of a real connector that flips one byte in block `which` of each reply."""
    ctx = zmq.Context.instance()
    front = ctx.socket(zmq.ROUTER)
    port = front.bind_to_random_port("tcp://127.0.0.1")

    def run():
        back = ctx.socket(zmq.DEALER)
        back.connect(target)
        while not stop.is_set():
            if not front.poll(100):
                continue
            ident, *msg = front.recv_multipart()
            back.send_multipart(msg)
            reply = back.recv_multipart()
            block = bytearray(reply[3 + which])
            block[len(block) // 2] ^= 0x40
            reply[3 + which] = bytes(block)
            front.send_multipart([ident, *reply])
        back.close(0)
        front.close(0)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return f"tcp://127.0.0.1:{port}", t


def test_a_corrupted_block_is_recomputed_from_there_on(workers, prompt_ids):
    prefill, decode, both = workers
    ids = prompt_ids[1:] + [prompt_ids[0]]          # other blocks than the first test's
    reference = _complete(both, ids)
    params = _prefill(prefill, ids)
    stop = threading.Event()
    endpoint, thread = _corrupting_proxy(params["remote_endpoint"], which=2, stop=stop)
    corrupt = _metric(decode, 'everybyte:kv_transfer_blocks_total{outcome="corrupt",path="zmq"}')
    try:
        out = _decode(decode, ids, {**params, "remote_endpoint": endpoint})
    finally:
        stop.set()
        thread.join(5)
    assert _tokens(out) == _tokens(reference)
    assert _cached(out) == 2 * BLOCK                 # blocks 0 and 1 loaded; 2 and 3 recomputed
    assert _metric(decode, 'everybyte:kv_transfer_blocks_total{outcome="corrupt",path="zmq"}') == corrupt + 1


def test_another_namespace_is_refused(workers, prompt_ids):
    prefill, decode, both = workers
    fp8 = Server(*ENGINE, "--role", "prefill", "--kv-cache-dtype", "fp8")
    try:
        ids = prompt_ids[2:] + prompt_ids[:2]
        reference = _complete(both, ids)
        params = _prefill(fp8, ids)
        refused = _metric(decode, "everybyte:kv_transfer_refused_total")
        out = _decode(decode, ids, params)               # the params name the fp8 namespace
        assert _tokens(out) == _tokens(reference) and _cached(out) == 0
        assert _metric(decode, "everybyte:kv_transfer_refused_total") == refused + 1
        # nvfp4 block names sent to the fp8 worker's connector: it refuses to answer them
        # blocks the decode worker has not computed yet; a rotation without a near-tie in its greedy
        # tokens (top-2 margin >= 0.3 nats). Rotating by 4 has a 0.0007-nat tie at its third token;
        # it failed in 1 of ~15 loaded runs and never in isolation (cause not found: a last-bit
        # difference, amplified by NVFP4 rounding, is enough to flip such a tie)
        ids = prompt_ids[7:] + prompt_ids[:7]
        reference = _complete(both, ids)
        mine = _prefill(prefill, ids)
        out = _decode(decode, ids, {**mine, "remote_endpoint": params["remote_endpoint"]})
        assert _tokens(out) == _tokens(reference) and _cached(out) == 0
        assert _metric(decode, "everybyte:kv_transfer_refused_total") == refused + 2
        assert _metric(fp8, 'everybyte:kv_transfer_served_total{what="refused"}') == 1
    finally:
        fp8.stop()


def test_requests_a_role_cannot_serve_are_400(workers, prompt_ids):
    prefill, decode, _ = workers
    cases = [(decode, {"do_remote_decode": True}), (prefill, {"do_remote_prefill": True, "remote_endpoint": "x"}),
             (decode, {"do_remote_prefill": True}), (decode, {"do_remote_prefill": True, "do_remote_decode": True}),
             (decode, {"do_remote_prefill": True, "remote_endpoint": "tcp://127.0.0.1:1", "namespace_digest": "zz",
                       "block_hashes": [], "num_tokens": 0})]
    for server, params in cases:
        r = httpx.post(server.url + "/v1/completions", timeout=30,
                       json={"prompt": prompt_ids, "max_tokens": 1, "kv_transfer_params": params})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", (params, r.text)
    r = httpx.post(prefill.url + "/v1/completions", timeout=30,
                   json={"prompt": prompt_ids, "max_tokens": 1, "stream": True,
                         "kv_transfer_params": {"do_remote_decode": True}})
    assert r.status_code == 400


def test_prefill_worker_killed_before_the_fetch(workers, prompt_ids):
    """Last in the file: it kills the module's prefill worker."""
    prefill, decode, both = workers
    ids = prompt_ids[5:] + prompt_ids[:5]
    reference = _complete(both, ids)
    params = _prefill(prefill, ids)
    prefill.stop(signal.SIGKILL)
    failed = _metric(decode, 'everybyte:kv_transfer_blocks_total{outcome="failed",path="zmq"}')
    out = _decode(decode, ids, params)
    assert _tokens(out) == _tokens(reference) and _cached(out) == 0
    assert _metric(decode, 'everybyte:kv_transfer_blocks_total{outcome="failed",path="zmq"}') == failed + 1


@pytest.mark.parametrize("flags, msg", [(["--role", "decode", "--kv-connector", "tcp://127.0.0.1:0"], "--kv-connector"),
                                        (["--kv-connector", "127.0.0.1:5"], "tcp://HOST:PORT"),
                                        (["--kv-transfer-timeout", "0"], "--kv-transfer-timeout"),
                                        (["--role", "router"], "invalid choice")])
def test_bad_flags_are_clear_errors(flags, msg):
    r = subprocess.run([sys.executable, "-m", "everybyte.cli", "serve", *flags], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and msg in r.stderr
