"""Tier measurements for `everybyte bench memory`: load bandwidth per tier vs memcpy and vs a
plain sequential disk read, and a 2K-token prefix loaded from each tier vs recomputed."""
from __future__ import annotations

import os
import statistics
import time

from everybyte.bench.traces.tokens import TokenSpace

# ---- tiers: bandwidth, and a 2K-token prefix loaded vs recomputed ------------------------------
def _median(fn, n: int = 3) -> float:
    return statistics.median(fn() for _ in range(n))


def _disk_read_bandwidth(root: str, nbytes: int, chunk: int) -> float:
    path = os.path.join(root, "seq-read.bin")
    with open(path, "wb") as f:
        for off in range(0, nbytes, 1 << 20):
            f.write(os.urandom(min(1 << 20, nbytes - off)))
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buf, got = bytearray(chunk), 0
        t0 = time.perf_counter()
        with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
            while (n := f.readinto(buf)) > 0:
                got += n
        return got / max(time.perf_counter() - t0, 1e-9)
    finally:
        os.close(fd)
        os.unlink(path)


def _engine_load_seconds(eng, ids: list[int], drop_cache: bool) -> tuple[float, int, int]:
    """Seconds for the engine's own load path (BlockLoader job: locate, get_many, header checks,
    copies into fresh G1 pool blocks) to bring the prompt's cached prefix back from the first tier;
    blocks loaded and bytes moved. The blocks are freed unnamed afterwards (the tier keeps them)."""
    bm = eng.block_manager
    names = bm.names_of(eng.make_sequence(ids))[:len(ids) // eng.pool.block_size]
    tier = bm.tiers.first
    if drop_cache:
        for n in names:
            tier.drop_page_cache(n)
    assert bm.cache.num_empty_blocks >= len(names), "G1 must be empty here (nothing to evict)"
    blocks = sorted(bm.cache.allocate(len(names)))          # as the engine takes fresh blocks
    try:
        t0 = time.perf_counter()
        job = bm.loader.start(names, blocks)
        job.future.result()
        seconds = time.perf_counter() - t0
    finally:
        bm.loader.finished()
        bm.cache.free(blocks)
    return seconds, len(job.loaded), len(job.loaded) * bm.codec.nbytes


def measure_tiers(loaded, layer_shapes, fmt: str, prefix_tokens: int, tier_dir: str, dtype, device: str,
                  block_size: int = 16) -> dict:
    import shutil
    import tempfile

    from everybyte.engine.llm_engine import LLMEngine
    from everybyte.engine.sampling_params import SamplingParams
    from everybyte.kv.pool import min_pool_bytes
    from everybyte.kv.tier_config import measure_memcpy_bandwidth

    root = tempfile.mkdtemp(prefix="eb-bench-memory-", dir=tier_dir)
    try:
        nblocks = max(1, prefix_tokens // block_size)
        mml = nblocks * block_size + block_size
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        prompt = [TokenSpace().token(7, 0, i) for i in range(nblocks * block_size + 1)]
        opts = dict(kv_cache_dtype=fmt, kv_cache_bytes=2 * min_pool_bytes(layer_shapes, fmt, mml, block_size),
                    max_model_len=mml, dtype=dtype, device=device)
        eng = LLMEngine(loaded, enable_prefix_caching=False, kv_tiers="none", **opts)
        eng.generate(list(range(1000, 1000 + 2 * block_size)), one)         # warm-up
        t0 = time.perf_counter()
        eng.generate(prompt, one)
        recompute = time.perf_counter() - t0
        del eng
        load, nbytes = {}, {}
        for level, spec in (("G2", "host:4GiB"), ("G3", f"disk:{os.path.join(root, 'g3')}:4GiB")):
            eng = LLMEngine(loaded, kv_tiers=spec, **opts)
            eng.generate(prompt, one)
            eng.reset_prefix_cache()                   # the prefix leaves G1 as one write-down batch
            runs = [_engine_load_seconds(eng, prompt, level == "G3") for _ in range(3)]
            if any(n != nblocks for _, n, _ in runs):
                raise RuntimeError(f"{level}: the engine loaded {[n for _, n, _ in runs]} of {nblocks} blocks")
            load[level], nbytes[level] = statistics.median(r[0] for r in runs), runs[0][2]
            eng.close()
            del eng
        total = nbytes["G2"]
        memcpy = _median(lambda: measure_memcpy_bandwidth(total))
        chunk = total // nblocks
        seq = max(_median(lambda: _disk_read_bandwidth(root, total, chunk)),
                  _median(lambda: _disk_read_bandwidth(root, total, 1 << 20)))
        bw = {k: nbytes[k] / max(v, 1e-9) for k, v in load.items()}
        return {"g2_load_vs_memcpy": bw["G2"] / memcpy, "g3_load_vs_disk": bw["G3"] / seq, "load_2k_prefix_s": load,
                "recompute_2k_prefix_s": recompute,
                "load_speedup_vs_recompute": {k: recompute / max(v, 1e-9) for k, v in load.items()},
                "load_2k_prefix_bytes_s": bw, "g2_load_bytes_s": bw["G2"], "memcpy_bytes_s": memcpy,
                "g3_load_bytes_s": bw["G3"], "disk_seq_read_bytes_s": seq,
                "prefix": {"tokens": nblocks * block_size, "kv_format": fmt, "encoded_block_bytes": chunk,
                           "bytes": total, "method": "engine generates the prefix, reset_prefix_cache() writes it down "
                           "to the tier (host: one buffer; disk: one pack file), then the engine's BlockLoader job "
                           "(locate, get_many, header checks, copies into fresh G1 pool blocks) loads it back; median "
                           "of 3, page cache dropped for G3; recompute = engine prefill of the same tokens after a "
                           "warm-up",
                           "baselines": "memcpy: one torch copy_ of the same total bytes (median of 3); disk: a plain "
                           "sequential read of one file of the same total bytes, page cache dropped, the faster of "
                           "block-sized and 1 MiB reads (median of 3 each)"}}
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---- goals, report, plot ----------------------------------------------------------------------
