"""Expert parallelism: a tiny random Qwen3-MoE written by transformers, run at EP=1 and EP=2 (rank 0
this process, rank 1 a real process, real gloo on 127.0.0.1).

Tolerance: EP=2 sums each token's experts per rank and then adds the ranks' partial sums, EP=1
adds the experts one after another, so in fp32 the two differ by summation order only: we allow
1e-4 on log-probabilities (seen: ~1e-6); greedy tokens must be identical.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
import torch
from serve_fixtures import Server, free_port
from test_cluster_launcher import Launcher
from test_loaders import save_hf_dir

from everybyte.cluster.launcher import plan_workers
from everybyte.dist import RankDiedError
from everybyte.engine.llm import LLM
from everybyte.engine.sampling_params import SamplingParams
from everybyte.models import moe_dispatch, replica_choice
from everybyte.models.expert_moves import transfer_plan
from everybyte.models.expert_placement import ExpertPlacement
from everybyte.models.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers", reason="the parity reference; in the test extra")

EXPERTS = 8
PROMPTS = [[257, 40, 41, 42, 43, 44], [257, 100, 7, 9, 250, 31, 77, 12, 5], [257, 3]]
ENGINE = dict(kv_cache_dtype="fp32", kv_cache_bytes="4MiB", max_num_seqs=4, max_model_len=64, kv_tiers="none")
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=EXPERTS, num_experts_per_tok=3,
        norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=128, bos_token_id=257,
        eos_token_id=258, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():                       # far from uniform logits and routing
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else p.shape[-1] ** -0.5 * torch.randn_like(p)
                    if p.dim() > 1 else torch.randn_like(p))
    return save_hf_dir(hf, tmp_path_factory.mktemp("qwen3_moe"))


def run(llm: LLM, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], [o.logprobs for o in outs]


@pytest.fixture(scope="module")
def reference(moe_dir):
    llm = LLM(str(moe_dir), **ENGINE)
    try:
        return run(llm)
    finally:
        llm.close()


def assert_close(logprobs_a, logprobs_b, tol=1e-4):
    for seq_a, seq_b in zip(logprobs_a, logprobs_b):
        for step_a, step_b in zip(seq_a, seq_b):
            assert step_a.keys() == step_b.keys()
            assert max(abs(step_a[t] - step_b[t]) for t in step_a) <= tol


def test_ep2_equals_ep1(moe_dir, reference):
    llm = LLM(str(moe_dir), expert_parallel=2, **ENGINE)
    try:
        blocks = llm.expert_parallel.blocks
        assert sorted(blocks) == [0, 2]                          # layer 1 is dense (mlp_only_layers)
        assert all(len(b.experts) == EXPERTS // 2 and b.placement.local_logical == [0, 1, 2, 3]
                   for b in blocks.values())                     # rank 0 holds only its half
        tokens, logprobs = run(llm)
        assert tokens == reference[0]
        assert_close(logprobs, reference[1])
        assert llm.stats()["expert_parallel"]["ranks"] == 2
    finally:
        llm.close()
    assert llm.expert_parallel.workers[0].returncode == 0         # told to stop, not killed


def test_serve_expert_parallel_and_a_killed_rank_0(moe_dir, reference):
    server = Server("--model", str(moe_dir), "--expert-parallel", "2", "--kv-cache", "4MiB", "--kv-cache-dtype",
                    "fp32", "--max-model-len", "64", "--kv-tiers", "none", "--max-num-seqs", "4")
    try:
        body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == Tokenizer.from_hf_dir(moe_dir).decode(reference[0][0])
        workers = psutil.Process(server.proc.pid).children()
        assert len(workers) == 1 and "everybyte.engine.ep_worker" in workers[0].cmdline()
        server.stop(signal.SIGKILL)
        workers[0].wait(30)                                      # it stops by itself, never hangs
        assert not workers[0].is_running()
        log = server.proc.stdout.read()                          # the rank's stderr is the server's
        assert f"everybyte expert rank 1: expert-parallel group: rank 0 (pid {server.proc.pid}) died" in log
    finally:
        server.stop()


def test_rebalance_mid_generation_keeps_tokens(moe_dir, reference):
    llm = LLM(str(moe_dir), expert_parallel=2, **ENGINE)
    final = {}

    def step():
        for out in llm.step():
            final[out.request_id] = out
    try:
        ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
        for _ in range(3):
            step()
        ep = llm.expert_parallel
        # layer 0: every expert changes rank; layer 2: 5 slots a rank, experts 0 and 7 on both
        assert ep.apply_placement(0, ExpertPlacement(EXPERTS, 2, 0, [4, 5, 6, 7, 0, 1, 2, 3], 4)) == 4
        assert ep.apply_placement(2, ExpertPlacement(EXPERTS, 2, 0, [0, 2, 4, 6, 7, 7, 1, 3, 5, 0], 5)) == 3
        assert ep.blocks[0].placement.local_logical == [4, 5, 6, 7]
        assert ep.blocks[2].placement.local_logical == [0, 2, 4, 6, 7]     # 4, 6, 7 came from rank 1
        step()
        assert ep.apply_placement(0, ExpertPlacement.identity(EXPERTS, 2)) == 4      # and back, mid-way
        while llm.has_unfinished_requests():
            step()
        with pytest.raises(ValueError, match="layer 1 is not a MoE layer"):
            ep.apply_placement(1, ExpertPlacement.identity(EXPERTS, 2))
    finally:
        llm.close()
    assert [final[i].token_ids for i in ids] == reference[0]
    assert_close([final[i].logprobs for i in ids], reference[1])


def test_killed_rank_is_named_and_nothing_hangs(moe_dir):
    llm = LLM(str(moe_dir), expert_parallel=2, **ENGINE)
    try:
        run(llm, PROMPTS[:1])
        worker = llm.expert_parallel.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankDiedError, match=rf"rank 1 \(pid {worker.pid}\) died") as err:
            run(llm, PROMPTS[:1])
        assert err.value.rank == 1 and time.monotonic() - t0 < 30
        with pytest.raises(RankDiedError):                       # and stays failed, at once
            run(llm, PROMPTS[1:2])
    finally:
        llm.close()


def test_bad_expert_parallel_values(moe_dir):
    with pytest.raises(ValueError, match=r"--expert-parallel 3 does not divide the 8 experts .* use one of \[1, 2, 4, 8\]"):
        LLM(str(moe_dir), expert_parallel=3, **ENGINE)
    with pytest.raises(ValueError, match="expert_parallel must be an int >= 1, got 0"):
        LLM(str(moe_dir), expert_parallel=0, **ENGINE)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model; .* is a dense llama model"):
        LLM(None, expert_parallel=2, **ENGINE)
    cli = subprocess.run([sys.executable, "-m", "everybyte.cli", "serve", "--model", str(moe_dir),
                          "--expert-parallel", "16", "--port", str(free_port())],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode != 0 and "does not divide the 8 experts" in cli.stderr and "[1, 2, 4, 8]" in cli.stderr


def test_cluster_launcher_runs_expert_parallel_workers(moe_dir, reference):
    assert plan_workers(2, None, None, [], cores=8, expert_parallel=2)[0].threads == 2       # 2 workers x 2 ranks
    assert plan_workers(1, None, None, ["--model", "m"], expert_parallel=2)[0].serve_args[-2:] == \
        ["--expert-parallel", "2"]
    with pytest.raises(ValueError, match="--expert-parallel must be >= 1, got 0"):
        plan_workers(1, None, None, [], expert_parallel=0)
    launcher = Launcher("--workers", "1", "--expert-parallel", "2", "--model", str(moe_dir), "--kv-cache", "4MiB",
                        "--kv-cache-dtype", "fp32", "--max-model-len", "64", "--kv-tiers", "none")
    try:
        ready = launcher.next_event()
        worker = ready["workers"][0]
        ranks = psutil.Process(worker["pid"]).children()
        assert [("everybyte.engine.ep_worker" in r.cmdline()) for r in ranks] == [True]
        body = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        r = httpx.post(worker["url"] + "/v1/completions", json=body, timeout=60)
        assert r.json()["choices"][0]["text"] == Tokenizer.from_hf_dir(moe_dir).decode(reference[0][1])
        assert launcher.stop() == 0
        ranks[0].wait(30)
        assert not ranks[0].is_running()                         # rank 0's exit stopped its expert rank
    finally:
        launcher.stop()


def test_transfer_plan():
    old = ExpertPlacement.identity(EXPERTS, 2)
    new = ExpertPlacement(EXPERTS, 2, 0, [0, 2, 4, 6, 7, 7, 1, 3, 5, 0], 5)
    assert transfer_plan(old, new) == {(0, 4): 1, (0, 6): 1, (0, 7): 1, (1, 0): 0, (1, 1): 0, (1, 3): 0}


def test_replicas_chosen_per_step_keep_tokens(moe_dir, reference, monkeypatch):
    """Every expert on both ranks: each step's tokens are split over the replicas by the step's load
    (models/replica_choice), and the tokens and log-probabilities stay those of EP=1."""
    quotas = []

    def spy(counts, p2l, ranks):
        quotas.append(replica_choice.slot_quotas(counts, p2l, ranks))
        return quotas[-1]
    monkeypatch.setattr(moe_dispatch, "slot_quotas", spy)
    llm = LLM(str(moe_dir), expert_parallel=2, **ENGINE)
    try:
        both = list(range(EXPERTS)) + list(range(EXPERTS))
        for layer in (0, 2):
            llm.expert_parallel.apply_placement(layer, ExpertPlacement(EXPERTS, 2, 0, both, EXPERTS))
        tokens, logprobs = run(llm)
    finally:
        llm.close()
    assert tokens == reference[0]
    assert_close(logprobs, reference[1])
    per_rank = [(sum(q[:EXPERTS]), sum(q[EXPERTS:])) for q in quotas]
    assert per_rank and all(abs(a - b) <= 1 for a, b in per_rank)     # each step split evenly over the ranks
    assert sum(b for _, b in per_rank) > 0                            # rank 1's replicas served tokens
