"""build_engine: the one place that makes the real parts from an EngineConfig (model, KV pool
and its scales, the memory system with its tiers, the model executor) and joins them in an
EngineCore. LLMEngine is this plus tokenization and the request API."""
from __future__ import annotations

import weakref
from dataclasses import dataclass

from everybyte.engine.config import EngineConfig, set_threads
from everybyte.engine.core import EngineCore
from everybyte.engine.ep import ExpertParallel, load_expert_parallel
from everybyte.engine.executor import ModelExecutor
from everybyte.engine.kv_budget import resolve_kv_budget
from everybyte.engine.model_runner import CALIBRATION_TEXT, ModelRunner, calibrate_kv_amax
from everybyte.engine.sampler import Sampler
from everybyte.engine.scheduler import Scheduler
from everybyte.kv.block_id import KVNamespace
from everybyte.kv.block_manager import BlockManager
from everybyte.kv.clock import Clock
from everybyte.kv.data.pool import KVPool, format_size, min_pool_bytes
from everybyte.kv.data.tier_config import build_tiers
from everybyte.kv.memory_manager import KVMemoryManager
from everybyte.kv.tier_movement import TierSet
from everybyte.models.kv_scales import read_kv_scales
from everybyte.models.loader import LoadedModel, load_model
from everybyte.models.nvfp4_linear import weight_bytes

_AMAX_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclass
class BuiltEngine:
    loaded: LoadedModel
    max_model_len: int
    layer_shapes: list[tuple[int, int]]
    pool: KVPool
    weights_bytes: int
    model_runner: ModelRunner
    core: EngineCore
    expert_parallel: ExpertParallel | None = None


def build_engine(model: str | LoadedModel | None, cfg: EngineConfig, clock: Clock) -> BuiltEngine:
    set_threads()
    if cfg.expert_parallel > 1:
        loaded, ep = load_expert_parallel(model, cfg.expert_parallel, str(cfg.dtype).removeprefix("torch."),
                                          cfg.weights_dtype, cfg.device)
        try:
            return _build(loaded, cfg, clock, ep)
        except BaseException:
            ep.close()
            raise
    loaded = model if isinstance(model, LoadedModel) else load_model(model, dtype=cfg.dtype, device=cfg.device,
                                                                     weights_dtype=cfg.weights_dtype)
    return _build(loaded, cfg, clock, None)


def _build(loaded: LoadedModel, cfg: EngineConfig, clock: Clock, ep: ExpertParallel | None) -> BuiltEngine:
    mc = loaded.config
    max_model_len = cfg.max_model_len or mc.max_position_embeddings
    shapes = [(mc.num_key_value_heads, mc.head_dim)] * mc.num_hidden_layers
    if cfg.kv_cache_bytes == "auto":
        cfg.kv_cache_bytes, max_model_len = resolve_kv_budget(
            shapes, cfg.kv_cache_dtype, cfg.block_size, max_model_len, cfg.max_model_len is not None)
    need = min_pool_bytes(shapes, cfg.kv_cache_dtype, max_model_len, cfg.block_size)
    if cfg.kv_cache_bytes < need:
        raise ValueError(
            f"KV cache of {cfg.kv_cache_bytes} bytes ({format_size(cfg.kv_cache_bytes)}) in "
            f"{cfg.kv_cache_dtype} is too small for one request of max_model_len={max_model_len} "
            f"tokens: it needs at least {need} bytes ({format_size(need)}); raise kv_cache_bytes "
            f"(--kv-cache) or lower max_model_len (--max-model-len)")
    pool = KVPool(shapes, cfg.kv_cache_dtype, cfg.kv_cache_bytes, cfg.block_size, cfg.device)
    if pool.fmt.scaled:
        k_amax, v_amax, grid = kv_amax(loaded, shapes)
        pool.set_scales_from_amax(k_amax, v_amax, headroom=cfg.kv_scale_headroom, grid=grid)
    runner = ModelRunner(loaded.model, pool, Sampler(cfg.seed), cfg.kv_exact_tail)
    bm = _block_manager(loaded, cfg, pool, runner, clock)
    scheduler = Scheduler(bm, cfg.max_num_seqs, cfg.max_num_batched_tokens, max_model_len, clock)
    eos = set(loaded.tokenizer.eos_token_ids) | set(mc.eos_token_ids)
    core = EngineCore(scheduler, ModelExecutor(runner), clock, eos, max_model_len)
    return BuiltEngine(loaded, max_model_len, shapes, pool, weight_bytes(loaded.model), runner, core, ep)


def _block_manager(loaded: LoadedModel, cfg: EngineConfig, pool: KVPool, runner: ModelRunner,
                   clock: Clock) -> BlockManager:
    if not cfg.enable_prefix_caching:
        return BlockManager(pool.num_blocks, cfg.block_size)
    mc = loaded.config
    # KV bytes also depend on the weights as computed with: their format and the compute dtype
    revision = f"{mc.revision}|weights={loaded.weights_format}|dtype={str(cfg.dtype)}"
    ns = KVNamespace.for_pool(pool, mc.model_id, revision)
    tiers = TierSet(build_tiers(cfg.kv_tiers or "none", pin_memory=str(cfg.device).startswith("cuda")))
    tail = runner.exact_tail          # reuse restarts where its exact span starts
    return KVMemoryManager(pool, ns, tiers, offload_on_park=cfg.offload_on_park,
                           load_timeout_s=cfg.kv_load_timeout_s,
                           restart_blocks=tail.span // tail.block_size if tail else 1,
                           max_sessions=cfg.max_sessions, session_idle_s=cfg.session_idle_s, clock=clock)


def kv_amax(loaded: LoadedModel, shapes: list[tuple[int, int]]) -> tuple[list[float], list[float], bool]:
    """Per-layer K/V amax, and whether they go on the power-of-two grid: the checkpoint's own
    k_scale/v_scale when it has them (used as they are), else the deterministic calibration
    (see calibrate_kv_amax; its tokens and block size depend on the model only), cached per model."""
    if (ckpt := read_kv_scales(loaded.path, loaded.config)) is not None:
        return [k for k, _ in ckpt], [v for _, v in ckpt], False
    if loaded.model not in _AMAX_CACHE:
        ids = loaded.tokenizer.encode(CALIBRATION_TEXT)[:loaded.config.max_position_embeddings]
        _AMAX_CACHE[loaded.model] = calibrate_kv_amax(loaded.model, shapes, ids)
    return (*_AMAX_CACHE[loaded.model], True)
