"""A mixture of experts made from a dense model, with routing learnt from real text.

Per layer, from the MLP inputs x [T, H] a calibration text produces:
1. split: the MLP's I intermediate neurons (rows of gate/up, columns of down) go into E experts
   of I/E neurons each, grouped by co-activation: each neuron is described by its |SiLU(gate) * up|
   over the T tokens (unit norm), and a balanced spherical k-means (every cluster exactly I/E
   neurons; greedy most-similar-first assignment; farthest-first start) groups neurons that fire
   on the same tokens.
2. router: a linear map hidden -> E (no bias, the Linear every HF router is) fitted by ridge
   least squares to each token's centred log contribution of each expert, ||down_e(act_e(x))||,
   so the top-k logits pick the experts that carry the most of that token's MLP output.
3. combine: the chosen experts' outputs are summed unweighted (moe_combine "sum", architecture
   llama_moe). The experts partition the neurons, so with top-k = E the block computes
   sum_e down_e(act_e(x)) = down(act(x)): the dense model, up to fp32 summation order. (Softmax-
   weighted combines, as in Mixtral, cannot equal the dense MLP at top-k = E: the weights sum to 1.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

KMEANS_ITERS = 12
RIDGE = 1e-3            # of the mean diagonal of X^T X


def activations(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(x gate^T) * (x up^T): [T, I]."""
    return F.silu(x @ gate.T) * (x @ up.T)


def balanced_clusters(act: torch.Tensor, num_experts: int, seed: int = 0) -> list[list[int]]:
    """The I neurons (columns of act [T, I]) in num_experts groups of I / num_experts, by co-activation."""
    inter = act.shape[1]
    if inter % num_experts:
        divisors = [e for e in range(1, inter + 1) if inter % e == 0 and e <= 256]
        raise ValueError(f"{num_experts} experts do not divide the {inter} intermediate neurons; choose one of "
                         f"{divisors}")
    size = inter // num_experts
    prof = F.normalize(act.abs().double().T, dim=1)                          # [I, T]
    first = int(torch.randint(inter, (1,), generator=torch.Generator().manual_seed(seed)))
    chosen = [first]                      # farthest-first start: each next the neuron least like the chosen
    for _ in range(num_experts - 1):
        chosen.append(int((prof @ prof[chosen].T).max(dim=1).values.argmin()))
    centroids = prof[chosen]
    assign = torch.zeros(inter, dtype=torch.long)
    for _ in range(KMEANS_ITERS):
        assign = _balanced_assign(prof @ centroids.T, size)
        centroids = F.normalize(torch.stack([prof[assign == e].mean(0) for e in range(num_experts)]), dim=1)
    return [torch.nonzero(assign == e).flatten().tolist() for e in range(num_experts)]


def _balanced_assign(sim: torch.Tensor, size: int) -> torch.Tensor:
    """Each neuron to a cluster, most similar pairs first, no cluster past `size` neurons."""
    inter, num = sim.shape
    order = torch.argsort(sim.flatten(), descending=True).tolist()
    assign, room, left = [-1] * inter, [size] * num, inter
    for flat in order:
        n, e = divmod(flat, num)
        if assign[n] < 0 and room[e]:
            assign[n], room[e], left = e, room[e] - 1, left - 1
            if not left:
                break
    return torch.tensor(assign)


def expert_contributions(act: torch.Tensor, down: torch.Tensor, groups: list[list[int]]) -> torch.Tensor:
    """||down_e(act_e)|| per token and expert: [T, E]."""
    return torch.stack([(act[:, g] @ down[:, g].T).norm(dim=1) for g in groups], dim=1)


def fit_router(x: torch.Tensor, contributions: torch.Tensor) -> torch.Tensor:
    """Router weight [E, H]: ridge least squares from x [T, H] to the centred log contributions."""
    y = contributions.double().clamp_min(1e-12).log()
    y = y - y.mean(dim=1, keepdim=True)
    xd = x.double()
    gram = xd.T @ xd
    gram += RIDGE * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=gram.dtype)
    return torch.linalg.solve(gram, xd.T @ y).T.float()


def split_layer(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, num_experts: int,
                seed: int = 0) -> tuple[list[list[int]], torch.Tensor]:
    """(neuron groups, router weight [E, H]) for one dense MLP from its calibration inputs x."""
    act = activations(x.float(), gate.float(), up.float())
    groups = balanced_clusters(act, num_experts, seed)
    return groups, fit_router(x, expert_contributions(act, down.float(), groups))


def expert_weights(layer: int, groups: list[list[int]], router: torch.Tensor, gate: torch.Tensor,
                   up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
    """The HF tensors of one MoE layer: per-expert gate/up rows and down columns, and the router."""
    prefix = f"model.layers.{layer}.mlp"
    out = {f"{prefix}.gate.weight": router.contiguous()}
    for e, g in enumerate(groups):
        idx = torch.tensor(g)
        out |= {f"{prefix}.experts.{e}.gate_proj.weight": gate[idx].contiguous(),
                f"{prefix}.experts.{e}.up_proj.weight": up[idx].contiguous(),
                f"{prefix}.experts.{e}.down_proj.weight": down[:, idx].contiguous()}
    return out


def set_top_k(lm, k: int) -> None:
    """Route every MoE layer of `lm` to its k best experts (perplexity at each k from one load)."""
    from everybyte.models.moe import MoEBlock
    for block in lm.modules():
        if isinstance(block, MoEBlock):
            if not 0 < k <= block.num_experts:
                raise ValueError(f"top-k {k} outside 1..{block.num_experts}")
            block.top_k = k
