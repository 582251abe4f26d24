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
        for off in range(0, nbytes, chunk):
            f.write(os.urandom(min(chunk, nbytes - off)))
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


def measure_tiers(loaded, layer_shapes, fmt: str, prefix_tokens: int, tier_dir: str, dtype, device: str,
                  block_size: int = 16) -> dict:
    import hashlib
    import shutil
    import tempfile

    import torch

    from everybyte.engine.llm_engine import LLMEngine
    from everybyte.engine.sampling_params import SamplingParams
    from everybyte.kv.pool import bytes_per_token, min_pool_bytes
    from everybyte.kv.tier_config import measure_load_bandwidth, measure_memcpy_bandwidth
    from everybyte.kv.tiers import DiskTier, HostTier
    from everybyte.kv.tiers.codec import encode_pool_block, load_pool_block

    root = tempfile.mkdtemp(prefix="eb-bench-memory-", dir=tier_dir)
    cuda = str(device).startswith("cuda")
    try:
        probe_block = bytes_per_token(layer_shapes, "fp16") * block_size
        nblocks = max(1, prefix_tokens // block_size)
        host, disk = HostTier(1 << 30, pin_memory=cuda), DiskTier(os.path.join(root, "g3"), 1 << 30)
        g2 = _median(lambda: measure_load_bandwidth(host, probe_block, nblocks, device))
        memcpy = _median(lambda: measure_memcpy_bandwidth(probe_block * nblocks))
        g3 = _median(lambda: measure_load_bandwidth(disk, probe_block, nblocks, device))
        seq = _median(lambda: _disk_read_bandwidth(root, probe_block * nblocks, probe_block))

        mml = prefix_tokens + block_size
        eng = LLMEngine(loaded, kv_cache_dtype=fmt, kv_cache_bytes=min_pool_bytes(layer_shapes, fmt, mml, block_size),
                        max_model_len=mml, enable_prefix_caching=False, kv_tiers="none", dtype=dtype, device=device)
        one = SamplingParams(max_tokens=1, ignore_eos=True)
        eng.generate(list(range(1000, 1000 + 2 * block_size)), one)         # warm-up
        ids = TokenSpace().token
        prompt = [ids(7, 0, i) for i in range(prefix_tokens)]
        t0 = time.perf_counter()
        eng.generate(prompt, one)
        recompute = time.perf_counter() - t0
        pool, load = eng.pool, {}
        names = [hashlib.blake2b(b"eb-bench-memory-%d" % b, digest_size=16).digest() for b in range(nblocks)]
        bufs = [encode_pool_block(pool, b, n) for b, n in enumerate(names)]
        for level, tier in (("G2", host), ("G3", disk)):
            for n, buf in zip(names, bufs):
                tier.put(n, buf)
                getattr(tier, "drop_page_cache", lambda _: None)(n)
            t0 = time.perf_counter()
            for b, n in enumerate(names):
                load_pool_block(pool, b, tier.get(n), verify=False)
            if cuda:
                torch.cuda.synchronize()
            load[level] = time.perf_counter() - t0
        total = sum(b.numel() for b in bufs)
        del eng
        return {"g2_load_vs_memcpy": g2 / memcpy, "g3_load_vs_disk": g3 / seq, "load_2k_prefix_s": load,
                "recompute_2k_prefix_s": recompute,
                "load_speedup_vs_recompute": {k: recompute / max(v, 1e-9) for k, v in load.items()},
                "load_2k_prefix_bytes_s": {k: total / max(v, 1e-9) for k, v in load.items()},
                "g2_prefix_load_vs_memcpy": total / max(load["G2"], 1e-9) / memcpy,
                "g2_load_bytes_s": g2, "memcpy_bytes_s": memcpy, "g3_load_bytes_s": g3, "disk_seq_read_bytes_s": seq,
                "probe": {"block_bytes": probe_block, "blocks": nblocks, "note": "fp16 KV block size, median of 3; "
                          "measure_load_bandwidth copies every block into one block-sized buffer (cache-resident), "
                          "measure_memcpy_bandwidth copies blocks x block_bytes at once"},
                "prefix": {"tokens": nblocks * block_size, "kv_format": fmt, "encoded_block_bytes": total // nblocks,
                           "method": "sequential tier.get + load_pool_block(verify=False) per block, page cache "
                                     "dropped for G3; recompute = engine prefill of the same tokens (after a warm-up)"}}
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---- goals, report, plot ----------------------------------------------------------------------
