"""Expert weights as the model takes them: one name scheme, one tensor per expert, this rank's only.

Checkpoints name experts per expert (Qwen3-MoE / OLMoE `mlp.experts.E.{gate,up,down}_proj`,
Mixtral `block_sparse_moe.experts.E.{w1,w3,w2}` with router `block_sparse_moe.gate`, and the
ModelOpt NVFP4 tensors of each) or, as transformers 5 holds them in memory, stacked 3-D
(`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first, and `mlp.experts.down_proj` [E, H, I]).
`canonical_weights` turns all of them into per-expert `mlp.experts.E.{gate,up,down}_proj` names;
`localize_experts` renames expert E to the local slot(s) holding it and drops other ranks' experts.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import torch

_MIXTRAL = [(re.compile(r"\.block_sparse_moe\.gate(?=\.|$)"), ".mlp.gate"),
            (re.compile(r"\.block_sparse_moe\.experts\.([^.]+)\.w1(?=\.|$)"), r".mlp.experts.\1.gate_proj"),
            (re.compile(r"\.block_sparse_moe\.experts\.([^.]+)\.w3(?=\.|$)"), r".mlp.experts.\1.up_proj"),
            (re.compile(r"\.block_sparse_moe\.experts\.([^.]+)\.w2(?=\.|$)"), r".mlp.experts.\1.down_proj")]
_MIXTRAL_OUT = [(".mlp.gate.", ".block_sparse_moe.gate."), (".gate_proj.", ".w1."), (".up_proj.", ".w3."),
                (".down_proj.", ".w2."), (".mlp.experts.", ".block_sparse_moe.experts.")]
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)(\.weight)?$")
_PER_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(.+)$")


def canonical_name(name: str) -> str:
    """Mixtral's expert and router names -> the mlp.* ones (also for name patterns with '*')."""
    if "block_sparse_moe" in name:
        for pattern, repl in _MIXTRAL:
            name = pattern.sub(repl, name)
    return name


def mixtral_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The inverse of canonical_name for a Mixtral checkpoint being written (its HF names)."""
    for name, tensor in weights:
        for mine, theirs in _MIXTRAL_OUT:
            name = name.replace(mine, theirs)
        yield name, tensor


def canonical_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        name = canonical_name(name)
        stacked = _STACKED.match(name)
        if stacked is None or tensor.dim() != 3:
            yield name, tensor
            continue
        prefix, leaf = stacked.group(1), stacked.group(2)
        for e in range(tensor.shape[0]):
            if leaf == "gate_up_proj":
                if tensor.shape[1] % 2:
                    raise ValueError(f"{name}: stacked gate_up_proj {tuple(tensor.shape)} has an odd row count")
                gate, up = tensor[e].chunk(2, dim=0)
                yield f"{prefix}.{e}.gate_proj.weight", gate
                yield f"{prefix}.{e}.up_proj.weight", up
            else:
                yield f"{prefix}.{e}.{leaf}.weight", tensor[e]


def localize_experts(weights: Iterable[tuple[str, torch.Tensor]], lm) -> Iterator[tuple[str, torch.Tensor]]:
    """Per-expert names of logical expert E -> those of each local slot holding it (a replica
    gets the same tensor); experts this rank does not hold are skipped."""
    from everybyte.models.moe import MoEBlock
    layers = lm.model.layers
    for name, tensor in canonical_weights(weights):
        m = _PER_EXPERT.match(name)
        layer = int(m.group(1)) if m else -1
        block = layers[layer].mlp if 0 <= layer < len(layers) else None
        if not isinstance(block, MoEBlock) or not int(m.group(2)) < block.num_experts:
            yield name, tensor                   # not an expert (or an unknown one: load_weights names it)
            continue
        for slot in block.placement.local_slots_of(int(m.group(2))):
            yield f"model.layers.{layer}.mlp.experts.{slot}.{m.group(3)}", tensor
