"""A worker's cluster face over real processes: `serve --kv-events` publishes its blocks (read by
cluster/kv_events_sub over real ZeroMQ), `GET /v1/kv/info` describes it, and two workers with the
same namespace share a real Redis tier: a prefix computed on one is reused by the other, never by
a worker whose KV bytes differ."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
from serve_fixtures import Server, free_port, start_servers

from everybyte.cluster.kv_events_sub import Subscriber
from everybyte.kv.block_id import KVNamespace
from everybyte.kv.events import AllBlocksCleared, BlockStored

SMALL = ("--kv-cache", "16MiB", "--max-num-seqs", "4", "--max-model-len", "512")
PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. " * 5


def _complete(url: str, prompt, max_tokens: int = 4) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_worker_publishes_events_and_describes_itself():
    ep = f"tcp://127.0.0.1:{free_port()}"
    srv = Server(*SMALL, "--kv-tiers", "none", "--kv-events", ep, "--role", "prefill")
    try:
        info = httpx.get(srv.url + "/v1/kv/info", timeout=5).json()
        assert info["role"] == "prefill"            # a prefill worker serves its KV on a free loopback port
        assert info["kv_connector"]["endpoint"].startswith("tcp://127.0.0.1:")
        assert info["kv_format"] == "nvfp4" and info["block_size"] == 16
        ns = KVNamespace(**info["namespace"])
        assert ns.digest.hex() == info["namespace_digest"] and ns.tenant_salt is None
        port = int(ep.rsplit(":", 1)[1])
        assert info["kv_events"] == {"endpoint": ep, "replay_endpoint": f"tcp://127.0.0.1:{port + 1}",
                                     "topic": "kv." + info["namespace_digest"]}
        load = info["load"]
        assert load["num_running"] == 0 and load["kv_blocks_free"] == load["kv_blocks_total"] > 0
        assert set(info["speeds"]) == {"prefill_tok_s", "load_tok_s"}

        got, lock = [], threading.Lock()

        def on_batch(b):
            with lock:
                got.append(b)
        sub = Subscriber(ep, info["kv_events"]["replay_endpoint"], on_batch).start()
        ids = httpx.post(srv.url + "/tokenize", json={"prompt": PROMPT}, timeout=10).json()["tokens"]
        body = _complete(srv.url, ids)
        assert body["usage"]["prompt_tokens"] == len(ids)
        full = len(ids) // 16
        deadline, hashes, tokens = time.monotonic() + 20, [], []
        while time.monotonic() < deadline and len(hashes) < full:
            time.sleep(0.1)
            with lock:
                stored = [e for b in got for e in b.events if isinstance(e, BlockStored)]
            hashes = [h for e in stored for h in e.block_hashes]
            tokens = [t for e in stored for t in e.token_ids]
        sub.stop()
        assert got[0].seq == 0 and isinstance(got[0].events[0], AllBlocksCleared)   # replayed from 0
        assert [b.seq for b in got] == list(range(len(got)))
        assert len(hashes) >= full and tokens[:full * 16] == ids[:full * 16]
        assert stored[0].parent_block_hash is None and len(stored[0].block_hashes) > 1   # one run, as vLLM sends
        info = httpx.get(srv.url + "/v1/kv/info", timeout=5).json()
        assert info["speeds"]["prefill_tok_s"] > 0                    # measured on the prompt
    finally:
        srv.stop()


def test_pod_tier_reuse_across_workers(redis_server):
    """A and B share a Redis tier and a namespace: B serves A's prompt from A's blocks (its
    cached_tokens show them) with the same greedy tokens. C (fp8 KV: other bytes, other names)
    never loads them."""
    tiers = ("--kv-tiers", f"{redis_server.url}:64MiB")
    a, b, c = start_servers((*SMALL, *tiers), (*SMALL, *tiers), (*SMALL, *tiers, "--kv-cache-dtype", "fp8"))
    try:
        infos = [httpx.get(s.url + "/v1/kv/info", timeout=5).json() for s in (a, b, c)]
        assert infos[0]["namespace_digest"] == infos[1]["namespace_digest"] != infos[2]["namespace_digest"]
        first = _complete(a.url, PROMPT)
        assert _cached(first) == 0
        # A answered only once its blocks reached the pod tier (no waiting here: read-your-writes)
        import redis
        keys = list(redis.Redis(port=redis_server.port).scan_iter("everybyte:kv:b:*"))
        assert len(keys) >= first["usage"]["prompt_tokens"] // 16
        reused = _complete(b.url, PROMPT)
        prompt_tokens = reused["usage"]["prompt_tokens"]
        assert _cached(reused) >= 16 * ((prompt_tokens - 1) // 16) - 16       # all full blocks but the exact tail's
        assert reused["choices"][0]["text"] == first["choices"][0]["text"]
        assert "G3.5" in infos[1]["speeds"]["load_tok_s"]
        assert httpx.get(b.url + "/v1/kv/info", timeout=5).json()["speeds"]["load_tok_s"]["G3.5"] > 0
        other = _complete(c.url, PROMPT)
        assert _cached(other) == 0
    finally:
        for s in (a, b, c):
            s.stop()


def test_bad_kv_events_arguments_fail_before_the_model_loads():
    for args, msg in [(["--kv-events", "127.0.0.1:5557"], "tcp://HOST:PORT"),
                      (["--kv-events-replay", "tcp://127.0.0.1:5558"], "needs --kv-events")]:
        p = subprocess.run([sys.executable, "-m", "everybyte.cli", "serve", *args], capture_output=True,
                           text=True, timeout=120)
        assert p.returncode != 0 and msg in p.stderr, p.stderr
