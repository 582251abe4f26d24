"""ModelOpt NVFP4 checkpoints: the quantization config, and weights in their tensor names.

Per quantized linear `P` (HF name): `P.weight` uint8 [out, in/2], `P.weight_scale`
float8_e4m3fn [out, in/16], `P.weight_scale_2` float32 [] (decode form, amax / 2688) and
`P.input_scale` float32 [] (activation amax / 2688, from a calibration pass). The config is in
`hf_quant_config.json` ({"producer", "quantization": {"quant_algo": "NVFP4", "group_size": 16,
"exclude_modules", "kv_cache_quant_algo"}}) and in config.json's `quantization_config`
(`quant_method: modelopt`), which is where vLLM and transformers look.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import torch

from everybyte.formats.nvfp4 import AMAX_TO_SCALE
from everybyte.formats.nvfp4_gptq import gptq_group
from everybyte.formats.nvfp4_weights import PackedPart, quantize_group

QUANT_ALGO = "NVFP4"
SUPPORTED_ALGOS = (QUANT_ALGO,)
GROUP_SIZE = 16
QUANT_FILE = "hf_quant_config.json"
# fused groups: their members share one tensor scale (engines that fuse them need it)
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass
class QuantConfig:
    quant_algo: str = QUANT_ALGO
    group_size: int = GROUP_SIZE
    exclude_modules: list[str] = field(default_factory=list)
    kv_cache_quant_algo: str | None = None

    def to_json(self) -> dict:
        return {"quant_algo": self.quant_algo, "group_size": self.group_size,
                "exclude_modules": list(self.exclude_modules), "kv_cache_quant_algo": self.kv_cache_quant_algo}


def read_quant_config(path: str | Path) -> QuantConfig | None:
    """The checkpoint's quantization (None: unquantized); ValueError for what is not NVFP4."""
    path = Path(path)
    q = None
    if (path / QUANT_FILE).is_file():
        try:
            q = json.loads((path / QUANT_FILE).read_text()).get("quantization")
        except (OSError, ValueError) as e:
            raise ValueError(f"{path / QUANT_FILE}: cannot read JSON: {e}") from e
    if q is None and (path / "config.json").is_file():
        try:
            q = json.loads((path / "config.json").read_text()).get("quantization_config")
        except (OSError, ValueError):
            q = None
    if not q:
        return None
    algo = q.get("quant_algo") or (None if q.get("quant_method") == "modelopt" else q.get("quant_method"))
    if algo is None:               # KV-cache-only quantization: the weights are float
        return None
    if str(algo).upper() != QUANT_ALGO:
        raise ValueError(f"{path}: quantization {algo!r} is not supported; supported: {', '.join(SUPPORTED_ALGOS)} "
                         f"(ModelOpt quant_algo)")
    group = int(q.get("group_size", GROUP_SIZE))
    if group != GROUP_SIZE:
        raise ValueError(f"{path}: NVFP4 group_size {group} is not supported; NVFP4 blocks are {GROUP_SIZE} values")
    exclude = q.get("exclude_modules") or q.get("ignore") or []
    return QuantConfig(QUANT_ALGO, group, list(exclude), q.get("kv_cache_quant_algo"))


def hf_quant_json(cfg: QuantConfig) -> dict:
    return {"producer": {"name": "everybyte", "version": "0.1.0"}, "quantization": cfg.to_json()}


def config_json_entry(cfg: QuantConfig) -> dict:
    return {"quant_method": "modelopt", **cfg.to_json()}


def part_tensors(name: str, part: PackedPart) -> dict[str, torch.Tensor]:
    """`name` (HF matrix name) -> its ModelOpt tensors."""
    out = {f"{name}.weight": part.data.contiguous(), f"{name}.weight_scale": part.scales.contiguous(),
           f"{name}.weight_scale_2": torch.tensor(part.global_scale, dtype=torch.float32)}
    if part.input_scale is not None:
        out[f"{name}.input_scale"] = torch.tensor(part.input_scale, dtype=torch.float32)
    return out


def _group_of(matrix: str) -> tuple[str, tuple[str, ...]] | None:
    prefix, _, leaf = matrix.rpartition(".")
    for group in FUSED_GROUPS:
        if leaf in group:
            return prefix, group
    return None


def quantize_weights(weights: Iterable[tuple[str, torch.Tensor]], quantized, input_amax: dict[str, float] | None = None,
                     hessians: dict[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Float (HF name, tensor) -> the same with every matrix for which quantized(matrix name)
    holds replaced by its NVFP4 tensors; members of a fused group wait for each other and share
    one tensor scale. input_amax: matrix name -> its input's amax (gives input_scale);
    hessians: matrix name -> its input Hessian (GPTQ rounding; round-to-nearest without)."""
    waiting: dict[str, dict[str, torch.Tensor]] = {}
    for name, w in weights:
        matrix, _, suffix = name.rpartition(".")
        if suffix != "weight" or not quantized(matrix):
            yield name, w
            continue
        group = _group_of(matrix)
        if group is None:
            members = {matrix: w}
        else:
            prefix, leaves = group
            key = f"{prefix}.{'+'.join(leaves)}"
            waiting.setdefault(key, {})[matrix] = w
            if len(waiting[key]) < len(leaves):
                continue
            members = {f"{prefix}.{leaf}": waiting[key][f"{prefix}.{leaf}"] for leaf in leaves}
            del waiting[key]
        named = [(f"{m}.weight", t) for m, t in members.items()]
        h = (hessians or {}).get(next(iter(members)))
        parts = quantize_group(named) if h is None else gptq_group(named, h)
        for (m, _), part in zip(members.items(), parts):
            if input_amax and m in input_amax:
                part.input_scale = input_amax[m] / AMAX_TO_SCALE
            yield from part_tensors(m, part).items()
    if waiting:
        raise ValueError(f"fused group(s) {sorted(waiting)} incomplete: only {[sorted(v) for v in waiting.values()]}")


def dequantized_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """NVFP4 checkpoint tensors -> float32 weights (for --weights-dtype bf16/fp32 of a quantized
    checkpoint); other tensors as they are."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        matrix, _, suffix = name.rpartition(".")
        if suffix in ("weight_scale", "weight_scale_2", "input_scale") or (suffix == "weight" and t.dtype == torch.uint8):
            got = pending.setdefault(matrix, {})
            got[suffix] = t
            if {"weight", "weight_scale", "weight_scale_2"} <= set(got):
                w, s, g = got["weight"], got["weight_scale"], got["weight_scale_2"]
                if s.shape[-1] * 8 != w.shape[-1]:
                    raise ValueError(f"{matrix}.weight_scale: shape {tuple(s.shape)} does not fit weight {tuple(w.shape)}")
                yield f"{matrix}.weight", PackedPart(w, s.view(torch.float8_e4m3fn), float(g)).dequantize()
                got.clear()
            continue
        yield name, t
    broken = {m: sorted(v) for m, v in pending.items() if set(v) - {"input_scale"}}
    if broken:
        raise ValueError(f"NVFP4 tensors incomplete (need weight, weight_scale, weight_scale_2): {broken}")
