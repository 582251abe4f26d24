"""Expert bytes per rank under expert parallelism, and the KV tokens the freed bytes buy.

Pure arithmetic (formats.sizes): a rank holds E/N experts of each MoE layer plus R redundant
replicas, and one copy of everything else (attention, embeddings, norms, routers). At a fixed
per-rank memory budget the rest is KV cache, in whole blocks of the pool's format.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from everybyte.formats.sizes import kv_bytes_per_token, weight_matrix_bytes

_DTYPE_FORMATS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def stored_format(weights_format: str, dtype: str) -> str:
    """The sizes.py name of how a loaded model's expert weights are stored: "nvfp4" when packed,
    else their float dtype ("torch.float32" or "float32" -> "fp32")."""
    if weights_format == "nvfp4":
        return "nvfp4"
    name = dtype.removeprefix("torch.")
    if name not in _DTYPE_FORMATS:
        raise ValueError(f"no stored size for weights of dtype {dtype}")
    return _DTYPE_FORMATS[name]


@dataclass(frozen=True)
class ExpertShape:
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    num_moe_layers: int
    weights_format: str = "fp32"

    def expert_bytes(self) -> int:
        """One SwiGLU expert of one layer: gate and up [I, H] each, down [H, I], as stored."""
        h, i, fmt = self.hidden_size, self.moe_intermediate_size, self.weights_format
        return 2 * weight_matrix_bytes(fmt, i, h) + weight_matrix_bytes(fmt, h, i)


@dataclass(frozen=True)
class RankLedger:
    ranks: int
    redundant_per_rank: int
    experts_per_layer: int             # physical slots of one layer on one rank
    expert_bytes: int                  # all expert slots of all MoE layers on one rank
    replica_bytes: int                 # the redundant part of expert_bytes
    dense_bytes: int                   # everything not an expert (one copy per rank)
    budget_bytes: int
    kv_bytes: int                      # budget - dense - experts, rounded down to whole blocks
    kv_tokens: int
    freed_bytes: int                   # expert bytes one rank no longer holds vs holding all experts
    freed_kv_tokens: int               # KV tokens those bytes hold

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def rank_ledger(shape: ExpertShape, ranks: int, redundant_per_rank: int, dense_bytes: int, budget_bytes: int,
                layer_shapes: list[tuple[int, int]], kv_cache_dtype: str, block_size: int = 16) -> RankLedger:
    """The bytes of one rank of `ranks` at a per-rank budget of `budget_bytes`."""
    if ranks < 1 or shape.num_experts % ranks:
        raise ValueError(f"{ranks} ranks do not divide {shape.num_experts} experts")
    if redundant_per_rank < 0:
        raise ValueError(f"redundant experts per rank must be >= 0, got {redundant_per_rank}")
    per_layer = shape.num_experts // ranks + redundant_per_rank
    one = shape.expert_bytes()
    experts = per_layer * shape.num_moe_layers * one
    used = dense_bytes + experts
    if used > budget_bytes:
        raise ValueError(f"a rank's weights ({used} B: {dense_bytes} dense + {experts} experts) exceed "
                         f"its budget of {budget_bytes} B")
    per_token = kv_bytes_per_token(layer_shapes, kv_cache_dtype)
    blocks = (budget_bytes - used) // (per_token * block_size)
    freed = (shape.num_experts - per_layer) * shape.num_moe_layers * one
    return RankLedger(ranks=ranks, redundant_per_rank=redundant_per_rank, experts_per_layer=per_layer,
                      expert_bytes=experts, replica_bytes=redundant_per_rank * shape.num_moe_layers * one,
                      dense_bytes=dense_bytes, budget_bytes=budget_bytes, kv_bytes=blocks * block_size * per_token,
                      kv_tokens=blocks * block_size, freed_bytes=freed, freed_kv_tokens=max(freed, 0) // per_token)
