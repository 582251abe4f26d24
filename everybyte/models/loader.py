"""load_model: a GGUF file, a Hugging Face directory, or (None) the embedded default model."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from everybyte.models.config import ModelConfig
from everybyte.models.default_model import default_model_path
from everybyte.models.expert_placement import ExpertPlacement
from everybyte.models.gguf_file import GGUFFile
from everybyte.models.gguf_loader import config_from_gguf, iter_gguf_weights
from everybyte.models.hf_loader import config_from_hf, iter_hf_weights
from everybyte.models.llama import CausalLM
from everybyte.models.modelopt import QuantConfig, dequantized_weights, read_quant_config
from everybyte.models.moe import ROUTER_PATTERNS
from everybyte.models.moe_weights import canonical_name
from everybyte.models.nvfp4_linear import replace_modules
from everybyte.models.tokenizer import Tokenizer

WEIGHTS_DTYPES = ("auto", "nvfp4", "bf16", "fp32")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


@dataclass
class LoadedModel:
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    path: str
    load_seconds: float = field(default=0.0, compare=False)
    weights_format: str = "float"                  # "nvfp4" when matrices are packed
    quant: QuantConfig | None = None               # what the checkpoint holds
    packed_modules: list[str] = field(default_factory=list)


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """The GGUF file or HF directory `model` names (None: the default model, fetched on first use)."""
    path = Path(default_model_path() if model is None else os.fspath(model)).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path not found: {path}")
    if path.is_dir() and not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ValueError(f"{path}: not a model directory (needs config.json and *.safetensors, "
                             f"or exactly one .gguf file; found {len(ggufs)})")
        path = ggufs[0]
    return path


def load_config_and_tokenizer(path: Path) -> tuple[ModelConfig, Tokenizer, object]:
    """(config, tokenizer, source) for a resolved path; source is the open GGUFFile or the HF dir."""
    if path.is_dir():
        config = config_from_hf(path)
        tokenizer = Tokenizer.from_hf_dir(path, config.eos_token_ids)
        source = path
    else:
        source = GGUFFile(path)
        config = config_from_gguf(source)
        try:
            tokenizer = Tokenizer.from_gguf_metadata(source.metadata)
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"{path}: cannot build the tokenizer: {e}") from e
    config.eos_token_ids = list(dict.fromkeys([*config.eos_token_ids, *tokenizer.eos_token_ids]))
    tokenizer.eos_token_ids = list(config.eos_token_ids)
    if config.bos_token_id is None:
        config.bos_token_id = tokenizer.bos_token_id
    return config, tokenizer, source


def load_model(model: str | os.PathLike | None = None, dtype: torch.dtype | str = torch.float32,
               device: str | torch.device = "cpu", weights_dtype: str = "auto",
               exclude: tuple[str, ...] | None = None,
               placements: dict[int, ExpertPlacement] | None = None) -> LoadedModel:
    """weights_dtype: "auto" keeps what the checkpoint holds (NVFP4 stays packed), "nvfp4" packs
    every linear layer and the embedding (quantizing float ones at load, HF names matching an
    `exclude` pattern stay float; a MoE's routers stay float too), "bf16"/"fp32" computes with
    float weights (dequantized when the checkpoint is NVFP4) in `dtype`. placements: MoE layer
    index -> the ExpertPlacement of this rank (default: every expert here); only the experts it
    places here are loaded."""
    start = time.perf_counter()
    if weights_dtype not in WEIGHTS_DTYPES:
        raise ValueError(f"unsupported weights_dtype {weights_dtype!r}; supported: {', '.join(WEIGHTS_DTYPES)}")
    dtype = resolve_dtype(dtype)
    path = resolve_model_path(model)
    config, tokenizer, source = load_config_and_tokenizer(path)
    quant = None
    if isinstance(source, GGUFFile):
        weights = iter_gguf_weights(source, config, device=device)
    else:
        quant = read_quant_config(source)
        weights = iter_hf_weights(source, config)
    packed = weights_dtype == "nvfp4" or (weights_dtype == "auto" and quant is not None)
    if packed and torch.device(device).type != "cpu":
        raise ValueError(f"NVFP4 weights run on CPU only in this version (device {device!r}): pass "
                         f"weights_dtype='bf16' to dequantize them on {device}")
    if quant is not None and not packed:
        weights = dequantized_weights(weights)
    swapped = []
    if packed:
        if exclude is None:
            exclude = tuple(quant.exclude_modules) if quant is not None and weights_dtype == "auto" else ()
        exclude = tuple(canonical_name(p) for p in exclude)
        if config.is_moe and quant is None:
            exclude += ROUTER_PATTERNS
        with torch.device("meta"):
            lm = CausalLM(config, dtype, placements)
        swapped = replace_modules(lm, lm.linear_parts, exclude)
        lm.to_empty(device=device)
        lm.rotary = CausalLM.make_rotary(config).to(device)
    else:
        with torch.device(device):
            lm = CausalLM(config, dtype, placements)
    lm.load_weights(weights)
    lm.eval()
    return LoadedModel(config, lm, tokenizer, str(path), time.perf_counter() - start,
                       "nvfp4" if packed else "float", quant, swapped)
