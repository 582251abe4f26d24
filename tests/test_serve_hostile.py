"""Hostile clients and tenants over real HTTP (issue #21): every bad input is a 4xx naming its
field and leaves the server's state as it was; tenants keyed apart share no KV and no sessions;
dropping a session keeps the blocks another one shares. One server serves every test here."""
from __future__ import annotations

import json
import select
import socket

import httpx
import pytest
from serve_fixtures import Server

ALICE, BOB = "k-alice", "k-bob"
ENGINE = ["--kv-cache", "24MiB", "--kv-cache-dtype", "nvfp4", "--max-model-len", "1024", "--max-num-seqs", "16"]


@pytest.fixture(scope="module")
def server():
    s = Server(*ENGINE, "--api-key", ALICE, "--api-key", BOB, "--cache-salt-from-api-key",
               "--max-body-bytes", "262144", "--max-sessions", "8")
    yield s
    s.stop()


def post(server, path, body, key=ALICE, headers=None):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"content-type": "application/json", "authorization": f"Bearer {key}",
                               **(headers or {})})


def call(server, method, path, key=ALICE):
    return httpx.request(method, server.url + path, headers={"authorization": f"Bearer {key}"}, timeout=60)


def err(r, status, param="?"):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}
    if param != "?":
        assert e["param"] == param, e
    return e


def complete(server, prompt, key=ALICE, **kw):
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0, **kw}, key)
    assert r.status_code == 200, r.text
    return r.json()


def test_lone_surrogates_are_400_naming_the_field(server):
    e = err(post(server, "/v1/completions", '{"prompt": "hi \\ud800"}'), 400, "prompt")
    assert "surrogate" in e["message"] and "Error" not in e["message"]
    err(post(server, "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\udfff"}]}'),
        400, "messages.0.content")
    err(post(server, "/tokenize", '{"prompt": "\\ud800"}'), 400, "prompt")
    assert complete(server, "paired \U0001F600 is fine")["choices"]     # a real emoji passes


def test_body_limit_counts_chunked_bytes(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"authorization: Bearer " + ALICE.encode() + b"\r\ntransfer-encoding: chunked\r\n\r\n")
        chunk = b"x" * 16384
        try:
            for _ in range(64):             # 1 MiB against a 256 KiB limit, no Content-Length
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                if select.select([s], [], [], 0.01)[0]:
                    break                   # the server answered: stop before it closes on us
        except OSError:
            pass
        reply = b""
        while b"request_too_large" not in reply and (part := s.recv(4096)):
            reply += part
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413"), reply[:200]
    assert "request_too_large" in reply


def test_seed_stop_and_session_id_limits(server):
    e = err(post(server, "/v1/completions", {"prompt": "hi", "seed": 2 ** 64}), 400, "seed")
    assert "9223372036854775807" in e["message"]
    e = err(post(server, "/v1/completions", {"prompt": "hi", "stop": ["x"] * 50_000}), 400, "stop")
    assert "64" in e["message"]
    err(post(server, "/v1/completions", {"prompt": "hi", "stop": ["y" * 257]}), 400, "stop")
    out = complete(server, "Count: one, two,", max_tokens=12, stop=[" three", "four"] + [f"zz{i}" for i in range(60)])
    assert "three" not in out["choices"][0]["text"]
    err(post(server, "/v1/completions", {"prompt": "hi"}, headers={"X-Session-Id": "s" * 300}), 400, "X-Session-Id")
    err(post(server, "/v1/completions", {"prompt": "hi", "session_id": "s" * 300}), 400, "session_id")
    err(call(server, "GET", "/v1/sessions/" + "s" * 300), 400, "session_id")
    err(post(server, "/v1/completions", {"prompt": "hi", "cache_salt": ""}), 400, "cache_salt")
    err(post(server, "/v1/completions", {"prompt": [[1]] * 257, "max_tokens": 1}), 400, "prompt")   # > --max-queue


def test_one_json_boundary_for_every_route(server):
    deep = "[" * 20_000 + "]" * 20_000
    for path in ("/v1/completions", "/v1/sessions/x/park", "/tokenize"):
        e = err(post(server, path, deep), 400)
        assert "nested" in e["message"], e
    err(post(server, "/v1/sessions/x/park", b"\xff\xfe"), 400)


def test_bad_gap_leaves_the_session_intact(server):
    complete(server, "Session state test.", session_id="gap")
    for bad in ('{"expected_gap_s": NaN}', '{"expected_gap_s": 1e999}', '{"expected_gap_s": -1}',
                '{"expected_gap_s": "soon"}', '[1, 2]'):
        err(post(server, "/v1/sessions/gap/park", bad), 400)
    info = call(server, "GET", "/v1/sessions/gap")
    assert info.status_code == 200 and info.json()["state"] == "active", info.text
    assert post(server, "/v1/sessions/gap/park", {"expected_gap_s": 5}).json()["state"] == "parked"


def test_internal_names_are_not_client_names(server):
    complete(server, "Shared marker test.", session_id="<shared>")
    assert post(server, "/v1/sessions/<shared>/park", b"").json()["state"] == "parked"
    call(server, "DELETE", "/v1/sessions/<shared>")


def test_resume_of_unknown_or_deleted_session_is_404(server):
    err(post(server, "/v1/sessions/never-seen/resume", b""), 404)
    err(call(server, "GET", "/v1/sessions/never-seen"), 404)        # and no phantom was made
    complete(server, "Short lived.", session_id="gone")
    assert call(server, "DELETE", "/v1/sessions/gone").json()["deleted"] is True
    err(post(server, "/v1/sessions/gone/resume", b""), 404)


def test_cache_salt_and_tenants_keep_kv_apart(server):
    prompt = "Tenant isolation check: the quick brown fox jumps over the lazy dog. " * 4
    cached = lambda out: out["usage"]["prompt_tokens_details"]["cached_tokens"]  # noqa: E731
    complete(server, prompt, cache_salt="s1")
    assert cached(complete(server, prompt, cache_salt="s1")) >= 32
    assert cached(complete(server, prompt, cache_salt="s2")) == 0
    assert cached(complete(server, prompt, key=BOB, cache_salt="s1")) == 0      # same salt, other tenant
    assert cached(complete(server, prompt, key=BOB)) == 0
    assert cached(complete(server, prompt, key=BOB)) >= 32
    complete(server, "Alice's agent.", session_id="agent")
    err(call(server, "GET", "/v1/sessions/agent", key=BOB), 404)                 # sessions are per tenant
    assert call(server, "GET", "/v1/sessions/agent").status_code == 200
    err(call(server, "GET", "/v1/sessions/agent", key="k-mallory"), 401)


def test_drop_keeps_blocks_another_session_shares(server):
    system = "You are a coding agent working in a large repository; be terse and precise. " * 6
    ids = post(server, "/tokenize", {"prompt": system, "add_special_tokens": False}).json()["tokens"]
    for sid in ("A", "B"):
        complete(server, system + f" Task for {sid}: list the files.", session_id=sid)
    assert post(server, "/v1/sessions/B/park", b"").json()["blocks"]["G1"] == 0
    assert call(server, "DELETE", "/v1/sessions/A").json()["deleted"] is True
    resumed = post(server, "/v1/sessions/B/resume", b"").json()
    assert resumed["blocks"]["G1"] + resumed["blocks"]["loading"] >= len(ids) // 16
    out = complete(server, system + " Task for B: list the files. Now read README.md.", session_id="B")
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= (len(ids) // 16 - 1) * 16


def test_sessions_are_bounded_least_recently_active_first(server):
    for i in range(10):
        complete(server, f"Bounded {i}.", session_id=f"lru-{i}")
    err(call(server, "GET", "/v1/sessions/lru-0"), 404)
    assert call(server, "GET", "/v1/sessions/lru-9").status_code == 200


def test_metrics_are_labelled_by_route_never_by_client_values(server):
    for i in range(3):
        call(server, "GET", f"/v1/sessions/probe-{i}")
        call(server, "GET", f"/v1/no-such-route-{i}")
    text = httpx.get(server.url + "/metrics").text                 # open, like vLLM's
    lines = [l for l in text.splitlines() if l.startswith("everybyte:requests_total")]
    assert any('endpoint="/v1/sessions/{session_id}"' in l for l in lines)
    assert any('endpoint="unmatched"' in l for l in lines)
    assert not any("probe-" in l or "no-such-route" in l for l in lines), lines
