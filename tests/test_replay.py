"""The agentic replay: error accounting against a server that fails on purpose, the report files,
bad input, and short replays against a live everybyte server and the embedded engine."""
from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from everybyte.bench import agentic

FAST = ["--trace", "synthetic:sessions=4,turns=4,seed=6,system_tokens=128,first_tokens=64,append_tokens=16,"
        "output_tokens=6", "--gap-scale", "0.01", "--no-progress", "--warmup", "0", "--metrics-interval", "0.2"]


class FakeOpenAI(ThreadingHTTPServer):
    """/v1/completions streaming OpenAI SSE (with `token_ids`, like vLLM's return_token_ids). With
    fail_on_purpose: HTTP 500 for every session's 3rd turn, and an error event inside the stream for
    the first 2nd turn it sees. With text_only: token-id prompts are refused, /tokenize is offered."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        self.requests, self.failures, self.lock = [], 0, threading.Lock()
        self.turns: dict[str, int] = {}
        self.stream_broken = False
        self.delay = 0.0
        self.text_only = False
        self.fail_on_purpose = False


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def log_message(self, *a):
        pass

    def _json(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        if self.path == "/v1/models":
            return self._json(200, {"data": [{"id": "fake", "max_model_len": 4096}]})
        if self.path == "/metrics":
            text = ('# TYPE everybyte:g1_bytes gauge\neverybyte:g1_bytes{category="weights"} 1000000\n'
                    'everybyte:g1_bytes{category="kv_running"} 2000000\neverybyte:kv_cache_usage_perc 0.25\n'
                    'everybyte:tier_bytes_capacity{tier="g1"} 67108864\n').encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(text)))
            self.end_headers()
            return self.wfile.write(text)
        self._json(404, {"error": {"message": "not found"}})

    def do_POST(self):
        srv: FakeOpenAI = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if self.path == "/tokenize" and srv.text_only:
            return self._json(200, {"tokens": [2000 + len(w) for w in body["prompt"].split()]})
        if srv.text_only and not isinstance(body.get("prompt"), str):
            return self._json(400, {"error": {"message": "prompt must be a string"}})
        if self.path != "/v1/completions":
            return self._json(404, {"detail": "Not Found"})
        sid = body.get("session_id")
        with srv.lock:
            n = srv.turns[sid] = srv.turns.get(sid, 0) + 1
            srv.requests.append({"body": body, "header_sid": self.headers.get("X-Session-Id"), "n": n})
        if srv.fail_on_purpose and sid != "probe" and n == 3:
            with srv.lock:
                srv.failures += 1
            return self._json(500, {"error": {"message": "failing on purpose"}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        with srv.lock:
            broken = srv.fail_on_purpose and n == 2 and not srv.stream_broken
            srv.stream_broken = srv.stream_broken or broken
        if broken:
            with srv.lock:
                srv.failures += 1
            self.wfile.write(b'data: {"error": {"message": "stream broke on purpose"}}\n\n')
            return
        prompt = body["prompt"] if isinstance(body["prompt"], list) else body["prompt"].split()
        for i in range(body["max_tokens"]):
            tok = 2000 + (len(prompt) + i) % 500
            chunk = {"choices": [{"index": 0, "text": f" w{tok}", "token_ids": [tok], "finish_reason":
                                  "length" if i == body["max_tokens"] - 1 else None}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(srv.delay)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"],
                 "prompt_tokens_details": {"cached_tokens": len(prompt) // 2}}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture
def fake():
    srv = FakeOpenAI()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def run(capsys, *argv):
    rc = agentic.main(list(argv))
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 else None), out.err


def test_errors_are_counted_and_the_output_joins_the_context(fake, capsys, tmp_path):
    fake.fail_on_purpose = True
    rc, res, err = run(capsys, "--endpoint", fake.url, "--concurrency", "2", "--park", "--park-min-gap", "0", *FAST,
                       "--json", str(tmp_path / "r.json"))
    assert rc == 0, err
    s, turns = res["summary"], res["turns"]
    sent = [r for r in fake.requests if r["body"]["session_id"] != "probe"]
    assert len(turns) == len(sent) == res["run"]["requests_sent"]
    assert s["errors"] == fake.failures == sum(not t["ok"] for t in turns) > 0
    assert s["error_kinds"]["HTTP 500"] >= 1 and any("stream broke" in (t["error"] or "") for t in turns)
    skipped = res["run"]["skipped_turns"]
    assert skipped.get("after_error_in_session", 0) >= 1
    assert res["assumptions"]["tokens"]["output_join"]["methods"] == {"server_ids": s["turns_ok"]}
    assert res["run"]["park"].get("park:unsupported", 0) >= 1          # 404 tolerated and reported
    # what the server saw: session ids, ignore_eos, and turn 2 = turn 1 + its generated ids + new input
    by_sid: dict[str, list] = {}
    for r in sent:
        assert r["header_sid"] == r["body"]["session_id"] and r["body"]["ignore_eos"] is True
        by_sid.setdefault(r["body"]["session_id"], []).append(r["body"])
    sid, bodies = next((k, v) for k, v in by_sid.items() if len(v) >= 2 and turns_ok(turns, k, 2))
    first, second = bodies[0]["prompt"], bodies[1]["prompt"]
    gen = [2000 + (len(first) + i) % 500 for i in range(bodies[0]["max_tokens"])]
    assert second[:len(first) + len(gen)] == first + gen and len(second) > len(first) + len(gen)
    assert s["prefix_hit_rate"] == pytest.approx(
        sum(t["cached_tokens"] for t in turns if t["ok"]) / sum(t["prompt_tokens"] for t in turns if t["ok"]))
    assert json.loads((tmp_path / "r.json").read_text())["summary"] == s


def turns_ok(turns, sid, n):
    return sum(1 for t in turns if t["session"] == sid and t["ok"]) >= n


def test_report_files_and_fields(fake, capsys, tmp_path):
    out = tmp_path / "rep"
    rc, res, err = run(capsys, "--endpoint", fake.url, "--sweep", "1,2", "--out", str(out), *FAST)
    assert rc == 0, err
    for key in ("output_tok_s", "total_tok_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s",
                "tok_s_per_user_p50", "goodput_tok_s", "prefix_hit_rate", "errors"):
        assert key in res["summary"]
    assert res["summary"]["output_tok_s"] > 0 and res["summary"]["kv_budget_bytes"] == 67108864
    assert {"trace", "scaling", "tokens", "replay", "metrics", "target", "hardware", "software"} <= set(res["assumptions"])
    assert [x["concurrency"] for x in res["sweep"]] == [1, 2]
    files = set(os.listdir(out))
    assert {"report.json", "report.md", "ttft_cdf.png", "throughput_vs_tok_s_user.png", "g1_bytes.png"} <= files
    md = (out / "report.md").read_text()
    assert "token_scale" in md and "Concurrency sweep" in md and "run_marker" in md
    saved = json.loads((out / "report.json").read_text())
    assert set(saved) >= {"summary", "assumptions", "turns"} and len(saved["turns"]) == len(res["turns"])
    assert saved["samples"] and saved["samples"][0]["g1_bytes"]["kv_running"] == 2000000


def test_bounds_open_loop_and_idle_skip(fake, capsys):
    trace = FAST[1]
    rc, res, err = run(capsys, "--endpoint", fake.url, "--trace", trace, "--no-progress", "--mode", "open",
                       "--rate", "50", "--max-requests", "6", "--warmup", "2", "--gap-scale", "0.01")
    assert rc == 0, err
    assert res["run"]["stopped_by"] == "max_requests" and res["run"]["requests_sent"] == 6
    assert res["summary"]["turns_warmup"] == 2 and res["summary"]["turns_measured"] == 4
    # long gaps while nothing is in flight are skipped down to --idle-skip, and reported
    rc, res, err = run(capsys, "--endpoint", fake.url, "--trace", trace, "--no-progress", "--concurrency", "1",
                       "--max-requests", "4", "--gap-scale", "1", "--max-gap", "30", "--idle-skip", "0.05")
    assert rc == 0, err
    assert res["run"]["idle_skips"] >= 1 and res["run"]["idle_skipped_s"] > 1 and res["run"]["t_end"] < 20
    rc, res, err = run(capsys, "--endpoint", fake.url, "--trace", trace, "--no-progress", "--concurrency", "2",
                       "--gap-scale", "1", "--max-gap", "30", "--idle-skip", "0", "--duration", "1.5")
    assert rc == 0, err
    assert res["run"]["stopped_by"] == "duration" and res["run"]["skipped_turns"]["stopped_by_bound"] > 0
    assert res["run"]["t_end"] < 10
    fake.delay = 0.5            # turns still running after the drain are cancelled and counted as errors
    rc, res, err = run(capsys, "--endpoint", fake.url, "--trace", trace, "--no-progress", "--concurrency", "2",
                       "--duration", "1", "--drain", "0.5")
    assert rc == 0, err
    cancelled = [t for t in res["turns"] if not t["ok"] and t["error"].startswith("cancelled")]
    assert cancelled and res["summary"]["errors"] == len(cancelled) and res["run"]["t_end"] < 5
    assert len(res["turns"]) == res["run"]["requests_sent"]


def test_text_prompts_and_sub_agent_sessions(fake, capsys, tmp_path):
    fake.text_only = True
    reqs = [{"t": 0, "type": "n", "in": 300, "out": 4, "hash_ids": [1, 2, 3, 4]},
            {"t": 1, "type": "s", "in": 340, "out": 3, "hash_ids": [1, 2, 3, 4, 5]},
            {"t": 2, "type": "s", "in": 420, "out": 3, "hash_ids": [1, 2, 3, 4, 5, 6]},
            {"t": 3, "type": "n", "in": 400, "out": 2, "hash_ids": [1, 2, 3, 4, 7, 8], "think_time": 1}]
    (tmp_path / "s.json").write_text(json.dumps({"id": "sess", "block_size": 64, "requests": reqs}))
    rc, res, err = run(capsys, "--endpoint", fake.url, "--trace", str(tmp_path), "--no-progress", "--warmup", "0",
                       "--token-scale", "4", "--output-scale", "1", "--gap-scale", "0.01")
    assert rc == 0, err
    assert res["assumptions"]["tokens"]["prompt_mode"] == "text" and res["summary"]["errors"] == 0
    join = res["run"]["output_join"]
    assert join["methods"] == {"text": 4} and join["round_trip_rate"] == 1.0
    sids = [r["body"]["session_id"] for r in fake.requests if r["body"].get("session_id") not in ("probe", None)]
    assert sids == ["sess", "sess.sub1", "sess.sub1", "sess"]
    prompts = [r["body"]["prompt"] for r in fake.requests if r["body"].get("session_id") not in ("probe", None)]
    assert all(isinstance(p, str) for p in prompts)
    assert prompts[1].startswith(prompts[0] + " w")                  # the generated text joined the context
    assert prompts[2].startswith(prompts[1]) and prompts[3].startswith(prompts[0][:200])


def test_unreachable_endpoint_and_bad_trace_fail_before_the_run(capsys, tmp_path):
    from serve_fixtures import free_port
    url = f"http://127.0.0.1:{free_port()}"
    rc, _, err = run(capsys, "--endpoint", url, *FAST)
    assert rc == 2 and url in err and "cannot reach" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\nnope\n')
    rc, _, err = run(capsys, "--endpoint", url, "--trace", str(bad))
    assert rc == 2 and f"{bad}:2" in err and "--skip-bad" in err


@pytest.mark.parametrize("args, message", [
    (["--max-sessions", "-2"], "argument --max-sessions: must be >= 1, got '-2'"),   # sliced 2 sessions off
    (["--rate", "-1"], "argument --rate: must be > 0"),
    (["--duration", "0"], "argument --duration: must be > 0"),
    (["--warmup", "-1"], "argument --warmup: must be >= 0"),
    (["--request-timeout", "abc"], "argument --request-timeout: expected a number, got 'abc'"),
])
def test_out_of_range_flags_are_usage_errors(capsys, args, message):
    with pytest.raises(SystemExit) as e:
        agentic.main(["--embedded", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_an_unwritable_report_fails_before_the_run(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc, _, err = run(capsys, "--embedded", *FAST, "--out", str(blocker / "report"))
    assert rc == 2 and f"cannot write '{blocker / 'report'}'" in err


@pytest.mark.slow
def test_embedded_short_replay(capsys):
    rc, res, err = run(capsys, "--embedded", *FAST, "--max-requests", "3", "--max-output", "3",
                       "--concurrency", "2", "--kv-cache", "16MiB", "--max-model-len", "2048")
    assert rc == 0, err
    s = res["summary"]
    assert s["errors"] == 0 and s["turns_ok"] == 3 and s["output_tokens"] == sum(t["max_tokens"] for t in res["turns"])
    assert res["run"]["output_join"]["methods"] == {"server_ids": 3}
    assert res["assumptions"]["target"]["target"] == "embedded" and s["output_tok_s_per_gib_kv"] > 0


@pytest.mark.slow
def test_live_everybyte_server_short_replay(capsys):
    from serve_fixtures import Server
    srv = Server("--kv-cache", "16MiB", "--max-model-len", "2048")
    try:
        rc, res, err = run(capsys, "--endpoint", srv.url, *FAST, "--max-requests", "3", "--max-output", "3",
                           "--concurrency", "2", "--park")
    finally:
        srv.stop()
    assert rc == 0, err
    s = res["summary"]
    assert s["errors"] == 0 and s["turns_ok"] == 3
    assert all(t["completion_tokens"] == t["max_tokens"] for t in res["turns"])
    assert res["assumptions"]["target"]["everybyte_metrics"] is True
    assert res["assumptions"]["tokens"]["prompt_mode"] == "ids"
