"""The fused NVFP4 decode-attention kernel against the torch path (gather, dequantize, SDPA) on a
real KV pool: random K/V in scattered blocks, exact-tail slots or none, fp32 and bf16, ragged
context lengths, a decode group next to a prefill chunk; and the real model's greedy tokens."""
import pytest
import torch

from everybyte.kv.data.pool import KVPool
from everybyte.models import attention, native_ops
from everybyte.models.attention import AttentionMetadata, LayerKVCache, paged_attention

pytestmark = pytest.mark.skipif(native_ops.lib() is None, reason="no C compiler: torch path only")
HQ, HKV, D, BS, SPAN = 9, 3, 64, 16, 32


def _setup(lens, dtype, tails: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = KVPool([(HKV, D)], "nvfp4", 256 * BS * 2 * HKV * 36, BS)
    pool.k_scales, pool.v_scales = [4.0 / 2688], [3.0 / 2688]
    perm = torch.randperm(pool.num_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in lens:
        nb = -(-n // BS)
        tables.append(perm[at:at + nb])
        at += nb
    width = max(map(len, tables))
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    slots = torch.tensor([tables[i][p // BS] * BS + p % BS for i, n in enumerate(lens) for p in range(n)])
    k = torch.randn(len(slots), HKV, D, generator=g).to(dtype)
    v = torch.randn(len(slots), HKV, D, generator=g).to(dtype)
    pool.fmt.write_kv(pool.k[0], pool.v[0], slots, k, v, pool.k_scales[0], pool.v_scales[0])
    tk = tv = None
    if tails:
        tk = torch.randn(len(lens) + 1, SPAN, HKV, D, generator=g).to(dtype)
        tv = torch.randn(len(lens) + 1, SPAN, HKV, D, generator=g).to(dtype)
    cache = LayerKVCache(pool.fmt, pool.k[0], pool.v[0], pool.k_scales[0], pool.v_scales[0], BS, tk, tv)
    return cache, block_tables


def _run(cache, block_tables, lens, q_lens, dtype, tails, fused: bool, monkeypatch, seed=1):
    g = torch.Generator().manual_seed(seed)
    T = sum(q_lens)
    q = torch.randn(T, HQ, D, generator=g).to(dtype)
    k = torch.randn(T, HKV, D, generator=g).to(dtype)
    v = torch.randn(T, HKV, D, generator=g).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.full((T,), -1), query_lens=list(q_lens), context_lens=list(lens),
                             block_tables=block_tables, tail_slots=list(range(1, len(lens) + 1)) if tails else None)
    with monkeypatch.context() as m:
        if not fused:
            m.setattr(attention, "nvfp4_decode", lambda *a, **kw: None)
        return paged_attention(q, k, v, cache, meta, D ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tails", [True, False])
def test_fused_decode_matches_torch_path(dtype, tails, monkeypatch):
    lens = [1, 17, 40, 95, 33]
    cache, tables = _setup(lens, dtype, tails)
    q_lens = [1] * len(lens)
    fused = _run(cache, tables, lens, q_lens, dtype, tails, True, monkeypatch)
    ref = _run(cache, tables, lens, q_lens, dtype, tails, False, monkeypatch)
    tol = 2e-5 if dtype is torch.float32 else 3e-2        # bf16: the torch path gathers K/V in bf16
    assert (fused.float() - ref.float()).abs().max().item() <= tol


def test_fused_decode_next_to_a_prefill_chunk(monkeypatch):
    lens = [50, 30, 70]
    cache, tables = _setup(lens, torch.float32, True)
    q_lens = [1, 30, 1]                                   # row 1 is a prefill chunk
    fused = _run(cache, tables, lens, q_lens, torch.float32, True, True, monkeypatch)
    ref = _run(cache, tables, lens, q_lens, torch.float32, True, False, monkeypatch)
    assert (fused - ref).abs().max().item() <= 2e-5


def test_real_model_tokens_equal_torch_path(monkeypatch):
    from everybyte import LLM, SamplingParams
    llm = LLM(dtype="fp32", kv_cache_dtype="nvfp4", kv_cache_bytes="16MiB", max_model_len=512, kv_tiers="none")
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]
    used, kernel = [], attention.nvfp4_decode
    monkeypatch.setattr(attention, "nvfp4_decode", lambda *a, **kw: used.append(kernel(*a, **kw)) or used[-1])
    fused = [o.token_ids for o in llm.generate(prompts, p)]
    assert used and all(u is not None for u in used)                 # every decode step took the kernel
    llm.reset_prefix_cache()
    monkeypatch.setattr(attention, "nvfp4_decode", lambda *a, **kw: None)
    assert [o.token_ids for o in llm.generate(prompts, p)] == fused
