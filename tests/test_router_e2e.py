"""`everybyte router` over two real `everybyte serve` processes, driven over real HTTP.

Approximate mode (the workers publish no KV events here): a repeated long prompt goes back to the
worker that has it and its cached_tokens show the reuse, while round-robin alternates and gets
none. Streams pass through; a malformed request gets the worker's own 4xx; session calls reach
the session's worker; a dead worker is routed around, a stream cut in flight ends with an error
event and [DONE], and the failures are counted.
"""
from __future__ import annotations

import json
import signal

import httpx
import openai
import pytest
from serve_fixtures import Server, free_port, start_servers

ENGINE = ["--kv-cache", "16MiB", "--max-model-len", "512", "--max-num-seqs", "4", "--kv-tiers", "none"]
LONG = "Tools: search(query), open(url), click(id). Reply in JSON only. " * 6


@pytest.fixture(scope="module")
def workers():
    ws = start_servers(ENGINE, ENGINE)
    yield ws
    for w in ws:
        w.stop()


def router(*args: str) -> Server:
    return Server(*args, "--log-level", "warning", command="router")


def decisions(r: Server) -> dict[str, float]:
    out = {}
    for line in httpx.get(r.url + "/metrics").text.splitlines():
        if line.startswith("everybyte:router_decisions_total{"):
            out[line.split('worker="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def routed_to(r: Server, send) -> tuple[str, object]:
    before = decisions(r)
    result = send()
    after = decisions(r)
    changed = [w for w in after if after[w] != before.get(w, 0)]
    assert len(changed) == 1
    return changed[0], result


def complete(url: str, prompt: str):
    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    return c.completions.create(model="default", prompt=prompt, max_tokens=2, temperature=0)


def test_kv_approximate_mode_sends_a_prefix_back_where_it_is_cached(workers):
    r = router(*sum((["--worker", w.url] for w in workers), []), "--no-events")
    try:
        first_worker, first = routed_to(r, lambda: complete(r.url, LONG + "Q1"))
        again_worker, again = routed_to(r, lambda: complete(r.url, LONG + "Q1"))
        assert again_worker == first_worker
        assert again.usage.prompt_tokens_details.cached_tokens >= 64
        metrics = httpx.get(r.url + "/metrics").text
        assert 'everybyte:router_overlap_blocks_total{tier="G1"}' in metrics
        assert "everybyte:router_worker_up" in metrics
    finally:
        r.stop()


def test_round_robin_alternates_and_reuses_nothing(workers):
    r = router(*sum((["--worker", w.url] for w in workers), []), "--policy", "round-robin", "--no-events")
    try:
        prompt = LONG + "round robin"
        w1, _ = routed_to(r, lambda: complete(r.url, prompt))
        w2, second = routed_to(r, lambda: complete(r.url, prompt))
        assert w1 != w2 and second.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        r.stop()


@pytest.fixture(scope="module")
def kv_router(workers):
    r = router(*sum((["--worker", w.url] for w in workers), []))
    yield r
    r.stop()


def test_streaming_passthrough(kv_router):
    c = openai.OpenAI(base_url=kv_router.url + "/v1", api_key="none", max_retries=0)
    chunks = list(c.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=4, temperature=0, stream=True))
    assert chunks and chunks[0].object == "chat.completion.chunk"
    with httpx.stream("POST", kv_router.url + "/v1/completions",
                      json={"prompt": "Hello", "max_tokens": 2, "stream": True}) as resp:
        lines = [ln for ln in resp.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    models = httpx.get(kv_router.url + "/v1/models").json()
    assert models["data"][0]["object"] == "model"
    tok = httpx.post(kv_router.url + "/tokenize", json={"prompt": "Hello"}).json()
    assert httpx.post(kv_router.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "Hello"


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": -3}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": []}).encode()),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "model": "nope"}).encode()),
    ("/v1/completions", json.dumps({"prompt": [999999999]}).encode()),
])
def test_malformed_requests_get_the_workers_4xx(workers, kv_router, path, body):
    headers = {"content-type": "application/json"}
    direct = httpx.post(workers[0].url + path, content=body, headers=headers)
    routed = httpx.post(kv_router.url + path, content=body, headers=headers)
    assert 400 <= direct.status_code < 500
    assert routed.status_code == direct.status_code and routed.json() == direct.json()


def test_sessions_reach_the_sessions_worker(kv_router):
    sid = "agent-7"
    r = httpx.post(kv_router.url + "/v1/chat/completions", headers={"X-Session-Id": sid},
                   json={"messages": [{"role": "user", "content": "Plan a trip."}], "max_tokens": 2})
    assert r.status_code == 200
    assert httpx.get(f"{kv_router.url}/v1/sessions/{sid}").json()["id"] == sid
    assert httpx.post(f"{kv_router.url}/v1/sessions/{sid}/park", json={"expected_gap_s": 5}).status_code == 200
    assert httpx.post(f"{kv_router.url}/v1/sessions/{sid}/resume").status_code == 200
    assert httpx.delete(f"{kv_router.url}/v1/sessions/{sid}").json()["deleted"] is True
    missing = httpx.get(f"{kv_router.url}/v1/sessions/nobody")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "session_not_found"


def test_dead_worker_is_routed_around_and_a_cut_stream_ends_cleanly():
    dead = f"http://127.0.0.1:{free_port()}"
    live = Server(*ENGINE)
    r = router("--worker", dead, "--worker", live.url, "--policy", "round-robin")
    try:
        health = httpx.get(r.url + "/health").json()
        assert health["workers"] == [live.url]
        for _ in range(2):
            assert complete(r.url, "Hello there").choices[0].text is not None
        with httpx.stream("POST", r.url + "/v1/completions", timeout=60,
                          json={"prompt": "Count: 1 2 3", "max_tokens": 400, "stream": True,
                                "ignore_eos": True}) as resp:
            lines = resp.iter_lines()
            assert next(ln for ln in lines if ln.startswith("data:"))
            live.stop(signal.SIGKILL)
            rest = [ln for ln in lines if ln]
        assert rest[-1] == "data: [DONE]"
        assert any('"worker_failed"' in ln for ln in rest)
        down = httpx.post(r.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert down.status_code == 503
        metrics = httpx.get(r.url + "/metrics").text
        assert 'everybyte:router_failed_requests_total{reason="stream_cut"} 1.0' in metrics
        assert 'everybyte:router_failed_requests_total{reason="no_worker"}' in metrics
    finally:
        r.stop()
        live.stop()


def test_workers_listing(workers, kv_router):
    data = httpx.get(kv_router.url + "/v1/workers").json()["data"]
    assert sorted(d["url"] for d in data) == sorted(w.url for w in workers)
    assert all(d["healthy"] and d["role"] == "both" and d["namespace_digest"] for d in data)
