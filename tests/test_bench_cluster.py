"""`everybyte bench cluster`: its argument checks and the arithmetic of its report (the runs themselves start
clusters and are a benchmark, not a test)."""
from everybyte.bench import cluster


def test_unknown_policy_and_too_few_workers_are_refused(capsys):
    assert cluster.main(["--policies", "kv,fastest"]) == 2
    assert "unknown policy 'fastest'" in capsys.readouterr().err
    assert cluster.main(["--workers", "1", "--policies", "kv+disagg"]) == 2
    assert ">= 2 with kv+disagg" in capsys.readouterr().err


def test_disagg_command_splits_prefill_and_decode():
    args = cluster.build_parser().parse_args(["--kv-cache", "8MiB"])
    cmd = cluster.cluster_command(3, "kv+disagg", 9000, args)
    assert cmd[cmd.index("--policy") + 1] == "kv"
    assert cmd[cmd.index("--prefill") + 1] == "1" and cmd[cmd.index("--decode") + 1] == "2"
    assert "--prefill" not in cluster.cluster_command(3, "round-robin", 9000, args)


def test_counters_delta_and_ratios():
    before = {"prefill_computed": 100.0, "prefill_reused": {"G1": 10.0}, "bytes_moved": {}}
    after = {"prefill_computed": 400.0, "prefill_reused": {"G1": 50.0, "G2": 8.0}, "bytes_moved": {"G2/load": 64.0}}
    assert cluster.delta(after, before) == {"prefill_computed": 300.0, "prefill_reused": {"G1": 40.0, "G2": 8.0},
                                            "bytes_moved": {"G2/load": 64.0}}
    runs = [{"workers": 2, "policy": "round-robin", "prefill_tokens_computed": 1000, "ttft_p90_s": 2.0, "tpot_p99_s": 0.1},
            {"workers": 2, "policy": "kv", "prefill_tokens_computed": 400, "ttft_p90_s": 0.5, "tpot_p99_s": 0.2},
            {"workers": 2, "policy": "kv+disagg", "prefill_tokens_computed": 420, "ttft_p90_s": 0.6, "tpot_p99_s": 0.1}]
    r = cluster.ratios(runs)["2_workers"]
    assert r == {"kv_vs_round_robin_prefill_computed": 0.4, "kv_vs_round_robin_ttft_p90": 0.25,
                 "disagg_vs_kv_tpot_p99": 0.5}
    turns = [{"ok": True, "tpot_s": t / 100} for t in range(1, 101)] + [{"ok": True, "warmup": True, "tpot_s": 9.0}]
    assert cluster.tpot_p99(turns) == 1.0


def test_live_sessions_peak_counts_sessions_open_at_once():
    turns = [  # session a: 0-2 s then 3-5 s (100 -> 150 tokens); b: 1-4 s (300); c after both ended (500)
        {"ok": True, "session": "a", "t_start_s": 0.0, "t_end_s": 2.0, "prompt_len": 90, "completion_tokens": 10},
        {"ok": True, "session": "b", "t_start_s": 1.0, "t_end_s": 4.0, "prompt_len": 290, "completion_tokens": 10},
        {"ok": True, "session": "a", "t_start_s": 3.0, "t_end_s": 5.0, "prompt_len": 140, "completion_tokens": 10},
        {"ok": False, "session": "d", "t_start_s": 3.5, "t_end_s": 3.6, "prompt_len": 9000, "completion_tokens": 0},
        {"ok": True, "session": "c", "t_start_s": 6.0, "t_end_s": 7.0, "prompt_len": 490, "completion_tokens": 10},
    ]
    assert cluster.live_sessions_peak_tokens(turns) == 500      # a (150) + b (300) at 3 s; c alone: 500
    turns[-1]["prompt_len"] = 100
    assert cluster.live_sessions_peak_tokens(turns) == 450


def test_recompute_breakdown_splits_routing_losses_from_unavoidable_misses():
    def turn(k, prompt, cached):
        return {"ok": True, "session": "s", "agent": 0, "turn": k, "prompt_len": prompt, "cached_tokens": cached}
    runs = [{"workers": 2, "policy": "round-robin", "_turns": [turn(0, 300, 0), turn(1, 400, 0), turn(2, 500, 0)]},
            {"workers": 2, "policy": "kv", "_turns": [turn(0, 300, 0), turn(1, 400, 320), turn(2, 500, 16)]},
            {"workers": 2, "policy": "kv+disagg", "_turns": [turn(0, 300, 288), turn(1, 400, 400), turn(2, 500, 0)]},
            {"workers": 4, "policy": "kv", "error": "failed"}]
    cluster.recompute_breakdown(runs)
    assert runs[0]["recompute"] == {"uncached_tokens": 1200, "reusable_missed": 336, "unavoidable": 864,
                                    "turns_missing_reuse": 1}
    assert runs[1]["recompute"] == {"uncached_tokens": 864, "reusable_missed": 0, "unavoidable": 864,
                                    "turns_missing_reuse": 0}
    assert runs[2]["recompute"]["reusable_missed"] == 16 and all("_turns" not in r for r in runs)
