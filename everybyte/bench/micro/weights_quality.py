"""`everybyte bench weights-quality`: what NVFP4 weights cost in perplexity, and what each choice bought.

The texts, token count and teacher-forced engine path of `bench kv-quality` (argparse.py and
GPL-3, chunked prefill, logits at every position). Variants, each a fresh load of the model:
fp32 weights (the GGUF's dequantized values) with fp32 KV (the reference); nvfp4 weights
(everybyte's choices: best-of-5 block scales, tied embedding/LM head quantized) with fp32 KV;
nvfp4 weights + nvfp4 KV (what `--weights-dtype nvfp4` serves); fp32 weights + nvfp4 KV (the KV's
share); two ablations: block scales amax/6 only, and the embedding/LM head kept in fp32; and an
`everybyte quantize --method gptq` checkpoint (error-compensating rounding; minutes to write).
Greedy agreement is each variant's next-token argmax against the reference's. Uses engine
internals (the model runner), as kv-quality does. The default model is already 4-bit (Q4_1), so
nvfp4 here is a second rounding of its dequantized values.
"""
from __future__ import annotations

import argparse
import gc
import math
import sys
import tempfile
import time
from pathlib import Path

from everybyte.bench.micro.kv_quality import REFERENCE_PPL, TEXTS, teacher_forced
from everybyte.bench.report import emit, environment
from everybyte.cli_args import count

# name -> (weights_dtype, exclude, block-scale divisors or None (default), kv_cache_dtype, quantize method)
# method None: quantized at load (round to nearest); "gptq": an `everybyte quantize --method gptq` checkpoint
VARIANTS = {
    "fp32": ("fp32", (), None, "fp32", None),
    "nvfp4": ("nvfp4", (), None, "fp32", None),
    "nvfp4+nvfp4_kv": ("nvfp4", (), None, "nvfp4", None),
    "fp32+nvfp4_kv": ("fp32", (), None, "nvfp4", None),
    "nvfp4_amax6_only": ("nvfp4", (), (6.0,), "fp32", None),
    "nvfp4_embedding_fp32": ("nvfp4", ("model.embed_tokens", "lm_head"), None, "fp32", None),
    "nvfp4_gptq": ("auto", (), None, "fp32", "gptq"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="everybyte bench weights-quality", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=count, default=4096)
    p.add_argument("--chunk", type=count, default=512, help="prefill chunk (max_num_batched_tokens)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    p.add_argument("--quick", action="store_true", help="1,024 tokens")
    p.add_argument("--json", default=None)
    return p


def run_variant(a, name: str, texts_ids) -> dict:
    from everybyte import LLM
    from everybyte.formats import nvfp4_weights
    from everybyte.kv.data.pool import min_pool_bytes
    from everybyte.models.loader import load_model
    from everybyte.models.nvfp4_linear import weight_bytes
    weights_dtype, exclude, divs, kv, method = VARIANTS[name]
    saved = nvfp4_weights.WEIGHT_DIVISORS
    nvfp4_weights.WEIGHT_DIVISORS = divs or saved
    try:
        t = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="everybyte-wq-") as tmp:
            model = a.model
            if method is not None:
                from everybyte.engine.quantize_cli import quantize_checkpoint
                model = quantize_checkpoint(a.model, Path(tmp) / "q", exclude, dtype="fp32", method=method)
            loaded = load_model(model, dtype="fp32", weights_dtype=weights_dtype,
                                exclude=None if method else exclude)
            if method is not None:      # the checkpoint's tensors are memory-mapped: keep them past the dir
                for m in loaded.model.modules():
                    if getattr(m, "packed", None) is not None:
                        for part in m.packed.parts:
                            part.data, part.scales = part.data.clone(), part.scales.clone()
                        m.packed = type(m.packed)(m.packed.parts)
        load_s = time.perf_counter() - t
    finally:
        nvfp4_weights.WEIGHT_DIVISORS = saved
    mc = loaded.config
    shapes = [(mc.num_key_value_heads, mc.head_dim)] * mc.num_hidden_layers
    llm = LLM(loaded, kv_cache_dtype=kv, kv_cache_bytes=min_pool_bytes(shapes, kv, a.tokens + 16, 16),
              max_model_len=a.tokens, max_num_batched_tokens=a.chunk, kv_tiers="none")
    out = {"weights_bytes": weight_bytes(loaded.model), "load_s": load_s, "ppl": {}, "preds": {}}
    for text, ids in texts_ids.items():
        nll, preds = teacher_forced(llm, ids)
        out["ppl"][text], out["preds"][text] = math.exp(nll), preds
        print(f"[weights-quality] {name} {text}: ppl {out['ppl'][text]:.3f}", file=sys.stderr)
    del llm, loaded
    gc.collect()
    return out


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.quick:
        a.tokens = 1024
    names = [n.strip() for n in a.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        print(f"everybyte bench weights-quality: unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}",
              file=sys.stderr)
        return 2
    if "fp32" not in names:
        names.insert(0, "fp32")
    from everybyte.engine.config import set_threads
    from everybyte.models.loader import load_config_and_tokenizer, resolve_model_path
    set_threads()
    _, tokenizer, _ = load_config_and_tokenizer(resolve_model_path(a.model))
    texts_ids = {}
    for text, path in TEXTS.items():
        with open(path) as f:
            texts_ids[text] = tokenizer.encode(f.read(), add_special_tokens=False)[:a.tokens]
    runs = {n: run_variant(a, n, texts_ids) for n in names}
    ref = runs["fp32"]
    result = {
        "ppl": {n: r["ppl"] for n, r in runs.items()},
        "ppl_vs_fp32_weights": {n: {t: r["ppl"][t] / ref["ppl"][t] - 1 for t in texts_ids} for n, r in runs.items()},
        "greedy_agreement_vs_fp32": {n: {t: (r["preds"][t] == ref["preds"][t]).float().mean().item()
                                         for t in texts_ids} for n, r in runs.items()},
        "weights_bytes": {n: r["weights_bytes"] for n, r in runs.items()},
        "weights_bytes_vs_fp32": {n: r["weights_bytes"] / ref["weights_bytes"] for n, r in runs.items()},
        "load_s": {n: r["load_s"] for n, r in runs.items()},
        "reference_ppl_transformers_fp32": REFERENCE_PPL if a.tokens == 4096 else None,
        "config": {"model": a.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF; nvfp4 is a second rounding)",
                   "tokens": a.tokens, "compute_dtype": "float32", "prefill_chunk": a.chunk,
                   "variants": {n: dict(zip(("weights_dtype", "exclude", "divisors", "kv_cache_dtype", "method"),
                                            VARIANTS[n]))
                                for n in names},
                   "texts": TEXTS, "env": environment()},
    }
    if "nvfp4" in runs:
        result["goals"] = {"nvfp4 weights ppl within 5% of fp32 weights":
                           all(abs(v) <= 0.05 for v in result["ppl_vs_fp32_weights"]["nvfp4"].values())}
    emit(result, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
