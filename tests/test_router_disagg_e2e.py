"""Disaggregated prefill/decode through `everybyte router --disagg-threshold` on real workers
(`serve --role prefill` and `--role decode`, cluster contract §4): a long
prompt is prefilled on the prefill worker and its KV moves to the decode worker (the decode
worker's remote prefill tokens grow), with the same greedy text as an aggregated worker; a
short prompt stays on the decode worker alone."""
from __future__ import annotations

import httpx
import pytest
from serve_fixtures import Server, start_servers
from test_router_e2e import ENGINE, router

PROMPT = "The history of the printing press begins in the fifteenth century, when movable type " * 3


@pytest.fixture(scope="module")
def cluster():
    prefill, decode = start_servers((*ENGINE, "--role", "prefill"), (*ENGINE, "--role", "decode"))
    r = router("--worker", prefill.url, "--worker", decode.url, "--disagg-threshold", "32")
    yield r, prefill, decode
    for s in (r, prefill, decode):
        s.stop()


def _remote_tokens(decode: Server) -> float:
    try:
        return decode.metric('everybyte:prefill_tokens_total{source="remote"}')
    except KeyError:
        return 0.0


def test_long_prompt_is_prefilled_remotely(cluster):
    r, prefill, decode = cluster
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    before = _remote_tokens(decode)
    routed = httpx.post(r.url + "/v1/completions", json=body, timeout=120)
    assert routed.status_code == 200, routed.text
    assert _remote_tokens(decode) - before >= 32
    metrics = httpx.get(r.url + "/metrics").text
    assert 'everybyte:router_disagg_requests_total{outcome="remote_prefill"} 1.0' in metrics
    assert f'everybyte:router_decisions_total{{policy="kv",worker="{prefill.url}"}}' in metrics
    local = httpx.post(prefill.url + "/v1/completions", json=body, timeout=120).json()
    assert routed.json()["choices"][0]["text"] == local["choices"][0]["text"]


def test_short_prompt_stays_on_the_decode_worker(cluster):
    r, _, decode = cluster
    before = _remote_tokens(decode)
    resp = httpx.post(r.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert resp.status_code == 200 and _remote_tokens(decode) == before
