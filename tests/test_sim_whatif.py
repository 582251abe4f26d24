"""`everybyte sim whatif`: the tokens-per-MW table from simulated runs (tiny sweep), the frontier
interpolation, expert parallelism in the cost model, and bad input."""
import json

import pytest

from everybyte.sim.build import SimConfig, build
from everybyte.sim.cli import main as sim_main
from everybyte.sim.whatif import at_interactivity, fit_to, scenario_for, why_not

# sizes at full scale, read with --token-scale 64 as the shared traces are: each trace token then
# stands for 64 real ones (KV pools of ~1M blocks, not 64M, on the 64-GPU workers)
TRACE = "synthetic:sessions=6,turns=2,system_tokens=4096,first_tokens=4096,append_tokens=2048,output_tokens=16,seed=1"


def _pt(user, mw):
    return {"tok_s_per_user": user, "tok_s_per_mw": mw}


def test_frontier_interpolates_bounds_and_refuses():
    pts = [_pt(300, 100.0), _pt(100, 300.0), _pt(40, 500.0)]
    assert at_interactivity(pts, 200)["tok_s_per_mw"] == pytest.approx(200.0)
    low = at_interactivity([_pt(300, 100.0), _pt(100, 300.0)], 50)
    assert low["tok_s_per_mw"] == 300.0 and "lower bound" in low["how"]
    assert at_interactivity(pts, 400)["tok_s_per_mw"] is None
    queued = [_pt(300, 100.0), {**_pt(100, 900.0), "ttft_p50_s": 60.0}]         # fast tokens behind a long queue
    capped = at_interactivity(queued, 200, max_ttft_s=10.0)
    assert capped["tok_s_per_mw"] == 100.0 and "lower bound" in capped["how"]


def _cost(hw, gpus, ep, imbalance=1.0, wf="fp8"):
    return build(SimConfig(hw, "deepseek-r1", 1, gpus, wf, "fp8", ep=ep, expert_imbalance=imbalance))[0]


def test_expert_parallel_spreads_experts_and_pays_all_to_all():
    ep8, ep32 = _cost("GB300-NVL72", 8, True), _cost("GB300-NVL72", 32, True)
    ideal8 = _cost("GB300-NVL72", 8, False)
    # dense weights on every GPU, routed experts once: more bytes per worker than one copy
    assert ep8.weight_bytes() == ep8.fixed_weight_bytes * 8 + ep8.routed_bytes > ideal8.weight_bytes()
    assert ep32.kv_budget() > 4 * ep8.kv_budget() * 0.9             # more GPUs, same experts: far more KV room
    assert ep8.step_seconds(64, 64 * 500) > ideal8.step_seconds(64, 64 * 500)    # the all-to-all
    skewed = _cost("GB300-NVL72", 8, True, imbalance=2.56)
    assert skewed.step_seconds(4096, 4096 * 500) > ep8.step_seconds(4096, 4096 * 500)
    with pytest.raises(ValueError, match="EP8 needs a worker of 8 GPUs"):
        from everybyte.sim.cost_model import CostModel
        from everybyte.sim.expert_parallel import ExpertParallel
        CostModel(ep8.hw, ep8.model, gpus=4, ep=ExpertParallel(8))


def test_expert_parallel_across_nodes_is_bounded_by_the_nic():
    """EP16 on H200 spans 2 NVLink domains: each token reaches the other node over the NIC (50 GB/s
    a GPU) once, 1 - (1/2)^8 of the time, slower here than NVLink's share (450 GB/s one way)."""
    from dataclasses import replace as _replace
    ep16 = _cost("H200", 16, True)
    assert ep16.ep.nodes(ep16.hw) == 2 and _cost("H200", 8, True).ep.nodes(ep16.hw) == 1
    tokens, attended = 4096, 4096 * 500
    slow = ep16.step_seconds(tokens, attended)
    nic = ep16.hw.need("nic_bytes_per_s")
    ep16.hw = _replace(ep16.hw, figures={**ep16.hw.figures, "nic_bytes_per_s": (nic * 1000, "test")})
    m = ep16.model
    per_pair = tokens / 16 * m.hidden * 3 * m.moe_layers
    nvlink = per_pair * m.experts_per_token * 15 / 16 / (900e9 / 2)
    assert slow - ep16.step_seconds(tokens, attended) == pytest.approx(per_pair * (1 - 0.5 ** 8) / nic - nvlink)


def test_overlap_hides_the_all_to_all_behind_compute():
    from dataclasses import replace as _replace
    plain = _cost("GB300-NVL72", 8, True, imbalance=2.56)
    hidden = build(SimConfig("GB300-NVL72", "deepseek-r1", 1, 8, "fp8", "fp8", ep=True, expert_imbalance=2.56,
                             ep_overlap=True))[0]
    free = _cost("GB300-NVL72", 8, True, imbalance=2.56)            # NVLink so fast the all-to-all is ~0
    free.hw = _replace(free.hw, figures={**free.hw.figures, "nvlink_bytes_per_s": (1e30, "test")})
    for tokens in (64, 4096):
        compute = free.step_seconds(tokens, tokens * 500)
        comm = plain.step_seconds(tokens, tokens * 500) - compute
        assert comm > 0 and hidden.step_seconds(tokens, tokens * 500) == pytest.approx(max(compute, comm))
    assert hidden.describe()["expert_parallel"]["overlap"] is True
    with pytest.raises(ValueError, match="--ep-overlap needs --ep"):
        build(SimConfig("GB300-NVL72", "deepseek-r1", 1, 8, "fp8", "fp8", ep_overlap=True))
    assert scenario_for("ep32_overlap").overlap and scenario_for("ep32_overlap").ep == 32


def test_levers_outside_the_hardware_say_why():
    from dataclasses import replace as _replace
    assert why_not("H200", scenario_for("ep32")) is None              # across 4 nodes over the NIC
    assert "no NIC figure" in why_not("GB200-NVL72", _replace(scenario_for("ep64"), ep=128))
    assert "host link" in why_not("GB200-NVL72", scenario_for("host_staging"))
    assert why_not("GB300-NVL72", scenario_for("host_staging")) is None         # Grace's C2C is in the catalog
    assert why_not("GB300-NVL72", scenario_for("all")) is None
    assert fit_to("VR-NVL72", scenario_for("all"))[1] == ["local NVMe (no sourced drive figures)"]
    fleet = scenario_for("all_fleet")
    assert (fleet.workers, fleet.route, fleet.pod_flash, fleet.ep) == (2, "kv", True, 64)
    assert why_not("GB300-NVL72", scenario_for("local_nvme")) is None
    assert "local NVMe" in why_not("VR-NVL72", scenario_for("local_nvme"))
    pod = scenario_for("pod_flash")
    assert pod.pod_flash and pod.workers == 4 and pod.route == "round-robin"
    assert scenario_for("kv_routing_disagg").disagg and scenario_for("kv_routing_disagg").route == "kv"
    s, dropped = fit_to("GB200-NVL72", scenario_for("all"))                 # all the levers it has
    assert s.ep == 64 and not s.host_staging and s.weights_format == "nvfp4" and "host staging" in dropped[0]
    s, dropped = fit_to("H200", scenario_for("all"))
    assert s.ep == 8 and s.host_staging and "EP64" in dropped[0]           # stacked within one NVLink domain


def test_token_weight_scales_kv_bytes_and_prefill():
    one = build(SimConfig("H200", "deepseek-r1", 1, 8, "fp8", "fp8", ep=True))
    w64 = build(SimConfig("H200", "deepseek-r1", 1, 8, "fp8", "fp8", ep=True, token_weight=64))
    assert w64[0].kv_token_bytes == 64 * one[0].kv_token_bytes
    assert w64[1][0].spec.pool.num_blocks == pytest.approx(one[1][0].spec.pool.num_blocks / 64, rel=0.01)


def test_whatif_table_from_simulated_runs(tmp_path, capsys):
    rc = sim_main(["whatif", "--hardware", "GB300-NVL72,H200", "--levers", "baseline,ep32,pod_flash,fleet_round_robin,all,all_fleet",
                   "--sessions-per-gpu", "1,2", "--max-sessions-per-gpu", "2", "--turns", "2", "--trace", TRACE,
                   "--token-scale", "64", "--out", str(tmp_path)])
    assert rc == 0
    r = json.loads((tmp_path / "whatif.json").read_text())
    rows = {(x["hardware"], x["lever"]): x for x in r["rows"]}
    base = rows[("GB300-NVL72", "baseline")]
    assert base["simulated"] and len(base["points"]) == 2
    assert all(p["requests"] > 0 and p["tok_s_per_mw"] > 0 for p in base["points"])
    assert set(base["at"]) == {"50", "100", "160", "200"}
    assert rows[("GB300-NVL72", "ep32")]["simulated"]
    assert rows[("H200", "ep32")]["simulated"]                        # 4 nodes over the NIC
    pod = rows[("GB300-NVL72", "pod_flash")]
    assert pod["simulated"] and any(p["reused_by_tier"].get("G3.5", 0) > 0 for p in pod["points"])
    assert rows[("H200", "pod_flash")]["simulated"]                   # 4 x 8 GPUs: over the network
    assert rows[("H200", "all")]["simulated"] and rows[("H200", "all")]["scenario"]["ep"] == 8
    stacked = rows[("H200", "all_fleet")]                             # 2 x EP8 behind the kv router
    assert stacked["simulated"] and stacked["scenario"]["workers"] == 2 and stacked["scenario"]["route"] == "kv"
    assert stacked["points"][-1]["sessions"] == 2 * rows[("H200", "all")]["points"][-1]["sessions"]
    assert any("extrapolat" in a for a in r["assumptions"]) and any("power: H200" in a for a in r["assumptions"])
    assert [c["seed"] for c in r["claims"]] == [30.0, 30.0, 4.0, 1.8, 1.8, 5.0, 5.0]
    assert r["claims"][5]["simulated"] is not None                # pod flash vs the fleet without it
    md = (tmp_path / "whatif.md").read_text()
    assert "| GB300-NVL72 | baseline |" in md and "**160**" in md and "Assumptions:" in md
    assert r["plot"].endswith("whatif.png") and (tmp_path / "whatif.png").stat().st_size > 0


@pytest.mark.parametrize("argv, text", [(["--hardware", "TPU9"], "known: H200"),
                                        (["--levers", "magic"], "unknown lever 'magic'"),
                                        (["--turns", "0"], "--turns must be >= 1, got 0"),   # was an IndexError
                                        (["--sessions-per-gpu", "a,b"], "comma-separated whole numbers >= 1"),
                                        (["--interactivity", "x"], "--interactivity needs comma-separated numbers"),
                                        (["--interactivity", "-5"], "--interactivity must be > 0, got -5"),
                                        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
                                        (["--max-ttft", "0"], "--max-ttft must be > 0, got 0"),
                                        (["--out", "/proc/none/here"], "cannot write '/proc/none/here'")])
def test_bad_input_is_a_clear_error(argv, text, capsys):
    assert sim_main(["whatif", "--trace", TRACE, "--token-scale", "64", "--sessions-per-gpu", "1", "--turns", "1",
                     *argv]) == 2
    assert text in capsys.readouterr().err


def test_unknown_imbalance_source_names_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        sim_main(["whatif", "--imbalance", "guess"])
    assert e.value.code == 2 and "choose from 'cited', 'derived'" in capsys.readouterr().err
