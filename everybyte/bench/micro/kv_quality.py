"""`everybyte bench kv-quality`: what each KV cache format costs in quality and speed.

Perplexity over the first --tokens tokens of CPython's argparse.py (this interpreter's stdlib)
and of /usr/share/common-licenses/GPL-3, teacher-forced through the paged engine path (chunked
prefill into the pool in the format under test, logits for every position, every chunk reading
back the quantized KV of the chunks before it), once per format; greedy next-token agreement
with the fp32-KV run; decode speed with fp16 vs nvfp4 KV; KV bytes per token per format.
"""
from __future__ import annotations

import argparse
import argparse as stdlib_argparse
import gc
import math
import sys
import time

import torch

from everybyte.bench.report import emit, environment
from everybyte.cli_args import count

TEXTS = {"argparse.py": stdlib_argparse.__file__, "GPL-3": "/usr/share/common-licenses/GPL-3"}
REFERENCE_PPL = {"argparse.py": 6.22, "GPL-3": 17.8}   # transformers, fp32, same 4,096 tokens
FORMATS = ("fp32", "fp16", "fp8", "nvfp4")


def teacher_forced(llm, ids: list[int]) -> tuple[float, torch.Tensor]:
    """Mean NLL of ids[1:] and the greedy prediction at every position, via chunked prefill."""
    from everybyte.engine.sequence import Sequence
    from everybyte.kv.block_manager import BlockManager
    seq = Sequence(ids)
    BlockManager(llm.pool.num_blocks, llm.pool.block_size).allocate(seq)   # idle engine: whole pool ours
    chunk = llm.config.max_num_batched_tokens
    nll, preds = 0.0, []
    while seq.num_computed_tokens < len(ids):
        start = seq.num_computed_tokens
        n = min(chunk, len(ids) - start)
        logits = llm.model_runner.forward([seq], [n], logits="all")
        seq.num_computed_tokens += n
        targets = torch.tensor(ids[start + 1:start + n + 1])
        lp = logits[:len(targets)].log_softmax(-1)
        nll -= lp.gather(1, targets[:, None]).sum().item()
        preds.append(logits.argmax(-1))
    return nll / (len(ids) - 1), torch.cat(preds)[:-1]


def decode_speed(llm, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(decode tok/s, generate tok/s): decode counts the tokens after every sequence's first one
    over the time from the last first token to the last token (the prefill step excluded, since
    it costs the same per token for every format's matmuls and would swamp the KV format's share);
    generate is B * new_tokens over the whole call, prefill included."""
    from everybyte import SamplingParams
    p = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompts[0][::-1]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    t = time.perf_counter()
    outs = llm.generate(prompts, p)
    whole = time.perf_counter() - t
    start = max(o.metrics.token_times[0] for o in outs)
    end = max(o.metrics.token_times[-1] for o in outs)
    after = sum(sum(1 for x in o.metrics.token_times if x > start) for o in outs)
    return after / (end - start), len(prompts) * new_tokens / whole


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="everybyte bench kv-quality", description=__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=count, default=4096)
    p.add_argument("--dtype", default="float32", help="compute dtype for perplexity (default float32)")
    p.add_argument("--decode-dtype", default="auto", help="compute dtype for the decode speed runs")
    p.add_argument("--chunk", type=count, default=512, help="prefill chunk (max_num_batched_tokens)")
    p.add_argument("--decode-batch", type=count, default=8)
    p.add_argument("--decode-prompt-len", type=count, default=256)
    p.add_argument("--new-tokens", type=count, default=64)
    p.add_argument("--quick", action="store_true", help="1,024 tokens, 16 new tokens")
    p.add_argument("--json", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.quick:
        a.tokens, a.new_tokens = 1024, 16
    from everybyte import LLM
    from everybyte.engine.config import resolve_dtype, set_threads
    from everybyte.kv.data.pool import min_pool_bytes
    from everybyte.models.loader import load_model
    set_threads()
    loaded = load_model(a.model, dtype=resolve_dtype(a.dtype))
    texts = {}
    for name, path in TEXTS.items():
        with open(path) as f:
            ids = loaded.tokenizer.encode(f.read(), add_special_tokens=False)
        texts[name] = ids[:a.tokens]
    mc = loaded.config
    shapes = [(mc.num_key_value_heads, mc.head_dim)] * mc.num_hidden_layers

    def engine(fmt, model, tokens, seqs=1):
        # room for `seqs` sequences of `tokens` at once (each may leave a partly filled block)
        return LLM(model, kv_cache_dtype=fmt, kv_cache_bytes=min_pool_bytes(shapes, fmt, seqs * (tokens + 16), 16),
                   max_model_len=tokens, max_num_batched_tokens=a.chunk, max_num_seqs=max(a.decode_batch, 1))

    ppl, agree, nll_s = {n: {} for n in texts}, {n: {} for n in texts}, {}
    for fmt in FORMATS:
        llm = engine(fmt, loaded, a.tokens)
        for name, ids in texts.items():
            t = time.perf_counter()
            nll, preds = teacher_forced(llm, ids)
            nll_s[f"{name}/{fmt}"] = time.perf_counter() - t
            ppl[name][fmt] = math.exp(nll)
            print(f"[kv-quality] {name} {fmt}: ppl {ppl[name][fmt]:.3f} ({nll_s[f'{name}/{fmt}']:.1f}s)",
                  file=sys.stderr)
            if fmt == "fp32":
                agree[name]["_ref"] = preds
            agree[name][fmt] = (preds == agree[name]["_ref"]).float().mean().item()
        del llm
        gc.collect()
    for name in texts:
        del agree[name]["_ref"]
    kv_bpt = {f: v for f, v in engine("fp32", loaded, 16).kv_bytes_per_token().items()}

    decode_dtype = resolve_dtype(a.decode_dtype)
    if decode_dtype != loaded.model.dtype:
        del loaded
        gc.collect()
        loaded = load_model(a.model, dtype=decode_dtype)
    ids = texts["argparse.py"]
    prompts = [(ids * 2)[i * 97:i * 97 + a.decode_prompt_len] for i in range(a.decode_batch)]
    speed, generate = {}, {}
    for fmt in ("fp16", "nvfp4", "fp16", "nvfp4"):     # interleaved, best of two
        llm = engine(fmt, loaded, a.decode_prompt_len + a.new_tokens + 16, a.decode_batch)
        dec, gen = decode_speed(llm, prompts, a.new_tokens)
        speed[fmt], generate[fmt] = max(speed.get(fmt, 0.0), dec), max(generate.get(fmt, 0.0), gen)
        del llm
    rel = {n: ppl[n]["nvfp4"] / ppl[n]["fp16"] - 1 for n in texts}
    result = {
        "ppl": ppl,
        "agreement_vs_fp32": agree,
        "decode_tok_s": speed,
        "generate_tok_s_prefill_included": generate,
        "kv_bytes_per_token": kv_bpt,
        "reference_ppl_transformers_fp32": REFERENCE_PPL if a.tokens == 4096 else None,
        "nvfp4_vs_fp16": {"ppl_increase": rel, "decode_speed_ratio": speed["nvfp4"] / speed["fp16"],
                          "generate_speed_ratio": generate["nvfp4"] / generate["fp16"],
                          "tokens_per_byte_ratio": kv_bpt["fp16"] / kv_bpt["nvfp4"]},
        "goals": {"nvfp4 ppl within 3% of fp16": all(abs(r) <= 0.03 for r in rel.values()),
                  "nvfp4 decode within 10% of fp16": speed["nvfp4"] >= 0.9 * speed["fp16"]},
        "config": {"model": a.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)", "tokens": a.tokens,
                   "ppl_compute_dtype": str(resolve_dtype(a.dtype)), "decode_compute_dtype": str(decode_dtype),
                   "prefill_chunk": a.chunk, "decode_batch": a.decode_batch,
                   "decode_prompt_len": a.decode_prompt_len, "new_tokens": a.new_tokens,
                   "decode_metric": "tokens after each sequence's first / time from the last first "
                                    "token to the last token (best of two interleaved runs)",
                   "kv_scale_calibration": "per-layer amax of a fixed-text fp32-KV pass, x2 headroom",
                   "seconds_per_ppl_pass": nll_s, "texts": TEXTS, "env": environment()},
    }
    emit(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
