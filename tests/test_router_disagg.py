"""The router's side of disaggregated prefill/decode (cluster contract §4), against small fake HTTP
workers on real sockets: the worker side (serve --role, the KV connector) is another branch's, so
these fakes only state /v1/kv/info and record what they are sent; the real end-to-end test comes
after the merge. A long uncached prompt goes first to the prefill worker (its token ids,
max_tokens=1, do_remote_decode) and then, with the prefill worker's kv_transfer_params, to the
decode worker; a short one goes straight to decode; a failed prefill leaves the request
aggregated, counted."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from serve_fixtures import free_port

from everybyte.cluster.policy import Policy
from everybyte.cluster.request_blocks import RequestBlocks, load_tokenizer
from everybyte.cluster.router import create_app
from everybyte.cluster.routing import Routing

NS = {"model_id": "m", "revision": "", "kv_format": "nvfp4", "block_size": 16, "layer_shard": "all",
      "tenant_salt": None, "kv_fingerprint": ""}


class AppThread:
    def __init__(self, app):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


def fake_worker(role: str, seen: list, fail: list):
    app = FastAPI()

    @app.get("/v1/kv/info")
    async def info():
        return {"model": "m", "role": role, "block_size": 16, "kv_format": "nvfp4", "namespace": NS,
                "namespace_digest": "ab", "kv_events": None, "kv_connector": None,
                "speeds": {"prefill_tok_s": None, "load_tok_s": {}}, "load": {"num_running": 0, "num_waiting": 0}}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        if fail:
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        out = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "x"}]}
        if role == "prefill":
            out["kv_transfer_params"] = {"remote_endpoint": "tcp://127.0.0.1:9", "namespace_digest": "ab",
                                         "block_hashes": ["00" * 16], "num_tokens": len(body["prompt"])}
        return out

    return app


@pytest.fixture(scope="module")
def cluster():
    seen_p, seen_d, fail = [], [], []
    p, d = AppThread(fake_worker("prefill", seen_p, fail)), AppThread(fake_worker("decode", seen_d, []))
    routing = Routing([p.url, d.url], RequestBlocks(load_tokenizer(None)), Policy("kv"))
    r = AppThread(create_app(routing, disagg_threshold=64))
    yield r, seen_p, seen_d, fail, routing
    for s in (r, p, d):
        s.stop()


def test_long_prompt_prefills_remotely_then_decodes(cluster):
    r, seen_p, seen_d, _, routing = cluster
    prompt = "A long document about routing. " * 30
    resp = httpx.post(r.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 3, "cache_salt": "t"})
    assert resp.status_code == 200
    ids = routing.blocks.tokenizer.encode(prompt)
    assert seen_p[-1] == {"prompt": ids, "max_tokens": 1, "stream": False, "cache_salt": "t",
                          "kv_transfer_params": {"do_remote_decode": True}}
    sent = seen_d[-1]
    assert sent["prompt"] == prompt and sent["max_tokens"] == 3
    assert sent["kv_transfer_params"] == {"do_remote_prefill": True, "remote_endpoint": "tcp://127.0.0.1:9",
                                          "namespace_digest": "ab", "block_hashes": ["00" * 16],
                                          "num_tokens": len(ids)}


def test_short_prompt_and_failed_prefill_stay_aggregated(cluster):
    r, seen_p, seen_d, fail, _ = cluster
    n = len(seen_p)
    assert httpx.post(r.url + "/v1/completions", json={"prompt": "short", "max_tokens": 1}).status_code == 200
    assert len(seen_p) == n and "kv_transfer_params" not in seen_d[-1]
    fail.append(True)
    resp = httpx.post(r.url + "/v1/completions", json={"prompt": "Another long one. " * 40, "max_tokens": 1})
    assert resp.status_code == 200 and len(seen_p) == n + 1
    assert "kv_transfer_params" not in seen_d[-1]
    metrics = httpx.get(r.url + "/metrics").text
    assert 'everybyte:router_disagg_requests_total{outcome="prefill_failed"} 1.0' in metrics
    assert 'everybyte:router_disagg_requests_total{outcome="remote_prefill"} 1.0' in metrics


def test_a_worker_answering_5xx_or_429_is_retried_elsewhere():
    """A worker's 5xx or 429 before any byte is retried on another worker (a fake worker gives the
    error: a real one cannot be made to fail on cue); other 4xx are the client's answer."""
    seen_bad, seen_good, fail = [], [], [True]
    bad = AppThread(fake_worker("both", seen_bad, fail))
    good = AppThread(fake_worker("both", seen_good, []))
    routing = Routing([bad.url, good.url], RequestBlocks(load_tokenizer(None)), Policy("round-robin"))
    r = AppThread(create_app(routing))
    try:
        for _ in range(2):
            assert httpx.post(r.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 200
        assert len(seen_bad) == 2 and len(seen_good) == 2          # round-robin tries it each time
        assert 'everybyte:router_retries_total{reason="http 500"} 2.0' in httpx.get(r.url + "/metrics").text
        assert all(w.in_flight == 0 and w.active_blocks == 0 for w in routing.workers.workers.values())
    finally:
        for s in (r, bad, good):
            s.stop()
