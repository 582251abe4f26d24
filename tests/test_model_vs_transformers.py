import random

import pytest
import torch
import transformers

from everybyte.formats.kv_layout import get_kv_format
from everybyte.models.attention import AttentionMetadata, LayerKVCache
from everybyte.models.config import ModelConfig
from everybyte.models.llama import CausalLM

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-6)
ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(
        head_dim=16, tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, dict(
        head_dim=32, tie_word_embeddings=False)),
}


def config_from_hf(c) -> ModelConfig:
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    theta = rope.pop("rope_theta", getattr(c, "rope_theta", 10000.0))
    return ModelConfig(
        architecture=c.model_type, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps, rope_theta=theta,
        rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=c.model_type == "qwen2" or getattr(c, "attention_bias", False),
        qk_norm=c.model_type == "qwen3")


_models = {}


def hf_and_ours(arch, dtype=torch.float32):
    if arch not in _models:
        cfg_cls, model_cls, extra = ARCHS[arch]
        torch.manual_seed(0)
        hf = model_cls(cfg_cls(**COMMON, **extra)).eval()
        with torch.no_grad():  # larger than HF's 0.02 init, so attention is far from uniform
            for name, p in hf.named_parameters():
                if "norm" in name:
                    p.copy_(1 + 0.2 * torch.randn_like(p))
                elif name.endswith("bias"):
                    p.copy_(0.5 * torch.randn_like(p))
                else:
                    p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 * (4.0 if "embed" in name else 1.0))
        _models[arch] = hf
    hf = _models[arch]
    ours = CausalLM(config_from_hf(hf.config), dtype)
    ours.load_weights(hf.state_dict().items())
    return hf, ours


class PagedKV:
    """Test stand-in for the block manager: allocates blocks in shuffled order, builds metadata."""

    def __init__(self, model, kv_dtype="fp32", num_blocks=48, block_size=4):
        cfg, fmt = model.config, get_kv_format(kv_dtype)
        self.model, self.block_size = model, block_size
        self.caches = [LayerKVCache(fmt, *(fmt.allocate(num_blocks, block_size, cfg.num_key_value_heads,
                                                        cfg.head_dim, "cpu") for _ in "kv"),
                                    fmt.default_scale, fmt.default_scale, block_size)
                       for _ in range(cfg.num_hidden_layers)]
        self.free = list(range(num_blocks))
        random.Random(1).shuffle(self.free)
        self.tables, self.lens = {}, {}

    @torch.inference_mode()
    def step(self, chunks: dict):
        """chunks: seq id -> new token ids. Returns seq id -> logits [n, vocab] of its new tokens."""
        ids, positions, slots, qlens, ctxs, tables = [], [], [], [], [], []
        for sid, toks in chunks.items():
            start = self.lens.get(sid, 0)
            table = self.tables.setdefault(sid, [])
            while len(table) * self.block_size < start + len(toks):
                table.append(self.free.pop())
            for pos in range(start, start + len(toks)):
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            ids += toks
            positions += range(start, start + len(toks))
            qlens.append(len(toks))
            ctxs.append(start + len(toks))
            tables.append(table)
            self.lens[sid] = start + len(toks)
        width = max(map(len, tables))
        meta = AttentionMetadata(torch.tensor(slots), qlens, ctxs,
                                 torch.tensor([t + [0] * (width - len(t)) for t in tables]))
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), meta, self.caches)
        logits = self.model.compute_logits(hidden)
        return dict(zip(chunks, logits.split(qlens)))


def _tokens(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_prefill_and_decode_match_transformers(arch):
    hf, ours = hf_and_ours(arch)
    toks = _tokens(40, 0)
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0]
    kv = PagedKV(ours)
    got = kv.step({0: toks[:30]})[0]
    assert (got - ref[:30]).abs().max() <= 1e-4
    for i in range(30, 40):
        step = kv.step({0: [toks[i]]})[0]
        assert (step[0] - ref[i]).abs().max() <= 1e-4


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prefill_equals_unchunked(arch, kv_dtype):
    _, ours = hf_and_ours(arch)
    toks = _tokens(29, 1)
    whole = PagedKV(ours, kv_dtype).step({0: toks})[0]
    kv = PagedKV(ours, kv_dtype)
    parts = [kv.step({0: toks[a:b]})[0] for a, b in [(0, 7), (7, 8), (8, 20), (20, 29)]]
    # K/V of a token come out of matmuls of different shapes in each chunking, so they can differ
    # in the last float bits; a quantized format may then round one value to a neighbouring code
    atol = 1e-4 if kv_dtype in ("fp32", "bf16") else 1e-2
    assert torch.allclose(torch.cat(parts), whole, atol=atol, rtol=0)


@pytest.mark.parametrize("kv_dtype", ["fp32", "nvfp4"])
def test_batch_equals_alone(kv_dtype):
    _, ours = hf_and_ours("qwen2")
    prompts = {s: _tokens(n, 10 + s) for s, n in enumerate([5, 17, 9, 1])}
    alone = {}
    for sid, toks in prompts.items():
        kv = PagedKV(ours, kv_dtype)
        out = [kv.step({sid: toks})[sid][-1]]
        for t in range(3):
            out.append(kv.step({sid: [t + sid]})[sid][0])
        alone[sid] = torch.stack(out)
    kv = PagedKV(ours, kv_dtype)
    first = kv.step({s: prompts[s] for s in (0, 1)})
    out = {s: [first[s][-1]] for s in (0, 1)}
    mixed = kv.step({0: [0], 2: prompts[2], 1: [1], 3: prompts[3]})  # decodes mixed with prefills
    out[0].append(mixed[0][0]), out[1].append(mixed[1][0])
    out[2], out[3] = [mixed[2][-1]], [mixed[3][-1]]
    while any(len(o) < 4 for o in out.values()):
        step = kv.step({s: [len(out[s]) - 1 + s] for s in prompts if len(out[s]) < 4})
        for s, logits in step.items():
            out[s].append(logits[0])
    for sid in prompts:
        assert torch.allclose(torch.stack(out[sid]), alone[sid], atol=1e-4, rtol=0)


@pytest.mark.parametrize("kv_dtype,min_cos,mean_cos", [("bf16", 0.9999, 0.9999), ("fp16", 0.9999, 0.9999),
                                                       ("fp8", 0.995, 0.999), ("nvfp4", 0.97, 0.99)])
def test_quantized_kv_close_to_fp32(kv_dtype, min_cos, mean_cos):
    """Per-token cosine of the logits (32-token prefill + 16 decode steps) against fp32 KV."""
    _, ours = hf_and_ours("llama")
    toks = _tokens(48, 3)
    logits = {}
    for name in ("fp32", kv_dtype):
        kv = PagedKV(ours, name)
        out = [kv.step({0: toks[:32]})[0]]
        out += [kv.step({0: [t]})[0] for t in toks[32:]]
        logits[name] = torch.cat(out)
    cos = torch.nn.functional.cosine_similarity(logits["fp32"], logits[kv_dtype], dim=-1)
    assert cos.min() >= min_cos and cos.mean() >= mean_cos


def test_bf16_model_close_to_fp32():
    hf, ours = hf_and_ours("qwen3", torch.bfloat16)
    toks = _tokens(24, 4)
    with torch.no_grad():
        ref = hf(torch.tensor([toks])).logits[0]
    got = PagedKV(ours, "bf16").step({0: toks})[0]
    assert got.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min() >= 0.99


def test_load_weights_rejects_unknown_and_missing():
    hf, ours = hf_and_ours("qwen3")
    sd = hf.state_dict()
    with pytest.raises(ValueError, match="model.layers.0.mlp.extra.weight"):
        ours.load_weights(list(sd.items()) + [("model.layers.0.mlp.extra.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.k_norm.weight"):
        ours.load_weights([(n, t) for n, t in sd.items() if n != "model.layers.1.self_attn.k_norm.weight"])
    with pytest.raises(ValueError, match="shape"):
        ours.load_weights([("model.norm.weight", torch.zeros(3))])


@pytest.mark.parametrize("cached,new", [([5, 3, 13, 0], [1, 1, 2, 3]),   # 2 decodes, a chunk, a prefill
                                        ([5, 3, 13, 0], [1, 2, 3, 2]),   # one decode among prefills
                                        ([5, 3, 13, 2], [1, 1, 1, 1])])  # pure decode batch
def test_paged_attention_matches_naive(cached, new):
    from everybyte.models.attention import paged_attention
    torch.manual_seed(5)
    hq, hkv, d, bs = 6, 2, 16, 4
    fmt = get_kv_format("fp32")
    cache = LayerKVCache(fmt, fmt.allocate(16, bs, hkv, d), fmt.allocate(16, bs, hkv, d), 1.0, 1.0, bs)
    tables = [[3, 7, 1], [0, 5], [9, 2, 4, 8], [6]]
    full_k = [torch.randn(c + n, hkv, d) for c, n in zip(cached, new)]
    full_v = [torch.randn(c + n, hkv, d) for c, n in zip(cached, new)]
    slots = lambda s, ps: [tables[s][p // bs] * bs + p % bs for p in ps]
    for s, c in enumerate(cached):
        fmt.write(cache.k, torch.tensor(slots(s, range(c)), dtype=torch.long), full_k[s][:c], 1.0)
        fmt.write(cache.v, torch.tensor(slots(s, range(c)), dtype=torch.long), full_v[s][:c], 1.0)
    q = torch.randn(sum(new), hq, d)
    meta = AttentionMetadata(
        torch.tensor([x for s, (c, n) in enumerate(zip(cached, new)) for x in slots(s, range(c, c + n))]),
        new, [c + n for c, n in zip(cached, new)], torch.tensor([t + [0] * (4 - len(t)) for t in tables]))
    k_new = torch.cat([k[c:] for k, c in zip(full_k, cached)])
    v_new = torch.cat([v[c:] for v, c in zip(full_v, cached)])
    out = paged_attention(q, k_new, v_new, cache, meta, d ** -0.5)
    start = 0
    for s, (c, n) in enumerate(zip(cached, new)):
        k = full_k[s].repeat_interleave(hq // hkv, 1)
        v = full_v[s].repeat_interleave(hq // hkv, 1)
        for i in range(n):
            w = torch.einsum("hd,thd->ht", q[start + i], k[:c + i + 1]) * d ** -0.5
            ref = torch.einsum("ht,thd->hd", w.softmax(-1), v[:c + i + 1])
            assert torch.allclose(out[start + i], ref, atol=1e-5)
        start += n
