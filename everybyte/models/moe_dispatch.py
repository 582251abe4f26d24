"""Expert parallelism's dispatch and combine: a MoE layer's tokens go to the ranks holding their
experts and come back weighted, with all-to-all through dist/ (one exchange per layer per step).

Every rank of the group calls forward() for every MoE layer of every step, in the same order,
with its own tokens (a rank that has none passes zero rows; it still runs the experts others
send it). Per (token, expert) a replica is chosen among the placement's physical slots holding
the expert (models/replica_choice: a replicated expert's tokens go to the replicas on the ranks
least loaded in this step, from the step's own counts); a token goes once to each rank
holding any of its choices, with the local slots there (-1 for choices elsewhere) and the
combine weights; the rank returns the weighted sum over its slots and the partial sums from the
ranks are added per token. The counts exchange also carries the layer index, so ranks that fell
out of step fail loudly instead of mixing layers.
"""
from __future__ import annotations

import torch

from everybyte.dist import ProcessGroup
from everybyte.models.replica_choice import slot_quotas


class ReplicaTable:
    """A placement's logical -> physical slots as tensors: slots[e, j] (padded), count[e]."""

    def __init__(self, placement, device: torch.device):
        reps = [placement.replicas(e) for e in range(placement.num_logical)]
        width = max(len(r) for r in reps)
        self.placement, self.width = placement, width
        self.slots = torch.tensor([r + [r[0]] * (width - len(r)) for r in reps], dtype=torch.long, device=device)
        self.count = torch.tensor([len(r) for r in reps], dtype=torch.long, device=device)

    def choose(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T, k] logical -> physical slot [T, k]. An expert with one slot takes it; a replicated
        expert's (token, choice) pairs, in token order, fill its replicas' step quotas
        (replica_choice.slot_quotas: the least-loaded ranks of this step first)."""
        if self.width == 1 or ids.numel() == 0:
            return self.slots[ids, 0]
        p, flat = self.placement, ids.reshape(-1)
        counts = torch.bincount(flat, minlength=p.num_logical)
        quota = torch.tensor(slot_quotas(counts.tolist(), p.physical_to_logical, p.num_ranks),
                             dtype=torch.long, device=ids.device)
        real = torch.arange(self.width, device=ids.device)[None, :] < self.count[:, None]
        ends = torch.where(real, quota[self.slots], 0).cumsum(1)       # [E, width] cumulative quotas
        order = torch.argsort(flat, stable=True)
        starts = counts.cumsum(0) - counts
        pos = torch.empty_like(flat)
        pos[order] = torch.arange(flat.numel(), device=ids.device) - starts[flat[order]]
        j = (pos[:, None] >= ends[flat]).sum(1).clamp_(max=self.width - 1)
        return self.slots[flat, j].view_as(ids)


class AllToAllDispatcher:
    def __init__(self, group: ProcessGroup):
        self.group = group
        self.tables: dict[int, ReplicaTable] = {}

    def table(self, block, device: torch.device) -> ReplicaTable:
        t = self.tables.get(block.layer_idx)
        if t is None or t.placement is not block.placement:       # a new placement after a rebalance
            t = self.tables[block.layer_idx] = ReplicaTable(block.placement, device)
        return t

    def forward(self, block, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        g, p, k = self.group, block.placement, ids.shape[1]
        if p.num_ranks != g.world_size:
            raise ValueError(f"layer {block.layer_idx}: placement over {p.num_ranks} ranks, group of {g.world_size}")
        phys = self.table(block, ids.device).choose(ids)
        dest, local = phys // p.slots_per_rank, phys % p.slots_per_rank
        on_rank = torch.zeros(ids.shape[0], g.world_size, dtype=torch.bool, device=ids.device)
        on_rank.scatter_(1, dest, True)
        rank_of_row, token_of_row = on_rank.t().nonzero(as_tuple=True)      # grouped by destination rank
        send = on_rank.sum(0).tolist()
        recv = self._exchange_counts(block.layer_idx, send)
        slots = torch.where(dest[token_of_row] == rank_of_row[:, None], local[token_of_row], -1)
        meta = torch.cat([weights[token_of_row].float(), slots.float()], dim=1)   # slot ids < 2**24: exact
        if x.dtype == torch.float32:          # one exchange for rows and metadata
            got = g.all_to_all_single(torch.cat([x[token_of_row], meta], dim=1), recv, send)
            got_x, got_meta = got[:, :x.shape[1]], got[:, x.shape[1]:]
        else:
            got_x = g.all_to_all_single(x[token_of_row], recv, send)
            got_meta = g.all_to_all_single(meta, recv, send)
        y = block.run_local(got_x.contiguous(), got_meta[:, k:].long(), got_meta[:, :k])
        back = g.all_to_all_single(y, send, recv)
        return torch.zeros_like(x).index_add_(0, token_of_row, back)

    def _exchange_counts(self, layer: int, send: list[int]) -> list[int]:
        n = self.group.world_size
        got = self.group.all_to_all_single(torch.tensor([[c, layer] for c in send], dtype=torch.long,
                                                        device=self.group.device), [1] * n, [1] * n).tolist()
        if any(other != layer for _, other in got):
            raise RuntimeError(f"expert-parallel ranks out of step: this rank is in MoE layer {layer}, peers in "
                               f"{[other for _, other in got]} (a forward failed part-way on some rank)")
        return [c for c, _ in got]
