"""Model configuration shared by loaders, the model and the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")


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
    qk_norm: bool = False             # per-head RMSNorm on q and k (Qwen3)
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
