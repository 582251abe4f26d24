"""`everybyte bench kv-transfer`: what disaggregated prefill/decode moves, per KV format.

In one process, a prefill engine (LLM(kv_role="prefill"), its ZeroMQ block server on 127.0.0.1)
and a decode engine (kv_role="decode") over one copy of the weights: each prompt is prefilled
(max_tokens=1, do_remote_decode), then decoded from the fetched blocks (do_remote_prefill); the
same prompt recomputed on a fresh decode engine is the baseline. Reported per KV format: the
stored block size on the wire, bytes and bits per token and per value, the fetch's bandwidth
(bytes received over the seconds spent in the connector's fetch: a real socket round trip,
framing and checksums included), and time to first token on the decode side with the transfer
vs recomputing the prompt.
"""
from __future__ import annotations

import argparse
import time

from everybyte.bench.report import emit, environment
from everybyte.cli_args import count


def _prompts(tokenizer, n_tokens: int, count: int) -> list[list[int]]:
    import argparse as stdlib_argparse
    with open(stdlib_argparse.__file__) as f:
        ids = tokenizer.encode(f.read())
    return [ids[i * n_tokens:(i + 1) * n_tokens] for i in range(count)]


def _paths(llm) -> dict:
    return dict(llm.stats()["kv_transfer"]["paths"].get("zmq", {}))


def run_format(loaded, kv_dtype: str, prompts: list[list[int]], engine: dict) -> dict:
    from everybyte import LLM, SamplingParams
    prefill = LLM(loaded, kv_role="prefill", kv_cache_dtype=kv_dtype, **engine)
    decode = LLM(loaded, kv_role="decode", kv_cache_dtype=kv_dtype, **engine)
    recompute = LLM(loaded, kv_cache_dtype=kv_dtype, **engine)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    decode.generate([[1, 2, 3] * 8], one)                 # warm both engines' first step
    recompute.generate([[1, 2, 3] * 8], one)
    rows = []
    for ids in prompts:
        t = time.perf_counter()
        out = prefill.generate([ids], one, kv_transfer_params={"do_remote_decode": True})[0]
        prefill_s = time.perf_counter() - t
        params = out.kv_transfer_params
        before, t = _paths(decode), time.perf_counter()
        got = decode.generate([ids], one, kv_transfer_params={"do_remote_prefill": True, **params})[0]
        transfer_ttft = time.perf_counter() - t
        after = _paths(decode)
        t = time.perf_counter()
        recompute.generate([ids], one)
        fetched = after["bytes_received"] - before.get("bytes_received", 0)
        fetch_s = after["seconds"] - before.get("seconds", 0.0)
        rows.append({"prefill_s": prefill_s, "decode_ttft_transfer_s": transfer_ttft, "fetch_bytes": fetched,
                     "fetch_s": fetch_s, "fetch_MB_per_s": fetched / max(fetch_s, 1e-9) / 1e6,
                     "decode_ttft_recompute_s": time.perf_counter() - t, "cached_tokens": got.num_cached_tokens})
    z = _paths(decode)
    mc = loaded.config
    values_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim
    nbytes, blocks = z.get("bytes_received", 0), max(z.get("blocks_received", 0), 1)
    tokens = blocks * prefill.config.block_size        # a prompt's last full block is recomputed, not fetched
    prefill.close()
    med = sorted(rows, key=lambda r: r["decode_ttft_transfer_s"])[len(rows) // 2]
    return {"kv_cache_dtype": kv_dtype, "tokens_transferred": tokens, "blocks": z.get("blocks_received", 0),
            "bytes_received": nbytes, "bytes_per_block_on_wire": nbytes / blocks,
            "bytes_per_token": nbytes / max(tokens, 1),
            "bits_per_value_on_wire": 8 * nbytes / max(tokens * values_per_token, 1),
            "fetch_seconds": z.get("seconds", 0.0), "fetch_MB_per_s": nbytes / max(z.get("seconds", 0.0), 1e-9) / 1e6,
            "fetch_ms_per_request": 1e3 * z.get("seconds", 0.0) / max(z.get("fetches", 0), 1),
            "median_fetch_MB_per_s": sorted(r["fetch_MB_per_s"] for r in rows)[len(rows) // 2],
            "failed": z.get("failed", 0), "corrupt": z.get("corrupt", 0),
            "median_request": med, "requests": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="everybyte bench kv-transfer", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--kv-dtypes", default="nvfp4,fp16", help="comma-separated KV formats to compare")
    p.add_argument("--prompt-tokens", type=count, default=512)
    p.add_argument("--requests", type=count, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import torch

    from everybyte.models.loader import load_model
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    loaded = load_model(args.model, dtype=dtype, device=args.device)
    prompts = _prompts(loaded.tokenizer, args.prompt_tokens, args.requests)
    engine = dict(kv_tiers="none", max_model_len=args.prompt_tokens + 64, kv_cache_bytes="64MiB",
                  dtype=dtype, device=args.device)
    formats = [run_format(loaded, f.strip(), prompts, engine) for f in args.kv_dtypes.split(",") if f.strip()]
    by = {f["kv_cache_dtype"]: f for f in formats}
    result = {"benchmark": "kv-transfer", "model": loaded.config.model_id, "prompt_tokens": args.prompt_tokens,
              "requests": args.requests, "formats": formats, "environment": environment()}
    if "nvfp4" in by and "fp16" in by:
        result["nvfp4_over_fp16_bytes"] = by["nvfp4"]["bytes_per_token"] / by["fp16"]["bytes_per_token"]
    emit(result, args.json)
    return 0
