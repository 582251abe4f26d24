"""Modules whose weights stay NVFP4 in memory, and how they take tensors while a model loads.

A module is told its parts' Hugging Face names (q/k/v of a fused projection, or one) and takes,
per part, either a float `weight` (quantized here with one tensor scale for the group, as
`everybyte quantize` does) or a ModelOpt NVFP4 triple `weight` (uint8 [out, in/2]),
`weight_scale` (float8_e4m3fn [out, in/16]) and `weight_scale_2` (float32 scalar, decode form),
plus an optional `input_scale`. Packed tensors are used as they are: memory-mapped checkpoint
tensors are never copied.
"""
from __future__ import annotations

import fnmatch

import torch
from torch import nn

from everybyte.formats.nvfp4_blocks import BLOCK, dequantize_blocks
from everybyte.formats.nvfp4_weights import PackedPart, quantize_group
from everybyte.models import nvfp4_gemm
from everybyte.models.nvfp4_gemm import PackedWeight

SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")


def _scalar(name: str, t: torch.Tensor) -> float:
    if t.numel() != 1 or not t.dtype.is_floating_point:
        raise ValueError(f"{name}: expected one float32 value, got dtype {t.dtype} shape {tuple(t.shape)}")
    v = float(t.float().reshape(()))
    if not (v == v and abs(v) != float("inf")) or v < 0:
        raise ValueError(f"{name}: {v} is not a finite non-negative scale")
    return v


class PackedModule(nn.Module):
    """Common part of NVFP4Linear and NVFP4Embedding: collect the parts' tensors, then pack."""

    def setup(self, in_features: int, part_rows: tuple[int, ...]):
        self.in_features, self.part_rows = in_features, tuple(part_rows)
        self.packed: PackedWeight | None = None
        self._got: list[dict] = [{} for _ in part_rows]
        self.part_names: list[str] = [str(i) for i in part_rows]

    def accept(self, part: int, suffix: str, tensor: torch.Tensor, name: str) -> None:
        self._got[part][suffix] = (name, tensor)
        got = self._got
        if all("weight" in g and g["weight"][1].is_floating_point() for g in got):
            self._pack_float()

    def _pack_float(self) -> None:
        named = [g["weight"] for g in self._got]
        for (name, w), rows in zip(named, self.part_rows):
            if tuple(w.shape) != (rows, self.in_features):
                raise ValueError(f"weight {name}: shape {tuple(w.shape)}, expected {(rows, self.in_features)}")
        self.packed = PackedWeight(quantize_group(named))
        self._got = [{} for _ in self.part_rows]

    def _packed_part(self, i: int) -> PackedPart:
        got, rows, k = self._got[i], self.part_rows[i], self.in_features
        prefix = self.part_names[i]
        for suffix in ("weight", "weight_scale", "weight_scale_2"):
            if suffix not in got:
                raise ValueError(f"{prefix}.{suffix}: missing (an NVFP4 weight needs weight, weight_scale, "
                                 f"weight_scale_2)")
        (wn, w), (sn, s) = got["weight"], got["weight_scale"]
        if w.dtype != torch.uint8 or tuple(w.shape) != (rows, k // 2):
            raise ValueError(f"{wn}: dtype {w.dtype} shape {tuple(w.shape)}, expected uint8 {(rows, k // 2)}")
        if s.dtype not in (torch.float8_e4m3fn, torch.uint8) or tuple(s.shape) != (rows, k // BLOCK):
            raise ValueError(f"{sn}: dtype {s.dtype} shape {tuple(s.shape)}, expected float8_e4m3fn "
                             f"{(rows, k // BLOCK)}")
        gs = _scalar(got["weight_scale_2"][0], got["weight_scale_2"][1])
        inp = _scalar(*got["input_scale"]) if "input_scale" in got else None
        return PackedPart(w, s.view(torch.float8_e4m3fn), gs, inp)

    def finish(self) -> list[str]:
        """Pack what came as NVFP4 tensors; the names still missing (empty: loaded)."""
        if self.packed is not None:
            return []
        if any("weight" in g and g["weight"][1].is_floating_point() for g in self._got):
            return [f"{n}.weight" for n, g in zip(self.part_names, self._got) if "weight" not in g]
        if not any(self._got):
            return [f"{n}.weight" for n in self.part_names]
        self.packed = PackedWeight([self._packed_part(i) for i in range(len(self.part_rows))])
        self._got = [{} for _ in self.part_rows]
        return []


class NVFP4Linear(PackedModule):
    def __init__(self, in_features: int, part_rows: tuple[int, ...], bias: nn.Parameter | None):
        super().__init__()
        self.setup(in_features, part_rows)
        self.bias = bias

    def forward(self, x):
        return nvfp4_gemm.linear(x, self.packed, self.bias)


class NVFP4Embedding(PackedModule):
    """Embedding rows dequantized on lookup; as a tied LM head, the packed matrix in the GEMM."""

    def __init__(self, num: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.setup(dim, (num,))
        self.dtype = dtype

    def forward(self, ids):
        p = self.packed.parts[0]
        flat = ids.reshape(-1)
        rows = dequantize_blocks(p.data[flat], p.scales[flat], p.global_scale, self.dtype)
        return rows.view(*ids.shape, self.in_features)

    def logits(self, h):
        return nvfp4_gemm.linear(h, self.packed)


def matches(name: str, patterns) -> bool:
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*") for p in patterns)


def replace_modules(lm: nn.Module, parts_of, exclude=()) -> list[str]:
    """Swap every Linear/Embedding of `lm` whose HF names match no `exclude` pattern for its
    NVFP4 module (build `lm` on the meta device: nothing is allocated for the float weights).
    parts_of(module name) -> [(HF name, rows)] of the matrices it holds. Returns the names swapped."""
    from everybyte.models.layers import Embedding, Linear
    swapped = []
    for name, mod in list(lm.named_modules()):
        if not isinstance(mod, (Linear, Embedding)):
            continue
        parts = parts_of(name)
        if any(matches(p, exclude) for p, _ in parts):
            continue
        if isinstance(mod, Linear):
            new = NVFP4Linear(mod.weight.shape[1], tuple(r for _, r in parts), mod.bias)
        else:
            new = NVFP4Embedding(*mod.weight.shape, mod.weight.dtype)
        new.part_names = [p for p, _ in parts]
        swapped.append(name)
        parent, _, attr = name.rpartition(".")
        setattr(lm.get_submodule(parent) if parent else lm, attr, new)
    return swapped


def weight_bytes(lm: nn.Module) -> int:
    """Bytes of every weight: packed NVFP4 parts plus the float parameters."""
    packed = sum(m.packed.nbytes for m in lm.modules() if isinstance(m, PackedModule) and m.packed is not None)
    return packed + sum(p.numel() * p.element_size() for p in lm.parameters())
