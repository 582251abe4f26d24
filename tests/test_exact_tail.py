"""Lossy KV formats keep each sequence's last block unquantized (engine/exact_tail.py)."""
import argparse

import pytest
import torch

from everybyte import LLM, SamplingParams
from everybyte.engine.exact_tail import ExactTail, NoExactTail, exact_tail_for
from everybyte.engine.sequence import Sequence
from everybyte.kv.block_id import chain_block_ids
from everybyte.kv.block_manager import BlockManager
from everybyte.kv.data.pool import KVPool
from everybyte.models.loader import load_model
from everybyte.models.own_block_attention import attention_with_lse, attention_with_lse_reference, own_block_attention


def _reference(q, kq, vq, ke, ve, ctx, bs, scale):
    """Query p: stored keys of the blocks before its own, exact keys of its own block up to p."""
    n, hq, d = q.shape
    g, start = hq // kq.shape[1], ctx - n
    b0 = start // bs * bs
    k_exact, v_exact = kq.clone(), vq.clone()
    k_exact[b0:], v_exact[b0:] = ke, ve
    out = []
    for i in range(n):
        p = start + i
        own = p // bs * bs
        keys = torch.cat([kq[:own], k_exact[own:p + 1]]).repeat_interleave(g, 1)
        vals = torch.cat([vq[:own], v_exact[own:p + 1]]).repeat_interleave(g, 1)
        w = (torch.einsum("hd,lhd->hl", q[i], keys) * scale).softmax(-1)
        out.append(torch.einsum("hl,lhd->hd", w, vals))
    return torch.stack(out)


@pytest.mark.parametrize("ctx,n", [(40, 40), (40, 7), (37, 21), (33, 1), (48, 16), (16, 16), (5, 2)])
def test_own_block_attention_matches_the_rule(ctx, n):
    g = torch.Generator().manual_seed(ctx * 100 + n)
    q = torch.randn(n, 6, 8, generator=g)
    kq, vq = torch.randn(ctx, 2, 8, generator=g), torch.randn(ctx, 2, 8, generator=g)
    b0 = (ctx - n) // 16 * 16
    ke = kq[b0:] + 0.3 * torch.randn(ctx - b0, 2, 8, generator=g)
    ve = vq[b0:] + 0.3 * torch.randn(ctx - b0, 2, 8, generator=g)
    got = own_block_attention(q, kq, vq, ke, ve, 0.35, 16)
    torch.testing.assert_close(got, _reference(q, kq, vq, ke, ve, ctx, 16, 0.35), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n,length", [(24, 24), (5, 24), (1, 9)])
def test_fused_attention_with_lse_matches_the_float32_reference(n, length):
    """The CPU kernel (grouped KV heads as they are) vs the plain path other devices take."""
    g = torch.Generator().manual_seed(n * 31 + length)
    q, k, v = torch.randn(6, n, 8, generator=g), torch.randn(2, length, 8, generator=g), torch.randn(2, length, 8, generator=g)
    out, lse = attention_with_lse(q, k, v, length - n, 0.35)
    allowed = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    mask = torch.zeros(n, length).masked_fill_(~allowed, float("-inf")) if n != length else None
    ref_out, ref_lse = attention_with_lse_reference(q, k, v, mask, 0.35)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def model():
    return load_model(None, dtype=torch.float32)


def _logits(loaded, fmt, ids, chunks, exact_tail=True):
    llm = LLM(loaded, kv_cache_dtype=fmt, kv_cache_bytes="8MiB", max_model_len=len(ids) + 16,
              kv_exact_tail=exact_tail)
    seq = Sequence(ids)
    BlockManager(llm.pool.num_blocks, llm.pool.block_size).allocate(seq)
    out = []
    for n in chunks:
        out.append(llm.model_runner.forward([seq], [n], logits="all"))
        seq.num_computed_tokens += n
    return torch.cat(out)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
def test_first_span_is_exact_in_prefill_and_decode(model, fmt):
    """Within the first span (2 blocks) every key is its own span's: nvfp4/fp8 KV give fp32-KV
    logits there, whether the span is prefilled at once, in chunks, or decoded token by token."""
    ids = model.tokenizer.encode(open(argparse.__file__).read(), add_special_tokens=False)[:32]
    exact = _logits(model, "fp32", ids, [32])
    for chunks in ([32], [5, 11, 16], [1] * 32):
        torch.testing.assert_close(_logits(model, fmt, ids, chunks), exact, atol=2e-3, rtol=0)
    assert (_logits(model, fmt, ids, [32], exact_tail=False) - exact).abs().max() > 0.05


def test_later_spans_read_the_pool_and_chunking_agrees(model):
    ids = model.tokenizer.encode(open(argparse.__file__).read(), add_special_tokens=False)[:48]
    whole = _logits(model, "nvfp4", ids, [48])
    chunked = _logits(model, "nvfp4", ids, [20, 1, 1, 26])
    # same rule either way: only float rounding differs (which a 4-bit code can amplify a little)
    assert (whole - chunked).abs().max() < 0.5
    assert (whole.argmax(-1) == chunked.argmax(-1)).float().mean() > 0.95
    fp32 = _logits(model, "fp32", ids, [48])
    assert (whole[32:] - fp32[32:]).abs().max() > 0.05     # spans before a query's own are quantized


def test_slots_are_reused_grown_and_refilled_from_the_pool():
    pool = KVPool([(2, 16)] * 2, "nvfp4", "1MiB", block_size=4)
    tail = ExactTail(pool, torch.float32, "cpu", capacity=1)
    assert tail.span == 8 and tail.k[0].shape[1] == 8                # two blocks of 4
    a, b = Sequence(list(range(8))), Sequence(list(range(8)))
    a.block_table, b.block_table = [3, 4], [5, 6]
    assert len(set(tail.assign([a, b], {a.seq_id, b.seq_id}))) == 2 and tail.capacity == 2
    tail.advance([a, b], [2, 2])
    c = Sequence(list(range(8)))
    c.block_table = [7, 8]
    slot_c = tail.assign([c], {c.seq_id})[0]                  # a (least recent, not in the batch) gives way
    assert a.seq_id not in tail.slot_of and tail.capacity == 2
    # b resumes mid-span with its slot lost: the span's earlier tokens come from the pool
    tail.slot_of.pop(b.seq_id)
    x = torch.randn(8, 2, 16)
    pool.fmt.write(pool.k[0], torch.tensor([4, 5, 6, 7, 24, 25, 26, 27]), x, pool.k_scales[0])
    b.block_table, b.num_computed_tokens = [1, 6], 6
    slot_b = tail.assign([b], {b.seq_id, c.seq_id})[0]          # c is in this batch: the store grows
    assert slot_b != slot_c and tail.capacity == 4
    stored = pool.fmt.read(pool.k[0], torch.tensor([1, 6]), pool.k_scales[0]).reshape(8, 2, 16)
    assert torch.equal(tail.k[0][slot_b, :6], stored[:6])


def test_a_hit_ending_mid_span_restarts_at_the_span_and_keeps_the_stored_block(model):
    """3 reusable blocks = 1.5 spans: the request computes from the span start (token 32), block 3
    is recomputed for the exact tail only (its pool bytes untouched), the tokens are those of no
    reuse, and the ledger counts 32 reused tokens."""
    ids = model.tokenizer.encode(open(argparse.__file__).read(), add_special_tokens=False)[:53]
    kw = dict(kv_cache_dtype="nvfp4", kv_cache_bytes="8MiB", max_model_len=128)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reference = LLM(model, enable_prefix_caching=False, **kw).generate([ids], greedy)[0].token_ids
    llm = LLM(model, **kw)
    assert llm.generate([ids], greedy)[0].token_ids == reference
    hits = llm.block_manager.cache.lookup(chain_block_ids(llm.block_manager.ns, ids, 16)[:3])
    assert len(hits) == 3
    snapshot = lambda: [t[hits].clone() for store in llm.pool.k + llm.pool.v for t in store.values()]
    before = snapshot()
    again = llm.generate([ids], greedy)[0]
    assert again.num_cached_tokens == 32 and again.token_ids == reference
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot()))
    assert llm.stats()["memory"]["prefill_tokens"]["reused"] == {"G1": 32}


def test_the_lever_follows_the_pool_format():
    """exact_tail_for: exact tails for a lossy pool with the lever on, else the pool only; the
    model runner and the memory manager see either through the same small interface."""
    lossy, exact = (KVPool([(2, 16)] * 2, fmt, "1MiB", block_size=4) for fmt in ("nvfp4", "fp32"))
    tail = exact_tail_for(lossy, torch.float32, "cpu")
    assert isinstance(tail, ExactTail) and tail.restart_blocks == 2 and tail.layer(1) == (tail.k[1], tail.v[1])
    seqs = [Sequence(list(range(5))) for _ in range(9)]             # more than the 8 slots it starts with
    for i, seq in enumerate(seqs):
        seq.block_table = [2 * i, 2 * i + 1]
    slots, grown = tail.begin_step(seqs)
    assert grown and len(set(slots)) == 9 and tail.begin_step(seqs) == (slots, False)
    for none in (exact_tail_for(lossy, torch.float32, "cpu", enabled=False),
                 exact_tail_for(exact, torch.float32, "cpu")):
        assert isinstance(none, NoExactTail) and none.restart_blocks == 1
        assert none.layer(0) == (None, None) and none.begin_step(seqs) == (None, False)
