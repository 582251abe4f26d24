"""Hugging Face model directories: config.json -> ModelConfig, and *.safetensors weights read
through safetensors' memory map (single files or sharded with an index)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from everybyte.models.config import ModelConfig
from everybyte.models.moe_config import moe_fields
from everybyte.models.moe_weights import canonical_weights

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral", "OlmoeForCausalLM": "olmoe",
                 "LlamaMoeForCausalLM": "llama_moe"}
INDEX_FILE = "model.safetensors.index.json"
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale")      # KV cache scales, not weights: models/kv_scales.py


def read_json(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{file}: cannot read JSON: {e}") from e


HF_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")   # of generation_config.json


def config_from_hf(path: str | Path) -> ModelConfig:
    path = Path(path)
    file = path / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such file (a Hugging Face model directory needs config.json)")
    c = read_json(file)
    names = c.get("architectures") or [c.get("model_type")]
    arch = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"{file}: unsupported model architecture {'/'.join(map(str, names))}; "
                         f"supported: {', '.join(ARCHITECTURES)}")
    for unsupported in ("mlp_bias", "use_sliding_window"):
        if c.get(unsupported):
            raise ValueError(f"{file}: {unsupported}=true is not supported")
    rope = dict(c.get("rope_scaling") or c.get("rope_parameters") or {})
    theta = c.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0
    rope.pop("rope_theta", None)
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in c]
    if missing:
        raise ValueError(f"{file}: missing {', '.join(missing)}")
    heads = c["num_attention_heads"]
    generation = read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
    eos = [i for src in (generation, c) for i in _ids(src.get("eos_token_id"))]
    fields = dict(
        architecture=arch, vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"], num_hidden_layers=c["num_hidden_layers"],
        num_attention_heads=heads, num_key_value_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads, rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta), rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
        max_position_embeddings=c.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=True if arch == "qwen2" else bool(c.get("attention_bias", False)),
        qk_norm=arch == "qwen3", bos_token_id=c.get("bos_token_id"), eos_token_ids=list(dict.fromkeys(eos)),
        model_id=c.get("_name_or_path") or path.resolve().name, revision=_identity(path, file),
        sampling_defaults={k: generation[k] for k in HF_SAMPLING if generation.get(k) is not None})
    return ModelConfig(**(fields | moe_fields(c, arch, file)))


def _ids(value) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def weight_files(path: str | Path) -> list[Path]:
    path = Path(path)
    if (path / INDEX_FILE).is_file():
        shards = sorted(set(read_json(path / INDEX_FILE).get("weight_map", {}).values()))
        files = [path / s for s in shards]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{f}: shard named in {INDEX_FILE} is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weight files")
    return files


def _identity(path: Path, config_file: Path) -> str:
    """Cheap identity: config.json plus each weight file's name, size and safetensors header."""
    h = hashlib.sha256(config_file.read_bytes())
    for f in weight_files(path):
        with open(f, "rb") as fh:
            h.update(f"{f.name}:{f.stat().st_size}".encode())
            h.update(fh.read(min(int.from_bytes(fh.read(8), "little"), 100 << 20)))
    return h.hexdigest()[:16]


def iter_hf_weights(path: str | Path, config: ModelConfig, dtype: torch.dtype | None = None,
                    device="cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) per weight, read through the memory map; converted only when dtype/device
    differ (dtype None leaves the casting to the consumer's copy). Expert weights come one per
    expert under mlp.experts.E.* names (models/moe_weights)."""
    return canonical_weights(_iter_files(path, config, dtype, device))


def _iter_files(path, config: ModelConfig, dtype, device) -> Iterator[tuple[str, torch.Tensor]]:
    for f in weight_files(path):
        try:
            st = safe_open(f, framework="pt")
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{f}: corrupt or truncated safetensors file: {e}") from e
        for name in st.keys():
            if (name.endswith(("rotary_emb.inv_freq", *KV_SCALE_SUFFIXES))
                    or (config.tie_word_embeddings and name == "lm_head.weight")):
                continue
            yield name, st.get_tensor(name).to(device=device, dtype=dtype)
