"""`everybyte moe-ify [MODEL] --experts E --top-k K OUTDIR`: a mixture of experts made from a dense
Llama-architecture model (default: the embedded SmolLM2-135M), written as a Hugging Face directory.

Each layer's MLP neurons are split into E experts by co-activation and a router is fitted, both on
the calibration text `quantize --method gptq` uses (CPython's json/decoder.py and textwrap.py and
the Apache-2.0 text; the perplexity benches score argparse.py and GPL-3); see models/moe_from_dense.
The directory has architecture llama_moe (Llama attention, chosen experts summed unweighted), its
tokenizer and chat template, and loads with load_model / serve / LLM. With --eval-tokens N it prints
the perplexity over the first N tokens of argparse.py at top-k 1, 2, 4 and E next to the dense model's.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

PROG = "everybyte moe-ify"
CALIBRATION_TOKENS = 2048
EVAL_TEXT = argparse.__file__      # scored by the perplexity benches, never seen by the calibration


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("model", nargs="?", default=None,
                   help="a dense Llama-architecture GGUF file or HF directory (default: the embedded default model)")
    p.add_argument("out", help="output directory (a Hugging Face model directory)")
    p.add_argument("--experts", type=int, default=8, help="experts per layer (must divide the MLP width)")
    p.add_argument("--top-k", type=int, default=2, help="experts each token uses (num_experts_per_tok)")
    p.add_argument("--calibration-tokens", type=int, default=CALIBRATION_TOKENS,
                   help="tokens of calibration text the split and the routers are fitted on")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"),
                   help="dtype of the written weights (fp32: top-k = E equals the dense model exactly)")
    p.add_argument("--eval-tokens", type=int, default=0,
                   help="then print perplexity at each top-k on this many held-out tokens (0: skip)")
    p.add_argument("--seed", type=int, default=0, help="k-means initialisation")
    p.add_argument("--force", action="store_true", help="replace OUTDIR when it exists and is not empty")
    return p


def teacher_forced_nll(lm, ids: list[int], chunk: int = 512) -> float:
    """Mean NLL of ids[1:] under lm, chunked prefill over an exact fp32 KV cache."""
    import torch

    from everybyte.engine.model_runner import ModelRunner
    from everybyte.engine.sequence import Sequence
    from everybyte.kv.data.pool import KVPool, min_pool_bytes
    cfg, bs = lm.config, 16
    shapes = [(cfg.num_key_value_heads, cfg.head_dim)] * cfg.num_hidden_layers
    pool = KVPool(shapes, "fp32", min_pool_bytes(shapes, "fp32", len(ids), bs), bs)
    runner, seq, nll = ModelRunner(lm, pool), Sequence(list(ids)), 0.0
    seq.block_table = list(range(pool.num_blocks))
    with torch.inference_mode():
        while seq.num_computed_tokens < len(ids):
            start = seq.num_computed_tokens
            n = min(chunk, len(ids) - start)
            logits = runner.forward([seq], [n], logits="all")
            seq.num_computed_tokens += n
            targets = torch.tensor(ids[start + 1:start + n + 1], dtype=torch.long)
            nll -= logits[:len(targets)].log_softmax(-1).gather(1, targets[:, None]).sum().item()
    return nll / max(len(ids) - 1, 1)


def mlp_inputs(loaded, ids: list[int]) -> list:
    """Each layer's MLP input [T, H] over ids (the dense model's own calibration forward)."""
    import torch
    lm, seen = loaded.model, {}
    hooks = [layer.mlp.register_forward_pre_hook(lambda _, args, i=i: seen.setdefault(i, []).append(args[0].detach()))
             for i, layer in enumerate(lm.model.layers)]
    try:
        teacher_forced_nll(lm, ids)
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(seen[i]) for i in range(len(lm.model.layers))]


def moeify(model, out: str | Path, experts: int = 8, top_k: int = 2, calibration_tokens: int = CALIBRATION_TOKENS,
           dtype: str = "fp32", force: bool = False, seed: int = 0) -> Path:
    from everybyte.engine.quantize_cli import gptq_calibration_ids
    from everybyte.models.hf_export import check_out_dir, export_hf
    from everybyte.models.loader import load_model
    from everybyte.models.moe_from_dense import expert_weights, split_layer
    out = check_out_dir(out, force)
    if not 0 < top_k <= experts:
        raise ValueError(f"--top-k {top_k} must be in 1..{experts} (--experts)")
    if calibration_tokens < 16:
        raise ValueError("--calibration-tokens must be at least 16")
    loaded = load_model(model, dtype="fp32")
    cfg = loaded.config
    if cfg.architecture != "llama":
        raise ValueError(f"moe-ify takes a dense Llama-architecture model; this one is {cfg.architecture}")
    if cfg.intermediate_size % experts:
        raise ValueError(f"{experts} experts do not divide the {cfg.intermediate_size} intermediate neurons; choose "
                         f"one of {[e for e in range(1, 257) if cfg.intermediate_size % e == 0]}")
    ids = gptq_calibration_ids(loaded.tokenizer, calibration_tokens)[:cfg.max_position_embeddings]
    inter, tensors = cfg.intermediate_size, {}
    for i, (layer, x) in enumerate(zip(loaded.model.model.layers, mlp_inputs(loaded, ids))):
        gate_up, down = layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight
        groups, router = split_layer(x, gate_up[:inter], gate_up[inter:], down, experts, seed)
        tensors[i] = expert_weights(i, groups, router, gate_up[:inter], gate_up[inter:], down)
    del loaded

    def transform(weights):
        for name, w in weights:
            parts = name.split(".")
            if name.startswith("model.layers.") and parts[3] == "mlp":
                yield from tensors.pop(int(parts[2]), {}).items()      # a layer's experts replace its MLP
                continue
            yield name, w

    update = {"architecture": "llama_moe", "num_experts": experts, "num_experts_per_tok": top_k,
              "moe_intermediate_size": inter // experts, "moe_combine": "sum"}
    return export_hf(model, out, dtype=dtype, force=force, transform=transform, config_update=update)


def perplexities(model, moe_dir: str | Path, tokens: int) -> dict:
    """Perplexity of the dense model and of the MoE at top-k 1, 2, 4 and E on held-out text."""
    from everybyte.models.loader import load_model
    from everybyte.models.moe_from_dense import set_top_k
    dense = load_model(model, dtype="fp32")
    ids = dense.tokenizer.encode(Path(EVAL_TEXT).read_text(), add_special_tokens=False)[:tokens]
    result = {"eval_text": Path(EVAL_TEXT).name, "eval_tokens": len(ids),
              "dense_ppl": round(math.exp(teacher_forced_nll(dense.model, ids)), 3)}
    del dense
    moe = load_model(moe_dir, dtype="fp32")
    experts = moe.config.num_experts
    result["ppl_by_top_k"] = {}
    for k in sorted({k for k in (1, 2, 4, experts) if k <= experts}):
        set_top_k(moe.model, k)
        result["ppl_by_top_k"][str(k)] = round(math.exp(teacher_forced_nll(moe.model, ids)), 3)
    return result


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        path = moeify(args.model, args.out, args.experts, args.top_k, args.calibration_tokens, args.dtype,
                      args.force, args.seed)
        if args.eval_tokens > 0:
            print(json.dumps({"out": str(path), "experts": args.experts, "top_k": args.top_k,
                              "calibration_tokens": args.calibration_tokens,
                              **perplexities(args.model, path, args.eval_tokens)}))
        else:
            print(path)
    except (OSError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    return 0
