"""`everybyte moe-ify`: the default model (SmolLM2-135M) split into a llama_moe directory whose routers
were fitted on calibration text; with every expert active it is the dense model (fp32 summation
order apart); with fewer, the routers pick experts by the text, unevenly. Few calibration tokens here."""
import json
import math

import pytest
import torch
from test_loaders import everybyte_logits

from everybyte import LLM
from everybyte.engine import moeify_cli
from everybyte.engine.sampling_params import SamplingParams
from everybyte.models.loader import load_model
from everybyte.models.moe import MoEBlock
from everybyte.models.moe_from_dense import balanced_clusters, fit_router, set_top_k

EXPERTS = 4
IDS = [1, 504, 3458, 314, 260, 2117, 282, 4911, 30, 378, 17, 1000, 65, 7, 9, 12345]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe") / "smollm2-moe"
    assert moeify_cli.main([str(out), "--experts", str(EXPERTS), "--top-k", "2", "--calibration-tokens", "48"]) == 0
    return out


@pytest.fixture(scope="module")
def dense():
    return load_model(None)


def test_the_directory_is_a_llama_moe_with_tokenizer_and_template(moe_dir, dense):
    cfg = json.loads((moe_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaMoeForCausalLM"] and cfg["moe_combine"] == "sum"
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (EXPERTS, 2, 384)
    moe = load_model(str(moe_dir))
    assert moe.config.architecture == "llama_moe" and moe.config.tie_word_embeddings
    assert all(isinstance(layer.mlp, MoEBlock) and len(layer.mlp.experts) == EXPERTS for layer in moe.model.model.layers)
    chat = [{"role": "user", "content": "hi"}]
    assert moe.tokenizer.apply_chat_template(chat) == dense.tokenizer.apply_chat_template(chat)


def test_all_experts_equal_the_dense_model(moe_dir, dense):
    moe = load_model(str(moe_dir))
    set_top_k(moe.model, EXPERTS)
    want = everybyte_logits(dense, IDS)
    got = everybyte_logits(moe, IDS)
    assert (got - want).abs().max().item() <= 1e-3 * want.abs().max().item()     # fp32 summation order
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    set_top_k(moe.model, 1)
    assert (everybyte_logits(moe, IDS) - want).abs().max().item() > 1e-2          # fewer experts: another model


def test_routing_is_uneven_and_generation_runs(moe_dir):
    moe = load_model(str(moe_dir))
    counts = torch.zeros(len(moe.model.model.layers), EXPERTS)
    for layer in moe.model.model.layers:
        layer.mlp.load_counter = lambda i, ids: counts[i].add_(torch.bincount(ids.flatten(), minlength=EXPERTS))
    llm = LLM(moe, kv_cache_bytes="16MiB", max_num_seqs=4, max_model_len=256)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    assert counts.sum().item() > 0 and (counts.max(1).values > counts.mean(1)).all()   # skew per layer


def test_the_split_groups_co_active_neurons_and_the_router_follows_contributions():
    torch.manual_seed(0)
    t, groups = torch.arange(64), [list(range(e, 32, 4)) for e in range(4)]   # neuron n fires on tokens with t % 4 == n % 4
    act = torch.zeros(64, 32)
    for n in range(32):
        act[t % 4 == n % 4, n] = 1 + torch.rand(16)
    found = balanced_clusters(act, 4)
    assert sorted(map(sorted, found)) == sorted(groups)
    x = torch.randn(200, 8)
    w = torch.randn(4, 8)
    router = fit_router(x, torch.exp(x @ w.T))                                 # log contribution is linear in x
    assert torch.equal((x @ router.T).argmax(1), (x @ w.T).argmax(1))


def test_bad_input_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"7 experts do not divide the 1536 intermediate neurons; choose one of \[1, 2, 3"):
        moeify_cli.moeify(None, tmp_path / "a", experts=7, calibration_tokens=16)
    assert moeify_cli.main([str(tmp_path / "b"), "--experts", "4", "--top-k", "5"]) == 2


def test_perplexity_report(moe_dir):
    r = moeify_cli.perplexities(None, moe_dir, 64)
    assert r["eval_tokens"] == 64 and set(r["ppl_by_top_k"]) == {"1", "2", "4"}
    assert math.isclose(r["ppl_by_top_k"]["4"], r["dense_ppl"], rel_tol=1e-3)
    assert r["ppl_by_top_k"]["1"] > r["ppl_by_top_k"]["4"]
