"""The router on real workers that publish KV events (`serve --kv-events`, cluster contract §1-2).

The router's block
names for a chat prompt equal the BlockStored hashes the worker publishes over ZeroMQ, and the
router learns from events alone: a prompt sent straight to one worker (past the router) is
indexed from that worker's events, and the router then sends the same prompt there.
"""
from __future__ import annotations

import time

import httpx
import pytest
from serve_fixtures import free_port, start_servers
from test_router_e2e import ENGINE, LONG, complete, routed_to, router

from everybyte.cluster.event_feed import EventFeed
from everybyte.cluster.request_blocks import RequestBlocks, block_names, load_tokenizer, namespace_from_info
from everybyte.kv.events import BlockStored


def wait_for(cond, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached")


@pytest.fixture(scope="module")
def workers():
    ws = start_servers(*[(*ENGINE, "--kv-events", f"tcp://127.0.0.1:{free_port()}",
                          "--kv-events-replay", f"tcp://127.0.0.1:{free_port()}") for _ in range(2)])
    yield ws
    for w in ws:
        w.stop()


def test_router_names_equal_the_published_hashes(workers):
    w = workers[0]
    info = httpx.get(w.url + "/v1/kv/info").json()
    ns = namespace_from_info(info["namespace"])
    assert ns.digest.hex() == info["namespace_digest"]
    got: list = []
    feed = EventFeed(lambda _, events, ts: got.extend(events), lambda _: None)
    feed.start("w", info["kv_events"]["endpoint"], info["kv_events"]["replay_endpoint"])
    try:
        wait_for(lambda: (complete(w.url, f"warm up {time.monotonic()}"), bool(got))[1])   # SUB has joined
        got.clear()
        body = {"messages": [{"role": "system", "content": "Answer in one word. " * 10},
                             {"role": "user", "content": "Capital of France?"}],
                "max_tokens": 2, "cache_salt": "tenant-x"}
        assert httpx.post(w.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        tokens = RequestBlocks(load_tokenizer(None)).prompt_tokens("/v1/chat/completions", body)
        names = block_names(ns, tokens, "tenant-x")
        assert len(names) >= 3
        stored = lambda: [h for e in got if isinstance(e, BlockStored) and e.medium == "G1" for h in e.block_hashes]
        # a late event from the warm-up may still arrive after got.clear(): match from the first name
        def from_first() -> list:
            s = stored()
            return s[s.index(names[0]):] if names[0] in s else []
        wait_for(lambda: len(from_first()) >= len(names))
        assert from_first()[:len(names)] == names
    finally:
        feed.stop_all()


def test_router_learns_from_events_alone(workers):
    r = router(*sum((["--worker", w.url] for w in workers), []))
    try:
        target = workers[1]
        prompt = LONG + "events only"
        complete(target.url, prompt)                           # past the router: only events can tell it

        def indexed() -> float:
            for line in httpx.get(r.url + "/metrics").text.splitlines():
                if line.startswith(f'everybyte:router_indexed_blocks{{tier="G1",worker="{target.url}"}}'):
                    return float(line.rsplit(" ", 1)[1])
            return 0.0
        wait_for(lambda: indexed() >= 4)
        chosen, again = routed_to(r, lambda: complete(r.url, prompt))
        assert chosen == target.url
        assert again.usage.prompt_tokens_details.cached_tokens >= 64
    finally:
        r.stop()
