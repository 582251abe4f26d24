"""Write any model everybyte loads (GGUF, HF directory, the embedded default) as a Hugging Face
directory: config.json, generation_config.json, tokenizer.json + tokenizer_config.json and
safetensors weights under HF names in HF's q/k layout (the GGUF loader already undid llama.cpp's
rope permutation). The directory is written next to its target and renamed into place, so a
half-written export is never mistaken for a finished one."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from everybyte.models.config import ModelConfig
from everybyte.models.gguf_file import GGUFFile
from everybyte.models.gguf_loader import iter_gguf_weights
from everybyte.models.hf_loader import ARCHITECTURES, INDEX_FILE, iter_hf_weights
from everybyte.models.loader import load_config_and_tokenizer, resolve_dtype, resolve_model_path
from everybyte.models.modelopt import QUANT_FILE, QuantConfig, config_json_entry, hf_quant_json
from everybyte.models.moe_config import hf_moe_config
from everybyte.models.moe_weights import mixtral_weights
from everybyte.models.tokenizer import Tokenizer

FORMATS = ("hf",)
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
HF_ARCHITECTURES = {arch: name for name, arch in ARCHITECTURES.items()}
SHARD_BYTES = 4 << 30
SCALE_SUFFIXES = (".weight_scale_2", ".input_scale", ".k_scale", ".v_scale")   # float32 in quantized checkpoints


def export_hf(model: str | os.PathLike | None, out_dir: str | os.PathLike, dtype: torch.dtype | str = "bf16",
              force: bool = False, shard_bytes: int = SHARD_BYTES, quant: QuantConfig | None = None,
              transform=None, config_update: dict | None = None) -> Path:
    """Convert `model` (None: the default model) into the HF directory `out_dir`; returns it.
    quant + transform: a quantized checkpoint (transform maps the float (name, tensor) stream
    to the stored one; quant is written to hf_quant_config.json and config.json);
    config_update: ModelConfig fields the written model changes (e.g. a MoE made from it)."""
    dtype = resolve_dtype(dtype)
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}; supported: fp32, fp16, bf16")
    out = check_out_dir(out_dir, force)
    config, tokenizer, source = load_config_and_tokenizer(resolve_model_path(model))
    written = dataclasses.replace(config, **config_update) if config_update else config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        cfg = hf_config(written, dtype)
        if quant is not None:
            cfg["quantization_config"] = config_json_entry(quant)
            _write_json(tmp / QUANT_FILE, hf_quant_json(quant))
        _write_json(tmp / "config.json", cfg)
        _write_json(tmp / "generation_config.json", generation_config(written))
        write_tokenizer(tokenizer, written, tmp)
        weights = (iter_gguf_weights(source, config) if isinstance(source, GGUFFile)
                   else iter_hf_weights(source, config))
        if transform is not None:
            weights = transform(weights)
        if written.architecture == "mixtral":
            weights = mixtral_weights(weights)
        write_weights(weights, tmp, dtype, config.tie_word_embeddings, shard_bytes)
        _default_modes(tmp)
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def check_out_dir(out_dir: str | os.PathLike, force: bool) -> Path:
    """The output directory as a Path; FileExistsError when it holds something and force is off."""
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise FileExistsError(f"{out} exists and is not empty; pass --force to replace it")
    return out


def hf_config(c: ModelConfig, dtype: torch.dtype) -> dict:
    cfg = {"architectures": [HF_ARCHITECTURES[c.architecture]], "model_type": c.architecture,
           "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": "silu",
           "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
           "rope_theta": c.rope_theta, "rope_scaling": dict(c.rope_scaling) if c.rope_scaling else None,
           "tie_word_embeddings": c.tie_word_embeddings, "attention_dropout": 0.0, "initializer_range": 0.02,
           "use_cache": True, "bos_token_id": c.bos_token_id, "eos_token_id": _one_or_list(c.eos_token_ids),
           "torch_dtype": DTYPE_NAMES[dtype], "dtype": DTYPE_NAMES[dtype]}
    if c.architecture in ("llama", "llama_moe", "mixtral"):
        cfg |= {"attention_bias": c.attention_bias, "mlp_bias": False, "pretraining_tp": 1}
    else:
        cfg |= {"use_sliding_window": False, "sliding_window": None, "max_window_layers": c.num_hidden_layers}
        if c.architecture in ("qwen3", "qwen3_moe", "olmoe"):
            cfg["attention_bias"] = c.attention_bias
    return cfg | hf_moe_config(c.architecture, c)


def generation_config(c: ModelConfig) -> dict:
    return {"bos_token_id": c.bos_token_id, "eos_token_id": _one_or_list(c.eos_token_ids)}


def write_tokenizer(tok: Tokenizer, config: ModelConfig, out: Path) -> None:
    """tokenizer.json as everybyte builds it, and a tokenizer_config.json that makes transformers use
    it as it is (PreTrainedTokenizerFast: no BOS handling of its own on top of the post-processor)."""
    tok.backend.save(str(out / "tokenizer.json"))
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", **tok.special_tokens,
          "model_max_length": config.max_position_embeddings, "clean_up_tokenization_spaces": False}
    if tok.chat_template:
        tc["chat_template"] = tok.chat_template
    _write_json(out / "tokenizer_config.json", tc)
    special = {k: v for k, v in tok.special_tokens.items() if k in ("bos_token", "eos_token", "unk_token",
                                                                     "pad_token")}
    _write_json(out / "special_tokens_map.json", special)


def write_weights(weights, out: Path, dtype: torch.dtype, tied: bool, shard_bytes: int = SHARD_BYTES) -> None:
    """model.safetensors, or model-0000K-of-0000N.safetensors plus an index past shard_bytes."""
    shards, current, size = [], {}, 0
    for name, w in weights:
        if tied and name == "lm_head.weight":
            continue
        keep = w.dtype not in DTYPE_NAMES or name.endswith(SCALE_SUFFIXES)    # NVFP4 tensors and scales as they are
        w = (w if keep else w.to(dtype)).contiguous()
        if current and size + w.nbytes > shard_bytes:
            shards.append(_save_shard(current, out, len(shards)))
            current, size = {}, 0
        current[name], size = w, size + w.nbytes
    shards.append(_save_shard(current, out, len(shards)))
    if len(shards) == 1:
        os.replace(out / shards[0][0], out / "model.safetensors")
        return
    n = len(shards)
    weight_map, total = {}, 0
    for i, (file, names, nbytes) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(out / file, out / final)
        weight_map |= dict.fromkeys(names, final)
        total += nbytes
    _write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})


def _save_shard(tensors: dict, out: Path, index: int) -> tuple[str, list[str], int]:
    file = f"shard-{index}.safetensors"
    save_file(tensors, str(out / file), metadata={"format": "pt"})
    return file, list(tensors), sum(t.nbytes for t in tensors.values())


def _default_modes(path: Path) -> None:
    """mkdtemp's (and safetensors') private modes -> what a plain mkdir/open would give."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)
    for f in path.iterdir():
        f.chmod(0o666 & ~umask)


def _one_or_list(ids: list[int]):
    return None if not ids else ids[0] if len(ids) == 1 else list(ids)


def _write_json(file: Path, data: dict) -> None:
    file.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
