"""`everybyte bench serve`: the same concurrent workload over HTTP and in process.

Measures what the HTTP layer costs: output tokens/s through `everybyte serve` (official
`openai` async client, streaming) vs the in-process engine, and the TTFT p50 it adds.
The server runs in a subprocess, then the in-process engine in this one, never both at once.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

from everybyte.bench.report import emit, environment
from everybyte.bench.servers import free_port
from everybyte.cli_args import count


def _prompts(n: int) -> list[str]:
    topics = ["a lighthouse", "compilers", "the ocean", "a chess game", "bread", "rain", "a robot", "trains"]
    return [f"Request {i}: write a short paragraph about {topics[i % len(topics)]}." for i in range(n)]


def _engine_flags(a) -> list[str]:
    flags = ["--kv-cache", a.kv_cache, "--kv-cache-dtype", a.kv_cache_dtype, "--max-model-len",
             str(a.max_model_len), "--max-num-seqs", str(a.clients)]
    return flags + (["--model", a.model] if a.model else [])


async def _http_run(url: str, prompts: list[str], max_tokens: int):
    """Streams every request with a plain httpx client (SSE lines, one json.loads each), so the
    client's own parsing takes as little of the shared CPU as possible."""
    import httpx
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        async def one(p):
            t0 = time.perf_counter()
            ttft, n = None, 0
            body = {"model": "default", "prompt": p, "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
            async with client.stream("POST", "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    if ttft is None and '"text": ""' not in line:
                        ttft = time.perf_counter() - t0
                    if '"usage": {' in line:
                        n = json.loads(line[6:])["usage"]["completion_tokens"]
            return ttft, n

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts), return_exceptions=True)
        wall = time.perf_counter() - t0
    ok = [r for r in results if not isinstance(r, BaseException)]
    return wall, ok, len(results) - len(ok)


def _start_server(a) -> tuple[subprocess.Popen, str]:
    import httpx
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "everybyte.cli", "serve", "--port", str(port),
                             "--log-level", "warning", "--served-model-name", "default", *_engine_flags(a)])
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


def measure_http(a, prompts) -> dict:
    proc, url = _start_server(a)
    try:
        asyncio.run(_http_run(url, prompts[:2], 4))  # warm-up
        wall, ok, errors = asyncio.run(_http_run(url, prompts, a.max_tokens))
    finally:
        proc.terminate()
        proc.wait(60)
    tokens = sum(n for _, n in ok)
    return {"tok_s": tokens / wall, "ttft_p50_s": statistics.median(t for t, _ in ok if t is not None),
            "output_tokens": tokens, "wall_s": wall, "errors": errors}


def measure_inprocess(a, prompts) -> dict:
    from everybyte import LLM, SamplingParams
    kw = dict(kv_cache_bytes=a.kv_cache, kv_cache_dtype=a.kv_cache_dtype, max_model_len=a.max_model_len,
              max_num_seqs=a.clients)
    llm = LLM(a.model, **kw)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tok_s": tokens / wall, "ttft_p50_s": statistics.median(o.metrics.ttft for o in outs),
            "output_tokens": tokens, "wall_s": wall, "errors": 0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="everybyte bench serve", description=__doc__)
    p.add_argument("--clients", type=count, default=64)
    p.add_argument("--max-tokens", type=count, default=32)
    p.add_argument("--model", default=None)
    p.add_argument("--kv-cache", default="64MiB")
    p.add_argument("--kv-cache-dtype", default="nvfp4")
    p.add_argument("--max-model-len", type=count, default=1024)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    prompts = _prompts(a.clients)
    http = measure_http(a, prompts)
    inproc = measure_inprocess(a, prompts)
    emit({"http_tok_s": http["tok_s"], "inprocess_tok_s": inproc["tok_s"],
          "ratio": http["tok_s"] / inproc["tok_s"],
          "ttft_added_p50_s": http["ttft_p50_s"] - inproc["ttft_p50_s"],
          "errors": http["errors"], "http": http, "inprocess": inproc,
          "config": {"clients": a.clients, "max_tokens": a.max_tokens, "kv_cache": a.kv_cache,
                     "kv_cache_dtype": a.kv_cache_dtype, "max_model_len": a.max_model_len,
                     "model": a.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)",
                     "workload": "all clients start at once, greedy, ignore_eos, streaming over HTTP",
                     **environment()}}, a.json)
    return 0
