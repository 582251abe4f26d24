"""Model configuration shared by loaders, the model and the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "olmoe", "llama_moe")
MOE_ARCHITECTURES = ("qwen3_moe", "mixtral", "olmoe", "llama_moe")
# how a token's chosen experts are combined: "weighted" (their softmax probabilities, HF MoE
# models) or "sum" (weight 1 each: llama_moe, the MoE split from a dense model, models/moe_from_dense)
MOE_COMBINES = ("weighted", "sum")


@dataclass
class ModelConfig:
    architecture: str                 # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF form, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # q/k/v projection bias (Qwen2)
    qk_norm: bool = False             # RMSNorm on q and k: per head (Qwen3), or over the whole projection:
    qk_norm_whole: bool = False       # (OLMoE) one RMSNorm over all of q's (k's) heads
    clip_qkv: float | None = None     # (OLMoE) q, k, v clamped to [-clip, clip]
    # mixture of experts (num_experts 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0    # one expert's intermediate size
    norm_topk_prob: bool = False      # renormalise the top-k probabilities to sum to 1 (Mixtral: always)
    moe_layers: tuple[int, ...] | None = None   # which layers are MoE (None: all, when num_experts > 0)
    moe_combine: str = "weighted"     # one of MOE_COMBINES
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    model_id: str = "unknown"         # names the weights in KV block identity
    revision: str = ""
    # the checkpoint's own sampling defaults (generation_config.json, GGUF general.sampling.*), SamplingParams names
    sampling_defaults: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..{self.num_experts} "
                                 f"(num_experts)")
            if self.moe_intermediate_size <= 0:
                raise ValueError("a MoE model needs moe_intermediate_size > 0")
            if self.moe_combine not in MOE_COMBINES:
                raise ValueError(f"moe_combine {self.moe_combine!r}: choose one of {', '.join(MOE_COMBINES)}")
            bad = [i for i in self.moe_layers or () if not 0 <= i < self.num_hidden_layers]
            if bad:
                raise ValueError(f"moe_layers {bad} outside 0..{self.num_hidden_layers - 1}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and (self.moe_layers is None or layer in self.moe_layers)
