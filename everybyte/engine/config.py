"""Engine options (the knobs of LLM(...) and `everybyte generate`)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from everybyte.engine.eplb import check_eplb_settings
from everybyte.engine.kv_budget import is_auto
from everybyte.formats.kv_layout import KV_CACHE_DTYPES
from everybyte.kv.data.pool import parse_size
from everybyte.models.loader import WEIGHTS_DTYPES

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def default_dtype(device: str) -> torch.dtype:
    """bf16 on CUDA; float32 on CPU. CPU bf16 GEMMs (oneDNN with AVX512-BF16/AMX) give a row a
    different result depending on how many rows share the call (measured: the same greedy chat
    reads differently when its prefix is reused, since the recomputed span is a shorter chunk),
    which breaks "a token's output does not depend on its batch"; float32 keeps it. bf16 stays
    available with dtype="bf16"."""
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def resolve_dtype(dtype, device: str = "cpu") -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def set_threads() -> None:
    """All cores for intra-op parallelism unless the user pinned a thread count."""
    if "OMP_NUM_THREADS" not in os.environ and "EVERYBYTE_NUM_THREADS" not in os.environ:
        torch.set_num_threads(os.cpu_count() or 1)
    elif "EVERYBYTE_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["EVERYBYTE_NUM_THREADS"]))


@dataclass
class EngineConfig:
    kv_cache_dtype: str = "nvfp4"
    kv_cache_bytes: int | str = "auto"     # "auto": engine.kv_budget (EVERYBYTE_KV_CACHE_SPACE, else sized)
    dtype: torch.dtype | str | None = None
    weights_dtype: str = "auto"            # auto | nvfp4 | bf16 | fp32 (models.loader.load_model)
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None       # default: the model's context length
    device: str = "cpu"
    seed: int | None = None                # the sampler's generator for unseeded requests
    kv_scale_headroom: float = 2.0
    enable_prefix_caching: bool = True     # content-named blocks reused across requests (G1)
    kv_tiers: str | None = "host:1GiB"     # tiers below G1, e.g. "host:2GiB,disk:/path:20GiB"; None/"none" = off
    offload_on_park: bool = True           # a parked session's KV leaves G1 at once (to the first tier)
    kv_load_timeout_s: float = 10.0        # a tier load not done by then is abandoned and recomputed
    kv_exact_tail: bool = True             # fp8/nvfp4: each sequence's last block also kept unquantized
    max_sessions: int = 10000              # agent sessions remembered; the least recently active go first
    session_idle_s: float = 3600.0         # a session idle this long is forgotten (its private KV freed)
    kv_role: str = "both"                  # disaggregation: both | prefill | decode (engine/kv_transfer)
    kv_connector: str | None = None        # tcp://HOST:PORT the KV connector binds (prefill: a free port if None)
    kv_transfer_timeout_s: float = 5.0     # a remote block fetch not answered by then is recomputed
    expert_parallel: int = 1               # ranks a MoE model's experts are split over (engine/ep)
    eplb_interval: int = 0                 # rebalance experts every this many steps (engine/eplb); 0 = off
    eplb_redundant: int = 0                # redundant expert slots per rank when rebalancing
    eplb_window: int = 0                   # load history in steps (>= interval); 0 = 4 intervals

    def __post_init__(self):
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose one of "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        self.kv_cache_bytes = "auto" if is_auto(self.kv_cache_bytes) else parse_size(self.kv_cache_bytes)
        if self.weights_dtype not in WEIGHTS_DTYPES:
            raise ValueError(f"unknown weights_dtype {self.weights_dtype!r}; choose one of {', '.join(WEIGHTS_DTYPES)}")
        if self.weights_dtype in ("bf16", "fp32") and self.dtype in (None, "auto"):
            self.dtype = self.weights_dtype        # float weights compute in their own dtype
        self.dtype = resolve_dtype(self.dtype, self.device)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.max_sessions, int) or self.max_sessions < 1:
            raise ValueError(f"max_sessions must be an int >= 1, got {self.max_sessions!r}")
        if not self.session_idle_s > 0:
            raise ValueError(f"session_idle_s must be > 0, got {self.session_idle_s!r}")
        if not self.kv_load_timeout_s > 0:
            raise ValueError(f"kv_load_timeout_s must be > 0, got {self.kv_load_timeout_s!r}")
        if not self.kv_transfer_timeout_s > 0:
            raise ValueError(f"kv_transfer_timeout_s must be > 0, got {self.kv_transfer_timeout_s!r}")
        if not isinstance(self.expert_parallel, int) or isinstance(self.expert_parallel, bool) \
                or self.expert_parallel < 1:
            raise ValueError(f"expert_parallel must be an int >= 1, got {self.expert_parallel!r}")
        check_eplb_settings(self.expert_parallel, self.eplb_interval, self.eplb_redundant, self.eplb_window)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len!r}")
