"""`everybyte bench memory` smoke: 2 sessions x 2 turns, levers off vs all, on the real default model."""
import json

from everybyte.bench.micro.memory import main

TRACE = ("synthetic:sessions=6,turns=3,system_tokens=128,first_tokens=64,append_tokens=32,output_tokens=8,"
         "gap_s=0.3,gap_sigma=0.2,block_size=16,seed=0")


def test_bench_memory_smoke(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["--trace", TRACE, "--sessions", "2", "--turns", "2", "--token-scale", "1", "--output-scale", "1",
               "--max-output", "8", "--max-context", "512", "--min-context", "16", "--gap-scale", "1",
               "--max-gap", "0.5", "--runs", "levers_off,all", "--prefix-tokens", "64",
               "--json", str(tmp_path / "r.json"), "--out", str(out)])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result == json.loads((tmp_path / "r.json").read_text())
    assert {"runs", "tiers", "assumptions", "goals"} <= result.keys()
    runs = {r["name"]: r for r in result["runs"]}
    assert list(runs) == ["levers_off", "all"]
    for r in runs.values():
        assert {"prefill_tokens_computed", "min_prefill_tokens", "ttft_resumed_p50_s", "ttft_resumed_p90_s",
                "output_tok_s", "reuse_by_tier", "g1_ledger"} <= r.keys()
        assert r["turns"] == 4 and r["output_tok_s"] > 0
        assert r["ttft_resumed_p50_s"] > 0 and r["ttft_resumed_p90_s"] >= r["ttft_resumed_p50_s"]
        assert r["prefill_tokens_computed"] >= r["min_prefill_tokens"] > 0
        g1 = r["g1_ledger"]
        assert g1["samples"] >= 2
        assert {"weights", "running_kv", "parked_kv", "cached_kv", "free", "waste"} <= g1["peak"].keys()
    assert runs["levers_off"]["min_prefill_tokens"] == runs["all"]["min_prefill_tokens"]
    assert runs["all"]["prefill_tokens_computed"] < runs["levers_off"]["prefill_tokens_computed"]
    assert sum(runs["all"]["reuse_by_tier"].values()) > 0 and runs["levers_off"]["reuse_by_tier"] == {}
    t = result["tiers"]
    assert {"g2_load_vs_memcpy", "g3_load_vs_disk", "load_2k_prefix_s", "recompute_2k_prefix_s"} <= t.keys()
    assert set(t["load_2k_prefix_s"]) == {"G2", "G3"} and t["recompute_2k_prefix_s"] > 0
    assert t["g2_load_vs_memcpy"] > 0 and t["g3_load_vs_disk"] > 0
    assert result["assumptions"]["kv_budget_bytes"] == runs["all"]["kv_pool"]["budget_bytes"] \
        == runs["levers_off"]["kv_pool"]["budget_bytes"]
    assert "prefill_le_1.15x_min" in result["goals"]
    assert (out / "report.md").read_text().startswith("# everybyte bench memory")
    assert (out / "g1_bytes.png").stat().st_size > 0
