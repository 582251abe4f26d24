"""MoE models (Qwen3-MoE, Mixtral, OLMoE) from directories transformers writes itself: logits against
transformers' forward, greedy tokens through the engine, NVFP4 experts, `everybyte quantize` on a
MoE, expert placements (a rank loads only its experts), the EP/EPLB hooks, and bad configs."""
import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from test_loaders import IDS, everybyte_logits, hf_logits, save_hf_dir

from everybyte import LLM
from everybyte.engine.sampling_params import SamplingParams
from everybyte.formats.kv_layout import get_kv_format
from everybyte.models import decode_step
from everybyte.models.attention import AttentionMetadata, LayerKVCache
from everybyte.models.expert_placement import ExpertPlacement
from everybyte.models.layers import Linear
from everybyte.models.llama import CausalLM
from everybyte.models.loader import load_model
from everybyte.models.moe import MoEBlock
from everybyte.models.moe_weights import canonical_weights
from everybyte.models.nvfp4_linear import NVFP4Linear, PackedModule

transformers = pytest.importorskip("transformers", reason="the parity reference; in the test extra")

COMMON = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=257,
              eos_token_id=258, tie_word_embeddings=False)
ARCHS = {   # each exercises its own routing and structure options
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True,
        mlp_only_layers=[1])),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(
        num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM, dict(
        num_experts=8, num_experts_per_tok=3, intermediate_size=32, norm_topk_prob=False, clip_qkv=2.0)),
}
TOL = 1e-4          # fp32: summation order only


def tiny_moe(arch: str, **overrides):
    cfg_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    hf = model_cls(cfg_cls(**{**COMMON, **extra, **overrides})).eval()
    with torch.no_grad():     # larger than HF's init: routing and attention far from uniform
        for name, p in hf.named_parameters():
            scale = 4.0 if "embed" in name or name.endswith("gate.weight") else 1.0
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else scale * p.shape[-1] ** -0.5 * torch.randn_like(p))
    return hf


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request, tmp_path_factory):
    """(arch, the transformers model, the directory its save_pretrained wrote)"""
    return request.param, (hf := tiny_moe(request.param)), save_hf_dir(hf, tmp_path_factory.mktemp(request.param))


def test_logits_match_transformers(tiny):
    arch, hf, path = tiny
    keys = set(safe_open(path / "model.safetensors", "pt").keys())      # transformers 5 writes one per expert
    assert ("model.layers.0.block_sparse_moe.experts.0.w1.weight" if arch == "mixtral"
            else "model.layers.0.mlp.experts.0.gate_proj.weight") in keys
    loaded = load_model(str(path))
    c = loaded.config
    assert c.architecture == arch and c.is_moe and c.num_experts == ARCHS[arch][2].get(
        "num_experts", ARCHS[arch][2].get("num_local_experts"))
    assert c.norm_topk_prob == (arch != "olmoe")
    assert c.moe_layers == ((0, 2) if arch == "qwen3_moe" else None)
    assert c.qk_norm_whole == (arch == "olmoe") and c.clip_qkv == (2.0 if arch == "olmoe" else None)
    blocks = [layer.mlp for layer in loaded.model.model.layers]
    assert [isinstance(b, MoEBlock) for b in blocks] == [True, arch != "qwen3_moe", True]
    assert (everybyte_logits(loaded, IDS) - hf_logits(hf, IDS)).abs().max().item() <= TOL


def test_stacked_expert_tensors_load(tiny):
    """transformers 5 holds experts stacked 3-D in memory (mlp.experts.gate_up_proj [E, 2I, H])."""
    arch, hf, path = tiny
    state = hf.state_dict()
    assert state["model.layers.0.mlp.experts.gate_up_proj"].dim() == 3
    loaded = load_model(str(path))
    ours = CausalLM(loaded.config)
    ours.load_weights(state.items())
    loaded.model = ours
    assert (everybyte_logits(loaded, IDS) - hf_logits(hf, IDS)).abs().max().item() <= TOL


def test_route_matches_transformers_router(tiny):
    arch, hf, path = tiny
    loaded = load_model(str(path))
    x = torch.randn(20, COMMON["hidden_size"])
    ids, w = loaded.model.model.layers[0].mlp.route(x)
    _, hf_w, hf_ids = hf.model.layers[0].mlp.gate(x)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == hf_ids.shape
    assert torch.equal(ids, hf_ids) and torch.allclose(w, hf_w.float(), atol=1e-6)
    if arch != "olmoe":
        assert torch.allclose(w.sum(-1), torch.ones(20))


def test_greedy_tokens_match_transformers_through_the_engine(tiny):
    arch, hf, path = tiny
    prompts = [IDS[:7], IDS[5:17]]
    llm = LLM(str(path), kv_cache_dtype="fp32", kv_cache_bytes="4MiB", max_model_len=64, dtype="float32",
              max_num_seqs=4, block_size=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == ref


def dequantized_copy(packed, hf):
    """A float model holding exactly the NVFP4 model's weights, dequantized."""
    weights = dict(canonical_weights(hf.state_dict().items()))
    for m in packed.model.modules():
        if isinstance(m, PackedModule):
            weights |= {f"{n}.weight": part.dequantize() for n, part in zip(m.part_names, m.packed.parts)}
    lm = CausalLM(packed.config)
    lm.load_weights(weights.items())
    return dataclasses.replace(packed, model=lm)


def test_nvfp4_experts_pack_each_expert_and_compute_their_dequantized_weights(tiny):
    arch, hf, path = tiny
    loaded = load_model(str(path), weights_dtype="nvfp4")
    block = loaded.model.model.layers[0].mlp
    assert all(isinstance(e.gate_up_proj, NVFP4Linear) and isinstance(e.down_proj, NVFP4Linear) for e in block.experts)
    assert type(block.gate) is Linear                 # the router stays float
    assert "model.layers.0.mlp.experts.1.gate_up_proj" in loaded.packed_modules
    got = everybyte_logits(loaded, IDS)
    assert (got - everybyte_logits(dequantized_copy(loaded, hf), IDS)).abs().max().item() <= 1e-3
    # against the float model: 4-bit weights in every linear of a random tiny model (routing flips
    # included) measured 0.31-0.47 relative logit error; NVFP4 experts alone 0.16-0.20
    ref = hf_logits(hf, IDS)
    assert (got - ref).norm() / ref.norm() < 0.6
    experts_only = load_model(str(path), weights_dtype="nvfp4",
                              exclude=("model.embed_tokens", "lm_head", "model.layers.*.self_attn.*"))
    assert type(experts_only.model.model.layers[0].self_attn.qkv_proj) is Linear
    assert (everybyte_logits(experts_only, IDS) - ref).norm() / ref.norm() < 0.3


def test_fused_decode_step_falls_back_for_moe(tiny):
    """The one-call C decode step runs dense layers only: a MoE model's decode takes the per-op path."""
    arch, hf, path = tiny
    loaded = load_model(str(path), weights_dtype="nvfp4")
    cfg, fmt, bs = loaded.config, get_kv_format("nvfp4"), 16
    caches = [LayerKVCache(fmt, fmt.allocate(2, bs, cfg.num_key_value_heads, cfg.head_dim),
                           fmt.allocate(2, bs, cfg.num_key_value_heads, cfg.head_dim), 1.0, 1.0, bs)
              for _ in range(cfg.num_hidden_layers)]
    meta = AttentionMetadata(torch.tensor([3]), [1], [4], torch.arange(2)[None])
    assert decode_step.run(loaded.model, torch.tensor([5]), torch.tensor([3]), meta, caches) is None
    assert loaded.model._decode_plan.layers is None


def test_quantize_writes_a_moe_checkpoint_that_loads(tiny, tmp_path):
    from everybyte.engine.quantize_cli import quantize_checkpoint
    arch, hf, path = tiny
    out = quantize_checkpoint(str(path), tmp_path / "q", dtype="fp32", kv_cache_dtype="none")
    keys = set(safe_open(out / "model.safetensors", "pt").keys())
    expert = ("model.layers.0.block_sparse_moe.experts.1.w1" if arch == "mixtral"
              else "model.layers.0.mlp.experts.1.gate_proj")
    assert f"{expert}.weight_scale" in keys and f"{expert}.weight_scale_2" in keys
    assert not any(k.endswith("gate.weight_scale") for k in keys)          # routers stay float
    loaded = load_model(str(out))
    assert loaded.weights_format == "nvfp4" and loaded.config.architecture == arch
    assert type(loaded.model.model.layers[0].mlp.gate) is Linear
    dequantized = load_model(str(out), weights_dtype="fp32")
    assert (everybyte_logits(loaded, IDS) - everybyte_logits(dequantized, IDS)).abs().max().item() <= 1e-3


def test_a_rank_loads_only_its_placed_experts(tiny):
    """Rank 1 of 2 holds experts E/2..E-1; a replica placement loads the same expert twice."""
    arch, hf, path = tiny
    full = load_model(str(path))
    E = full.config.num_experts
    half = ExpertPlacement.identity(E, num_ranks=2, rank=1)
    assert half.local_logical == list(range(E // 2, E)) and half.num_local_slots == E // 2
    replicated = ExpertPlacement(E, 2, 0, [0, *range(E), 1], E // 2 + 1)     # expert 0 twice on rank 0
    assert replicated.local_logical[:2] == [0, 0] and replicated.replicas(1) == [2, E + 1]
    for placement in (half, replicated):
        part = load_model(str(path), placements={0: placement})
        block, ref = part.model.model.layers[0].mlp, full.model.model.layers[0].mlp
        assert len(block.experts) == placement.num_local_slots
        for slot, logical in enumerate(placement.local_logical):
            assert torch.equal(block.experts[slot].down_proj.weight, ref.experts[logical].down_proj.weight)
        x = torch.randn(16, COMMON["hidden_size"])
        ids, w = ref.route(x)
        slots = placement.to_local_slots(ids)
        assert ((slots >= 0) == torch.isin(ids, torch.tensor(placement.local_logical))).all()
        here = w * (slots >= 0)                  # the same sum over the experts this rank holds
        assert torch.allclose(block.run_local(x, slots, w), ref.run_local(x, ref.placement.to_local_slots(ids), here),
                              atol=1e-5)


def test_forward_calls_the_load_counter_and_the_dispatcher(tiny):
    arch, hf, path = tiny
    block = load_model(str(path)).model.model.layers[2].mlp
    x = torch.randn(5, COMMON["hidden_size"])
    local = block(x)
    seen, calls = [], []
    block.load_counter = lambda layer, ids: seen.append((layer, ids.clone()))

    class EchoDispatcher:              # a test double for helper B's AllToAllDispatcher: all experts local
        def forward(self, blk, xs, ids, weights):
            calls.append(ids.shape)
            return blk.run_local(xs, blk.placement.to_local_slots(ids), weights)

    block.dispatcher = EchoDispatcher()
    assert torch.equal(block(x), local)
    assert seen[0][0] == 2 and seen[0][1].shape == (5, block.top_k) and calls == [(5, block.top_k)]
    assert torch.equal(block.run_local(x, torch.full((5, block.top_k), -1), torch.ones(5, block.top_k)),
                       torch.zeros_like(x))


def test_placement_errors_name_what_is_wrong():
    with pytest.raises(ValueError, match=r"3 ranks do not divide 8 experts.*\[1, 2, 4, 8\]"):
        ExpertPlacement.identity(8, 3)
    with pytest.raises(ValueError, match=r"experts \[3\] have no slot"):
        ExpertPlacement(4, 2, 0, [0, 1, 2, 2], 2)
    with pytest.raises(ValueError, match="rank 2 outside"):
        ExpertPlacement.identity(4, 2, rank=2)
    assert ExpertPlacement(4, 2, 1, [0, 1, 2, 3, 0, 3], 3).replicas(0) == [0, 4]


@pytest.mark.parametrize("field,value", [("shared_expert_intermediate_size", 64), ("n_shared_experts", 1),
                                         ("scoring_func", "sigmoid"), ("n_group", 4), ("hidden_act", "gelu")])
def test_unsupported_moe_fields_are_named(tmp_path, field, value):
    hf = tiny_moe("qwen3_moe")
    path = save_hf_dir(hf, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        load_model(str(path))


def test_decoder_sparse_step_makes_every_other_layer_moe(tmp_path):
    hf = tiny_moe("qwen3_moe", decoder_sparse_step=2, mlp_only_layers=[])
    loaded = load_model(str(save_hf_dir(hf, tmp_path / "m")))
    assert loaded.config.moe_layers == (1,)
    assert (everybyte_logits(loaded, IDS) - hf_logits(hf, IDS)).abs().max().item() <= TOL
