"""The OpenAI-compatible server, driven by the official `openai` client over real HTTP."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest
from serve_fixtures import Server

ENGINE = ["--kv-cache", "24MiB", "--kv-cache-dtype", "nvfp4", "--max-model-len", "1024",
          "--max-num-seqs", "64"]


@pytest.fixture(scope="module")
def server():
    s = Server(*ENGINE, "--served-model-name", "smol")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["smol"]


def test_completion_text_and_token_ids(client):
    r = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens > 0
    text = r.choices[0].text
    assert text
    ids = client.completions.create(model="smol", prompt=[504, 3575, 282, 4649, 314], max_tokens=4,
                                    temperature=0)
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens == 4


def test_greedy_is_deterministic_over_http(client):
    a = client.completions.create(model="smol", prompt="def fibonacci(n):", max_tokens=12, temperature=0)
    b = client.completions.create(model="smol", prompt="def fibonacci(n):", max_tokens=12, temperature=0)
    assert a.choices[0].text == b.choices[0].text


def test_seeded_request_alone_equals_next_to_others(server, client):
    """README "Batch invariance" over HTTP: a prompt shorter than a block (so no prefix reuse)."""
    seeded = dict(model="smol", prompt="The year 2010 was", max_tokens=16, temperature=0.8, seed=7,
                  logprobs=2, extra_body={"return_token_ids": True, "ignore_eos": True})
    pick = lambda r: (r.choices[0].model_extra["token_ids"], r.choices[0].logprobs.token_logprobs)
    alone = pick(client.completions.create(**seeded))

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
        others = [c.completions.create(model="smol", prompt=p, max_tokens=n, extra_body={"ignore_eos": True})
                  for p, n in (("def quicksort(arr):", 24), ("The history of Rome " * 8, 6), ("Colors:", 30))]
        out = await asyncio.gather(*others, c.completions.create(**seeded))
        await c.close()
        return out[-1]

    assert pick(asyncio.run(main())) == alone


def test_chat(client):
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_stream_with_usage(client):
    stream = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Count to five."}], max_tokens=12,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    whole = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "Count to five."}], max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == text


def test_completion_stream(client):
    stream = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=10,
                                       temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 10
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    whole = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=10, temperature=0)
    assert whole.choices[0].text == text


def _post(server, path, body, **kw):
    return httpx.post(server.url + path, content=body if isinstance(body, (bytes, str)) else json.dumps(body),
                      headers={"content-type": "application/json", **kw.pop("headers", {})}, timeout=60, **kw)


def _err(r, status):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}
    return e


def test_bad_inputs(server):
    assert "JSON" in _err(_post(server, "/v1/completions", b"{not json"), 400)["message"]
    e = _err(_post(server, "/v1/completions", {"prompt": "hi", "temperature": -1}), 400)
    assert e["param"] == "temperature"
    e = _err(_post(server, "/v1/completions", {"prompt": "hi", "top_p": 1.5}), 400)
    assert e["param"] == "top_p"
    e = _err(_post(server, "/v1/chat/completions", {"messages": "nope"}), 400)
    assert e["param"].startswith("messages")
    e = _err(_post(server, "/v1/completions", {"model": "gpt-9", "prompt": "hi"}), 404)
    assert e["code"] == "model_not_found"
    e = _err(_post(server, "/v1/completions", {"prompt": [1] * 1500}), 400)
    assert "1500" in e["message"] and "1024" in e["message"]
    e = _err(_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 5000}), 400)
    assert e["param"] == "max_tokens" and "5000" in e["message"]
    e = _err(_post(server, "/v1/completions", {"prompt": [10 ** 9]}), 400)
    assert "vocabulary" in e["message"]
    e = _err(_post(server, "/v1/completions", {"prompt": ""}), 400)
    e = _err(_post(server, "/v1/completions", b"x" * (9 * 1024 * 1024)), 413)
    _err(httpx.get(server.url + "/v1/nothing-here"), 404)
    assert httpx.get(server.url + "/health").status_code == 200


def test_disconnect_mid_stream_frees_blocks(server):
    free0 = server.metric("everybyte:kv_blocks_free")
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"prompt": "Write a long story about a dragon.", "max_tokens": 400,
                            "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(g.startswith("data:") for g in got)
    deadline = time.time() + 300                    # an upper bound only: it ends when the blocks are back
    while time.time() < deadline:
        if server.metric("everybyte:kv_blocks_free") == free0 and server.metric("everybyte:num_requests_running") == 0:
            break
        time.sleep(0.2)
    assert server.metric("everybyte:kv_blocks_free") == free0


def test_64_concurrent_streaming_clients(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)

        async def one(i):
            stream = await client.completions.create(model="smol", prompt=f"Item {i}: the number", max_tokens=8,
                                                     temperature=0.7, seed=i, stream=True)
            n = 0
            async for c in stream:
                n += bool(c.choices and c.choices[0].text)
            return n

        results = await asyncio.gather(*(one(i) for i in range(64)), return_exceptions=True)
        await client.close()
        return results

    results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    assert all(n > 0 for n in results)
    text = httpx.get(server.url + "/metrics").text
    assert "everybyte:time_to_first_token_seconds_bucket" in text
    assert 'everybyte:requests_total{endpoint="/v1/completions",status="200"}' in text


def test_api_key_queue_limit_and_sigterm():
    s = Server(*ENGINE, "--api-key", "sekrit", "--max-queue", "1", "--shutdown-timeout", "2")
    try:
        e = _err(_post(s, "/v1/completions", {"prompt": "hi", "max_tokens": 2}), 401)
        assert e["type"] == "authentication_error"
        auth = {"authorization": "Bearer sekrit"}
        assert _post(s, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers=auth).status_code == 200
        assert _concurrent_streams(s, auth, 4) == [200, 429, 429, 429]
        with httpx.stream("POST", s.url + "/v1/completions", headers=auth, timeout=60,
                          json={"prompt": "Tell a long story.", "max_tokens": 1000, "ignore_eos": True,
                                "stream": True}) as r:
            lines = r.iter_lines()
            first = next(lines)
            assert first.startswith("data:") and "error" not in first, first
            assert s.metric("everybyte:num_requests_running") == 1
            busy = _post(s, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, headers=auth)
            assert busy.status_code == 429 and busy.headers.get("retry-after"), (busy.text, next(lines))
            t0 = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)      # drain: the stream is cut at the 2 s deadline
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and "shutting_down" in rest[-2], rest[-3:]
        assert s.proc.wait(30) == 0
        assert time.monotonic() - t0 < 12
    finally:
        s.stop()


def _concurrent_streams(s, headers, n) -> list[int]:
    """n streaming requests at once against --max-queue 1: admission happens before the response
    starts, so all but one are a 429 with Retry-After (never a 200 with an error inside)."""
    async def one(client):
        async with client.stream("POST", "/v1/completions", headers=headers,
                                 json={"prompt": "Hello", "max_tokens": 40, "ignore_eos": True, "stream": True}) as r:
            body = "".join([line async for line in r.aiter_lines()])
            assert (r.status_code == 429) == bool(r.headers.get("retry-after"))
            assert r.status_code != 200 or ("error" not in body and body.endswith("[DONE]")), body[-200:]
            return r.status_code

    async def main():
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as client:
            return await asyncio.gather(*(one(client) for _ in range(n)))

    return sorted(asyncio.run(main()))


def test_cached_tokens_on_a_repeated_prefix(client):
    prefix = "You are a careful assistant. Answer in one short sentence. " * 6
    client.completions.create(model="smol", prompt=prefix + "What is 2+2?", max_tokens=2, temperature=0)
    r = client.completions.create(model="smol", prompt=prefix + "What is 3+3?", max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens >= 32


def test_sessions_park_resume_delete(server, client):
    msgs = [{"role": "system", "content": "You are a coding agent. " * 8},
            {"role": "user", "content": "List the files in the repository."}]
    r = client.chat.completions.create(model="smol", messages=msgs, max_tokens=6, temperature=0,
                                       extra_body={"session_id": "agent-42"})
    assert r.choices[0].message.content is not None
    info = httpx.get(server.url + "/v1/sessions/agent-42").json()
    assert info["state"] == "active" and info["blocks"]["G1"] > 0
    parked = _post(server, "/v1/sessions/agent-42/park", {"expected_gap_s": 20}).json()
    assert parked["state"] == "parked" and parked["blocks"]["G1"] == 0 and parked["blocks"]["G2"] > 0
    msgs += [{"role": "assistant", "content": r.choices[0].message.content},
             {"role": "user", "content": "Tool result: README.md setup.py src/"}]
    r2 = client.chat.completions.create(model="smol", messages=msgs, max_tokens=6, temperature=0,
                                        extra_headers={"X-Session-Id": "agent-42"})
    assert r2.usage.prompt_tokens_details.cached_tokens > 0
    _post(server, "/v1/sessions/agent-42/park", b"")
    resumed = _post(server, "/v1/sessions/agent-42/resume", b"").json()
    assert resumed["state"] == "active" and resumed["blocks"]["G1"] > 0
    assert httpx.delete(server.url + "/v1/sessions/agent-42").json()["deleted"] is True
    e = _err(httpx.get(server.url + "/v1/sessions/agent-42"), 404)
    assert e["code"] == "session_not_found"
    _err(_post(server, "/v1/sessions/nobody/park", b""), 404)
    _err(_post(server, "/v1/sessions/agent-42/park", {"expected_gap_s": -1}), 400)
    text = httpx.get(server.url + "/metrics").text
    assert 'everybyte:g1_bytes{category="weights"}' in text and "everybyte:tier_bytes_used" in text


def test_tokenize_and_return_token_ids(server):
    ids = _post(server, "/tokenize", {"prompt": "hello world", "add_special_tokens": False}).json()["tokens"]
    assert _post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == "hello world"
    r = _post(server, "/v1/completions", {"prompt": ids, "max_tokens": 5, "temperature": 0,
                                          "return_token_ids": True}).json()
    assert len(r["choices"][0]["token_ids"]) == 5
