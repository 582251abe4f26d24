"""The device KV pool: K and V blocks for every layer, preallocated from a byte budget.

The pool knows shapes and formats only (layering: kv never imports models); the engine passes
one (num_kv_heads, head_dim) pair per layer. The block count follows from the byte budget and
the format, so a 4.5-bit format holds ~3.5x the tokens of fp16 in the same bytes.

Each field of the format (nvfp4: data, scales) is one stacked tensor per layer shape,
[K layers + V layers, num_blocks, block_size, ...]; every layer's store is a contiguous view of
it. So moving a batch of blocks to or from a tier is one copy per field, not one per layer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from everybyte.formats.kv_layout import KV_CACHE_DTYPES, get_kv_format
from everybyte.formats.sizes import format_size, parse_size  # noqa: F401 (re-exported)
from everybyte.formats.sizes import kv_bytes_per_token as kv_bytes_per_token_of


def bytes_per_token(layer_shapes: list[tuple[int, int]], kv_cache_dtype: str) -> int:
    """KV bytes of one token across all layers, K and V (formats.sizes, shared with the simulator)."""
    get_kv_format(kv_cache_dtype)                     # an unknown name is the formats' error
    return kv_bytes_per_token_of(layer_shapes, kv_cache_dtype)


def kv_bytes_per_token(layer_shapes: list[tuple[int, int]]) -> dict[str, int]:
    return {name: bytes_per_token(layer_shapes, name) for name in KV_CACHE_DTYPES}


def min_pool_bytes(layer_shapes, kv_cache_dtype: str, num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size) * block_size * bytes_per_token(layer_shapes, kv_cache_dtype)


def pow2_ceil(x: float) -> float:
    """The least power of two >= x > 0, exactly (frexp, not a rounded log2)."""
    m, e = math.frexp(x)
    return math.ldexp(1.0, e - 1 if m == 0.5 else e)


@dataclass
class Stack:
    key: str                              # the format's field ("data", "scales")
    tensor: torch.Tensor                  # [len(members), num_blocks, block_size, ...]
    members: list[tuple[str, int]]        # ("k", layer) / ("v", layer) of each row, in order


class KVPool:
    def __init__(self, layer_shapes: list[tuple[int, int]], kv_cache_dtype: str = "nvfp4",
                 kv_cache_bytes: int | str = "64MiB", block_size: int = 16, device="cpu"):
        self.fmt = get_kv_format(kv_cache_dtype)
        self.kv_cache_dtype = kv_cache_dtype
        self.layer_shapes = list(layer_shapes)
        self.block_size = block_size
        self.budget_bytes = parse_size(kv_cache_bytes)
        self.bytes_per_token = bytes_per_token(self.layer_shapes, kv_cache_dtype)
        self.bytes_per_block = self.bytes_per_token * block_size
        self.num_blocks = self.budget_bytes // self.bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(f"KV cache of {self.budget_bytes} bytes holds no block: one block of "
                             f"{block_size} tokens in {kv_cache_dtype} needs {self.bytes_per_block} bytes")
        self.k: list[dict[str, torch.Tensor]] = [{} for _ in self.layer_shapes]
        self.v: list[dict[str, torch.Tensor]] = [{} for _ in self.layer_shapes]
        self.stacks: list[Stack] = []
        groups: dict[tuple[int, int], list[int]] = {}
        for layer, shape in enumerate(self.layer_shapes):
            groups.setdefault(tuple(shape), []).append(layer)
        for (h, d), layers in groups.items():
            members = [("k", i) for i in layers] + [("v", i) for i in layers]
            for key, t in self.fmt.allocate(len(members) * self.num_blocks, block_size, h, d, device).items():
                t = t.view(len(members), self.num_blocks, *t.shape[1:])
                self.stacks.append(Stack(key, t, members))
                for row, (kv, layer) in enumerate(members):
                    (self.k if kv == "k" else self.v)[layer][key] = t[row]
        self.k_scales = [self.fmt.default_scale] * len(self.layer_shapes)
        self.v_scales = [self.fmt.default_scale] * len(self.layer_shapes)

    @property
    def num_layers(self) -> int:
        return len(self.layer_shapes)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for store in (*self.k, *self.v) for t in store.values())

    def set_scales_from_amax(self, k_amax: list[float], v_amax: list[float], headroom: float = 2.0,
                             grid: bool = True) -> None:
        """Per-layer FP32 scales (decode form) that map amax * headroom, rounded up to a power of
        two, to the format's largest value. The rounding is a pure function of the amax (no
        state, no hysteresis): two processes whose maxima agree bit for bit (the calibration
        pass is deterministic) get the same scales, and maxima that differ by a relative eps
        (another CPU or GEMM library: ~1e-6 in fp32) still do unless one straddles a power of
        two, which happens with probability ~eps / ln 2 per value. grid=False takes the amax as
        given (scales a checkpoint brings, which every process reads bit for bit)."""
        up = lambda a: pow2_ceil(max(a * headroom, 1e-30)) if grid else a
        self.k_scales = [self.fmt.scale_for_amax(up(a)) for a in k_amax]
        self.v_scales = [self.fmt.scale_for_amax(up(a)) for a in v_amax]

    def describe(self) -> dict:
        return {"kv_cache_dtype": self.kv_cache_dtype, "budget_bytes": self.budget_bytes,
                "allocated_bytes": self.nbytes, "block_size": self.block_size,
                "num_blocks": self.num_blocks, "capacity_tokens": self.capacity_tokens,
                "bytes_per_token": self.bytes_per_token}
