"""DeepSeek's expert-parallel load balancer (EPLB): which logical expert each physical slot holds.

Given each layer's load per logical expert, R physical slots (experts + redundant replicas) and
G GPUs of R/G slots each:
1. replicate: every expert gets one slot, then each extra slot goes to the expert with the
   highest load per replica (load / replicas so far);
2. pack: replicas (each carrying load / replicas of its expert), heaviest first, go to the
   lightest GPU that still has a free slot and, while such a GPU exists, holds no replica of the
   same expert (the dispatcher moves a step's load between replicas on different GPUs only).
Hierarchical when the expert groups divide among the nodes: groups are packed onto nodes the
same way first (so a group's tokens stay on one node), then replication and packing run inside
each node. Otherwise one global pass (one group, one node).
Ties break toward the lower index (a stable sort, the first minimum), which is what reproduces
DeepSeek's reference example.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

Loads = Sequence[Sequence[float]]


def balanced_packing(weights: Sequence[float], num_packs: int,
                     labels: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
    """Items of `weights` into `num_packs` packs of equal item count, heaviest first into the
    lightest pack with room: (pack of each item, its position in the pack). With `labels` (the
    expert of each replica), a pack that already holds the label is passed over while another
    has room: two replicas of one expert on one GPU cannot share a step's load between GPUs."""
    n = len(weights)
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"cannot pack {n} items into {num_packs} packs of equal size")
    per_pack = n // num_packs
    if per_pack == 1:                                   # one item a pack: keep the order
        return list(range(n)), [0] * n
    pack_of, rank_in_pack = [-1] * n, [-1] * n
    load, count = [0.0] * num_packs, [0] * num_packs
    held: list[set[int]] = [set() for _ in range(num_packs)]
    for item in sorted(range(n), key=lambda i: -weights[i]):
        room = [p for p in range(num_packs) if count[p] < per_pack]
        if labels is not None:
            room = [p for p in room if labels[item] not in held[p]] or room
        pack = min(room, key=load.__getitem__)
        if labels is not None:
            held[pack].add(labels[item])
        pack_of[item], rank_in_pack[item] = pack, count[pack]
        load[pack] += weights[item]
        count[pack] += 1
    return pack_of, rank_in_pack


def replicate(weights: Sequence[float], num_slots: int) -> tuple[list[int], list[int], list[int]]:
    """Slots for experts with loads `weights`: slot i < len(weights) holds expert i, each further
    slot the expert with the highest load per replica. (expert of each slot, replica index of
    each slot, replica count of each expert)."""
    n = len(weights)
    slot_expert, slot_replica, count = list(range(n)), [0] * n, [1] * n
    for _ in range(n, num_slots):
        best = max(range(n), key=lambda e: weights[e] / count[e])
        slot_expert.append(best)
        slot_replica.append(count[best])
        count[best] += 1
    return slot_expert, slot_replica, count


def _rebalance_layer(w: Sequence[float], num_replicas: int, num_groups: int, num_nodes: int,
                     num_gpus: int) -> tuple[list[int], list[int], list[int]]:
    """One layer: (logical expert of each physical slot, its replica index, replicas per expert)."""
    num_experts = len(w)
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    per_node_experts, per_node_slots = num_experts // num_nodes, num_replicas // num_nodes
    slots_per_gpu = num_replicas // num_gpus
    group_load = [sum(w[g * group_size:(g + 1) * group_size]) for g in range(num_groups)]
    node_of, pos_in_node = balanced_packing(group_load, num_nodes)
    # node-major order of the experts: node n holds positions [n*per_node_experts, ...)
    order = [-1] * num_experts
    for g in range(num_groups):
        start = (node_of[g] * groups_per_node + pos_in_node[g]) * group_size
        for j in range(group_size):
            order[start + j] = g * group_size + j
    phy2log, phy_rank, logcnt = [-1] * num_replicas, [-1] * num_replicas, [0] * num_experts
    for node in range(num_nodes):
        experts = order[node * per_node_experts:(node + 1) * per_node_experts]
        loads = [float(w[e]) for e in experts]
        slot_expert, slot_replica, count = replicate(loads, per_node_slots)
        gpu_of, pos_in_gpu = balanced_packing([loads[e] / count[e] for e in slot_expert],
                                              num_gpus // num_nodes, labels=slot_expert)
        for s, local in enumerate(slot_expert):
            phys = node * per_node_slots + gpu_of[s] * slots_per_gpu + pos_in_gpu[s]
            phy2log[phys], phy_rank[phys] = experts[local], slot_replica[s]
        for local, e in enumerate(experts):
            logcnt[e] = count[local]
    return phy2log, phy_rank, logcnt


def check_settings(num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    """Clear errors for settings the balancer cannot place."""
    for name, v in (("num_groups", num_groups), ("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        if v < 1:
            raise ValueError(f"EPLB: {name} must be >= 1, got {v}")
    if num_experts < 1:
        raise ValueError("EPLB: the load has no experts")
    if num_replicas < num_experts:
        raise ValueError(f"EPLB: {num_replicas} physical slots cannot hold {num_experts} experts; "
                         f"num_replicas must be >= {num_experts}")
    if num_replicas % num_gpus:
        ok = [num_replicas - num_replicas % num_gpus + num_gpus * k for k in (0, 1)]
        raise ValueError(f"EPLB: num_replicas {num_replicas} is not a multiple of num_gpus {num_gpus} "
                         f"(every GPU holds the same number of slots); try {ok[0] if ok[0] >= num_experts else ok[1]}")
    if num_experts % num_groups:
        raise ValueError(f"EPLB: {num_experts} experts do not split into {num_groups} equal groups")
    if num_gpus % num_nodes:
        raise ValueError(f"EPLB: {num_gpus} GPUs do not split into {num_nodes} nodes of equal size")


def is_hierarchical(num_groups: int, num_nodes: int) -> bool:
    return num_groups % num_nodes == 0


def rebalance(weight: torch.Tensor | Loads, num_replicas: int, num_groups: int, num_nodes: int,
              num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [L, E] load per logical expert -> (phy2log [L, R] logical expert of each physical
    slot, log2phy [L, E, max replicas] physical slots of each expert (-1 pads), logcnt [L, E]
    replicas of each expert). GPU g holds slots [g*R/G, (g+1)*R/G)."""
    import torch  # here, so that place() (the simulator's) needs no torch

    w = weight.tolist() if isinstance(weight, torch.Tensor) else [list(row) for row in weight]
    if not w or not isinstance(w[0], list) or any(len(row) != len(w[0]) for row in w):
        raise ValueError("EPLB: weight must be a 2-D [layers, experts] table")
    if any(not (x >= 0 and x != float("inf")) for row in w for x in row):
        raise ValueError("EPLB: loads must be finite and >= 0")
    num_experts = len(w[0])
    check_settings(num_experts, num_replicas, num_groups, num_nodes, num_gpus)
    if not is_hierarchical(num_groups, num_nodes):
        num_groups, num_nodes = 1, 1
    layers = [_rebalance_layer(row, num_replicas, num_groups, num_nodes, num_gpus) for row in w]
    phy2log = torch.tensor([p for p, _, _ in layers], dtype=torch.int64)
    logcnt = torch.tensor([c for _, _, c in layers], dtype=torch.int64)
    log2phy = torch.full((len(w), num_experts, int(logcnt.max())), -1, dtype=torch.int64)
    for i, (p2l, rank, _) in enumerate(layers):
        for slot, (e, r) in enumerate(zip(p2l, rank)):
            log2phy[i, e, r] = slot
    return phy2log, log2phy, logcnt


def place(load: Sequence[float], num_replicas: int, num_gpus: int, num_groups: int = 1,
          num_nodes: int = 1) -> list[int]:
    """One layer's placement without torch: the logical expert of each physical slot (a row of
    rebalance's phy2log)."""
    w = [float(x) for x in load]
    if any(not (x >= 0 and x != float("inf")) for x in w):
        raise ValueError("EPLB: loads must be finite and >= 0")
    check_settings(len(w), num_replicas, num_groups, num_nodes, num_gpus)
    if not is_hierarchical(num_groups, num_nodes):
        num_groups, num_nodes = 1, 1
    return _rebalance_layer(w, num_replicas, num_groups, num_nodes, num_gpus)[0]


def rank_loads(load: Sequence[float], phy2log: Sequence[int], num_ranks: int) -> list[float]:
    """Tokens per rank for one layer: each expert's load split evenly over its replicas."""
    if len(phy2log) % num_ranks:
        raise ValueError(f"{len(phy2log)} slots do not split over {num_ranks} ranks")
    replicas = [0] * len(load)
    for e in phy2log:
        replicas[e] += 1
    per = len(phy2log) // num_ranks
    return [sum(load[e] / replicas[e] for e in phy2log[r * per:(r + 1) * per]) for r in range(num_ranks)]


def imbalance(loads_per_rank: Sequence[float]) -> float:
    """max / mean tokens per rank (1.0 = perfectly even; an idle layer counts as even)."""
    mean = sum(loads_per_rank) / len(loads_per_rank)
    return max(loads_per_rank) / mean if mean > 0 else 1.0
