"""Tier measurements for `everybyte bench memory`: load bandwidth per tier vs memcpy and vs a
plain sequential disk read, and a 2K-token prefix loaded from each tier vs recomputed."""
from __future__ import annotations

import os
import statistics
import time

from everybyte.traces.tokens import TokenSpace

# ---- tiers: bandwidth, and a 2K-token prefix loaded vs recomputed ------------------------------
REPS = 7


class _Memcpy:
    """One torch copy_ between two warm buffers of `nbytes`, timed on the loader's thread (its
    OpenMP team is the one the load's copies run on, so neither pays for the other's)."""

    def __init__(self, nbytes: int):
        import torch
        self.src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)

    def __call__(self) -> float:
        from everybyte.kv.tiers.base import job_executor

        def timed() -> float:
            t0 = time.perf_counter()
            self.dst.copy_(self.src)
            return time.perf_counter() - t0
        return self.src.numel() / max(job_executor().submit(timed).result(), 1e-9)


class _DiskRead:
    """A plain sequential read of one file of `nbytes` (written once), page cache dropped first;
    the faster of block-sized and 1 MiB reads into a reused buffer."""

    def __init__(self, root: str, nbytes: int, chunk: int):
        self.path, self.chunks = os.path.join(root, "seq-read.bin"), (chunk, 1 << 20)
        with open(self.path, "wb") as f:
            for off in range(0, nbytes, 1 << 20):
                f.write(os.urandom(min(1 << 20, nbytes - off)))
            f.flush()
            os.fsync(f.fileno())

    def _read(self, chunk: int) -> float:
        fd = os.open(self.path, os.O_RDONLY)
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

    def __call__(self) -> float:
        return max(self._read(c) for c in self.chunks)


def _engine_load_seconds(eng, ids: list[int], drop_cache: bool) -> tuple[float, int, int]:
    """Seconds for the engine's own load path (BlockLoader job: locate, streamed batch read, header
    checks, copies into fresh G1 pool blocks) to bring the prompt's cached prefix back from the
    first tier; blocks loaded and bytes moved. The blocks are freed unnamed afterwards (the tier
    keeps them)."""
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
        job = bm.mover.start(names, blocks)
        job.future.result()
        seconds = time.perf_counter() - t0
    finally:
        bm.mover.finished()
        bm.cache.free(blocks)
    return seconds, len(job.loaded), len(job.loaded) * bm.mover.nbytes


def measure_tiers(loaded, layer_shapes, fmt: str, prefix_tokens: int, tier_dir: str, dtype, device: str,
                  block_size: int = 16) -> dict:
    import shutil
    import tempfile

    from everybyte.engine.llm_engine import LLMEngine
    from everybyte.engine.sampling_params import SamplingParams
    from everybyte.kv.data.pool import min_pool_bytes

    root = tempfile.mkdtemp(prefix="eb-bench-memory-", dir=tier_dir)
    try:
        nblocks = max(1, prefix_tokens // block_size)
        mml = nblocks * block_size + block_size
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)   # no default penalty in the timing
        prompt = [TokenSpace().token(7, 0, i) for i in range(nblocks * block_size + 1)]
        opts = dict(kv_cache_dtype=fmt, kv_cache_bytes=2 * min_pool_bytes(layer_shapes, fmt, mml, block_size),
                    max_model_len=mml, dtype=dtype, device=device)
        eng = LLMEngine(loaded, enable_prefix_caching=False, kv_tiers="none", **opts)
        eng.generate(list(range(1000, 1000 + 2 * block_size)), one)         # warm-up
        t0 = time.perf_counter()
        eng.generate(prompt, one)
        recompute = time.perf_counter() - t0
        del eng
        load, nbytes, base, ratio = {}, {}, {}, {}
        for level, spec in (("G2", "host:4GiB"), ("G3", f"disk:{os.path.join(root, 'g3')}:4GiB")):
            eng = LLMEngine(loaded, kv_tiers=spec, **opts)
            eng.generate(prompt, one)
            eng.reset_prefix_cache()                   # the prefix leaves G1 as one write-down batch
            _engine_load_seconds(eng, prompt, level == "G3")                  # warm-up
            total = nblocks * eng.block_manager.mover.nbytes
            baseline = _Memcpy(total) if level == "G2" else _DiskRead(root, total, total // nblocks)
            runs, bws = [], []
            for _ in range(REPS):                      # interleaved: both see the same machine
                bws.append(baseline())
                runs.append(_engine_load_seconds(eng, prompt, level == "G3"))
            if any(n != nblocks for _, n, _ in runs):
                raise RuntimeError(f"{level}: the engine loaded {[n for _, n, _ in runs]} of {nblocks} blocks")
            nbytes[level] = runs[0][2]
            load[level] = statistics.median(r[0] for r in runs)
            base[level] = statistics.median(bws)
            ratio[level] = statistics.median(r[2] / r[0] / bw for r, bw in zip(runs, bws))
            eng.close()
            del eng
        bw = {k: nbytes[k] / max(v, 1e-9) for k, v in load.items()}
        return {"g2_load_vs_memcpy": ratio["G2"], "g3_load_vs_disk": ratio["G3"], "load_2k_prefix_s": load,
                "recompute_2k_prefix_s": recompute,
                "load_speedup_vs_recompute": {k: recompute / max(v, 1e-9) for k, v in load.items()},
                "load_2k_prefix_bytes_s": bw, "g2_load_bytes_s": bw["G2"], "memcpy_bytes_s": base["G2"],
                "g3_load_bytes_s": bw["G3"], "disk_seq_read_bytes_s": base["G3"],
                "prefix": {"tokens": nblocks * block_size, "kv_format": fmt, "encoded_block_bytes": nbytes["G2"] // nblocks,
                           "bytes": nbytes["G2"], "method": "engine generates the prefix, reset_prefix_cache() writes it down "
                           "to the tier (host: one buffer; disk: one pack file), then the engine's BlockLoader job "
                           "(locate, streamed batch read, header checks, copies into fresh G1 pool blocks) loads it "
                           f"back; {REPS} runs, each right after one run of its baseline; ratios are the median of "
                           "the per-pair ratios, seconds and bandwidths medians; page cache dropped for G3; "
                           "recompute = engine prefill of the same tokens after a warm-up",
                           "baselines": "memcpy: one torch copy_ of the same total bytes between two warm buffers, on "
                           "the loader's thread; disk: a plain sequential read of one file of the same total bytes, "
                           "page cache dropped, the faster of block-sized and 1 MiB reads into a reused buffer"}}
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---- goals, report, plot ----------------------------------------------------------------------
