"""Wide expert parallelism in the cost model (DeepSeek-style: attention data-parallel over the g
GPUs of a worker, routed experts spread E/g per GPU, two all-to-alls per MoE layer over NVLink).

Per GPU and step, for T tokens computed by the worker (context attended A):
- bytes: the dense weights (replicated on every GPU) + the distinct local experts the tokens
  reach (E/g of them per MoE layer, uniform top-k) + its T/g tokens' KV context;
- FLOPs: its T/g tokens through the dense part and attention + its share of the expert work
  (T x k / g token-expert pairs) x the imbalance factor (the most loaded GPU sets the step);
- all-to-all: each of its T/g tokens goes to k experts, (g-1)/g of them remote, as the hidden
  vector in FP8 (dispatch) and back in BF16 (combine), x the imbalance, at half the NVLink figure
  (the catalog's is both directions), not overlapped with compute, no per-message latency.
- across nodes (g above the NVLink domain, as DeepSeek serves R1 over InfiniBand): a token's
  experts on other nodes are reached DeepEP's way, once per destination node over the NIC
  (uniform top-k: N - 1 other nodes of N, each reached with probability 1 - (1 - 1/N)^k) and
  then forwarded over NVLink inside it, so NVLink still carries every remote token-expert pair;
  the two links run at once and the slower sets the all-to-all.
step = max(FLOPs / peak, bytes / HBM bandwidth) + all-to-all; with `overlap` (two micro-batches,
each one's all-to-all hidden behind the other's compute, as DeepSeek serves R1) the ideal
max(compute, all-to-all).
"""
from __future__ import annotations

from dataclasses import dataclass

DISPATCH_BYTES, COMBINE_BYTES = 1, 2          # per hidden value: FP8 out, BF16 back


@dataclass(frozen=True)
class ExpertParallel:
    gpus: int                                 # EP degree = GPUs in the worker
    imbalance: float = 1.0                    # max / mean tokens per GPU (EPLB: ~1.11; none: ~2.56 at EP32)
    overlap: bool = False                     # all-to-all hidden behind compute (two-batch overlap), ideally

    def __post_init__(self):
        if self.gpus < 1 or not self.imbalance >= 1.0:
            raise ValueError(f"EP degree must be >= 1 and imbalance >= 1, got {self.gpus}, {self.imbalance}")

    def worker_weight_bytes(self, fixed: int, routed: int) -> int:
        """Dense weights on every GPU, routed experts once over the worker."""
        return fixed * self.gpus + routed

    def step_seconds(self, cost, tokens: float, attended: float, new_kv: float) -> float:
        m, g = cost.model, self.gpus
        touched_local = cost.experts_touched(tokens) / g
        nbytes = cost.fixed_weight_bytes + m.moe_layers * touched_local * cost.expert_bytes
        nbytes += (attended + new_kv) / g * cost.kv_token_bytes
        expert_params = m.moe_layers * m.experts_per_token * cost.expert_params
        dense_flops = tokens / g * (cost.flops_per_token - 2 * expert_params) + attended * cost.token_weight / g * cost.attn_flops_per_ctx
        expert_flops = tokens * 2 * expert_params / g * self.imbalance
        compute = max((dense_flops + expert_flops) / cost.gpu_flops, nbytes / cost.gpu_hbm_bw)
        if g == 1 or not m.moe_layers:
            return compute
        per_pair = tokens / g * m.hidden * (DISPATCH_BYTES + COMBINE_BYTES) * m.moe_layers * self.imbalance
        comm = per_pair * m.experts_per_token * (g - 1) / g / (cost.hw.need("nvlink_bytes_per_s") / 2)
        nodes = self.nodes(cost.hw)
        if nodes > 1:
            reached = (nodes - 1) * (1.0 - (1.0 - 1.0 / nodes) ** m.experts_per_token)
            comm = max(comm, per_pair * reached / cost.hw.need("nic_bytes_per_s"))
        return max(compute, comm) if self.overlap else compute + comm

    def nodes(self, hw) -> int:
        """NVLink domains the EP group spans (1 when it fits one)."""
        domain = int(hw.get("nvlink_domain_gpus") or self.gpus)
        return max(1, -(-self.gpus // domain))

    def describe(self) -> dict:
        return {"ep": self.gpus, "imbalance": self.imbalance, "overlap": self.overlap, "assumptions": [
            "attention and dense layers data-parallel: every GPU holds them and computes its T/g tokens",
            "routed experts E/g per GPU per MoE layer; distinct experts reached: uniform top-k",
            "expert FLOPs and all-to-all bytes x the imbalance (max/mean tokens per GPU)",
            "two all-to-alls per MoE layer (FP8 dispatch, BF16 combine) at half the NVLink figure "
            "(one direction), no latency term, not overlapped with compute"
            + (" unless overlapped (two micro-batches: the step is the ideal max of compute and all-to-all)"
               if self.overlap else ""),
            "beyond one NVLink domain: each token once per other node it reaches over the NIC (per GPU, "
            "one direction), then forwarded over NVLink; the slower link sets the all-to-all"]}
