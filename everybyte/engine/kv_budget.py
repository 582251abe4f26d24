"""The device KV budget when none is given (kv_cache_bytes="auto", `--kv-cache auto`).

Rule, in order:
1. EVERYBYTE_KV_CACHE_SPACE (a size, e.g. 2GiB; vLLM's CPU backend reads VLLM_CPU_KVCACHE_SPACE
   the same way) is the budget, exactly as if it had been passed.
2. Otherwise the budget is what one request of max_model_len tokens needs in the chosen KV format,
   and at least DEFAULT_FLOOR (64 MiB: the nvfp4 default for the default model, ~10k tokens).
3. If that is more than AVAILABLE_SHARE of the memory available now and max_model_len was not
   given, the budget is that share (still at least the floor) and max_model_len is lowered to the
   tokens it holds, with a warning naming both numbers and how to change them.
An explicit budget is never changed: one too small for max_model_len stays an error.
"""
from __future__ import annotations

import logging
import os

from everybyte.kv.data.pool import format_size, min_pool_bytes, parse_size
from everybyte.native.host_memory import available_memory_bytes

log = logging.getLogger(__name__)

ENV = "EVERYBYTE_KV_CACHE_SPACE"
DEFAULT_FLOOR = 64 << 20
AVAILABLE_SHARE = 0.25


def is_auto(kv_cache_bytes) -> bool:
    return kv_cache_bytes is None or (isinstance(kv_cache_bytes, str) and kv_cache_bytes.strip().lower() == "auto")


def resolve_kv_budget(layer_shapes, kv_cache_dtype: str, block_size: int, max_model_len: int,
                      model_len_given: bool, available: int | None = None) -> tuple[int, int]:
    """(budget bytes, max_model_len) for an "auto" budget; see the module docstring."""
    if os.environ.get(ENV):
        return parse_size(os.environ[ENV]), max_model_len
    need = min_pool_bytes(layer_shapes, kv_cache_dtype, max_model_len, block_size)
    want = max(DEFAULT_FLOOR, need)
    available = available_memory_bytes() if available is None else available
    if model_len_given or available is None or want <= AVAILABLE_SHARE * available:
        return want, max_model_len
    budget = max(DEFAULT_FLOOR, int(AVAILABLE_SHARE * available))
    per_block = min_pool_bytes(layer_shapes, kv_cache_dtype, block_size, block_size)
    fits = budget // per_block * block_size
    if fits >= max_model_len:
        return budget, max_model_len
    log.warning("KV cache: one request of max_model_len=%d tokens in %s needs %s, more than a quarter of "
                "the memory available (%s); using %s and max_model_len=%d. Set kv_cache_bytes (--kv-cache) "
                "or %s to choose the budget, or max_model_len (--max-model-len)", max_model_len,
                kv_cache_dtype, format_size(need), format_size(available), format_size(budget), fits, ENV)
    return budget, fits
