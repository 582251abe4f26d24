"""Per-layer KV cache scales carried in a Hugging Face checkpoint, in ModelOpt's convention.

ModelOpt exports, per attention layer, `model.layers.N.self_attn.k_proj.k_scale` and
`...v_proj.v_scale`: float32 scalars in decode form (stored value * scale ~= x), scale = amax /
bound, bound = 448 for `kv_cache_quant_algo` FP8 (E4M3's largest value) and 6 * 448 = 2688 for
NVFP4 (E2M1's 6 times E4M3's 448: ModelOpt's maxbound, the same FP32 scale everybyte's nvfp4 KV
keeps per layer). So everybyte's per-layer amax is scale * 448 (FP8) or scale * 2688 (NVFP4),
whichever KV format the engine then stores. vLLM reads these names (and llm-compressor's
`self_attn.k_scale`, its remapped form) into each attention layer's k_scale/v_scale; ModelOpt
clamps FP8 scales to >= 1 (amax >= 448), so such a checkpoint may say only "the raw E4M3 range".
The algorithm is named in hf_quant_config.json ({"quantization": {"kv_cache_quant_algo": ...}})
or config.json's quantization_config (kv_cache_quant_algo, or compressed-tensors' kv_cache_scheme).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from everybyte.models.config import ModelConfig
from everybyte.models.hf_loader import INDEX_FILE, read_json, weight_files

KV_QUANT_ALGO = {"fp8": "FP8", "nvfp4": "NVFP4"}          # everybyte kv_cache_dtype -> ModelOpt name
KV_SCALE_BOUND = {"FP8": 448.0, "NVFP4": 6.0 * 448.0}     # ModelOpt: scale = amax / bound
QUANT_CONFIG_FILE = "hf_quant_config.json"
SCALES_FILE = "kv_scales.safetensors"


def k_scale_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.k_proj.k_scale"


def v_scale_name(layer: int) -> str:
    return f"model.layers.{layer}.self_attn.v_proj.v_scale"


def _aliases(layer: int, kv: str) -> list[str]:
    """Names a checkpoint may use for one layer's K or V scale: ModelOpt's, llm-compressor's."""
    base = f"model.layers.{layer}.self_attn"
    return [f"{base}.{kv}_proj.{kv}_scale", f"{base}.{kv}_scale"]


def kv_scale_tensors(amax_per_layer: list[tuple[float, float]],
                     kv_cache_dtype: str = "fp8") -> dict[str, torch.Tensor]:
    """ModelOpt-named float32 scalar scales for per-layer (k_amax, v_amax): what a checkpoint
    writer puts next to the weights (and KV_QUANT_ALGO[kv_cache_dtype] as kv_cache_quant_algo)."""
    bound = KV_SCALE_BOUND[_algo(kv_cache_dtype)]
    out = {}
    for i, (k, v) in enumerate(amax_per_layer):
        for name, amax in ((k_scale_name(i), k), (v_scale_name(i), v)):
            if not (amax > 0 and amax < float("inf")):
                raise ValueError(f"{name}: amax must be finite and > 0, got {amax!r}")
            out[name] = torch.tensor(amax / bound, dtype=torch.float32)
    return out


def _algo(kv_cache_dtype: str) -> str:
    if kv_cache_dtype not in KV_QUANT_ALGO:
        raise ValueError(f"no KV scales for kv_cache_dtype {kv_cache_dtype!r}; "
                         f"choose one of {', '.join(KV_QUANT_ALGO)}")
    return KV_QUANT_ALGO[kv_cache_dtype]


def kv_quant_algo(path: str | Path) -> str | None:
    """The checkpoint's declared kv_cache_quant_algo ("FP8", "NVFP4"), or None."""
    path = Path(path)
    declared = []
    if (path / QUANT_CONFIG_FILE).is_file():
        quantization = read_json(path / QUANT_CONFIG_FILE).get("quantization") or {}
        declared.append(quantization.get("kv_cache_quant_algo"))
    if (path / "config.json").is_file():
        qc = read_json(path / "config.json").get("quantization_config") or {}
        scheme = qc.get("kv_cache_scheme")
        if isinstance(scheme, dict) and scheme.get("type") == "float" and scheme.get("num_bits") == 8:
            scheme = "FP8"
        declared += [qc.get("kv_cache_quant_algo"), (qc.get("quantization") or {}).get("kv_cache_quant_algo"),
                     scheme if isinstance(scheme, str) else None]
    algo = next((str(a).upper() for a in declared if a), None)
    if algo is not None and algo not in KV_SCALE_BOUND:
        raise ValueError(f"{path}: kv_cache_quant_algo {algo!r} is not supported; supported: "
                         f"{', '.join(KV_SCALE_BOUND)}")
    return algo


def read_kv_scales(path: str | Path, config: ModelConfig) -> list[tuple[float, float]] | None:
    """Per-layer (k_amax, v_amax) from the k_scale/v_scale tensors of the HF directory `path`, or
    None when it has none (or is not a directory: a GGUF file). Scales without a declared
    algorithm are FP8's (vLLM's reading). A per-head scale [num_kv_heads] gives its largest head."""
    path = Path(path)
    if not path.is_dir():
        return None
    layers = range(config.num_hidden_layers)
    wanted = {name: (i, kv) for i in layers for kv in "kv" for name in _aliases(i, kv)}
    found: dict[tuple[int, str], tuple[str, torch.Tensor]] = {}
    for f in weight_files(path):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                if name in wanted:
                    found[wanted[name]] = (name, st.get_tensor(name))
    if not found:
        return None
    bound = KV_SCALE_BOUND[kv_quant_algo(path) or "FP8"]
    amax = {}
    for i in range(config.num_hidden_layers):
        for kv in "kv":
            if (i, kv) not in found:
                raise ValueError(f"{path}: {_aliases(i, kv)[0]} is missing (the checkpoint has KV scales for "
                                 f"other layers; every layer needs both k_scale and v_scale)")
            amax[i, kv] = _check(*found[i, kv], config.num_key_value_heads) * bound
    return [(amax[i, "k"], amax[i, "v"]) for i in range(config.num_hidden_layers)]


def _check(name: str, t: torch.Tensor, num_kv_heads: int) -> float:
    if t.numel() not in (1, num_kv_heads) or t.dim() > 1:
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected a scalar "
                         f"(or [{num_kv_heads}], one per KV head)")
    if not t.is_floating_point():
        raise ValueError(f"{name}: dtype {t.dtype}, expected a floating-point scale")
    t = t.float()
    if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
        raise ValueError(f"{name}: scales must be finite and > 0, got {t.tolist()}")
    return float(t.max())


def write_kv_scales(path: str | Path, amax_per_layer: list[tuple[float, float]],
                    kv_cache_dtype: str = "fp8") -> Path:
    """Put ModelOpt-named KV scales into the HF directory `path`: a safetensors file of their own
    (listed in the weight index when there is one: vLLM and everybyte read the files it names, or
    every *.safetensors without one), kv_cache_quant_algo in hf_quant_config.json, and in
    config.json's quantization_config when the weights are quantized (an unquantized checkpoint
    gets none: ModelOpt's config needs a weight quant_algo). Returns the scales file."""
    path = Path(path)
    algo, tensors = _algo(kv_cache_dtype), kv_scale_tensors(amax_per_layer, kv_cache_dtype)
    out = path / SCALES_FILE
    for f in weight_files(path):
        if f.name != SCALES_FILE:
            with safe_open(f, framework="pt") as st:
                clash = sorted(set(st.keys()) & set(tensors))
            if clash:
                raise ValueError(f"{f}: already holds KV scales ({clash[0]}, ...); remove them first")
    save_file(tensors, str(out), metadata={"format": "pt"})
    if (path / INDEX_FILE).is_file():
        index = read_json(path / INDEX_FILE)
        index.setdefault("weight_map", {}).update(dict.fromkeys(tensors, SCALES_FILE))
        _write_json(path / INDEX_FILE, index)
    qfile = path / QUANT_CONFIG_FILE
    qc = (read_json(qfile) if qfile.is_file()
          else {"producer": {"name": "everybyte"}, "quantization": {"quant_algo": None}})
    qc.setdefault("quantization", {})["kv_cache_quant_algo"] = algo
    _write_json(qfile, qc)
    config = read_json(path / "config.json")
    if config.get("quantization_config"):
        config["quantization_config"]["kv_cache_quant_algo"] = algo
        _write_json(path / "config.json", config)
    return out


def _write_json(file: Path, data: dict) -> None:
    file.write_text(json.dumps(data, indent=2) + "\n")
