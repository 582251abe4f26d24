"""`everybyte quantize [MODEL] --to nvfp4 DIR`: write a ModelOpt-format NVFP4 checkpoint.

Every linear layer and the embedding (the tied LM head) become NVFP4 tensors (see
formats/nvfp4_weights for the block-scale search); norms and biases stay in --dtype; names
matching --exclude stay in --dtype too (`--exclude model.embed_tokens,lm_head` gives the
checkpoint engines expect that never quantize embeddings, e.g. vLLM's ModelOpt loader), and so
do a MoE's routers (each expert's linears are quantized like any other). One
calibration pass over a fixed text measures each linear layer's input amax (`input_scale`) and
each layer's K/V amax, the same pass the engine runs for its KV scales.
"""
from __future__ import annotations

import argparse
import sys
from itertools import chain
from pathlib import Path

from everybyte.engine.config import EngineConfig

PROG = "everybyte quantize"
FORMATS = ("nvfp4",)
METHODS = ("rtn", "gptq")
GPTQ_TOKENS = 2048
APACHE = "/usr/share/common-licenses/Apache-2.0"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("model", nargs="?", default=None,
                   help="a GGUF file or Hugging Face directory (default: the embedded default model)")
    p.add_argument("--to", nargs=2, required=True, metavar=("FORMAT", "DIR"),
                   help=f"output format ({', '.join(FORMATS)}) and directory")
    p.add_argument("--exclude", default="", help="comma-separated HF module names/patterns kept unquantized")
    p.add_argument("--dtype", default="bf16", choices=("fp32", "fp16", "bf16"), help="dtype of unquantized tensors")
    p.add_argument("--kv-cache-dtype", default="nvfp4", choices=("nvfp4", "fp8", "none"),
                   help="KV format whose per-layer k_scale/v_scale the checkpoint carries ('none': no KV scales)")
    p.add_argument("--method", default="rtn", choices=METHODS,
                   help="rtn: round to nearest (best of five block scales; what --weights-dtype nvfp4 does at "
                        "load); gptq: error-compensating rounding calibrated on GPTQ_TEXTS (minutes)")
    p.add_argument("--force", action="store_true", help="replace DIR when it exists and is not empty")
    return p


def gptq_calibration_ids(tokenizer, n: int = GPTQ_TOKENS) -> list[int]:
    """Prose, code and a license that the perplexity benches do not score (they use argparse.py and
    GPL-3): CPython's json/decoder.py and textwrap.py, and the Apache-2.0 text where it exists."""
    import json as _json
    import textwrap as _textwrap
    files = [Path(_json.__file__).with_name("decoder.py"), Path(_textwrap.__file__), Path(APACHE)]
    text = "".join(f.read_text() for f in files if f.is_file())
    return tokenizer.encode(text, add_special_tokens=False)[:n]


def _forward_with_inputs(loaded, ids: list[int], on_input, on_head_input=None):
    """One calibration forward over ids (the engine's calibrate_kv_amax pass, whose per-layer K/V
    amax it returns); on_input(HF matrix names, x) sees every Linear's input, on_head_input(x) the
    tied LM head's (the final norm's output)."""
    import torch

    from everybyte.engine.model_runner import calibrate_kv_amax
    from everybyte.models.llama import Linear
    lm, hooks = loaded.model, []
    for name, mod in lm.named_modules():
        if isinstance(mod, Linear):
            parts = [p for p, _ in lm.linear_parts(name)]
            hooks.append(mod.register_forward_pre_hook(lambda _, args, parts=parts: on_input(parts, args[0])))
    if on_head_input is not None and lm.lm_head is None:
        hooks.append(lm.model.norm.register_forward_hook(
            lambda _, args, out: on_head_input(out[0] if isinstance(out, tuple) else out)))
    mc = loaded.config
    try:
        with torch.inference_mode():
            return calibrate_kv_amax(lm, [(mc.num_key_value_heads, mc.head_dim)] * mc.num_hidden_layers,
                                     ids[:mc.max_position_embeddings])
    finally:
        for hook in hooks:
            hook.remove()


def hessians(loaded, ids: list[int]) -> dict:
    """HF matrix name -> sum of x x^T over its inputs on `ids` (float64); the tied embedding's is
    the final norm's output (its input as the LM head)."""
    h = {}

    def add(names, x):
        x = x.detach().reshape(-1, x.shape[-1]).double()
        xx = x.T @ x
        for name in names:
            h[name] = h[name] + xx if name in h else xx

    _forward_with_inputs(loaded, ids, add, lambda x: add(["model.embed_tokens"], x))
    return h


def calibrate(loaded) -> tuple[dict[str, float], tuple[list[float], list[float]]]:
    """(HF matrix name -> its input's amax, per-layer (K amax, V amax)) from one calibration pass."""
    from everybyte.engine.model_runner import CALIBRATION_TEXT
    amax = {}

    def record(names, x):
        a = float(x.detach().abs().max())
        for name in names:
            amax[name] = max(amax.get(name, 0.0), a)

    kv = _forward_with_inputs(loaded, loaded.tokenizer.encode(CALIBRATION_TEXT), record)
    return amax, kv


def quantize_checkpoint(model, out: str | Path, exclude: tuple[str, ...] = (), dtype: str = "bf16",
                        force: bool = False, kv_cache_dtype: str | None = "nvfp4",
                        kv_headroom: float = EngineConfig.kv_scale_headroom, method: str = "rtn") -> Path:
    """The checkpoint's KV scales are the ones the engine would derive from the calibration
    (amax * headroom rounded up to a power of two), so every process that loads it uses them."""
    from everybyte.kv.data.pool import pow2_ceil
    from everybyte.models.hf_export import check_out_dir, export_hf
    from everybyte.models.kv_scales import KV_QUANT_ALGO, kv_scale_tensors
    from everybyte.models.loader import load_model
    from everybyte.models.modelopt import QuantConfig, quantize_weights
    from everybyte.models.nvfp4_linear import matches
    out = check_out_dir(out, force)             # before minutes of calibration, not after
    from everybyte.models.llama import Embedding, Linear
    loaded = load_model(model, dtype="fp32")
    if loaded.config.is_moe:                    # routers stay float: tiny, and routing-sensitive
        from everybyte.models.moe import ROUTER_PATTERNS
        exclude = tuple(dict.fromkeys((*exclude, *ROUTER_PATTERNS)))
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    input_amax, (k_amax, v_amax) = calibrate(loaded)
    hess = hessians(loaded, gptq_calibration_ids(loaded.tokenizer)) if method == "gptq" else None
    kv = {}
    if kv_cache_dtype not in (None, "none"):
        kv = kv_scale_tensors([(pow2_ceil(k * kv_headroom), pow2_ceil(v * kv_headroom))
                               for k, v in zip(k_amax, v_amax)], kv_cache_dtype)
    lm = loaded.model
    matrices = {part for name, mod in lm.named_modules() if isinstance(mod, (Linear, Embedding))
                for part, _ in lm.linear_parts(name)}
    del loaded, lm
    quantized = lambda matrix: matrix in matrices and not matches(matrix, exclude)
    quant = QuantConfig(exclude_modules=list(exclude), kv_cache_quant_algo=KV_QUANT_ALGO.get(kv_cache_dtype))
    return export_hf(model, out, dtype=dtype, force=force, quant=quant,
                     transform=lambda weights: chain(quantize_weights(weights, quantized, input_amax, hess), kv.items()))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fmt, out = args.to
    if fmt not in FORMATS:
        print(f"{PROG}: error: unknown --to format {fmt!r}; choose from {', '.join(FORMATS)}", file=sys.stderr)
        return 2
    exclude = tuple(p.strip() for p in args.exclude.split(",") if p.strip())
    try:
        path = quantize_checkpoint(args.model, out, exclude, args.dtype, args.force, args.kv_cache_dtype,
                                   method=args.method)
    except (OSError, ValueError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
