"""`everybyte bench engine`: prefill and decode tokens/s, everybyte vs transformers, same run.

Each side runs in its own subprocess (so peak RSS is its own), with the same threads, compute
dtype and GGUF file. Prefill: one prompt of --prompt-len tokens, 1 new token. Decode: B prompts
of --decode-prompt-len tokens, --new-tokens each (ignore_eos), greedy; tok/s = B * new_tokens /
wall time of the whole generate call (its short prefill included, on both sides). Prefill is the
best of --prefill-repeats distinct prompts (nothing cached between them), since a noisy shared
machine can slow one run by a third.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

from everybyte.bench.report import emit, environment
from everybyte.cli_args import count


def _prompts(tokenize, n: int, length: int, offset: int = 0) -> list[list[int]]:
    """n distinct windows of CPython's argparse.py (no shared prefixes: nothing to reuse)."""
    import argparse as stdlib_argparse
    with open(stdlib_argparse.__file__) as f:
        ids = tokenize(f.read())
    need = offset + n * length
    ids = ids * (need // len(ids) + 1)
    return [ids[offset + i * length:offset + (i + 1) * length] for i in range(n)]


def _prefill_prompts(tokenize, a) -> list[list[int]]:
    """--prefill-repeats distinct windows, none overlapping the decode prompts."""
    return [_prompts(tokenize, 1, a.prompt_len, offset=0 if r == 0 else 10_000 + 3_000 * r)[0]
            for r in range(a.prefill_repeats)]


def _best_rate(tokens: int, run, prompts) -> float:
    best = float("inf")
    for prompt in prompts:
        t = time.perf_counter()
        run(prompt)
        best = min(best, time.perf_counter() - t)
    return tokens / best


def run_everybyte(a) -> dict:
    import torch

    from everybyte import LLM, SamplingParams
    llm = LLM(a.model, kv_cache_dtype=a.kv_cache_dtype, kv_cache_bytes=a.kv_cache, dtype=a.dtype,
              weights_dtype=a.weights_dtype,
              max_model_len=max(a.prompt_len, a.decode_prompt_len + a.new_tokens) + 16,
              max_num_seqs=max(a.batches), max_num_batched_tokens=a.max_num_batched_tokens)
    tok = lambda s: llm.tokenizer.encode(s, add_special_tokens=False)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(_prompts(tok, 1, 64, offset=a.prompt_len), SamplingParams(temperature=0, max_tokens=4,
                                                                           ignore_eos=True))
    prefill = _best_rate(a.prompt_len, lambda p: llm.generate([p], one), _prefill_prompts(tok, a))
    decode = {}
    for j, b in enumerate(a.batches):
        prompts = _prompts(tok, b, a.decode_prompt_len, offset=a.prompt_len + 64 + j * 32 * a.decode_prompt_len)
        p = SamplingParams(temperature=0, max_tokens=a.new_tokens, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, p)
        dt = time.perf_counter() - t
        assert all(len(o.token_ids) == a.new_tokens for o in outs)
        decode[str(b)] = b * a.new_tokens / dt
    return {"prefill_tok_s": prefill, "decode_tok_s": decode, "dtype": str(llm.config.dtype),
            "kv_pool": llm.stats()["kv_pool"], "threads": torch.get_num_threads(),
            "weights_format": llm.loaded.weights_format, "weights_bytes": llm.weights_bytes}


def run_transformers(a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    from everybyte import default_model_path
    from everybyte.engine.config import resolve_dtype
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    path = a.model or default_model_path()
    d, f = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    dtype = resolve_dtype(a.hf_dtype or a.dtype)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tok = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]

    def gen(prompts, n):
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=n, min_new_tokens=n, pad_token_id=pad)

    gen(_prompts(tok, 1, 64, offset=a.prompt_len), 4)
    prefill = _best_rate(a.prompt_len, lambda p: gen([p], 1), _prefill_prompts(tok, a))
    decode = {}
    for j, b in enumerate(a.batches):
        prompts = _prompts(tok, b, a.decode_prompt_len, offset=a.prompt_len + 64 + j * 32 * a.decode_prompt_len)
        t = time.perf_counter()
        out = gen(prompts, a.new_tokens)
        dt = time.perf_counter() - t
        assert out.shape[1] == a.decode_prompt_len + a.new_tokens
        decode[str(b)] = b * a.new_tokens / dt
    return {"prefill_tok_s": prefill, "decode_tok_s": decode, "dtype": str(dtype),
            "threads": torch.get_num_threads()}


def run_llama_server(a) -> dict:
    """llama-server at -np B for each batch B: B concurrent requests of --decode-prompt-len tokens and
    --new-tokens output tokens (ignore_eos); tok/s = all predicted tokens / wall time (the batch's
    prefill included, as on everybyte's side). bench/peers/llama_server_decode.py does the work."""
    import importlib.util
    import tempfile
    from pathlib import Path

    from everybyte import default_model_path
    path = Path(__file__).resolve().parents[2] / "bench" / "peers" / "llama_server_decode.py"
    spec = importlib.util.spec_from_file_location("everybyte_llama_server_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    peer = mod.load_peer()
    if peer.missing():
        raise SystemExit(f"llama-server not installed: {peer.missing()[0]}; build it with: {peer.INSTALL}")
    args = argparse.Namespace(model=a.model or str(default_model_path()), threads=a.threads,
                              prompt_tokens=a.decode_prompt_len, max_tokens=a.new_tokens,
                              ctx=a.decode_prompt_len + a.new_tokens + 64, repeat=2,
                              log_dir=tempfile.mkdtemp(prefix="everybyte-llama-server-"))
    runs = {str(b): mod.measure(peer, args, b) for b in a.batches}
    return {"version": peer.version(), "decode_tok_s": {b: r["aggregate_tok_s"] for b, r in runs.items()},
            "runs": runs}


def _side(a) -> int:
    import torch
    torch.set_num_threads(a.threads)
    result = (run_everybyte if a.side == "everybyte" else run_transformers)(a)
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(result))
    return 0


def _spawn(side: str, argv: list[str]) -> dict:
    cmd = [sys.executable, "-m", "everybyte.bench.engine", "--side", side, *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} side failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="everybyte bench engine", description=__doc__)
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="compute dtype for both sides (auto = the engine default)")
    p.add_argument("--hf-dtype", default=None, help="override the transformers side's dtype")
    p.add_argument("--kv-cache-dtype", default="nvfp4")
    p.add_argument("--weights-dtype", default="auto", help="everybyte's weights: auto, nvfp4, bf16, fp32")
    p.add_argument("--baseline-weights", default=None,
                   help="also run everybyte with these weights (e.g. fp32) in the same run, and report the ratios")
    p.add_argument("--kv-cache", default="256MiB")
    p.add_argument("--max-num-batched-tokens", type=count, default=2048)
    p.add_argument("--prompt-len", type=count, default=2048)
    p.add_argument("--prefill-repeats", type=count, default=3, help="prefill: best of this many prompts")
    p.add_argument("--decode-prompt-len", type=count, default=32)
    p.add_argument("--new-tokens", type=count, default=128)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--threads", type=count, default=os.cpu_count())
    p.add_argument("--quick", action="store_true", help="prompt 256, 16 new tokens, batches 1,8")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--llama-server", action="store_true",
                   help="also run llama.cpp's llama-server (bench/peers/llamaserver.py) on the same GGUF: "
                        "-np B for each batch B, same prompt/new tokens and threads")
    p.add_argument("--json", default=None, help="also write the JSON here")
    p.add_argument("--side", choices=("everybyte", "transformers"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    if a.quick:
        a.prompt_len, a.new_tokens, a.batches = 256, 16, "1,8"
    a.batches = [int(b) for b in str(a.batches).split(",")]
    if a.side:
        return _side(a)
    from everybyte.engine.config import resolve_dtype
    dtype = str(resolve_dtype(a.dtype)).replace("torch.", "")
    child = ["--dtype", dtype, "--kv-cache-dtype", a.kv_cache_dtype, "--kv-cache", a.kv_cache,
             "--max-num-batched-tokens", str(a.max_num_batched_tokens), "--prompt-len", str(a.prompt_len),
             "--decode-prompt-len", str(a.decode_prompt_len), "--new-tokens", str(a.new_tokens),
             "--prefill-repeats", str(a.prefill_repeats),
             "--batches", ",".join(map(str, a.batches)), "--threads", str(a.threads)]
    child += ["--model", a.model] if a.model else []
    child += ["--hf-dtype", a.hf_dtype] if a.hf_dtype else []
    ours = _spawn("everybyte", child + ["--weights-dtype", a.weights_dtype])
    base = a.baseline_weights and _spawn("everybyte", child + ["--weights-dtype", a.baseline_weights])
    theirs = None if a.skip_transformers else _spawn("transformers", child)
    llama = run_llama_server(a) if a.llama_server else None
    keys = ("prefill_tok_s", "decode_tok_s", "peak_rss_bytes")
    result = {"everybyte": {k: ours[k] for k in (*keys, "weights_format", "weights_bytes")},
              "transformers": theirs and {k: theirs[k] for k in keys}}
    if base:
        bs = [str(b) for b in a.batches]
        result[f"everybyte_{a.baseline_weights}_weights"] = {k: base[k] for k in (*keys, "weights_format", "weights_bytes")}
        result[f"vs_{a.baseline_weights}_weights"] = {
            "prefill": ours["prefill_tok_s"] / base["prefill_tok_s"],
            **{f"decode_{b}": ours["decode_tok_s"][b] / base["decode_tok_s"][b] for b in bs},
            "weights_bytes": ours["weights_bytes"] / base["weights_bytes"],
            "peak_rss": ours["peak_rss_bytes"] / base["peak_rss_bytes"]}
    if theirs:
        bs = [str(b) for b in a.batches]
        ratios = {"prefill": ours["prefill_tok_s"] / theirs["prefill_tok_s"],
                  **{f"decode_{b}": ours["decode_tok_s"][b] / theirs["decode_tok_s"][b] for b in bs},
                  "peak_rss": ours["peak_rss_bytes"] / theirs["peak_rss_bytes"]}
        if "32" in bs and "8" in bs:
            ratios["decode_32_vs_transformers_8"] = ours["decode_tok_s"]["32"] / theirs["decode_tok_s"]["8"]
        result["ratios"] = ratios
        result["goals"] = {"prefill >= 1.0x": ratios["prefill"] >= 1.0,
                           **({"decode B=32 >= 4x transformers B=8": ratios["decode_32_vs_transformers_8"] >= 4.0}
                              if "decode_32_vs_transformers_8" in ratios else {})}
    if llama:
        result["llama_server"] = llama
        result["vs_llama_server"] = {f"decode_{b}": ours["decode_tok_s"][b] / llama["decode_tok_s"][b]
                                     for b in llama["decode_tok_s"]}
        result["vs_llama_server"]["decode_32_vs_best_np"] = ours["decode_tok_s"][str(max(a.batches))] / max(
            llama["decode_tok_s"].values())
    result["config"] = {"model": a.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)",
                        "compute_dtype": ours["dtype"], "weights_dtype": a.weights_dtype, "transformers_dtype": theirs and theirs["dtype"],
                        "kv_cache_dtype": a.kv_cache_dtype, "kv_pool": ours["kv_pool"],
                        "max_num_batched_tokens": a.max_num_batched_tokens, "prompt_len": a.prompt_len,
                        "prefill_repeats": a.prefill_repeats,
                        "decode_prompt_len": a.decode_prompt_len, "new_tokens": a.new_tokens,
                        "batches": a.batches, "threads": a.threads, "quick": a.quick,
                        "decode_metric": "B * new_tokens / wall time of generate (short prefill included)",
                        "env": environment()}
    emit(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
