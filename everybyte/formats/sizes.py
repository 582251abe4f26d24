"""Byte sizes of the stored formats, as pure arithmetic (no torch): what the KV pool allocates
per token and what a packed weight matrix takes. The real formats (kv_layout, nvfp4_weights) and
the simulator's model catalog both use these, so a simulated pool holds exactly the blocks a
real one of the same budget holds."""
from __future__ import annotations

import re

KV_CACHE_DTYPES = ("fp32", "fp16", "bf16", "fp8", "nvfp4")
WEIGHT_FORMATS = ("fp32", "fp16", "bf16", "fp8", "nvfp4")
NVFP4_BLOCK = 16                                   # values sharing one E4M3 scale
_FLOAT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1}


def kv_token_bytes(kv_cache_dtype: str, num_kv_heads: int, head_dim: int) -> int:
    """Bytes for K *or* V of one token in one layer (nvfp4: packed E2M1 pairs + an E4M3 scale per
    16 head_dim values; the per-layer FP32 scale is not per token)."""
    n = num_kv_heads * head_dim
    if kv_cache_dtype == "nvfp4":
        if head_dim % NVFP4_BLOCK:
            raise ValueError(f"nvfp4 KV cache needs head_dim divisible by 16, got {head_dim}")
        return n // 2 + n // NVFP4_BLOCK
    if kv_cache_dtype not in _FLOAT_BYTES:
        raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    return n * _FLOAT_BYTES[kv_cache_dtype]


def kv_bytes_per_token(layer_shapes: list[tuple[int, int]], kv_cache_dtype: str) -> int:
    """KV bytes of one token across all layers, K and V (layer_shapes: (num_kv_heads, head_dim) each)."""
    return sum(2 * kv_token_bytes(kv_cache_dtype, h, d) for h, d in layer_shapes)


def weight_matrix_bytes(weights_format: str, rows: int, cols: int) -> int:
    """Bytes of one [rows, cols] weight matrix as stored: nvfp4 = packed codes + an E4M3 scale
    per 16 values + one FP32 tensor scale; fp8 = one byte a value + one FP32 scale."""
    n = rows * cols
    if weights_format == "nvfp4":
        return n // 2 + -(-cols // NVFP4_BLOCK) * rows + 4
    if weights_format == "fp8":
        return n + 4
    if weights_format not in _FLOAT_BYTES:
        raise ValueError(f"unknown weights format {weights_format!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    return n * _FLOAT_BYTES[weights_format]


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(size: int | str) -> int:
    """'64MiB', '1GiB', '500MB', '1.5GB', '4096' or an int -> bytes."""
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(size))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"cannot parse size {size!r}; use bytes or a unit like 64MiB, 1GiB, 500MB")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be > 0 bytes, got {size!r}")
    return value


def format_size(n: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"
