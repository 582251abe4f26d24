"""KV block storage formats: how one layer's K (or V) blocks are laid out and (de)quantized.

A store is a dict of tensors that all start with [num_blocks, block_size, num_kv_heads, ...], so
one block is `{key: t[block_id] for key, t in store.items()}` in every format. A slot is
`block_id * block_size + offset`. `scale` is the per-layer FP32 scale of K or V (decode form:
stored value * scale ~= x); float formats ignore it.
"""
from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod

import torch

from everybyte.formats import cpu_kernels, fp8, nvfp4
from everybyte.formats.nvfp4_kv import divisors, quantize_blocks_best_scale
from everybyte.formats.sizes import KV_CACHE_DTYPES, kv_token_bytes

FP8_MAX = 448.0
NVFP4_MAX = 6.0 * 448.0


@functools.lru_cache(maxsize=16)
def hadamard(n: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix (symmetric, orthonormal: H @ H = I); n a power of 2."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of 2, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(dtype=dtype, device=device)


class KVFormat(ABC):
    name: str = ""
    default_scale: float = 1.0
    # Store K and V rotated by a Hadamard matrix over head_dim (queries rotated alike, outputs
    # rotated back): outlier channels spread over the whole vector instead of coarsening the
    # 16-value blocks they fall in. Exact in real arithmetic since H is orthonormal.
    rotate: bool = False
    # Per-layer K/V scales calibrated from the model's amax (scale_for_amax matters), and values
    # lossy enough that each sequence keeps its last span unquantized (engine/exact_tail).
    scaled: bool = False
    lossy: bool = False

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> int:
        """Bytes for K *or* V of one token in one layer (formats.sizes: the torch-free arithmetic
        the simulator shares; test_kv_layout checks it against what allocate() makes)."""
        return kv_token_bytes(self.name, num_kv_heads, head_dim)

    def scale_for_amax(self, amax: float) -> float:
        return 1.0

    def allocate(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 device="cpu") -> dict[str, torch.Tensor]:
        return {key: torch.zeros(num_blocks, block_size, *shape, dtype=dtype, device=device)
                for key, (shape, dtype) in self._fields(num_kv_heads, head_dim).items()}

    def write(self, store: dict[str, torch.Tensor], slot_mapping: torch.Tensor, x: torch.Tensor,
              scale: float) -> None:
        if slot_mapping.numel() == 0:
            return
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            slot_mapping, x = slot_mapping[keep], x[keep]
        for key, value in self.encode(x, scale).items():
            t = store[key]
            t.view(-1, *t.shape[2:])[slot_mapping] = value

    def write_kv(self, k_store, v_store, slot_mapping, k, v, k_scale: float, v_scale: float) -> None:
        """Store one layer's new K and V (formats may encode both in one pass)."""
        self.write(k_store, slot_mapping, k, k_scale)
        self.write(v_store, slot_mapping, v, v_scale)

    def read_kv(self, k_store, v_store, block_ids: torch.Tensor, k_scale: float, v_scale: float,
                dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """read() of a layer's K and V at the same block ids (formats may share the work)."""
        return self.read(k_store, block_ids, k_scale, dtype), self.read(v_store, block_ids, v_scale, dtype)

    def read(self, store: dict[str, torch.Tensor], block_ids: torch.Tensor, scale: float,
             dtype=torch.float32) -> torch.Tensor:
        """Gather blocks and dequantize: [..., block_size, num_kv_heads, head_dim]."""
        flat_ids = block_ids.reshape(-1)
        parts = {key: t.view(t.shape[0], -1).index_select(0, flat_ids).view(*block_ids.shape, *t.shape[1:])
                 for key, t in store.items()}
        return self.decode(parts, scale, dtype)

    @abstractmethod
    def encode(self, x: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
        """[T, Hkv, D] -> the store's fields for those T tokens."""

    @abstractmethod
    def decode(self, parts: dict[str, torch.Tensor], scale: float, dtype) -> torch.Tensor:
        """Gathered fields -> values [..., Hkv, D] in dtype."""

    @abstractmethod
    def _fields(self, num_kv_heads: int, head_dim: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-token shape and dtype of each field of the store."""

    def __repr__(self):
        return f"KVFormat({self.name!r})"


class FloatKV(KVFormat):
    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.dtype = name, dtype

    def _fields(self, num_kv_heads, head_dim):
        return {"data": ((num_kv_heads, head_dim), self.dtype)}

    def encode(self, x, scale):
        return {"data": x.to(self.dtype)}

    def decode(self, parts, scale, dtype):
        return parts["data"].to(dtype)


class FP8KV(KVFormat):
    """E4M3 values, x ~= q * scale; scale 1.0 keeps the raw +-448 range."""
    name = "fp8"
    scaled = lossy = True

    def _fields(self, num_kv_heads, head_dim):
        return {"data": ((num_kv_heads, head_dim), torch.float8_e4m3fn)}

    def scale_for_amax(self, amax):
        return max(float(amax), 1e-12) / FP8_MAX

    def encode(self, x, scale):
        return {"data": fp8.quantize_raw(x, scale)}

    def decode(self, parts, scale, dtype):
        return fp8.dequantize_raw(parts["data"], scale, dtype)


class NVFP4KV(KVFormat):
    """Packed E2M1 pairs (low nibble first) + an E4M3 scale per 16 head_dim values of one token of
    one KV head + the per-layer FP32 scale (decode form). The default scale, 448/2688, covers the
    same +-448 range as fp8 at scale 1. Values are Hadamard-rotated (see KVFormat.rotate) and each
    block takes the best of several scales from amax/6 to amax/4 (formats.nvfp4_kv); both measured on
    SmolLM2-135M to cut the perplexity cost of nvfp4 KV roughly in half."""
    name = "nvfp4"
    default_scale = FP8_MAX / NVFP4_MAX
    rotate = True
    scaled = lossy = True

    def _fields(self, num_kv_heads, head_dim):
        if head_dim % 16:
            raise ValueError(f"nvfp4 KV cache needs head_dim divisible by 16, got {head_dim}")
        return {"data": ((num_kv_heads, head_dim // 2), torch.uint8),
                "scales": ((num_kv_heads, head_dim // 16), torch.float8_e4m3fn)}

    def scale_for_amax(self, amax):
        return max(float(amax), 1e-12) / NVFP4_MAX

    def encode(self, x, scale):
        packed, scales = quantize_blocks_best_scale(x, scale)
        return {"data": packed, "scales": scales}

    def write(self, store, slot_mapping, x, scale):
        if _c_kernels(x) and slot_mapping.numel() and _flat(store):
            cpu_kernels.kv_write(store["data"], store["scales"], slot_mapping, x, float(scale), divisors("cpu"))
        else:
            super().write(store, slot_mapping, x, scale)

    def write_kv(self, k_store, v_store, slot_mapping, k, v, k_scale, v_scale):
        """With the C kernels: each of K and V encoded straight into its slots (one call each).
        Otherwise K and V encoded in one torch pass (one scale per 16-value block), then
        scattered: half the per-call overhead, which dominates at decode batch sizes."""
        if slot_mapping.numel() == 0:
            return
        if _c_kernels(k) and _flat(k_store) and _flat(v_store):
            cpu_kernels.kv_write_pairs([(k_store["data"], k_store["scales"], k, float(k_scale)),
                                        (v_store["data"], v_store["scales"], v, float(v_scale))],
                                       slot_mapping, divisors("cpu"))
            return
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
        per_block = k.shape[0] * k.shape[1] * (k.shape[2] // 16)
        scales = torch.cat([torch.full((per_block,), float(k_scale), device=k.device),
                            torch.full((per_block,), float(v_scale), device=k.device)])
        packed, sf = quantize_blocks_best_scale(torch.cat([k, v]), scales)
        n = k.shape[0]
        for store, rows in ((k_store, slice(0, n)), (v_store, slice(n, 2 * n))):
            for key, value in (("data", packed[rows]), ("scales", sf[rows])):
                t = store[key]
                t.view(-1, *t.shape[2:])[slot_mapping] = value

    def read_kv(self, k_store, v_store, block_ids, k_scale, v_scale, dtype=torch.float32):
        if _c_kernels(k_store["data"]) and _flat(k_store) and _flat(v_store) and dtype in (torch.float32, torch.bfloat16):
            k, v = cpu_kernels.kv_gather_pairs([(k_store["data"], k_store["scales"], float(k_scale)),
                                                (v_store["data"], v_store["scales"], float(v_scale))], block_ids, dtype)
            shape = (*block_ids.shape, *k_store["data"].shape[1:-1], -1)
            return k.view(shape), v.view(shape)
        return super().read_kv(k_store, v_store, block_ids, k_scale, v_scale, dtype)

    def read(self, store, block_ids, scale, dtype=torch.float32):
        if _c_kernels(store["data"]) and _flat(store) and dtype in (torch.float32, torch.bfloat16):
            out = cpu_kernels.kv_gather(store["data"], store["scales"], block_ids, float(scale), dtype)
            return out.view(*block_ids.shape, *store["data"].shape[1:-1], -1)
        return super().read(store, block_ids, scale, dtype)

    def decode(self, parts, scale, dtype):
        return nvfp4.dequantize_blocks(parts["data"], parts["scales"], scale, dtype)


def _c_kernels(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and cpu_kernels.available()


def _flat(store: dict[str, torch.Tensor]) -> bool:
    """The C kernels address a block by id * its bytes: the store must be contiguous."""
    return all(t.is_contiguous() for t in store.values())


_FORMATS = {
    "fp32": FloatKV("fp32", torch.float32),
    "fp16": FloatKV("fp16", torch.float16),
    "bf16": FloatKV("bf16", torch.bfloat16),
    "fp8": FP8KV(),
    "nvfp4": NVFP4KV(),
}


def get_kv_format(name: str) -> KVFormat:
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown KV cache dtype {name!r}; choose one of "
                         f"{', '.join(KV_CACHE_DTYPES)}") from None
