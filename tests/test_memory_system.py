"""The memory system on the real default model: reuse from every tier gives the same tokens as
no reuse, sessions park off the device and come back, tenants stay apart, faults cost only a
recompute, and two processes share prefixes through one Redis."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from everybyte import LLM, SamplingParams
from everybyte.kv.data.tiers.disk import read_pack_table
from everybyte.models.loader import load_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SYSTEM = ("You are a coding agent working in a Python repository. You can call the tools read_file, "
          "write_file, run_tests and search. Think step by step, keep edits small, and run the tests "
          "after every change. ")
ENGINE = dict(kv_cache_bytes="8MiB", max_model_len=512, dtype="float32", kv_cache_dtype="nvfp4")


@pytest.fixture(scope="module")
def loaded():
    return load_model(None, dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(loaded):
    """The same engine with no reuse at all: what every reuse path must reproduce."""
    llm = LLM(loaded, enable_prefix_caching=False, **ENGINE)
    return lambda prompt: llm.generate([prompt], GREEDY)[0].token_ids


def _memory(llm) -> dict:
    return llm.stats()["memory"]


def _tier_spec(kind: str, tmp_path: Path, redis_url: str | None) -> str:
    return {"host": "host:64MiB", "disk": f"disk:{tmp_path}/g3:64MiB", "shared": f"shared:{tmp_path}/g35:64MiB",
            "cold": f"cold:{tmp_path}/g4:64MiB", "redis": f"{redis_url}:64MiB"}[kind]


@pytest.mark.parametrize("kind", ["host", "disk", "shared", "cold", "redis"])
def test_reuse_from_each_tier_gives_the_same_tokens(kind, loaded, reference, tmp_path, request):
    redis_url = request.getfixturevalue("redis_server").url if kind == "redis" else None
    llm = LLM(loaded, kv_tiers=_tier_spec(kind, tmp_path, redis_url), **ENGINE)
    prompt = SYSTEM + "Task: the test test_parse_dates fails with a KeyError; find out why."
    first = llm.generate([prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0
    g1_hit = llm.generate([prompt], GREEDY)[0]
    assert g1_hit.num_cached_tokens > 0 and g1_hit.token_ids == first.token_ids
    assert llm.reset_prefix_cache() > 0                  # every cached block leaves G1 for the tier
    loaded_turn = llm.generate([prompt], GREEDY)[0]
    level = llm.block_manager.tiers.tiers[0].level
    reused = _memory(llm)["prefill_tokens"]["reused"]
    assert reused.get(level, 0) >= loaded_turn.num_cached_tokens > 0
    assert loaded_turn.token_ids == first.token_ids == reference(prompt)


def test_park_moves_the_session_off_the_device_and_resume_brings_it_back(loaded, reference):
    llm = LLM(loaded, kv_tiers="host:64MiB", **ENGINE)
    turn1 = SYSTEM + "Task: rename the function load_cfg to load_config everywhere."
    out1 = llm.generate([turn1], GREEDY, session_id="agent-1")[0]
    before = llm.session_info("agent-1")
    assert before["state"] == "active" and before["blocks"]["G1"] > 0
    cached_before = _memory(llm)["g1"]["cached_kv"]
    assert llm.park("agent-1", expected_gap_s=30) == before["blocks"]["G1"]
    parked = llm.session_info("agent-1")
    assert parked["state"] == "parked" and parked["blocks"]["G1"] == 0
    assert parked["blocks"]["G2"] == before["blocks"]["G1"]
    assert _memory(llm)["g1"]["cached_kv"] == cached_before - before["bytes"]["G1"]
    # the next turn: previous context + the model's output + a tool result; loads, not recompute
    turn2 = turn1 + out1.text + "\nTool result: 3 files changed, all tests pass."
    out2 = llm.generate([turn2], GREEDY, session_id="agent-1")[0]
    assert out2.num_cached_tokens >= (before["tokens"] // 16) * 16 - 16
    assert _memory(llm)["prefill_tokens"]["reused"].get("G2", 0) > 0
    assert out2.token_ids == reference(turn2)
    llm.park("agent-1")
    n = llm.resume("agent-1")                            # returns at once; the blocks load meanwhile
    blocks = llm.session_info("agent-1")["blocks"]
    assert n > 0 and blocks["G1"] + blocks["loading"] == n
    llm.step()                                           # no request to run: waits for the prestage
    blocks = llm.session_info("agent-1")["blocks"]
    assert blocks["G1"] == n and blocks["loading"] == 0 and not llm.has_pending_loads()
    assert _memory(llm)["blocks"]["prestaged"] == n
    llm.drop("agent-1")
    with pytest.raises(KeyError):
        llm.session_info("agent-1")


def test_parked_blocks_are_evicted_first_without_offload(loaded):
    llm = LLM(loaded, kv_tiers="none", offload_on_park=False, **ENGINE)
    llm.generate([SYSTEM + "Session A."], GREEDY, session_id="a")
    llm.generate([SYSTEM[::-1] + "Session B."], GREEDY, session_id="b")
    assert llm.park("a") == 0                           # no lower tier: stays on G1, first to go
    assert _memory(llm)["g1"]["parked_kv"] > 0
    order = llm.block_manager.cache.evictable_order()
    a_blocks = set(llm.block_manager.cache.session_blocks["a"]) - set(llm.block_manager.cache.session_blocks["b"])
    assert set(order[:len(a_blocks)]) == a_blocks


def test_ledger_counts_every_g1_eviction(loaded):
    llm = LLM(loaded, kv_tiers="host:64MiB", **ENGINE)
    llm.generate([SYSTEM + "Task: count the evictions."], GREEDY)
    n = llm.block_manager.evict_all()
    m = _memory(llm)
    assert n > 0 and m["blocks_by_tier"]["evicted"]["G1"] == n == m["prefix_cache"]["evictions"]


def test_tenant_salts_never_share_blocks(loaded):
    llm = LLM(loaded, kv_tiers="host:64MiB", **ENGINE)
    prompt = SYSTEM + "Task: add type hints to utils.py."
    assert llm.generate([prompt], GREEDY, cache_salt="tenant-a")[0].num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY, cache_salt="tenant-b")[0].num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 0
    assert llm.generate([prompt], GREEDY, cache_salt="tenant-a")[0].num_cached_tokens > 0


def test_corrupt_disk_block_is_recomputed(loaded, reference, tmp_path):
    llm = LLM(loaded, kv_tiers=f"disk:{tmp_path}:64MiB", **ENGINE)
    prompt = SYSTEM + "Task: the CI job times out; make the slow test faster."
    llm.generate([prompt], GREEDY)
    llm.reset_prefix_cache()
    packs = sorted(tmp_path.rglob("*.kvp"))              # the evicted blocks went down as one pack
    assert packs and not list(tmp_path.rglob("*.kvb"))
    for f in packs:                                      # flip a byte in the middle of every block
        data = bytearray(f.read_bytes())
        for offset, size in read_pack_table(str(f)).values():
            data[offset + size // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    out = llm.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == reference(prompt)
    assert _memory(llm)["tiers"]["G3"]["corrupt"] >= 1


def test_redis_down_mid_run_costs_a_recompute(loaded, reference, redis_server):
    llm = LLM(loaded, kv_tiers=f"{redis_server.url}:64MiB", **ENGINE)
    prompt = SYSTEM + "Task: bump the version number and update the changelog."
    llm.generate([prompt], GREEDY)
    redis_server.stop()
    llm.reset_prefix_cache()                             # writes down to a dead tier: logged, dropped
    out = llm.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == reference(prompt)


def test_full_tier_rejects_and_recomputes(loaded, reference):
    llm = LLM(loaded, kv_tiers="host:64KiB", **ENGINE)   # smaller than one nvfp4 block of this model
    prompt = SYSTEM + "Task: delete the unused imports."
    llm.generate([prompt], GREEDY)
    llm.reset_prefix_cache()
    out = llm.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == reference(prompt)
    assert _memory(llm)["tiers"]["G2"]["used_bytes"] == 0


def test_two_processes_share_prefixes_through_redis(loaded, redis_server):
    shared = SYSTEM * 2
    script = textwrap.dedent(f"""
        import json, sys
        from everybyte import LLM, SamplingParams
        llm = LLM(None, kv_tiers={redis_server.url + ':64MiB'!r}, **{ENGINE!r})
        out = llm.generate([{shared!r} + "Node one asks about the parser."],
                           SamplingParams(temperature=0, max_tokens=4))[0]
        llm.close()
        print(json.dumps(llm.stats()["memory"]["prefill_tokens"]))
    """)
    first = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert json.loads(first.stdout.strip().splitlines()[-1])["reused_total"] == 0
    llm = LLM(loaded, kv_tiers=f"{redis_server.url}:64MiB", **ENGINE)
    prompt = shared + "Node two asks about the lexer."
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4))[0]
    n_prompt = len(out.prompt_token_ids)
    prefill = _memory(llm)["prefill_tokens"]
    shared_blocks = len(llm.tokenizer.encode(shared)) // 16
    assert prefill["reused"].get("G3.5", 0) == out.num_cached_tokens >= (shared_blocks - 1) * 16
    assert prefill["computed"] == n_prompt - out.num_cached_tokens     # only the non-shared suffix


def test_ledger_accounts_for_every_device_byte(loaded):
    llm = LLM(loaded, kv_tiers="host:64MiB", **ENGINE)
    llm.generate([SYSTEM + "Hi."], GREEDY, session_id="s")
    g1 = _memory(llm)["g1"]
    assert g1["total"] == llm.weights_bytes + llm.pool.budget_bytes
    assert g1["running_kv"] == 0 and g1["cached_kv"] > 0 and g1["free"] > 0
