"""Move a MoE layer's expert weights between ranks to a new placement (an EPLB rebalance).

Every rank of the group calls move_experts() for the same layer with the same new map, between
two forwards. Each rank derives the same plan from the old and new maps: a slot whose expert
this rank already holds keeps that module (no copy; a second local replica shares it), any
other expert comes from the lowest rank that held it before, serialized whole (so NVFP4-packed
experts travel with their scales) in one all-to-all of bytes for the layer.
"""
from __future__ import annotations

import dataclasses
import io

import torch
from torch import nn

from everybyte.dist import ProcessGroup


def transfer_plan(old, new) -> dict[tuple[int, int], int]:
    """{(destination rank, logical expert): source rank} for every expert a rank holds under
    `new` but not under `old` (the source: the lowest rank that held it)."""
    held = [set(old.physical_to_logical[r * old.slots_per_rank:(r + 1) * old.slots_per_rank])
            for r in range(old.num_ranks)]
    plan: dict[tuple[int, int], int] = {}
    for dst in range(new.num_ranks):
        for e in sorted(set(new.physical_to_logical[dst * new.slots_per_rank:(dst + 1) * new.slots_per_rank])):
            if e not in held[dst]:
                plan[(dst, e)] = min(r for r in range(old.num_ranks) if e in held[r])
    return plan


def _pack(modules: dict[int, nn.Module]) -> bytes:
    buf = io.BytesIO()
    torch.save(modules, buf)
    return buf.getvalue()


def _unpack(data: bytes, device: torch.device) -> dict[int, nn.Module]:
    # our own ranks' bytes over the group's loopback sockets, not a file from elsewhere
    return torch.load(io.BytesIO(data), map_location=device, weights_only=False) if data else {}


def move_experts(group: ProcessGroup | None, block, physical_to_logical: list[int], slots_per_rank: int) -> int:
    """Give `block` the placement (physical_to_logical, slots_per_rank) on this rank; returns the
    number of expert modules this rank received. group None: one rank, only local moves."""
    old = block.placement
    rank, world = (0, 1) if group is None else (group.rank, group.world_size)
    new = dataclasses.replace(old, rank=rank, physical_to_logical=list(physical_to_logical),
                              slots_per_rank=slots_per_rank)
    if new.num_ranks != world:
        raise ValueError(f"layer {block.layer_idx}: placement over {new.num_ranks} ranks, group of {world}")
    mine = {e: block.experts[s] for s, e in reversed(list(enumerate(old.local_logical)))}
    plan = transfer_plan(old, new)
    received: dict[int, nn.Module] = {}
    if group is not None and plan:
        outgoing = []
        for d in range(world):
            items = {e: mine[e] for (dst, e), src in plan.items() if src == rank and dst == d}
            outgoing.append(_pack(items) if items else b"")
        send = [len(b) for b in outgoing]
        recv = group.exchange_counts(send)
        data = torch.frombuffer(bytearray(b"".join(outgoing)), dtype=torch.uint8) if sum(send) else \
            torch.empty(0, dtype=torch.uint8)
        got = group.all_to_all_single(data.to(group.device), recv, send).cpu().numpy().tobytes()
        offset = 0
        for n in recv:
            received.update(_unpack(got[offset:offset + n], group.device))
            offset += n
    have = {**mine, **received}
    missing = sorted({e for e in new.local_logical if e not in have})
    if missing:
        raise RuntimeError(f"layer {block.layer_idx}: experts {missing} reached no slot of rank {rank}")
    block.experts = nn.ModuleList(have[e] for e in new.local_logical)
    block.placement = new
    return len(received)


def placement_message(placement) -> tuple[list[int], int]:
    """What a rank broadcasts so the others build the same placement: (map, slots_per_rank)."""
    return list(placement.physical_to_logical), int(placement.slots_per_rank)
