"""`GET /v1/kv/info`: what a router needs to know of this worker (cluster contract §1): its KV
namespace (so equal digests mean reusable blocks), where its KV events and connector listen, its
role, its measured prefill and tier-load speeds, and its load. Read between engine steps without
waiting for one: a router polls it as the health check with a short timeout."""
from __future__ import annotations

from dataclasses import fields

from everybyte.kv.memory_manager import KVMemoryManager


def namespace_fields(mem: KVMemoryManager) -> dict:
    """The base (unsalted) namespace's init fields: KVNamespace(**these) rebuilds it."""
    ns = mem.ns.with_tenant(None)
    return {f.name: getattr(ns, f.name) for f in fields(ns) if f.init}


def speeds(mem: KVMemoryManager | None) -> dict:
    return {"prefill_tok_s": None, "load_tok_s": {}} if mem is None else mem.tiers.speeds()


def kv_info(state) -> dict:
    engine = state.engine.engine
    bm, sched, cfg = engine.block_manager, engine.scheduler, state.config
    mem = bm if isinstance(bm, KVMemoryManager) else None
    total, free = bm.num_blocks, bm.num_free_blocks
    return {
        "model": cfg.model_name,
        "role": cfg.role,
        "block_size": bm.block_size,
        "kv_format": engine.pool.kv_cache_dtype,
        "namespace": namespace_fields(mem) if mem else None,
        "namespace_digest": mem.ns.with_tenant(None).digest.hex() if mem else None,
        "kv_events": cfg.kv_events,
        "kv_connector": cfg.kv_connector,
        "speeds": speeds(mem),
        "load": {"num_running": len(sched.running), "num_waiting": len(sched.waiting) + len(sched.loading), "max_num_seqs": sched.max_num_seqs,
                 "kv_usage": round((total - free) / total, 6), "kv_blocks_free": free, "kv_blocks_total": total},
    }
